"""This machine's costs, measured once and cached: the cost curve (one row's step by drafted nodes) and the
batched cost surface (the whole step by rows and drafted nodes per row), each timed by the probe (probe.py) on
the engine's own steps, within a budget, and kept in the cost cache (cache.py) under its key.

The first time a (model, heads, dtype, device, threads, machine, acceptance rule) is used, `costs_for` measures
a `CostCurve` (~10-20 s on a CPU, one progress line) and later runs read it; `surface_for` does the same for a
server's batches. Delete the file (or run `entmtp doctor --probe`) to measure again; `ENTMTP_NO_PROBE=1` or
`--no-probe` uses a profile's stored latencies instead.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from ..accept import Sampling
from ..machine import record
from ..tree import Tree
from .cache import (
    cached,
    cached_or_measured,
    cost_key,
    cost_path,
    uses_graphs,
)
from .curves import CostCurve, CostsError, CostSurface
from .fill import complete, extrapolate, like, monotone
from .probe import Probe

# the curve's plan. Drafted nodes measured (0 = a plain step): every size up to 8, where CPU policies choose
# most, since a CPU's step cost climbs in steps, not along a line (scripts/probe_sizes.py: on a 2-core AMD EPYC
# with AVX-512 and bf16, 6 nodes 1.51 plain steps against 5 nodes' 1.37, where interpolating from 4 to 8 gave
# 1.48 and 1.41); sparser above
SIZES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
CONTEXTS = (128, 768)  # committed tokens before the measured steps: a short and a long context
STEP_COSTS = "this machine's step costs"  # what a progress line names, unless told
BUDGET_S = 20.0  # the whole measurement; sizes past it are extrapolated from the last two measured
MIN_REPS, MAX_REPS = 3, 9  # timed rounds per context (a round: one step of every size), after a warm-up round
WARMUP_STEPS = 3  # plain steps before any timing (then the untimed round of every size, `_rounds`)

# the surface's plan
BATCHES = (1, 2, 4, 8, 16)
SURFACE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # drafted nodes per row (the policies' largest master: 63 nodes)
SURFACE_PROBE = 2  # what a surface times: 2, `batch.Batch.step` itself (1: the probe's own restatement of it)
CONTEXT = 256  # committed tokens per row before the timed steps
SURFACE_BUDGET_S = 30.0
REPS = 3  # timed steps per point, after one warm-up


class _Line:
    """One progress line: rich's bar on a terminal, else a plain line at the start and the end."""

    def __init__(self, what: str, total: int, enabled: bool):
        self.what, self.total, self.enabled = what, total, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.bar.start()
            self.job = self.bar.add_task(what, total=total)
        elif enabled:
            print(f"entmtp: {what}...", file=sys.stderr, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.job)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def say(self, summary: str) -> None:
        if self.enabled:
            print(f"entmtp: {summary}", file=sys.stderr, flush=True)


# ---- the cost curve ---------------------------------------------------------------------------------------


def costs_for(
    model,
    heads=None,
    *,
    refresh: bool = False,
    budget_s: float = BUDGET_S,
    progress: bool = True,
    graphs: bool = True,
    sampling: Sampling | None = None,
    what: str = STEP_COSTS,
) -> CostCurve:
    """This machine's cost curve for (model, heads) under `sampling`'s acceptance rule (None: greedy): the
    cached one, or measured now and cached. `graphs`: as the engine's (`Engine(graphs=...)`); they are used on
    CUDA only. The heads come bound to the model, and packed when it is. `what`: the progress line's name for
    it (e.g. a `--dtype auto` candidate's)."""
    graphs = uses_graphs(model, graphs)
    key = cost_key(model, heads, graphs, sampling, SIZES)
    kw = dict(budget_s=budget_s, progress=progress, graphs=graphs, sampling=sampling, what=what)
    timed = partial(measure, model, heads, **kw)
    return cached_or_measured(CostCurve, cost_path(key), key, timed, refresh=refresh)


