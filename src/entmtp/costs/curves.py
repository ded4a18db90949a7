"""What a step costs on a machine, as the policies read it: the types, and the fallback when nothing is measured.

A leaf: no model, engine or probe imports, so the scheduler, the lookup hybrid and the replays read costs
without loading anything. `LatencyModel` is the interpolated curve a policy weighs trees by; `CostCurve` one
machine's measurement at batch 1 (the probe, probe.py, or a profile's stored latencies); `CostSurface` the
batched step's, by rows and drafted nodes per row. `CPU_COST` and `HEADS_DRAFT_COST` are what the lookup
hybrid and the replays fall back on when no curve was measured: both come from another machine (see each).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..codec import JsonForm, from_json, to_json
from ..errors import EntMTPError
from ..tree import Tree

FORMAT, VERSION = "entmtp-costs", 1
SURFACE_FORMAT, SURFACE_VERSION = "entmtp-surface", 1


class CostRecord(JsonForm):
    """A measurement the cost cache keeps (a curve, a surface, a prefill or a choice cost): its fields as the
    codec writes them (codec.py), under a format name and version that reading checks first. `KIND` names it
    in messages."""

    FORMAT: ClassVar[str]
    VERSION: ClassVar[int]
    KIND: ClassVar[str]

    def to_json(self) -> dict:
        return {"format": self.FORMAT, "version": self.VERSION, **to_json(self)}

    @classmethod
    def from_json(cls, data: dict):
        if data.get("format") != cls.FORMAT or data.get("version") != cls.VERSION:
            raise CostsError(f"not an {cls.FORMAT} v{cls.VERSION} document")
        return from_json(cls, {k: v for k, v in data.items() if k not in ("format", "version")})


class CostsError(EntMTPError):
    """A cost curve file is corrupt or does not belong to this machine."""


CONTEXT_BUCKET = 64  # tokens of context per step of `LatencyModel.at` (its curves are kept per bucket)


class LatencyModel:
    """Measured step latency (ms, drafting included) against tree nodes, interpolated between measurements;
    `ms_of` prefers a tree's own measurement when it has one (`measured`: tree name -> entry)."""

    def __init__(
        self,
        nodes: Sequence[int],
        ms: Sequence[float],
        measured: dict[str, dict] | None = None,
        *,
        contexts: Sequence[int] = (),
        by_context: Sequence[Sequence[float]] = (),
    ):
        if len(nodes) == 0 or len(nodes) != len(ms):
            raise EntMTPError("a latency profile needs as many step times as tree sizes, at least one")
        order = np.argsort(nodes)
        self.nodes = np.asarray(nodes, dtype=float)[order]
        self.ms = np.maximum.accumulate(np.asarray(ms, dtype=float)[order])  # more nodes never cost less
        self.measured = measured or {}
        # the curve at each measured context (tokens in the cache), where it was measured at several
        rows = [r for r in by_context if len(r) == len(nodes)]
        self.contexts = np.asarray(contexts, dtype=float) if len(rows) == len(contexts) > 1 else np.zeros(0)
        self._by_context = np.asarray(rows, dtype=float)[:, order] if self.contexts.size else None
        self._at: dict[int, LatencyModel] = {}

    def at(self, position: int) -> LatencyModel:
        """The curve at `position` tokens of context: interpolated between the measured contexts (the nearest
        one's outside them); this curve itself where it was measured at one context or fewer. A step after a
        short prompt costs other multiples of a plain step than one after a long one (llama.cpp: 1.8x and 1.45x
        for a drafted token after 200 and 768 tokens on the AMX Xeon)."""
        if self._by_context is None:
            return self
        bucket = int(position) // CONTEXT_BUCKET
        found = self._at.get(bucket)
        if found is None:
            x = (bucket + 0.5) * CONTEXT_BUCKET
            ms = [np.interp(x, self.contexts, self._by_context[:, i]) for i in range(len(self.nodes))]
            found = self._at[bucket] = LatencyModel(self.nodes, ms)
        return found

    @classmethod
    def from_measured(cls, measured: dict[str, dict]) -> LatencyModel:
        """From per-tree measurements: name -> {"nodes", "ms_per_step", ...}."""
        entries = list(measured.values())
        return cls([m["nodes"] for m in entries], [m["ms_per_step"] for m in entries], measured)

    def __call__(self, nodes) -> np.ndarray:
        return np.interp(nodes, self.nodes, self.ms)

    def ms_of(self, tree: Tree) -> float:
        """The tree's measured step latency, else interpolated by its node count."""
        m = self.measured.get(tree.name)
        return (
            m["ms_per_step"]
            if m is not None and m["nodes"] == tree.num_nodes
            else float(self(tree.num_nodes))
        )


