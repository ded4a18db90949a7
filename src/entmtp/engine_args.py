"""`EngineSpec` and `GenerationOptions` on the command line: their flags, made from the fields' settings
(settings.py), and the spec, options and engine that parsed flags name. Every command that builds or loads a
model takes its flags from here, so a field added to either class is a flag of each of them."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from .accept import GenerationOptions
from .build import EngineSpec, build
from .console import say
from .model import DTYPES
from .routing import Router
from .settings import add_arguments, from_args

# what a command that loads the model itself takes (bench, calibrate, step-costs): a named dtype, no policy
MODEL_FIELDS = ("model", "dtype", "device", "threads", "graphs", "pack")
NAMED_DTYPE = dict(default="bfloat16", choices=list(DTYPES), help="base model dtype (default bfloat16)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every `EngineSpec` flag: model, backend, dtype, heads, tree, policy, profile, lookup, costs."""
    add_arguments(p, EngineSpec)


def add_model_arguments(p: argparse.ArgumentParser, fields=MODEL_FIELDS, **changes) -> None:
    """The model's flags alone (`fields` of EngineSpec), its dtype named (default bfloat16); `changes`: per
    field, argparse keywords of this command's own."""
    add_arguments(p, EngineSpec, only=fields, changes={"dtype": NAMED_DTYPE, **changes})


def add_generation_arguments(p: argparse.ArgumentParser, **changes) -> None:
    """Every `GenerationOptions` flag: max tokens, temperature, acceptance, seed, stop."""
    add_arguments(p, GenerationOptions, changes=changes)


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """The `EngineSpec` that generate, chat and serve's flags name; the generation's temperature and
    acceptance pick the profile's section (serve: greedy, its requests choose per request)."""
    return from_args(
        EngineSpec,
        args,
        temperature=getattr(args, "temperature", 0.0),
        acceptance=getattr(args, "acceptance", "auto"),
    )


def generation_options(args: argparse.Namespace) -> GenerationOptions:
    return from_args(GenerationOptions, args)


def engine_from_args(args: argparse.Namespace, *, route: bool = True, **overrides):
    """The engine that `generate` and `chat` share (`built_from_args`'s)."""
    return built_from_args(args, route=route, **overrides).engine


def built_from_args(
    args: argparse.Namespace, *, route: bool = True, max_batch: int | None = None, **overrides
):
    """What `build` makes of generate, chat and serve's flags; `-v` prints the plan behind it. `route`: requests
    routed between backends by prompt length where both were measured (routing.py; a server batches on one
    engine: False); `max_batch`: with the cost surface of batches up to that many rows (a server's).
    `overrides`: `EngineSpec` fields the command sets itself."""
    built = build(replace(engine_spec(args), **overrides), route=route, max_batch=max_batch)
    if getattr(args, "verbose", False):
        print(built.plan.describe(), file=sys.stderr)
        if isinstance(built.engine, Router):  # each request's lane too
            built.engine.log = say
    return built


def setup_torch(args: argparse.Namespace) -> None:
    """--threads, for commands that load the model themselves."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
