"""Correcting a cached cost curve by the steps generations actually took (for later builds)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

from .cache import cost_path, save_curve
from .curves import CostCurve, priced_ms

NOISE = 0.25  # relative disagreement between measured steps and the curve that counts as a change
MIN_STEPS = 6  # steps of one size a correction needs


class CostCorrector:
    """Compares the measured ms of generations' steps with the curve their policy was built on, and rewrites
    a size's point of the cached curve (for later builds; the running policy keeps its curve) when it
    disagrees by more than `NOISE`, over at least `MIN_STEPS` steps, twice in a row in the same direction.

    What is corrected is the curve's shape, the cost of each size relative to the others, which is all a
    policy's choice depends on. A slowdown every size of a generation shares is the machine's load at the
    time (other processes on the cores), not the curve's: each step's ms is divided by the load, the median
    ratio of measured to curve ms over the generation's smallest size with `MIN_STEPS` steps (its yardstick,
    plain steps mostly, never corrected itself), before it is judged. So a loaded machine corrects nothing,
    and a generation of one size alone says nothing about the shape and changes nothing. A new point stays
    between its neighbours'. Steps are matched to the measured sizes exactly, and priced as the probe
    measured them (`priced_ms`: the probe and the choice left out)."""

    def __init__(self, curve: CostCurve, path: Path | None):
        self.curve, self.path = curve, path
        self.samples: dict[int, list[float]] = {n: [] for n in curve.nodes}
        self.verdicts: dict[int, float] = {}  # size -> the last disagreeing median, awaiting a second one

    @classmethod
    def for_curve(cls, curve: CostCurve) -> CostCorrector | None:
        """A corrector for a measured curve, writing to its cache file; None for curves read from a profile or
        another file (nothing of this machine's to correct)."""
        if curve.source not in ("probe", "corrected") or not curve.key:
            return None
        return cls(curve, cost_path(curve.key))

    def observe(self, steps) -> CostCurve | None:
        """Add a generation's steps (first two dropped: warm-up); return the corrected curve when one was
        written."""
        lat = self.curve.latency()
        timed = [s for s in steps[2:] if "total" in s.seconds]
        ms = [priced_ms(s.seconds) for s in timed]
        counts = Counter(s.tree_nodes for s in timed)
        anchor = min((n for n, k in counts.items() if k >= MIN_STEPS), default=None)
        if anchor is None:
            return None
        # the yardstick: the smallest size with enough steps (plain steps, mostly) measures the load
        load = statistics.median(
            m / float(lat(anchor)) for s, m in zip(timed, ms, strict=True) if s.tree_nodes == anchor
        )
        for s, m in zip(timed, ms, strict=True):
            if s.tree_nodes in self.samples:  # a measured size
                self.samples[s.tree_nodes].append(m / load)  # the generation's common slowdown divided out
        updates = self._updates()
        if not updates:
            return None
        self.curve = self.curve.with_points(updates)
        if self.path is not None:
            save_curve(self.curve, self.path)
        return self.curve

    def _updates(self) -> dict[int, float]:
        """Size -> its new ms, for the sizes with enough samples that disagreed twice in a row the same way."""
        updates = {}
        curve_ms = self.curve.step_ms
        for i, n in enumerate(self.curve.nodes):
            got = self.samples[n]
            if len(got) < MIN_STEPS:
                continue
            observed, self.samples[n] = statistics.median(got), []
            off = math.log(observed / curve_ms[i])
            if abs(off) <= math.log1p(NOISE):
                self.verdicts.pop(n, None)
                continue
            before = self.verdicts.pop(n, None)
            if before is None or (before > curve_ms[i]) != (observed > curve_ms[i]):
                self.verdicts[n] = observed  # the first verdict: wait for a second
                continue
            low = curve_ms[i - 1] if i > 0 else 0.0
            high = curve_ms[i + 1] if i + 1 < len(curve_ms) else math.inf
            updates[n] = min(max(statistics.median([before, observed]), low), high)
        return updates
