"""The machine part of a schedule: what a verification step costs here, measured, cached and corrected.

A profile (scheduler/profiles.py) holds what belongs to the task: traces, the acceptance model, the candidate
trees and how many tokens each accepts per step. What a tree *costs* belongs to the machine (CPU model and
flags, GPU, threads, dtype, packing, model and heads), and differs a lot across machines: a 4-node tree costs
1.1 plain steps on a 2-core CPU with native bf16 and 2.8 on one with AVX2 only. So the first time a (model,
heads, dtype, device, threads, machine) is used, `costs_for` measures a `CostCurve` (ms per step against
drafted nodes, at two context lengths; ~10-20 s on a CPU, one progress line), writes it atomically under
`$ENTMTP_CACHE/costs/`, and reuses it on later runs. Policies and the lookup hybrid are built on it
(`Profile.policy(..., costs=curve)`), so the same shipped profile gives small trees on a small CPU and big
ones on a GPU.

What changes a cached curve: `CostCorrector` compares the measured ms of a generation's steps with the curve
and, where they disagree by more than `NOISE` on enough steps, rewrites those points for *later* builds (a
policy keeps the curve it was built with, so a seeded run repeats given the same cache). Delete the file (or
run `entmtp doctor --probe`) to measure again; `ENTMTP_NO_PROBE=1` or `--no-probe` uses a profile's stored
latencies instead.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .accept import Sampling, accept
from .backends import backend_name, base_for
from .errors import EntMTPError
from .files import write_text_atomic
from .machine import digest, hardware, heads_checksum, model_fingerprint, record
from .packing import PackedLinear
from .tree import Tree

FORMAT, VERSION = "entmtp-costs", 1
# drafted nodes measured (0 = a plain step): every size up to 8, where CPU policies choose most, since a CPU's
# step cost climbs in steps, not along a line (scripts/probe_sizes.py: on a 2-core AMD EPYC with AVX-512 and
# bf16, 6 nodes 1.51 plain steps against 5 nodes' 1.37, where interpolating from 4 to 8 gave 1.48 and 1.41);
# sparser above
SIZES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
CONTEXTS = (128, 768)  # committed tokens before the measured steps: a short and a long context
BUDGET_S = 20.0  # the whole measurement; sizes past it are extrapolated from the last two measured
MIN_REPS, MAX_REPS = 3, 9  # timed rounds per context (a round: one step of every size), after a warm-up round
WARMUP_STEPS = 3  # plain steps before any timing (then the untimed round of every size, `_Probe.row`)
DEPTH_STEP, RANK_STEP = 1.0, 0.45  # -log score per depth and per rank: mc_sim_7b_63-like widths
NOISE = 0.25  # relative disagreement between measured steps and the curve that counts as a change
MIN_STEPS = 6  # steps of one size a correction needs


class CostsError(EntMTPError):
    """A cost curve file is corrupt or does not belong to this machine."""


class LatencyModel:
    """Measured step latency (ms, drafting included) against tree nodes, interpolated between measurements;
    `ms_of` prefers a tree's own measurement when it has one (`measured`: tree name -> entry)."""

    def __init__(self, nodes: Sequence[int], ms: Sequence[float], measured: dict[str, dict] | None = None):
        if len(nodes) == 0 or len(nodes) != len(ms):
            raise EntMTPError("a latency profile needs as many step times as tree sizes, at least one")
        order = np.argsort(nodes)
        self.nodes = np.asarray(nodes, dtype=float)[order]
        self.ms = np.maximum.accumulate(np.asarray(ms, dtype=float)[order])  # more nodes never cost less
        self.measured = measured or {}

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