def cached_curve(
    model, heads=None, *, graphs: bool = True, sampling: Sampling | None = None
) -> CostCurve | None:
    """The cost curve `costs_for` would return if it was measured on this machine before (the cost cache), else
    None: nothing is measured (what `--no-probe` and the replays' `--cached-only` read)."""
    graphs = uses_graphs(model, graphs)
    key = cost_key(model, heads, graphs, sampling, SIZES)
    return cached(cost_path(key), key, CostCurve)


@torch.inference_mode()
def measure(
    model,
    heads=None,
    *,
    sizes: Sequence[int] | None = None,
    contexts: Sequence[int] = CONTEXTS,
    budget_s: float = BUDGET_S,
    progress: bool = True,
    graphs: bool | None = None,
    sampling: Sampling | None = None,
    what: str = STEP_COSTS,
) -> CostCurve:
    """Time the engine's decode steps of synthetic trees of each size (`SIZES` when None) at each context length
    (probe.py). Sizes are timed in rounds of one step each (`_rounds`), so the machine's speed changing while
    it is measured moves every size alike. Within `budget_s`, shared among the contexts: sizes whose rounds
    would not fit are extrapolated, and a context without time left for a useful row is not measured. The
    progress line names `what` and the budget (how long it may take)."""
    t_start = time.perf_counter()
    sizes = tuple(SIZES if sizes is None else sizes)
    graphs = uses_graphs(model) if graphs is None else graphs
    probe = Probe(model, heads, sizes, sampling, graphs)
    room = probe.room(len(sizes) * (MAX_REPS + 1) + WARMUP_STEPS)
    contexts = _clamp(contexts, probe.engine.window, room)
    line = _Line(f"measuring {what} (once, at most {budget_s:.0f} s)", MAX_REPS * len(contexts), progress)
    rows: list[dict[int, float]] = []  # per context: ms per step by size (the sizes measured in time)
    drafts: dict[int, list[float]] = {n: [] for n in sizes}  # ms of the heads' drafting per timed step
    order = torch.Generator().manual_seed(0)  # each round's order of sizes
    try:
        for i, ctx in enumerate(contexts):
            left = budget_s - (time.perf_counter() - t_start)
            if rows and (left < budget_s / 3 or left < 2 * ctx * (probe.prefill_ms_per_token or 0) / 1000):
                break  # no time for a useful second row: the first context's curve stands alone
            row = probe.row(ctx, room)
            if not rows:  # a fresh process: the first calls of each kernel are slow, whatever their size
                for _ in range(WARMUP_STEPS):
                    probe.step(row, 0)
            left = budget_s - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + left / (len(contexts) - i)
            rows.append(_rounds(probe, row, sizes, (line, deadline, order), drafts))
    finally:
        line.stop()  # a failure must not leave the bar drawing
    seconds = time.perf_counter() - t_start
    first = extrapolate(rows[0], sizes)  # the short context, measured first, is the reference shape
    by_context = (tuple(first),) + tuple(tuple(like(r, first, sizes)) for r in rows[1:])
    step = tuple(float(np.mean([r[i] for r in by_context])) for i in range(len(sizes)))
    draft = {n: float(statistics.median(d)) if d else 0.0 for n, d in drafts.items()}
    curve = CostCurve(
        sizes, step, tuple(extrapolate(draft, sizes)), tuple(contexts[: len(rows)]), by_context,
        probe.prefill_ms_per_token, cost_key(model, heads, graphs, sampling, SIZES), "probe", seconds,
        record(model.device),
    )  # fmt: skip
    line.say(f"step costs measured in {seconds:.1f} s: {curve.summary()}")
    return curve


def _clamp(contexts: Sequence[int], window: int, room: int) -> list[int]:
    """The context lengths that fit in the model's window with room for the measured steps."""
    if window - room < 8:
        raise CostsError(
            f"a context window of {window} tokens leaves no room for the probe's steps ({room} tokens): "
            "measure fewer sizes (`measure(..., sizes=...)`) or give a profile's latencies (--no-probe)"
        )
    return sorted({max(8, min(c, window - room)) for c in contexts})


