"""The machine's cost of a batched step: ms per step against (rows in the batch, drafted nodes per row).

At batch 1 a step's cost is the cost curve (costs.py). With B rows, one forward verifies B trees padded to the
largest, so a step of B rows of n nodes costs far less than B steps (the per-step overhead and the weights'
reads are shared) but each extra node now costs B tokens of work: the tree that pays at batch 1 can lose at
batch 8. `measure_surface` times whole batched steps the way `Batch.step` runs them (each row's drafting, one
forward, each row's acceptance and commit) on synthetic trees and random tokens, for each batch size up to
the server's `--max-batch`, within a budget (sizes past it extrapolated); `surface_for` caches the result
beside the cost curves. Policies read `latency(B)`: the ms of the whole step by drafted nodes per row.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .accept import Sampling, accept
from .cache import BaseModel, BatchKV
from .costs import CostsError, LatencyModel, _extrapolate, _Line, _now, cost_key, cost_path, synthetic_tree
from .files import write_text_atomic
from .machine import record

FORMAT, VERSION = "entmtp-surface", 1
BATCHES = (1, 2, 4, 8, 16)
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # drafted nodes per row (the policies' largest master trees: 63 nodes)
CONTEXT = 256  # committed tokens per row before the timed steps
BUDGET_S = 30.0
REPS = 3  # timed steps per point, after one warm-up


@dataclass(frozen=True)
class CostSurface:
    """`ms[i][j]`: one step of `batches[i]` rows, each verifying `nodes[j]` drafted nodes."""

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

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> CostSurface:
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise CostsError(f"not an {FORMAT} v{VERSION} document")
        return cls(
            tuple(int(b) for b in d["batches"]),
            tuple(int(n) for n in d["nodes"]),
            tuple(tuple(float(x) for x in r) for r in d["ms"]),
            d.get("key", {}),
            d.get("source", "probe"),
            float(d.get("seconds", 0.0)),
            d.get("machine"),
        )


@torch.inference_mode()
def measure_surface(
    model,
    heads=None,
    *,
    batches: Sequence[int] = BATCHES,
    sizes: Sequence[int] = SIZES,
    budget_s: float = BUDGET_S,
    progress: bool = True,
) -> CostSurface:
    """Time batched steps of each (batch, size): every batch's plain step, then size by size over every batch
    until the budget is spent, then every batch's plain step once more (the lower of the two is kept: a slow
    start must not make plain steps look dear, which makes every tree look free); the sizes not measured in
    time are filled in by `_complete`."""
    t0 = time.perf_counter()
    probe = _BatchProbe(model, heads, max(batches))
    line = _Line("measuring this machine's batched step costs (once)", len(batches) * len(sizes), progress)
    measured: dict[int, dict[int, float]] = {b: {} for b in batches}
    try:
        for b in batches:  # untimed: the first step of a batch shape pays for its kernels and buffers
            probe.time(b, sizes[0])
        for n in sizes:  # size by size over every batch: the small trees batches use come first everywhere
            for b in batches:
                if n != sizes[0] and time.perf_counter() - t0 > budget_s:
                    break  # every batch's plain step is measured whatever the budget
                measured[b][n] = probe.time(b, n)
                line.advance()
        for b in batches:
            measured[b][sizes[0]] = min(measured[b][sizes[0]], probe.time(b, sizes[0]))
    finally:
        line.stop()
    rows = {b: _monotone(r) for b, r in _complete(measured, batches, sizes).items()}
    seconds = time.perf_counter() - t0
    key = {**cost_key(model, heads), "surface": list(batches), "sizes": list(sizes)}
    surface = CostSurface(
        tuple(batches), tuple(sizes), tuple(tuple(rows[b]) for b in batches), key, "probe", seconds,
        record(model.device),
    )  # fmt: skip
    line.say(f"batched step costs measured in {seconds:.1f} s:\n{surface.summary()}")
    return surface


def _monotone(ms: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators). A step of more nodes never
    costs less; a timing outlier is averaged with its neighbours instead of raising every larger size, as a
    running maximum would."""
    blocks: list[list[float]] = []  # [sum, count]
    for m in ms:
        blocks.append([m, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _complete(measured: dict[int, dict[int, float]], batches: Sequence[int], sizes: Sequence[int]):
    """Every (batch, size): measured; a batch's larger sizes linear from its two largest measured (costs.py's
    `_extrapolate`), or, with only its plain step measured, the previous batch's shape scaled to it; a batch
    not measured at all linear in rows from the two largest measured batches."""
    rows: dict[int, list[float]] = {}
    for b in batches:
        got = measured.get(b, {})
        if len(got) >= 2 or (got and not rows):
            rows[b] = _extrapolate(got, sizes)
        elif got:
            prev = rows[max(rows)]
            rows[b] = [got.get(n, prev[j] * got[sizes[0]] / prev[0]) for j, n in enumerate(sizes)]
    done = sorted(rows)
    for b in batches:
        if b not in rows:
            lo, hi = (done[-2], done[-1]) if len(done) > 1 else (done[-1], done[-1])
            step = [(y - x) / max(1, hi - lo) for x, y in zip(rows[lo], rows[hi], strict=True)]
            rows[b] = [
                y + s * (b - hi) if hi > lo else y * b / hi for y, s in zip(rows[hi], step, strict=True)
            ]
    return rows


class _BatchProbe:
    """Rows of `CONTEXT` random tokens (one prefill, copied) and each row's drafting state; `time(b, n)`."""

    def __init__(self, model, heads, max_batch: int):
        offset = heads.config.hidden_state_offset if heads is not None else 0
        self.base, self.heads = BaseModel(model, hidden_state_offset=offset), heads
        self.num_heads = heads.config.num_heads if heads is not None else 4
        self.vocab, self.dev = model.config.vocab_size, self.base.device
        self.gen = torch.Generator().manual_seed(0)
        self.kv = BatchKV(model)
        need = CONTEXT + 64 * (REPS + 1) * (self.num_heads + 1) + 2 * max(SIZES) + 2
        ids = torch.randint(0, self.vocab, (CONTEXT,), generator=self.gen).to(self.dev)
        first = self.kv.add(need)
        fwd = self.base.forward(ids, None, first)
        self.base.commit(first, list(range(CONTEXT)))
        self.rows, self.drafters = [first], []
        for _ in range(max_batch - 1):
            row = self.kv.add(need)
            row.kv[:, :, :, :, :CONTEXT] = first.kv[:, :, :, :, :CONTEXT]
            row.length = CONTEXT
            self.rows.append(row)
        if heads is not None:
            heads.bind(model)
            for _ in range(max_batch):
                d = heads.drafter()
                d.extend(fwd.hidden)
                self.drafters.append(d)
        self.full = list(self.kv.rows)
        # size -> its synthetic tree, built once (the heads cache plans per tree)
        self.trees: dict[int, object] = {}

    def time(self, b: int, n: int) -> float:
        """Median ms of a batched step of `b` rows each verifying a size-`n` tree (after one warm-up)."""
        self.kv.rows = self.full[:b]  # the first b rows take part (their views stay in place)
        for r in self.full[:b]:
            r.length = min(r.length, CONTEXT + 64)  # keep contexts comparable across points
        if n not in self.trees:
            self.trees[n] = synthetic_tree(n, self.num_heads)
        tree = self.trees[n]
        times = [self._step(b, tree) for _ in range(REPS + 1)][1:]
        return statistics.median(times)

    def _step(self, b: int, tree) -> float:
        base, dev, gen = self.base, self.dev, self.gen
        roots = torch.randint(0, self.vocab, (b, 1), generator=gen).to(dev)
        t0 = _now(dev)
        tokens = []
        for i in range(b):
            if self.heads is not None and tree.num_nodes:
                tokens.append(torch.cat([roots[i], self.drafters[i].draft(tree, roots[i]).tokens]))
            else:
                rand = torch.randint(0, self.vocab, (tree.num_nodes,), generator=gen).to(dev)
                tokens.append(torch.cat([roots[i], rand]))
        fwds = base.forward_batch(tokens, [tree] * b, self.kv)
        for i, fwd in enumerate(fwds):
            acc = accept(tree, tokens[i], fwd.logits, Sampling(), None)
            base.commit(self.kv.rows[i], acc.path)
            if self.heads is not None:
                self.drafters[i].extend(fwd.hidden[torch.tensor(acc.path, device=dev)])
        return 1000 * (_now(dev) - t0)


def surface_for(
    model, heads=None, *, max_batch: int, refresh: bool = False, progress: bool = True
) -> CostSurface:
    """This machine's cost surface for (model, heads) up to `max_batch` rows: cached, or measured now."""
    batches = tuple(b for b in BATCHES if b < max_batch) + (max_batch,)
    key = {**cost_key(model, heads), "surface": list(batches), "sizes": list(SIZES)}
    path = cost_path(key)
    if path.exists() and not refresh:
        try:
            surface = CostSurface.from_json(json.loads(path.read_text(encoding="utf-8")))
            if surface.key == json.loads(json.dumps(key)):
                return surface
        except (CostsError, OSError, ValueError, KeyError, TypeError) as e:
            print(f"entmtp: cost surface {path} is unreadable ({e}); measuring again", file=sys.stderr)
    surface = measure_surface(model, heads, batches=batches, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(surface.to_json(), indent=1) + "\n")
    return surface
