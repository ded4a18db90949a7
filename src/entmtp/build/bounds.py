"""Bounds on what a `--dtype auto` candidate could reach before its curve is measured: each dearer and tighter than
the last, so that a candidate that cannot beat the measured leader costs as little measuring as can show it
(`choose._measure`; the first bound, every tree priced as one plain step, is `choose._best_cases`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..backends.registry import at
from ..costs import CostCurve
from .composed import compose
from .loaded import Loader
from .spec import EngineSpec

# a candidate whose best case beats the leader: its steps timed briefly at a few sizes after a short context and
# without heads (a step after a longer one, or with heads, costs more), each size between them priced at the
# cheapest measured size below it (`floor`): on the AMX Xeon the Q8_0 and BF16 files' best cases (every tree one
# plain step) beat Q4_1's measured 117-123 tokens/s, so both curves were measured (2 x 18 s of a 104 s first
# run); now BF16 stops here (at most ~60), Q8_0 (at most ~150 here, 105 on its curve) at its curve without heads
# (`heads_less_case`: at most 112-115). A bound after both contexts with the heads was tried in its place: 116-120
# for Q8_0, too close to the leader, in ~7 s (2026-12-07)
FLOOR_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)
FLOOR_PROBE_S = 2.0
FLOOR_MARGIN = 0.85  # of each size's measured cost over a plain step: a brief probe's ratios err by ~5%


def tighten(loader: Loader, spec: EngineSpec, cand: str, bounds: dict, lead: float, log=None) -> str:
    """How `cand`'s best case in `bounds` (plain ms, tokens/s) was found, tightened while it still reaches
    `lead` (the leader's measured tokens/s), each step dearer than the last: every tree priced as one plain step
    (`choose._best_cases`); its steps timed briefly, each size at the least it could cost (`floor_case`); its curve
    without heads measured and its heads' trees priced on it (`heads_less_case`). `log(str)`: a line before
    each measurement (the curve's own progress line names itself)."""
    how = f"its plain step {bounds[cand][0]:.1f} ms, every tree priced as one"
    if bounds[cand][1] >= lead:
        if log is not None:
            log(f"timing {cand}'s steps briefly (~{FLOOR_PROBE_S:.0f} s): can it reach {lead:.1f} tokens/s?")
        low, bounds[cand] = floor_case(loader, spec, cand)
        how = f"its steps timed briefly, {low.summary()}, each tree priced at the least its size costs"
    if bounds[cand][1] >= lead and (found := heads_less_case(loader, spec, cand)) is not None:
        curve, bounds[cand] = found
        how = f"its curve without heads measured, {curve.summary()}, its heads' trees priced on it"
    return how


def heads_less_case(
    loader: Loader, spec: EngineSpec, cand: str
) -> tuple[CostCurve, tuple[float, float]] | None:
    """(its curve without heads, (that plain step's ms, the most expected tokens/s `cand` could reach)) for a
    candidate with heads: that curve measured (`HEADS_LESS_BUDGET_S`, and cached, so that the candidate's own
    measurement reads it, as it would measure it where a tree wins), its heads' trees priced on it, which they
    cost more than (their drafting; llama.cpp's embeddings on). On the AMX Xeon the Q8_0 file: its heads' curve
    took 12 s only to come out below Q4_1. None for a candidate without heads (its curve is all there is)."""
    bare = loader.load(replace(at(spec, cand), probe=False))
    if bare.heads is None:
        return None
    curve = replace(bare, probed=True).curve_without_heads()
    option = replace(bare, costs=curve, heads_less=curve)
    return curve, (curve.plain_ms, compose(option, spec, log=lambda _: None).expected)


def floor_case(loader: Loader, spec: EngineSpec, cand: str) -> tuple[CostCurve, tuple[float, float]]:
    """(the floor curve, (its plain step's ms, the most expected tokens/s `cand` could reach)): its steps timed
    briefly at `FLOOR_SIZES` without heads (heads only add to a step), each tree priced by `floor`."""
    from ..costs import measured

    bare = loader.load(replace(at(spec, cand), probe=False))
    quick = measured.measure(bare.model, None, sizes=FLOOR_SIZES, contexts=(128,), budget_s=FLOOR_PROBE_S,
                             progress=False)  # fmt: skip
    low = floor(quick)
    return low, (low.plain_ms, compose(replace(bare, costs=low), spec, log=lambda _: None).expected)


def floor(curve: CostCurve, margin: float = FLOOR_MARGIN) -> CostCurve:
    """The least a step of each size could cost, from a curve measured at a few sizes: a size between two
    measured ones at the smaller one's cost (a step costs no less for more nodes, but it may climb anywhere
    between them, so interpolating is no bound), each measured cost over a plain step shaved to `margin` of
    it. No drafting cost, one context."""
    plain = curve.plain_ms
    ms = [plain + margin * (m - plain) for m in np.maximum.accumulate(curve.step_ms)]
    nodes, step = [], []
    for i, (n, m) in enumerate(zip(curve.nodes, ms, strict=True)):
        nodes.append(n)
        step.append(m)
        following = curve.nodes[i + 1] if i + 1 < len(curve.nodes) else n
        if following - 1 > n:  # held flat to the next measured size
            nodes.append(following - 1)
            step.append(m)
    return CostCurve(tuple(nodes), tuple(step), (0.0,) * len(nodes), source="best case")