def _rounds(probe: Probe, row, sizes: Sequence[int], clock: tuple, drafts: dict) -> dict[int, float]:
    """Median ms per step of each size at this row's context, timed in rounds: a round runs one step of every
    size, so a change of the machine's speed while it measures (another tenant of the host, a throttled core)
    reaches every size alike and leaves their ratios, what the policies choose by, alone; timed one size after
    another, a few seconds of a busy neighbour made 5-8 nodes look 1.5x dearer than they are
    (scripts/probe_repeat.py --disturb). Each round runs its sizes in a new random order, so no size is always
    timed right after the same other one (the engine's own steps cost the same whatever came before them,
    scripts/step_transitions.py). A first, untimed round (the first calls of a shape allocate) takes sizes
    smallest first while `MIN_REPS` rounds of them fit before the deadline (two sizes at least); then rounds
    until `MAX_REPS`, or the deadline once `MIN_REPS` ran. `clock`: (progress line, deadline, order's
    generator); `drafts` gathers each size's drafting ms."""
    line, deadline, order = clock
    kept, warm = [], 0.0  # sizes in the rounds; the untimed round's seconds
    for n in sizes:
        t0 = time.perf_counter()
        probe.step(row, n)
        kept.append(n)
        warm += time.perf_counter() - t0
        if len(kept) >= 2 and time.perf_counter() + MIN_REPS * warm > deadline:
            break
    times: dict[int, list[float]] = {n: [] for n in kept}
    for rep in range(MAX_REPS):
        for i in torch.randperm(len(kept), generator=order).tolist():
            ms, draft_ms = probe.step(row, kept[i])
            times[kept[i]].append(ms)
            drafts[kept[i]].append(draft_ms)
        line.advance()
        if rep + 1 >= MIN_REPS and time.perf_counter() > deadline:
            break
    return {n: statistics.median(t) for n, t in times.items()}


# ---- given trees (a calibration's bank) -------------------------------------------------------------------


PLAIN = "none"  # `measure_trees`' key of a plain step without heads


@torch.inference_mode()
def measure_trees(
    model,
    heads,
    trees: Sequence[Tree],
    *,
    context: int,
    budget_s: float,
    sampling: Sampling | None = None,
    progress=None,
) -> dict[str, float]:
    """ms per step of each of `trees` (by name) with `heads`, and of a plain step without heads (`PLAIN`), at
    `context` committed tokens: the probe's steps priced as every curve's (probe.py), in rounds of one step of
    each (a plain one included) in a new random order, so a change of the machine's speed reaches all alike.
    After one untimed round, rounds run until `MAX_REPS`, or until `budget_s` is spent once `MIN_REPS` ran
    (a machine where big trees cost seconds per step still finishes). `progress`: a rich Progress, advanced
    per round. What `entmtp calibrate` stores as a bank's latencies."""
    plain = Probe(model, None, (0,), sampling)
    probe = Probe(model, heads, (), sampling, trees=trees)
    steps = (MAX_REPS + 1) + WARMUP_STEPS
    room = max(probe.room(steps), plain.room(steps))
    (context,) = _clamp((context,), probe.engine.window, room)
    row = probe.row(context, room)  # one generation steps every tree; plain steps have their own
    rows = {PLAIN: (plain, plain.row(context, room))} | {t.name: (probe, row) for t in trees}
    keys = list(rows)
    for _ in range(WARMUP_STEPS):
        plain.step(rows[PLAIN][1], 0)
    for k in keys:  # untimed: the first step of each shape allocates
        _step(rows, k)
    job = progress.add_task("tree latencies", total=MAX_REPS) if progress else None
    order, t0 = torch.Generator().manual_seed(0), time.perf_counter()
    times: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(MAX_REPS):
        for i in torch.randperm(len(keys), generator=order).tolist():
            times[keys[i]].append(_step(rows, keys[i]))
        if progress:
            progress.advance(job)
        if rep + 1 >= MIN_REPS and time.perf_counter() - t0 > budget_s:
            break
    return {k: statistics.median(t) for k, t in times.items()}