@dataclass(frozen=True)
class CostCurve:
    """ms per step (the heads' drafting, verification, acceptance and commit; not the probe) by drafted nodes.

    `step_ms[i]` is the mean over the measured contexts of `by_context[c][i]`; `draft_ms[i]` the heads' part of
    it (0 without heads); `prefill_ms_per_token` the prefill of the longest context, per token."""

    nodes: tuple[int, ...]  # [S]
    step_ms: tuple[float, ...]  # [S]
    draft_ms: tuple[float, ...]  # [S]
    contexts: tuple[int, ...] = ()  # [C]
    by_context: tuple[tuple[float, ...], ...] = ()  # [C][S]
    prefill_ms_per_token: float | None = None
    key: dict = field(default_factory=dict)  # what the curve was measured on (see `cost_key`)
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
        """The curve as the policies read it (interpolated, non-decreasing in nodes)."""
        return LatencyModel(self.nodes, self.step_ms)

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
        heads' tree saves; None when the curve does not split it out (a profile's stored latencies)."""
        shares = [
            d / self.plain_ms for n, d in zip(self.nodes, self.draft_ms, strict=True) if n > 0 and d > 0
        ]
        return statistics.median(shares) if shares else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["by_context"] = [list(r) for r in self.by_context]
        return {"format": FORMAT, "version": VERSION, **d}

    @classmethod
    def from_json(cls, d: dict) -> CostCurve:
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise CostsError(f"not an {FORMAT} v{VERSION} document")
        return cls(
            tuple(int(n) for n in d["nodes"]),
            tuple(float(x) for x in d["step_ms"]),
            tuple(float(x) for x in d["draft_ms"]),
            tuple(int(c) for c in d.get("contexts", ())),
            tuple(tuple(float(x) for x in r) for r in d.get("by_context", ())),
            d.get("prefill_ms_per_token"),
            d.get("key", {}),
            d.get("source", "probe"),
            float(d.get("seconds", 0.0)),
            d.get("machine"),
        )

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
        """From a per-step cost table (`entmtp step-costs --out F.json`: rows of ms per phase per tree); the
        first row per node count (e.g. one KV mode) is taken."""
        rows = json.loads(Path(path).read_text(encoding="utf-8"))["rows"].values()
        seen: dict[int, dict] = {}
        for r in rows:
            seen.setdefault(int(r["nodes"]), r)
        n = sorted(seen)
        return cls(
            tuple(n),
            tuple(float(seen[k]["total"]) for k in n),
            tuple(float(seen[k]["draft"]) for k in n),
            source=Path(path).name,
        )

    def with_points(self, updates: dict[int, float]) -> CostCurve:
        """The curve with some sizes' step times replaced (a correction)."""
        step = tuple(updates.get(n, ms) for n, ms in zip(self.nodes, self.step_ms, strict=True))
        return CostCurve(
            self.nodes, step, self.draft_ms, self.contexts, self.by_context, self.prefill_ms_per_token,
            self.key, "corrected", self.seconds, self.machine,
        )  # fmt: skip


# ---- the key: what a curve belongs to -------------------------------------------------------------------


def cost_key(model, heads, graphs: bool = False) -> dict:
    """Everything that changes what a step costs: the machine, the model, its dtype and packing, the heads,
    CUDA graphs."""
    key = {
        "graphs": graphs,
        "hardware": hardware(model),
        "model": model_fingerprint(model),
        "packed": any(isinstance(m, PackedLinear) for m in model.modules()),
        "heads": None
        if heads is None
        else {
            "kind": heads.config.kind,
            "num_heads": heads.config.num_heads,
            "checksum": heads_checksum(heads),
        },
        "versions": {"entmtp": __version__, "torch": torch.__version__},
        "probe_sizes": list(SIZES),  # a curve cached under another plan of sizes is measured again
    }
    if backend_name(model) != "transformers":  # llama.cpp: its own kernels, its own curve
        key["backend"] = backend_name(model)
    return key


def costs_dir() -> Path:
    from .model import cache_dir

    return cache_dir() / "costs"


def cost_path(key: dict) -> Path:
    return costs_dir() / f"{digest(key)}.json"


# ---- measuring -----------------------------------------------------------------------------------------