# Step latency (ms) by drafted nodes with Hydra's shipped heads on SmolLM2-135M in bf16 with packed weights,
# measured on a 2-core AMD EPYC with AVX-512 and native bf16 (the shipped hydra/mixed profile's latencies,
# `entmtp calibrate --latency-only`, 2026-12-01, commit 26217cc): what the lookup hybrid sizes its branch by
# when it is given no measured curve (`--no-probe`, no profile). Another machine's: on an AVX2-only CPU a
# node costs 1.5 plain steps, not 1.2. LatencyModel makes it non-decreasing.
CPU_COST = LatencyModel(
    [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 90],
    [28.0, 33.0, 32.7, 32.3, 33.1, 35.8, 37.8, 42.1, 46.2, 56.3, 70.2, 89.6, 111.9, 136.1],
)
# The heads' drafting in plain steps, when no measured curve splits it out (`CostCurve.draft_share` is None):
# Hydra's draft phase took 3.95-4.2 ms (median Step.seconds["draft"], chain_2 / tree_4 / EntMTP*, bf16, not yet
# packed) against 36-38 ms plain steps on the 2-core Intel Xeon (AVX-512, AMX) the first shipped profiles were
# measured on (2026-11-30, commit b45ba0d). Another machine's: a measured curve's share replaces it.
HEADS_DRAFT_COST = 0.11


def relative_cost(latency: LatencyModel | None) -> Callable[[np.ndarray], np.ndarray]:
    """A step's cost in plain steps by drafted nodes: on `latency` (this machine's curve, a profile's stored
    latencies), else on `CPU_COST` (another machine's)."""
    curve = latency if latency is not None else CPU_COST
    plain = float(curve(0))
    return lambda nodes: curve(nodes) / plain


def priced_ms(seconds: dict[str, float]) -> float:
    """The ms of a step (its `Step.seconds`) that a cost curve prices: the whole step less the heads' probe and
    the policy's choice (which depend on the policy, not on the tree verified). The probe times steps by this,
    and the corrector compares steps with the curve by it."""
    return 1000 * (seconds["total"] - seconds.get("probe", 0.0) - seconds.get("choose", 0.0))


@dataclass(frozen=True)
class CostCurve(CostRecord):
    """ms per step (the heads' drafting, verification, acceptance and commit; not the probe) by drafted nodes.

    `step_ms[i]` is the mean over the measured contexts of `by_context[c][i]`; `draft_ms[i]` the heads' part of
    it (0 without heads); `prefill_ms_per_token` the prefill of the longest context, per token."""

    FORMAT, VERSION, KIND = FORMAT, VERSION, "cost curve"

    nodes: tuple[int, ...]  # [S]
    step_ms: tuple[float, ...]  # [S]
    draft_ms: tuple[float, ...]  # [S]
    contexts: tuple[int, ...] = ()  # [C]
    by_context: tuple[tuple[float, ...], ...] = ()  # [C][S]
    prefill_ms_per_token: float | None = None
    key: dict = field(default_factory=dict)  # what the curve was measured on (see `store.cost_key`)
    source: str = "probe"  # probe | profile | corrected | a file name
    seconds: float = 0.0  # how long the measurement took
    machine: dict | None = None  # machine.record of where it was measured (None: a file from before records)

    def __post_init__(self):
        if not self.nodes or len(self.nodes) != len(self.step_ms) or self.nodes[0] != 0:
            raise CostsError(
                "a cost curve needs a step time per size, starting with the plain step (0 nodes)"
            )

    @property
    def plain_ms(self) -> float:
        return self.step_ms[0]

    def latency(self) -> LatencyModel:
        """The curve as the policies read it (interpolated, non-decreasing in nodes; `at` a context)."""
        return LatencyModel(self.nodes, self.step_ms, contexts=self.contexts, by_context=self.by_context)

    def relative(self, nodes) -> np.ndarray:
        """Step cost in plain steps."""
        return self.latency()(nodes) / self.plain_ms

    def summary(self) -> str:
        """One line: the plain step's ms and every other size in plain steps."""
        rel = ", ".join(
            f"{n}: {ms / self.plain_ms:.2f}x" for n, ms in zip(self.nodes, self.step_ms, strict=True) if n
        )
        return f"plain {self.plain_ms:.1f} ms; nodes {rel}"

    @property
    def draft_share(self) -> float | None:
        """The heads' drafting in plain steps (median over the sizes that draft): what a step that drops the
        heads' tree saves, and what the hybrid's probe costs. 0 for a curve the probe measured without heads
        (nothing drafts); None when the curve does not split it out (a profile's stored latencies)."""
        if self.source in ("probe", "corrected") and "heads" in self.key and self.key["heads"] is None:
            return 0.0
        shares = [
            d / self.plain_ms for n, d in zip(self.nodes, self.draft_ms, strict=True) if n > 0 and d > 0
        ]
        return statistics.median(shares) if shares else None

    @classmethod
    def from_latency(cls, nodes: Sequence[int], ms: Sequence[float], source: str) -> CostCurve:
        """From a profile's latency section or another tool's measured (nodes, ms) pairs; no drafting split."""
        order = np.argsort(nodes)
        n = tuple(int(nodes[i]) for i in order)
        m = tuple(float(ms[i]) for i in order)
        if n[0] != 0:
            raise CostsError(f"{source}: the measurements lack the plain step (0 nodes)")
        return cls(n, m, (0.0,) * len(n), source=source)

    @classmethod
    def from_step_costs(cls, path: str | os.PathLike[str]) -> CostCurve:
        """From a per-step cost table (`entmtp step-costs --out F.json`: rows of ms per phase per tree, and the
        machine it was measured on); the first row per node count (e.g. one KV mode) is taken."""
        table = json.loads(Path(path).read_text(encoding="utf-8"))
        rows = table["rows"].values()
        seen: dict[int, dict] = {}
        for r in rows:
            seen.setdefault(int(r["nodes"]), r)
        n = sorted(seen)
        return cls(
            tuple(n),
            tuple(float(seen[k]["total"]) for k in n),
            tuple(float(seen[k]["draft"]) for k in n),
            source=Path(path).name,
            machine=table.get("meta", {}).get("machine"),
        )

    def with_points(self, updates: dict[int, float]) -> CostCurve:
        """The curve with some sizes' step times replaced (a correction; each context's time of such a size scaled
        alike, so the curve at a context moves with its mean)."""
        step = tuple(updates.get(n, ms) for n, ms in zip(self.nodes, self.step_ms, strict=True))
        scale = [new / old if old > 0 else 1.0 for new, old in zip(step, self.step_ms, strict=True)]
        by_context = tuple(
            tuple(ms * k for ms, k in zip(row, scale, strict=True)) if len(row) == len(scale) else row
            for row in self.by_context
        )
        return CostCurve(
            self.nodes, step, self.draft_ms, self.contexts, by_context, self.prefill_ms_per_token,
            self.key, "corrected", self.seconds, self.machine,
        )  # fmt: skip


