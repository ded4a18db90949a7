"""Continuous batching: several generations stepped together, every row's tree verified in ONE forward.

A `Batch` over an engine holds rows, each one generation's `DecodeState` over its own row of a `BatchKV`
(cache.py). `add` prefills a new row alone and returns its first event; `step` runs one step of every row:

  (1)(2) each row chooses and drafts its tree (engine.prepare); with a cost surface (`costs`, surface.py) a
         greedy (or gumbel) row's policy weighs its trees by the ms of the WHOLE step at this batch size, so
         trees shrink when the batch is busy and grow when it is idle; and a measured `Gate` decides whether
         the step speculates at all (plain steps skip each row's probe and drafting). Neither changes such a
         row's tokens (accept.TREE_INVARIANT); a row sampled otherwise chooses on its own text alone, so its
         seeded output never depends on its batch-mates
  (3)    ONE forward verifies every row's tree (cache.BaseModel.forward_batch: padded to the largest)
  (4)-(6) each row accepts, commits and finishes its step (engine.conclude), exactly as `engine.decode`

Rows join (`add`) and leave (finished, or `cancel`) between steps: nobody waits for the slowest. A row never
sees another's tokens, cache, heads' state, policy, lookup index or random stream, so each row's output is
what `Engine.stream` gives it alone (token for token in float32 greedy decoding). `Engine.generate_batch` and
`stream_batch` are the offline API on top; the server (server/worker.py) keeps one batch.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from .accept import TREE_INVARIANT, Sampling
from .engine import DecodeState, Engine, Pending, conclude, prefill, prepare, redraft, scratch
from .errors import EntMTPError
from .heads import Drafter, Probe
from .records import Result, Step, TokenEvent
from .scheduler.joint import joint_budget
from .surface import CostSurface

_ids = itertools.count()


@dataclass(eq=False)
class Row:
    """One generation in a batch."""

    state: DecodeState
    t0: float  # when its prefill started
    prefill_seconds: float = 0.0
    steps: list[Step] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))


@dataclass(frozen=True)
class BatchStep:
    """What one `Batch.step` did: its rows, the tree sizes they verified, its seconds."""

    rows: int
    nodes: tuple[int, ...]  # drafted nodes per row
    padded: int  # tokens per row the forward ran (the largest tree's)
    seconds: float
    verify_seconds: float

    @property
    def tokens(self) -> int:
        """Tokens through the forward, padding included."""
        return self.rows * self.padded


class Batch:
    """Rows stepped together over one engine (see the module docstring). `costs`: the cost surface greedy rows
    weigh their trees by; `gate`: whether steps speculate at all is measured (`Gate`). Not thread-safe: one
    thread drives it."""

    def __init__(self, engine: Engine, costs: CostSurface | None = None, gate: bool = True):
        if engine.graphs is not None:
            raise EntMTPError("batched decoding runs eagerly: build the engine with graphs=False")
        if not engine.base.batchable:
            raise EntMTPError(
                "batched decoding needs the preallocated KV cache, which this model cannot use "
                "(sliding-window or linear-attention layers): serve it with --max-batch 1"
            )
        self.engine, self.costs = engine, costs
        self.kv = engine.base.new_batch()  # cache.BatchKV, or llama.cpp's sequences
        self._rows: dict[int, Row] = {}  # id(row's cache) -> row
        self.last: BatchStep | None = None  # the latest step's record
        self.gate = Gate() if gate else None  # None: every step as the rows' policies choose

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> list[Row]:
        """The rows in the order of their caches' rows in the batch tensor (which `forward_batch` follows)."""
        return [self._rows[id(c)] for c in self.kv.rows]

    def add(self, prompt, *, chat: bool = True, tree=None, **kwargs) -> tuple[Row, TokenEvent]:
        """Prefill a new row and return it with its first event; a row whose first token already ends it (EOS,
        a stop string, max_new_tokens=1) comes back finished and is not kept. `tree`: this row's own tree or
        policy (a name, a `Tree`, a `TreePolicy`; None: the engine's for the row's sampling rule), so one batch
        mixes plain, static and scheduled rows; `kwargs`: `Engine.stream`'s."""
        engine = self.engine
        sampling = Sampling(kwargs.get("temperature", 0.0), kwargs.get("acceptance", "auto"))
        policy = engine.as_policy(tree) if tree is not None else engine.policy_for(sampling)
        max_new = kwargs.get("max_new_tokens", 256)
        ids = engine.encode(prompt, max_new, chat=chat, logprobs=kwargs.get("logprobs"))
        t0 = time.perf_counter()
        cache = self.kv.add(min(engine.window, len(ids) + max_new + scratch(policy)))
        try:
            row = Row(engine.new_state(ids, cache, policy=policy, **kwargs), t0)
            self._rows[id(cache)] = row
            event = prefill(engine, row.state)
        except BaseException:
            self._drop(cache)
            raise
        row.prefill_seconds = time.perf_counter() - t0
        event = self._finish(row, event)
        if event.result is not None:
            self._drop(cache)
        return row, event

    def cancel(self, row: Row) -> None:
        """Drop `row` between steps (a client that left); its result is never built."""
        if id(row.state.cache) in self._rows:
            self._drop(row.state.cache)

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, TokenEvent]]:
        """One step of every row: (row, event) per row, in row order; finished rows leave the batch."""
        if not self._rows:
            return []
        t0 = time.perf_counter()
        rows, engine = self.rows, self.engine
        # one row alone chooses on its policy's own cost curve, exactly as `Engine.stream` does
        latency = self.costs.latency(len(rows)) if self.costs is not None and len(rows) > 1 else None
        speculate = self.gate is None or self.gate.speculate(len(rows))
        probes = _probes(rows, speculate)  # every row's probe of its master, batched per master
        pending: list[Pending] = [self._prepare(r, latency, speculate, probes.get(r.id)) for r in rows]
        if latency is not None and speculate:
            pending = self._joint(rows, pending, latency)
        t1 = time.perf_counter()
        if len(rows) == 1:  # a row alone verifies as engine.decode does: no padding, no batch masks
            fwds = [engine.base.forward(pending[0].tokens, pending[0].tree, rows[0].state.cache)]
        else:
            fwds = engine.base.forward_batch([p.tokens for p in pending], [p.tree for p in pending], self.kv)
        verify = time.perf_counter() - t1  # (3) verify every row's tree in ONE forward
        out = []
        for row, p, fwd in zip(rows, pending, fwds, strict=True):
            p.times["verify"] = verify
            p.clock.lap()  # the forward is charged once per row as `verify`, not to the next phase
            event = conclude(engine, row.state, p, fwd)  # (4) accept (5) commit (6) finish
            row.steps.append(event.step)
            out.append((row, self._finish(row, event)))
        for row, event in out:  # rows leave after every row committed (a leaving row moves another's slots)
            if event.finish_reason is not None:
                self._drop(row.state.cache)
        nodes = tuple(p.tree.num_nodes for p in pending)
        padded = max(p.tokens.numel() for p in pending)
        self.last = BatchStep(len(rows), nodes, padded, time.perf_counter() - t0, verify)
        if self.gate is not None and any(_gated(r) for r in rows):
            self.gate.observe(len(rows), speculate, sum(len(e.token_ids) for _, e in out), self.last.seconds)
        return out

    def _joint(self, rows: list[Row], pending: list[Pending], latency) -> list[Pending]:
        """Every greedy or gumbel row's tree within the node budget best for the whole step (scheduler/joint.py)."""
        menus = [p.menu if _gated(r) else None for r, p in zip(rows, pending, strict=True)]
        budget = joint_budget(menus, [p.tree.num_nodes for p in pending], latency)
        if budget is None:
            return pending
        out = []
        for row, p, menu in zip(rows, pending, menus, strict=True):
            if menu is not None:
                tree = menu.tree(min(budget, len(menu.expected) - 1))
                if tree is not p.tree:
                    p = redraft(self.engine, row.state, p, tree)
                p.signals["budget"] = float(budget)
            out.append(p)
        return out

    def _prepare(self, row: Row, latency, speculate: bool, probe) -> Pending:
        """A greedy or gumbel row weighs its trees by the whole batched step's cost and follows the gate
        (neither changes its tokens); a row sampled otherwise chooses on its own text alone, so its seeded
        output is what it is alone."""
        if not _gated(row):
            return prepare(self.engine, row.state, probe=probe)
        return prepare(self.engine, row.state, latency, speculate, probe)

    def _finish(self, row: Row, event: TokenEvent) -> TokenEvent:
        """The event, with its result when it ends the row (the caller then drops the row)."""
        if event.finish_reason is None:
            return event
        seconds = time.perf_counter() - row.t0
        return replace(
            event, result=row.state.result(row.steps, seconds, row.prefill_seconds, event.finish_reason)
        )

    def _drop(self, cache) -> None:
        self._rows.pop(id(cache), None)
        if any(c is cache for c in self.kv.rows):
            self.kv.remove(cache)