def _step(rows: dict, key: str) -> float:
    probe, row = rows[key]
    return probe.step(row, 0 if key == PLAIN else key)[0]


# ---- the batched cost surface -----------------------------------------------------------------------------


def surface_for(
    model, heads=None, *, max_batch: int, refresh: bool = False, progress: bool = True, sampling=None
) -> CostSurface:
    """This machine's cost surface for (model, heads) up to `max_batch` rows: cached, or measured now."""
    batches = tuple(b for b in BATCHES if b < max_batch) + (max_batch,)
    key = cost_key(
        model, heads, sampling=sampling, sizes=SURFACE_SIZES, surface=batches, batch_step=(SURFACE_PROBE,)
    )
    timed = partial(measure_surface, model, heads, batches=batches, progress=progress, sampling=sampling)
    return cached_or_measured(CostSurface, cost_path(key), key, timed, refresh=refresh)


@torch.inference_mode()
def measure_surface(
    model,
    heads=None,
    *,
    batches: Sequence[int] = BATCHES,
    sizes: Sequence[int] = SURFACE_SIZES,
    budget_s: float = SURFACE_BUDGET_S,
    progress: bool = True,
    sampling: Sampling | None = None,
) -> CostSurface:
    """Time the engine's batched steps of each (batch, size): every batch's plain step, then size by size over
    every batch until the budget is spent, then every batch's plain step once more (the lower of the two is
    kept: a slow start must not make plain steps look dear, which makes every tree look free); the sizes not
    measured in time are filled in by `fill.complete`."""
    t0 = time.perf_counter()
    points = _Points(model, heads, sizes, max(batches), sampling)
    line = _Line("measuring this machine's batched step costs (once)", len(batches) * len(sizes), progress)
    measured: dict[int, dict[int, float]] = {b: {} for b in batches}
    try:
        for b in batches:  # untimed: the first step of a batch shape pays for its kernels and buffers
            points.time(b, sizes[0])
        for n in sizes:  # size by size over every batch: the small trees batches use come first everywhere
            for b in batches:
                if n != sizes[0] and time.perf_counter() - t0 > budget_s:
                    break  # every batch's plain step is measured whatever the budget
                measured[b][n] = points.time(b, n)
                line.advance()
        for b in batches:
            measured[b][sizes[0]] = min(measured[b][sizes[0]], points.time(b, sizes[0]))
    finally:
        line.stop()
    rows = {b: monotone(r) for b, r in complete(measured, batches, sizes).items()}
    seconds = time.perf_counter() - t0
    key = cost_key(model, heads, sampling=sampling, sizes=sizes, surface=batches, batch_step=(SURFACE_PROBE,))
    surface = CostSurface(
        tuple(batches), tuple(sizes), tuple(tuple(rows[b]) for b in batches), key, "probe", seconds,
        record(model.device),
    )  # fmt: skip
    line.say(f"batched step costs measured in {seconds:.1f} s:\n{surface.summary()}")
    return surface


class _Points:
    """The surface's measurements: a batch of `max_batch` rows of `CONTEXT` random tokens over the probe;
    `time(b, n)` the median ms of a step of its first b rows, each verifying a size-`n` tree."""

    def __init__(self, model, heads, sizes: Sequence[int], max_batch: int, sampling: Sampling | None):
        self.probe = probe = Probe(model, heads, sizes, sampling)
        if not probe.engine.base.batchable:
            raise CostsError(
                "this model keeps transformers' DynamicCache, so it cannot batch: a cost surface is for "
                "batched decoding (serve it with --max-batch 1)"
            )
        steps = (REPS + 1) * (len(BATCHES) + 2) * len(sizes)  # every step of the plan, at most
        self.batch = probe.batch(max_batch, CONTEXT, probe.room(steps))

    def time(self, b: int, n: int) -> float:
        """Median ms of a batched step of `b` rows each verifying a size-`n` tree (after one warm-up)."""
        times = [self.probe.batch_step(self.batch, b, n) for _ in range(REPS + 1)][1:]
        return statistics.median(times)