@dataclass(frozen=True)
class CostSurface(CostRecord):
    """The batched step's cost: `ms[i][j]`, one step of `batches[i]` rows, each verifying `nodes[j]` drafted
    nodes. At batch 1 it is the cost curve; with B rows one forward verifies B trees padded to the largest, so
    a step of B rows costs far less than B steps, but each extra node costs B tokens of work."""

    FORMAT, VERSION, KIND = SURFACE_FORMAT, SURFACE_VERSION, "cost surface"

    batches: tuple[int, ...]  # [R]
    nodes: tuple[int, ...]  # [S]
    ms: tuple[tuple[float, ...], ...]  # [R][S]
    key: dict = field(default_factory=dict)
    source: str = "probe"
    seconds: float = 0.0
    machine: dict | None = None  # machine.record of where it was measured (None: a file from before records)

    def __post_init__(self):
        if (
            not self.batches
            or len(self.ms) != len(self.batches)
            or any(len(r) != len(self.nodes) for r in self.ms)
        ):
            raise CostsError("a cost surface needs a step time per (batch, size)")

    def row(self, batch: int) -> np.ndarray:
        """[S] ms per step at `batch` rows: interpolated between measured batches, linear past the largest."""
        b, ms = np.asarray(self.batches, dtype=float), np.asarray(self.ms)
        if batch <= b[-1] or len(b) == 1:
            return np.array([np.interp(batch, b, ms[:, j]) for j in range(ms.shape[1])])
        slope = (ms[-1] - ms[-2]) / (b[-1] - b[-2])
        return ms[-1] + slope * (batch - b[-1])

    def latency(self, batch: int) -> LatencyModel:
        """What a policy weighs trees by in a step of `batch` rows: ms of the whole step by nodes per row."""
        return LatencyModel(self.nodes, self.row(batch))

    def summary(self) -> str:
        """One line per batch: ms of a plain step and each size in plain steps of that batch."""
        lines = []
        for b, r in zip(self.batches, self.ms, strict=True):
            rel = ", ".join(f"{n}: {m / r[0]:.2f}x" for n, m in zip(self.nodes, r, strict=True) if n)
            lines.append(f"batch {b}: plain {r[0]:.1f} ms ({r[0] / b:.1f} ms/row); nodes {rel}")
        return "\n".join(lines)