def synthetic_tree(nodes: int, num_heads: int) -> Tree:
    """A tree of `nodes` nodes shaped like the calibrated ones: the top paths by a score that halves per
    rank and falls with depth (so prefix-closed and rank-contiguous), at most `num_heads` deep."""
    if nodes == 0:
        return Tree.root_only()
    out: list[tuple[int, ...]] = []
    heap: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]  # (cost = -log score, path): root first
    while heap and len(out) < nodes:
        cost, path = heapq.heappop(heap)
        if path:
            out.append(path)
        if len(path) < num_heads:  # its first child; each later child is pushed by its left sibling
            heapq.heappush(heap, (cost + DEPTH_STEP, (*path, 0)))
        if path:
            heapq.heappush(heap, (cost + RANK_STEP, (*path[:-1], path[-1] + 1)))
    return Tree(f"probe{nodes}", tuple(out))


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


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


@torch.inference_mode()
def measure(
    model,
    heads=None,
    *,
    sizes: Sequence[int] = SIZES,
    contexts: Sequence[int] = CONTEXTS,
    budget_s: float = BUDGET_S,
    progress: bool = True,
    graphs: bool | None = None,
) -> CostCurve:
    """Time decode steps of synthetic trees of each size at each context length (random tokens: the cost of
    a step does not depend on what it holds), the way `engine.decode` runs them: the heads' drafting, one
    verification forward, acceptance and commit. Sizes are timed in rounds of one step each (`_Probe.row`), so
    the machine's speed changing while it is measured moves every size alike. Within `budget_s`, shared among
    the contexts: sizes whose rounds would not fit are extrapolated, and a context without time left for a
    useful row is not measured."""
    t_start = time.perf_counter()
    probe = _Probe(model, heads, sizes, graphs)
    contexts = probe.clamp(contexts)
    line = _Line("measuring this machine's step costs (once)", MAX_REPS * len(contexts), progress)
    rows: list[dict[int, float]] = []  # per context: ms per step by size (the sizes measured in time)
    try:
        for i, ctx in enumerate(contexts):
            left = budget_s - (time.perf_counter() - t_start)
            if rows and (left < budget_s / 3 or left < 2 * ctx * (probe.prefill_ms_per_token or 0) / 1000):
                break  # no time for a useful second row: the first context's curve stands alone
            cache = probe.prefill(ctx)
            if not rows:  # a fresh process: the first calls of each kernel are slow, whatever their size
                for _ in range(WARMUP_STEPS):
                    probe.step(0, cache)
            left = budget_s - (time.perf_counter() - t_start)
            rows.append(probe.row(cache, line, time.perf_counter() + left / (len(contexts) - i)))
    finally:
        line.stop()  # a failure must not leave the bar drawing
    seconds = time.perf_counter() - t_start
    first = _extrapolate(rows[0], sizes)  # the short context, measured first, is the reference shape
    by_context = (tuple(first),) + tuple(tuple(_like(r, first, sizes)) for r in rows[1:])
    step = tuple(float(np.mean([r[i] for r in by_context])) for i in range(len(sizes)))
    draft = tuple(float(statistics.median(probe.drafts[n])) if probe.drafts[n] else 0.0 for n in sizes)
    draft = tuple(_extrapolate(dict(zip(sizes, draft, strict=True)), sizes))
    curve = CostCurve(
        tuple(sizes), step, draft, tuple(contexts[: len(rows)]), by_context, probe.prefill_ms_per_token,
        cost_key(model, heads, probe.graphs), "probe", seconds, record(model.device),
    )  # fmt: skip
    line.say(f"step costs measured in {seconds:.1f} s: {curve.summary()}")
    return curve


