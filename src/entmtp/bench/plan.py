"""What a bench runs, decided from the command line and checked before any model loads.

A method's name is `plain`, a peer's name (`hf-generate`, ...), a lookup-only variant (`lookup`,
`lookup-fixed`), or `HEADS/ITEM` where ITEM is a static tree or a scheduling policy, optionally with a lookup
branch (`tree_8+lookup`, `dynamic+lookup-fixed`). Comma lists of trees and policies apply to every heads;
`HEADS:ITEM` applies to one.
"""

from __future__ import annotations

import argparse
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import EntMTPError, TreeError
from ..lookup import Lookup
from ..prompts import load_prompt_file, load_prompts
from ..scheduler.policies import POLICIES
from ..settings import from_args
from ..shipped import HEAD_KINDS, heads_path
from ..tree import load_tree
from .peers import check_peers

# What a run compares unless told otherwise. The full run: every peer that needs no training, entmtp's prompt
# lookup, both heads with the published default tree and Hydra with its best small static tree, every policy
# for Hydra (the better heads here) and EntMTP* for Medusa. --quick (about 7 minutes on a 2-core CPU for all
# 11 tasks): the strongest peer, lookup, the published default, EntMTP* and the two best policies, shorter.
FULL = {
    "num_prompts": 10,
    "max_new_tokens": 128,
    "trees": "mc_sim_7b_63,hydra:tree_8",
    "policies": "hydra:static,hydra:binary,hydra:ladder,hydra:cost,hydra:dynamic,hydra:dynamic+lookup,medusa:static",
    "peers": "hf-generate,hf-prompt-lookup",
    "lookup_only": "adaptive",
}
QUICK = {
    "num_prompts": 2,
    "max_new_tokens": 48,
    "trees": "hydra:mc_sim_7b_63",
    "policies": "hydra:static,hydra:dynamic,hydra:dynamic+lookup",
    "peers": "hf-prompt-lookup",
    "lookup_only": "adaptive",
}
LOOKUP_VARIANTS = {"adaptive": "lookup", "fixed": "lookup-fixed"}  # --lookup-only item -> method name


@dataclass(frozen=True)
class Plan:
    """The methods and prompts of a bench. `args` is the command line with --quick's or the full run's sizes
    filled in; it also carries the sampling, lookup and model settings."""

    args: argparse.Namespace
    out: Path  # the output directory: checked writable, created when the results are written
    prompts: dict[str, list]  # task -> its prompts, in the order they run
    heads: list[str]  # heads specs: medusa, hydra or heads directories
    peers: list[str]
    lookup_only: list[str]  # LOOKUP_VARIANTS keys

    @property
    def tasks(self) -> list[str]:
        return list(self.prompts)

    def trees(self, kind: str) -> list[str]:
        """The static-tree items (`tree_8`, `tree_8+lookup`) for heads `kind`."""
        return for_heads(self.args.trees, kind)

    def policies(self, kind: str) -> list[str]:
        """The policy items (`dynamic`, `dynamic+lookup`) for heads `kind`."""
        return for_heads(self.args.policies, kind)

    def lookup(self, variant: str) -> Lookup:
        """Prompt-lookup drafts with the command line's settings: `adaptive` sizes the branch per step."""
        return from_args(Lookup, self.args, adaptive=variant == "adaptive")

    def split_lookup(self, item: str) -> tuple[str, Lookup | None]:
        """`tree_8+lookup` -> ("tree_8", adaptive lookup); `tree_8+lookup-fixed` -> fixed-length lookup."""
        for suffix, variant in (("+lookup-fixed", "fixed"), ("+lookup", "adaptive")):
            if item.endswith(suffix):
                return item[: -len(suffix)], self.lookup(variant)
        return item, None


def make_plan(args: argparse.Namespace) -> Plan:
    """Every name and size of the command line checked, in the order a user would fix them; raises
    EntMTPError naming the first bad one. Fills in the run's default sizes and methods on `args`."""
    resolve_sizes(args)
    out = out_dir(args.out)  # an unwritable --out fails before any model loads
    if args.prompts is not None:  # a user's own prompt file: one task named after it
        prompts = {Path(args.prompts).stem: load_prompt_file(args.prompts)[: args.num_prompts]}
    else:  # bad task names fail first
        prompts = {t: load_prompts(t, args.split, n=args.num_prompts) for t in args.tasks.split(",")}
    heads = [k for k in args.heads.split(",") if k and k != "none"]
    peers, lookup_only = ([x for x in spec.split(",") if x] for spec in (args.peers, args.lookup_only))
    plan = Plan(args, out, prompts, heads, peers, lookup_only)
    for item in (x for kind in heads for x in plan.policies(kind)):
        if plan.split_lookup(item)[0] not in POLICIES:
            raise EntMTPError(f"unknown policy {item!r} in --policies: use {', '.join(POLICIES)} (+lookup)")
    _check_heads_and_trees(plan)
    check_peers(plan.peers)
    for x in plan.lookup_only:
        if x not in LOOKUP_VARIANTS:
            raise EntMTPError(f"unknown --lookup-only variant {x!r}: use {' or '.join(LOOKUP_VARIANTS)}")
    plan.lookup("adaptive")  # bad lookup settings fail before any model loads
    return plan


def resolve_sizes(args: argparse.Namespace) -> None:
    """Sizes and methods default to --quick's or the full run's; what the command line sets wins."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise EntMTPError("--num-prompts and --max-new-tokens must be >= 1")


def out_dir(spec: str | None) -> Path:
    """The output directory (default: a new dated folder under runs/), checked writable; created when the
    results are written, so a run that fails early leaves nothing behind."""
    out = Path(spec) if spec else Path("runs") / f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if out.suffix == ".json":
        raise EntMTPError(
            f"--out {out}: give a directory (results.json, report.md and the plots are written into it)"
        )
    if out.exists() and not out.is_dir():
        raise EntMTPError(f"--out {out} is a file: give a directory")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise EntMTPError(f"--out {out} cannot be written ({parent} is not a writable directory)")
    return out


def for_heads(spec: str, kind: str) -> list[str]:
    """Items of a comma list for heads `kind`: plain items apply to every heads, `kind:item` to one."""
    out = []
    for item in (x for x in spec.split(",") if x):
        only, sep, rest = item.partition(":")
        if not sep:
            out.append(item)
        elif only == kind:
            out.append(rest)
    return out


def _check_heads_and_trees(plan: Plan) -> None:
    """Unknown heads, a HEADS: prefix naming no heads, and unknown trees are named before any model loads."""
    for spec in plan.heads:
        if not heads_path(spec).is_dir():
            raise EntMTPError(
                f"unknown heads {spec!r} in --heads: use medusa, hydra, none or a heads directory"
            )
    for flag, spec in (("--trees", plan.args.trees), ("--policies", plan.args.policies)):
        for item in (x for x in spec.split(",") if x):
            only, sep, _ = item.partition(":")
            if sep and only not in plan.heads and only not in HEAD_KINDS:
                raise EntMTPError(
                    f"{flag} item {item!r} is for heads {only!r}, which --heads does not name: "
                    f"use {' or '.join(f'{k}:' for k in plan.heads or HEAD_KINDS)} or no prefix"
                )
    for kind in plan.heads:
        for item in plan.trees(kind):
            try:
                load_tree(plan.split_lookup(item)[0])
            except TreeError as e:
                raise EntMTPError(f"--trees: {e}") from e