def _probes(rows: list[Row], speculate: bool) -> dict[int, Probe]:
    """Row id -> its probe, for the rows whose policy probes a master tree this step, one batched call per
    master (rows with the engine's policy share one)."""
    groups: dict[int, list[Row]] = {}
    for r in rows:
        master = r.state.policy.master
        if r.state.drafter is not None and master is not None and (speculate or not _gated(r)):
            groups.setdefault(id(master), []).append(r)
    out = {}
    for group in groups.values():
        master = group[0].state.policy.master
        roots = torch.tensor([r.state.root for r in group], device=group[0].state.drafter.heads.device)
        probes = Drafter.probe_rows([r.state.drafter for r in group], master, roots)
        out.update({r.id: p for r, p in zip(group, probes, strict=True)})
    return out


def _gated(row: Row) -> bool:
    return row.state.sampling.rule in TREE_INVARIANT  # the gate changes steps, never these rules' tokens


GATE_WINDOW = 8  # recent steps of each kind whose tokens over seconds measure it
GATE_EXPLORE = 8  # steps of a bucket before the kind that looks worse runs once more ...
GATE_EXPLORE_MAX = 64  # ... and the wait doubles, up to this, while the same kind stays ahead


class Gate:
    """Whether a batched step of several rows speculates at all, by measurement: per bucket of batch sizes,
    the tokens per second of the recent steps that speculated and of the recent plain ones (every row the
    root alone: no probe, no drafting, the policy not asked), each the sum of tokens over the sum of seconds
    of its last `GATE_WINDOW` steps. The better kind runs; the other is tried again after `GATE_EXPLORE`
    steps, so a change (of the text, of the machine's load) is seen, then after twice as many each time the
    same kind stays ahead (up to `GATE_EXPLORE_MAX`: exploring a losing kind costs little once it has lost
    for long), and again after `GATE_EXPLORE` when the lead changes. Speculation goes first. This keeps
    batched speculation from running below plain batched decoding where the per-row work of choosing and
    drafting costs more than the drafts bring: the cost surface prices verification, the gate the rest. A
    row alone is left to its policy's own cost curve, as `Engine.stream` leaves it."""

    def __init__(self):
        self.recent: dict[tuple[int, bool], deque[tuple[int, float]]] = {}  # (bucket, speculated) -> steps
        self.steps: dict[int, int] = {}
        # bucket -> (the kind ahead, the wait, the step at which the other kind runs again)
        self.explore: dict[int, tuple[bool, int, int]] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, ... (rows leaving one by one at the end of a
        burst would otherwise each start their measurement over)."""
        return (rows - 1).bit_length()

    def rate(self, rows: int, speculated: bool) -> float | None:
        """Tokens per second of the bucket's recent steps of that kind (None: none yet)."""
        recent = self.recent.get((self.bucket(rows), speculated))
        return sum(t for t, _ in recent) / max(sum(s for _, s in recent), 1e-9) if recent else None

    def speculate(self, rows: int) -> bool:
        if rows == 1:
            return True
        spec, plain = self.rate(rows, True), self.rate(rows, False)
        if spec is None or plain is None:
            return spec is None
        b, ahead = self.bucket(rows), spec >= plain
        n = self.steps[b] = self.steps.get(b, 0) + 1
        kind, wait, at = self.explore.get(b, (None, 0, 0))
        if kind != ahead:  # the lead changed (or the bucket is new): try the other kind soon
            wait, at = GATE_EXPLORE, n + GATE_EXPLORE
        if n < at:
            self.explore[b] = (ahead, wait, at)
            return ahead
        wait = min(2 * wait, GATE_EXPLORE_MAX)
        self.explore[b] = (ahead, wait, n + wait)
        return not ahead

    def observe(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        if rows > 1:
            key = (self.bucket(rows), speculated)
            self.recent.setdefault(key, deque(maxlen=GATE_WINDOW)).append((tokens, seconds))


def stream_batch(
    engine: Engine,
    prompts: Sequence,
    *,
    max_batch: int | None = None,
    costs: CostSurface | None = None,
    **kwargs,
) -> Iterator[tuple[int, TokenEvent]]:
    """(prompt index, event) as rows step together, at most `max_batch` at once (None: all); a prompt
    joins as soon as a row leaves. `kwargs`: `Engine.stream`'s, the same for every prompt."""
    if max_batch is not None and max_batch < 1:
        raise EntMTPError(f"max_batch must be >= 1, got {max_batch}")
    batch = Batch(engine, costs)
    waiting = list(enumerate(prompts))[::-1]
    index: dict[int, int] = {}  # row id -> prompt index
    while waiting or len(batch):
        while waiting and (max_batch is None or len(batch) < max_batch):
            i, prompt = waiting.pop()
            row, event = batch.add(prompt, **kwargs)
            index[row.id] = i
            yield i, event
        for row, event in batch.step():
            yield index[row.id], event


def generate_batch(engine: Engine, prompts: Sequence, **kwargs) -> list[Result]:
    """Every prompt's `Result`, in prompt order (`stream_batch`'s arguments)."""
    results: list[Result | None] = [None] * len(prompts)
    for i, event in stream_batch(engine, prompts, **kwargs):
        if event.result is not None:
            results[i] = event.result
    return results  # type: ignore[return-value]