class _Probe:
    """What `measure` times decode steps with: the base model verifying as the engine does (through the graphs
    when it uses them), the heads, one synthetic tree per size and seeded random tokens; it keeps each size's
    drafting times and the last prefill's cost per token."""

    def __init__(self, model, heads, sizes: Sequence[int], graphs: bool | None):
        self.heads, self.sizes = heads, sizes
        self.drafter = None  # the heads' drafting state over the measured context (`prefill`)
        self.num_heads = heads.config.num_heads if heads is not None else 4
        offset = heads.config.hidden_state_offset if heads is not None else 0
        full_hidden = heads is not None and getattr(heads.config, "head_arch", None) == "prefix-mlp"
        self.base = base = base_for(model, offset, full_hidden=full_hidden)  # the engine's backend
        self.graphs = uses_graphs(model) if graphs is None else graphs
        self.replay = None
        if (
            self.graphs
        ):  # as the engine verifies: one graph per tree-size bucket (on a CPU: the same padded forward)
            from .graphs import VerifyGraphs

            self.replay = VerifyGraphs(base, capture=base.device.type == "cuda", verbose=False)
        from .model import context_window

        self.window = context_window(model)
        self.trees = {n: synthetic_tree(n, self.num_heads) for n in sizes}
        if heads is not None:
            heads.bind(model)
        self.gen = torch.Generator().manual_seed(0)
        self.vocab, self.dev = model.config.vocab_size, base.device
        self.greedy = Sampling()
        self.drafts: dict[int, list[float]] = {n: [] for n in sizes}  # ms of drafting per timed step
        self.prefill_ms_per_token: float | None = None

    def clamp(self, contexts: Sequence[int]) -> list[int]:
        """The context lengths that fit in the model's window with room for the measured steps."""
        return sorted({max(8, min(c, self.window - 2 * max(self.sizes) - 64)) for c in contexts})

    def prefill(self, ctx: int):
        """A cache holding `ctx` random tokens (timed), with room for every step measured after them."""
        steps = len(self.sizes) * (MAX_REPS + 1) + WARMUP_STEPS + MIN_REPS
        need = ctx + steps * (self.num_heads + 1) + max(self.sizes) + 2
        base = self.base
        cache = self.replay.cache_for(need, self.window) if self.replay is not None else base.new_cache(need)
        ids = torch.randint(0, self.vocab, (ctx,), generator=self.gen).to(self.dev)
        t0 = _now(self.dev)
        fwd = base.forward(ids, None, cache, logits_to_keep=1)  # as the engine prefills
        self.prefill_ms_per_token = 1000 * (_now(self.dev) - t0) / ctx
        base.commit(cache, list(range(ctx)))
        if self.heads is not None:
            self.drafter = self.heads.drafter()  # a fresh drafting state per measured context
            self.drafter.extend(fwd.hidden)
        return cache

    def row(self, cache, line: _Line, deadline: float) -> dict[int, float]:
        """Median ms per step of each size at this context, timed in rounds: a round runs one step of every
        size, so a change of the machine's speed while it measures (another tenant of the host, a throttled
        core) reaches every size alike and leaves their ratios, what the policies choose by, alone; timed one
        size after another, a few seconds of a busy neighbour made 5-8 nodes look 1.5x dearer than they are
        (scripts/probe_repeat.py --disturb). Each round runs its sizes in a new random order, so no size is
        always timed right after the same other one (in a fixed order the plain step followed the 64-node
        step every round; the engine's own steps cost the same whatever came before them,
        scripts/step_transitions.py). A first, untimed round (the first calls of a shape allocate) takes
        sizes smallest first while `MIN_REPS` rounds of them fit before `deadline` (two sizes at least); then
        rounds until `MAX_REPS`, or the deadline once `MIN_REPS` ran."""
        kept, warm = [], 0.0  # sizes in the rounds; the untimed round's seconds
        for n in self.sizes:
            t0 = time.perf_counter()
            self.step(n, cache)
            kept.append(n)
            warm += time.perf_counter() - t0
            if len(kept) >= 2 and time.perf_counter() + MIN_REPS * warm > deadline:
                break
        times: dict[int, list[float]] = {n: [] for n in kept}
        for rep in range(MAX_REPS):
            for i in torch.randperm(len(kept), generator=self.gen).tolist():
                n = kept[i]
                ms, draft_ms = self.step(n, cache)
                times[n].append(ms)
                self.drafts[n].append(draft_ms)
            line.advance()
            if rep + 1 >= MIN_REPS and time.perf_counter() > deadline:
                break
        return {n: statistics.median(t) for n, t in times.items()}

    def step(self, n: int, cache) -> tuple[float, float]:
        """(ms of one decode step of the size-`n` tree, ms of its drafting) with random tokens; commits the
        accepted path."""
        base, heads, tree, dev, gen = self.base, self.heads, self.trees[n], self.dev, self.gen
        root = torch.randint(0, self.vocab, (1,), generator=gen).to(dev)
        t0 = _now(dev)
        if heads is not None and tree.num_nodes:
            tokens = torch.cat([root, self.drafter.draft(tree, root).tokens])
        else:
            tokens = torch.cat([root, torch.randint(0, self.vocab, (tree.num_nodes,), generator=gen).to(dev)])
        t1 = _now(dev)
        fwd = self.replay.forward(tokens, tree) if self.replay is not None else None
        if fwd is None:
            fwd = base.forward(tokens, tree, cache)
        acc = accept(tree, tokens, fwd.logits, self.greedy, None)
        base.commit(cache, acc.path)
        if heads is not None:
            self.drafter.extend(fwd.hidden[torch.tensor(acc.path, device=dev)])
        t2 = _now(dev)
        return 1000 * (t2 - t0), 1000 * (t1 - t0)


