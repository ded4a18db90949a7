"""The policy's choice, measured: what phase (1) of the engine's step, `policy.choose`, costs on this machine.

A cost curve (measured.py) prices what a tree costs: drafting, verification, acceptance, commit. The choice
is the policy's own work before that (the signals read from the root's logits, the menu, the cost-aware pick;
the heads' probe apart, which the curve's drafting share prices) and it does not depend on the tree, so it is
measured per policy: `choice_for(model, heads, policy)` runs the engine's own decode (`Engine.stream`) over
random tokens with that very policy choosing every step, and reads the engine's clock (`Step.seconds["choose"]`,
the probe's seconds already taken out of it) for `STEPS` steps after `WARMUP`. The median is what a replay
charges each step of that policy (calibration/replay.py, `StepPrices.with_choice`).

Cached like the curve (cache.py): under the cost key of (model, heads, machine, acceptance rule) with the
policy's settings (`policy_key`) and the way of timing (`CHOICE`); a policy built otherwise (another profile,
another curve it was sized on) is measured again (~1 s). Random tokens: a lookup hybrid finds few matches in
them, so its choice is timed mostly on its no-match path (the lookup query is made every step either way).
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..accept import Sampling
from ..machine import digest, record
from ..tree import Tree
from .cache import cached, cached_or_measured, cost_key, costs_dir
from .curves import CostRecord, CostsError

FORMAT, VERSION = "entmtp-choice", 1
CHOICE = 1  # how a choice is timed, part of the key: 1, the engine's decode steps on random tokens
CONTEXT = 64  # random tokens before the timed steps (the choice does not read the context's length)
WARMUP, STEPS = 2, 16  # steps not timed (first calls allocate); steps timed, their median kept


@dataclass(frozen=True)
class ChoiceCost(CostRecord):
    """ms of one policy's choice per step on one machine: the median of `steps` engine steps."""

    FORMAT, VERSION, KIND = FORMAT, VERSION, "choice cost"

    policy: str  # the policy's class
    ms_per_step: float
    steps: int
    key: dict = dataclasses.field(default_factory=dict)  # cost_key with the policy's settings (`policy_key`)
    seconds: float = 0.0  # how long the measurement took
    machine: dict | None = None  # machine.record of where it was measured
    source = "engine steps"  # how it was measured (a class attribute, as a curve's `source` is named)


def policy_key(policy) -> dict:
    """What a policy was built from, as a short digest: its class and its settings (`Settings.settings()`:
    trees by name and paths, tensors and arrays by value, inner policies by their own key)."""
    return {"kind": type(policy).__name__, "settings": digest({"s": _plain(policy)})}


def _plain(value):
    """`value` as JSON-able data for `policy_key` (an object of no known form: its class and id, so a policy
    holding one is measured again rather than matched with another's measurement)."""
    if hasattr(value, "settings") and hasattr(value, "SETTINGS"):
        return {"kind": type(value).__name__, "settings": [_plain(s) for s in value.settings()]}
    if isinstance(value, Tree):
        return [value.name, [list(p) for p in value.paths]]
    if isinstance(value, torch.Tensor | np.ndarray):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if dataclasses.is_dataclass(value):
        return {"kind": type(value).__name__, **{k: _plain(v) for k, v in dataclasses.asdict(value).items()}}
    return f"{type(value).__name__}@{id(value)}"


def choice_key(model, heads, policy, sampling: Sampling | None = None) -> dict:
    return {**cost_key(model, heads, sampling=sampling), "choice": CHOICE, "policy": policy_key(policy)}


def choice_for(
    model, heads, policy, *, sampling: Sampling | None = None, refresh: bool = False
) -> ChoiceCost:
    """This machine's cost of `policy`'s choice with (model, heads): cached, or measured now and cached."""
    key = choice_key(model, heads, policy, sampling)
    timed = partial(measure_choice, model, heads, policy, sampling=sampling)
    return cached_or_measured(ChoiceCost, _choice_path(key), key, timed, refresh=refresh)


def cached_choice(model, heads, policy, *, sampling: Sampling | None = None) -> ChoiceCost | None:
    """The cost `choice_for` would return if it was measured on this machine before, else None: nothing is
    measured (the replays' `--cached-only`)."""
    key = choice_key(model, heads, policy, sampling)
    return cached(_choice_path(key), key, ChoiceCost)


def _choice_path(key: dict):
    return costs_dir() / f"choice-{digest(key)}.json"


@torch.inference_mode()
def measure_choice(
    model, heads, policy, *, sampling: Sampling | None = None, steps: int | None = None
) -> ChoiceCost:
    """Time `policy`'s choice in the engine's own decode steps (module docstring): the median of `steps`
    (None: `STEPS`) steps' `seconds["choose"]` after `WARMUP` untimed ones."""
    steps = STEPS if steps is None else steps
    from .. import engine as engine_mod  # the engine imports this package
    from .probe import NoText

    t0 = time.perf_counter()
    engine = engine_mod.Engine(model, NoText(), heads, policy, graphs=False)
    engine.eos_ids = set()  # random context: the generation must not end at the model's end-of-text token
    context = min(CONTEXT, engine.window // 4)
    room = engine.window - context - engine.scratch
    need = (
        1 + (WARMUP + steps) * engine.scratch
    )  # the prefill's token; a step's, at most its tree's depth + 1
    if room < 1 + WARMUP + steps:
        raise CostsError(
            f"a context window of {engine.window} tokens leaves no room to time {steps} steps of this policy"
        )
    ids = torch.randint(0, engine.base.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    s = sampling or Sampling()
    events = engine.stream(
        ids.tolist(), max_new_tokens=min(need, room), temperature=s.temperature, acceptance=s.acceptance,
        seed=0,
    )  # fmt: skip
    times = []
    for event in events:
        if event.step is not None:
            times.append(1000 * event.step.seconds["choose"])
        if len(times) == WARMUP + steps:
            events.close()
            break
    timed = times[WARMUP:] or times
    if not timed:
        raise CostsError("the choice's generation ended before its first step")
    return ChoiceCost(
        type(policy).__name__, float(statistics.median(timed)), len(timed),
        choice_key(model, heads, policy, sampling), time.perf_counter() - t0, record(engine.base.device),
    )  # fmt: skip