def _like(row: dict[int, float], reference: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """A later context's step times for every size: measured, else the reference row's shape scaled to the
    largest size measured in both."""
    ref = dict(zip(sizes, reference, strict=True))
    top = max(row)
    return [row[n] if n in row else ref[n] * row[top] / ref[top] for n in sizes]


def _extrapolate(row: dict[int, float], sizes: Sequence[int]) -> list[float]:
    """Step times for every size: measured, or linear in nodes from the two largest measured (never less)."""
    known = sorted(row)
    out = []
    for n in sizes:
        if n in row:
            out.append(row[n])
        elif len(known) >= 2:
            a, b = known[-2], known[-1]
            # pessimistic past the measurements: the steeper of the last segment and the mean slope so far
            slope = max(
                (row[b] - row[a]) / max(1, b - a), (row[b] - row[known[0]]) / max(1, b - known[0]), 0.0
            )
            out.append(row[b] + slope * (n - b))
        else:
            out.append(row[known[-1]] * max(1.0, n))  # one point: assume a node costs a plain step
    return out


# ---- the cache ------------------------------------------------------------------------------------------


def load_curve(path: str | os.PathLike[str]) -> CostCurve:
    p = Path(path)
    try:
        return CostCurve.from_json(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise CostsError(
            f"cost curve {p} is unreadable ({type(e).__name__}: {e}): delete it to measure again"
        ) from e


def save_curve(curve: CostCurve, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(curve.to_json(), indent=1) + "\n")


def uses_graphs(model, graphs: bool = True) -> bool:
    """Whether an engine over `model` verifies with CUDA graphs (the engine's rule: on CUDA, with the
    preallocated cache)."""
    from .cache import preallocation_blocker

    return graphs and model.device.type == "cuda" and preallocation_blocker(model) is None


def costs_for(
    model,
    heads=None,
    *,
    refresh: bool = False,
    budget_s: float = BUDGET_S,
    progress: bool = True,
    graphs: bool = True,
):
    """This machine's cost curve for (model, heads): the cached one, or measured now and cached. `graphs`:
    as the engine's (`Engine(graphs=...)`); they are used on CUDA only."""
    graphs = uses_graphs(model, graphs)
    key = cost_key(model, heads, graphs)
    path = cost_path(key)
    if path.exists() and not refresh:
        try:
            curve = load_curve(path)
            if curve.key == json.loads(json.dumps(key)):
                return curve
        except CostsError as e:
            print(f"entmtp: {e}; measuring again", file=sys.stderr)
    curve = measure(model, heads, budget_s=budget_s, progress=progress, graphs=graphs)
    save_curve(curve, path)
    return curve


def probing_disabled() -> bool:
    return os.environ.get("ENTMTP_NO_PROBE", "").strip() not in ("", "0", "false", "no")


# ---- correction -----------------------------------------------------------------------------------------


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
    between its neighbours'. Steps are matched to the measured sizes exactly."""

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
        ms = [
            1000 * (s.seconds["total"] - s.seconds.get("probe", 0.0) - s.seconds.get("choose", 0.0))
            for s in timed
        ]
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
        if not updates:
            return None
        self.curve = self.curve.with_points(updates)
        if self.path is not None:
            save_curve(self.curve, self.path)
        return self.curve
