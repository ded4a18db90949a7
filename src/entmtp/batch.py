"""Continuous batching: several generations stepped together, every row's tree verified in ONE forward.

A `Batch` over an engine holds rows, each one generation's `DecodeState` over its own row of a `BatchKV`
(cache.py). `add` prefills a new row at once and returns its first event; `start` leaves its prompt to the
steps, one chunk (engine.PREFILL_CHUNK tokens) per step between the other rows' steps, so a long prompt
never stalls them for its whole prefill (the server's way); the prompt with the fewest tokens left goes first,
and a chunk in flight can be stopped for a newcomer (`step`'s interrupt, interrupt.py). `step` runs one step of every decoding row:

  (1)(2) each row chooses and drafts its tree (engine.choose, engine.draft); with a cost surface (`costs`,
         costs/curves.py) a greedy (or gumbel) row's policy weighs its trees by the ms of the WHOLE step at this
         batch size, so trees shrink when the batch is busy and grow when it is idle (the joint choice,
         policy.joint_budget); and a measured `Gate` decides whether the step speculates at all (plain steps
         skip each row's probe and drafting, and its policy is neither asked nor told). Neither changes such a
         row's tokens (accept.Rule.tree_invariant); a row sampled otherwise chooses on its own text alone
  (3)    ONE forward verifies every row's tree (cache.BaseModel.forward_batch: padded to the largest), but
         for seeded rows sampled by the sample or typical rule, each verified by a forward of its own
         (`Batch` says why: their seeded output is then bit for bit what it is alone, whatever the batch)
  (4)-(6) each row accepts, commits and finishes its step (engine.conclude), exactly as `engine.decode`,
         and its policy observes it

Rows join (`add`, `start`) and leave (finished, failed, or `cancel`) between steps: nobody waits for the
slowest, and a row whose own part of a step fails leaves alone. A row never sees another's tokens, cache,
heads' state, policy, lookup index or random stream, so each row's output is what `Engine.stream` gives it
alone: bit for bit for those seeded sampled rows; token for token for the others in float32 greedy decoding,
but for near-ties (a batched forward's logits differ from a single row's in their last bits, ~1e-6 in
float32, so two tokens whose logits are that close may swap). `generate_batch(engine, prompts, options,
**generation)` and `stream_batch` are the offline API on top (`BatchOptions`: the batch's settings;
`generation`: `Engine.stream`'s); the server (server/batching.py) keeps one batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from .accept import Sampling
from .costs.curves import CostSurface
from .engine import (
    Clock,
    DecodeState,
    Engine,
    Pending,
    choose,
    conclude,
    draft,
    forced_step,
    prefill_chunk,
    scratch,
)  # fmt: skip
from .errors import EntMTPError
from .heads import Drafter, Probe
from .interrupt import Interrupt, Preempted
from .policy import Choice, Menu, TreePolicy, joint_budget
from .records import Result, Step, TokenEvent
from .tree import Tree

_ids = itertools.count()
MAX_PASSES = 8  # steps a prompt going in may be passed over by shorter ones before its next chunk goes first


@dataclass(frozen=True)
class BatchOptions:
    """How a continuous batch runs (`Batch`, `stream_batch`, `generate_batch`; a server's worker sizes its batch
    itself and takes `costs` and `gate` from here)."""

    max_batch: int | None = None  # rows at once in `stream_batch` (None: every prompt)
    costs: CostSurface | None = None  # the cost surface greedy rows weigh their trees by (costs/curves.py)
    gate: bool = True  # whether steps speculate at all is measured (`Gate`); False: as the policies choose
    # every row verified alone, in a cache of its own (on llama.cpp a context of its own), so a row's tokens
    # never depend on its batch-mates, at about the throughput of one generation at a time (rows still take
    # turns step by step); False: only the rows whose seed must repeat (`Batch`)
    invariant: bool = False

    def __post_init__(self):
        if self.max_batch is not None and self.max_batch < 1:
            raise EntMTPError(f"max_batch must be >= 1, got {self.max_batch}")


@dataclass
class RowStep:
    """A row's step chosen and drafted (engine.Pending), with what the batch's joint choice reads."""

    pending: Pending
    chosen: bool = True  # the policy chose the tree and observes the step (False: a plain step of the gate's)
    menu: Menu | None = None  # the policy's best tree per node budget, when it gives one
    probe: Probe | None = None  # the heads' probe the drafts reuse when the joint choice redrafts


@dataclass(eq=False)
class Row:
    """One generation in a batch."""

    state: DecodeState
    t0: float  # when it was added (its prefill starts once the prompts added before it are in)
    tokens: int = 0  # slots its prompt and output take in the batch cache
    scratch: int = 0  # slots its largest tree takes past them
    alone: bool = False  # verified by its own forward, not the batch's (`Batch` says when)
    prefill_seconds: float = 0.0
    passed: int = 0  # steps since its prompt last had a chunk in while it waited for one (`Batch.step`)
    preempted_at: int = -1  # the prompt position whose chunk an interrupt stopped (it runs whole next time)
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
    """Rows stepped together over one engine (see the module docstring), run as `options` say (`costs`, `gate`;
    its `max_batch` is for whoever adds the rows). Not thread-safe: one thread drives it.

    A seeded row sampled by a rule whose tokens depend on the trees and on the logits' last bits (sample,
    typical) is verified ALONE, by a forward of its own over a cache of its own, as `Engine.stream` verifies
    it: a batched forward's numbers for a row differ in their last bits from a forward of that row alone,
    and differ again with the batch-mates (the matrix kernels of the CPU and GPU libraries pick their
    blocking by the number of rows; attention sums over the longest row's keys), so a seeded draw near a
    boundary would change with the batch. Its seed then repeats whatever the batch, in every dtype."""

    def __init__(self, engine: Engine, options: BatchOptions = BatchOptions()):
        if engine.graphs is not None:
            raise EntMTPError("batched decoding runs eagerly: build the engine with graphs=False")
        if not engine.base.batchable:
            raise EntMTPError(
                "batched decoding needs the preallocated KV cache, which this model cannot use "
                "(sliding-window or linear-attention layers): serve it with --max-batch 1"
            )
        self.engine, self.options = engine, options
        self.kv = engine.base.new_batch(options.max_batch)  # cache.BatchKV, or llama.cpp's sequences
        self._rows: dict[int, Row] = {}  # id(row's cache) -> a row verified by the batched forward
        self._alone: list[Row] = []  # rows verified by forwards of their own
        self._prefills: deque[Row] = deque()  # rows whose prompt is not all in yet, next chunk's first
        self.failed: list[tuple[Row, Exception]] = []  # the rows the latest step ended with an error
        self.preemptions = 0  # prefill chunks an interrupt stopped part way (each ran again later)
        self.last: BatchStep | None = None  # the latest step's record (None: it verified nothing)
        self.gate = Gate() if options.gate else None  # None: every step as the rows' policies choose

    def __len__(self) -> int:
        return len(self._rows) + len(self._alone) + len(self._prefills)

    @property
    def rows(self) -> list[Row]:
        """The rows the batched forward verifies, in the order of their caches' rows in the batch tensor (which
        `forward_batch` follows)."""
        return [self._rows[id(c)] for c in self.kv.rows]

    @torch.inference_mode()
    def add(
        self, prompt, *, chat: bool = True, policy: TreePolicy | None = None, **kwargs
    ) -> tuple[Row, TokenEvent]:
        """Prefill a new row now and return it with its first event; a row whose first token already ends it
        (EOS, a stop string, max_new_tokens=1) comes back finished and is not kept. `policy`: this row's own
        `TreePolicy` (checked as the engine's are; None: the engine's for the row's sampling rule), so one
        batch mixes plain, static and scheduled rows; `kwargs`: `Engine.stream`'s."""
        row = self._new_row(prompt, chat, policy, kwargs)
        try:
            while (event := self._prefill(row)) is None:
                pass
        except BaseException:
            self._drop(row)
            raise
        return row, event

    def start(self, prompt, *, chat: bool = True, policy: TreePolicy | None = None, **kwargs) -> Row:
        """A new row (`add`'s arguments) whose prompt goes in by the steps: each `step` prefills one chunk
        (`PREFILL_CHUNK` tokens) of a prompt not yet in (the one with the fewest tokens left), between the
        decoding rows' steps, so a long prompt never stalls them for its whole prefill. Its first event comes
        out of the step that prefills its last chunk."""
        row = self._new_row(prompt, chat, policy, kwargs)
        self._prefills.append(row)
        return row

    @torch.inference_mode()
    def cancel(self, row: Row) -> None:
        """Drop `row` between steps (a client that left); its result is never built."""
        self._drop(row)

    @torch.inference_mode()
    def step(self, interrupt: Interrupt | None = None) -> list[tuple[Row, TokenEvent]]:
        """One step of every decoding row, then one chunk of a prompt still going in: (row, event) for each row
        that has one, the decoding rows first; finished rows leave the batch. A row whose own part fails (its
        prefill, drafting, verification or acceptance) leaves too, listed in `failed` with its error; the other
        rows go on.

        The chunk is the next one of the prompt with the fewest tokens left to go in (`_next_prefill`), so a
        short prompt goes in ahead of the rest of a long one. `interrupt` (the server's, raised when a request
        arrives): once raised, the chunk stops part way (interrupt.py) and runs again, whole, at a later step,
        so a newcomer's prompt need not wait for it; a chunk is stopped at most once, so arrivals never starve
        a long prompt."""
        self.last, self.failed = None, []
        out = self._decode() if self._rows or self._alone else []
        if self._prefills:
            row = self._next_prefill()
            at = row.state.cache.length
            try:
                event = self._prefill(row, interrupt if row.preempted_at != at else None)
            except Preempted:
                row.preempted_at = at
                self.preemptions += 1
            except Exception as e:  # noqa: BLE001 - this row's own failure (its prompt, its arguments)
                self._fail(row, e)
                self._drop(row)
            else:
                if event is not None:
                    out.append((row, event))
        return out

    def _next_prefill(self) -> Row:
        """The prompt whose chunk goes in next: the one with the fewest tokens left (the oldest of equals), but
        one passed over `MAX_PASSES` steps in a row goes first, so a stream of short prompts never starves a
        long one. The others count a step passed."""
        left = [len(r.state.prompt) - r.state.cache.length for r in self._prefills]
        starved = [r for r in self._prefills if r.passed >= MAX_PASSES]
        row = starved[0] if starved else self._prefills[min(range(len(left)), key=left.__getitem__)]
        for r in self._prefills:
            r.passed = 0 if r is row else r.passed + 1
        return row

    def _new_row(self, prompt, chat: bool, policy: TreePolicy | None, kwargs: dict) -> Row:
        """A row with its state, its prompt not yet in: a row verified alone gets a cache of its own, as
        `Engine.stream` does; the others prefill into one sized to their prompt and join the batch tensor
        when it is in."""
        engine = self.engine
        sampling = Sampling(kwargs.get("temperature", 0.0), kwargs.get("acceptance", "auto"))
        # as Engine.new_state decides: an empty prediction drafts nothing; a suffix cache drafts for every row
        predicted = bool(kwargs.get("prediction")) or engine.suffix is not None
        policy = (
            engine.checked(policy, "a batch row")
            if policy is not None
            else engine.policy_for(sampling, predicted)
        )
        max_new = kwargs.get("max_new_tokens", 256)
        ids = engine.encode(prompt, max_new, chat=chat, logprobs=kwargs.get("logprobs"))
        alone = self.options.invariant or (
            kwargs.get("seed") is not None and not sampling.rule.tree_invariant
        )
        room = scratch(policy)
        tokens = min(engine.window, len(ids) + max_new)
        need = min(engine.window, tokens + max(room, engine.scratch)) if alone else len(ids)
        cache = engine.base.new_cache(need, private=alone)  # alone: numbers that batch-mates cannot move
        state = engine.new_state(ids, cache, policy=policy, **kwargs)
        return Row(state, time.perf_counter(), tokens, room, alone)

    def _prefill(self, row: Row, interrupt: Interrupt | None = None) -> TokenEvent | None:
        """One chunk of `row`'s prompt; after its last, the row decodes from the next step on (a batched one
        in a row of the batch tensor) and its first event comes back (finished and dropped when that token
        ends it). `interrupt`: as `step` says (`Preempted`, the row unchanged)."""
        event = prefill_chunk(self.engine, row.state, interrupt)
        if event is None:
            return None
        if row in self._prefills:
            self._prefills.remove(row)
        if row.alone:
            self._alone.append(row)
        else:
            cache = self.kv.add(row.tokens, row.scratch, like=row.state.cache)
            row.state.cache = cache
            self._rows[id(cache)] = row
        row.prefill_seconds = time.perf_counter() - row.t0
        event = self._finish(row, event)
        if event.result is not None:
            self._drop(row)
        return event

    def _decode(self) -> list[tuple[Row, TokenEvent]]:
        """One step of every decoding row (see the module docstring)."""
        t0 = time.perf_counter()
        rows, engine = self.rows, self.engine
        # one row alone chooses on its policy's own cost curve, exactly as `Engine.stream` does
        costs = self.options.costs
        latency = costs.latency(len(rows)) if costs is not None and len(rows) > 1 else None
        speculate = self.gate is None or self.gate.speculate(len(rows))
        probes = _probes(rows, speculate)  # every batched row's probe of its master, batched per master
        drafted: dict[int, RowStep] = {}  # (1) (2) each row chooses and drafts its tree
        for r in [*rows, *self._alone]:
            if (p := self._own(r, self._prepare, r, latency, speculate, probes.get(r.id))) is not None:
                drafted[r.id] = p
        for r, _ in self.failed:  # nothing of this step is in their slots yet: they leave now
            self._drop(r)
        rows = self.rows
        if latency is not None and speculate:
            self._joint(rows, [drafted[r.id] for r in rows], latency)
        pending = {rid: step.pending for rid, step in drafted.items()}
        t1 = time.perf_counter()
        fwds = self._verify(rows, pending)  # (3) verify every batched row's tree in ONE forward
        for r in self._alone:  # each by a forward of its own
            if (f := self._own_forward(r, pending[r.id])) is not None:
                fwds[r.id] = f
        verify = time.perf_counter() - t1
        out = []
        for row in [*rows, *self._alone]:
            if row.id not in fwds:
                continue
            p = pending[row.id]
            p.times["verify"] = verify
            p.clock.lap()  # the forward is charged once per row as `verify`, not to the next phase
            event = self._own(row, conclude, engine, row.state, p, fwds[row.id])  # (4) (5) (6)
            if event is not None:
                if drafted[row.id].chosen:  # the policy observes the step it chose
                    row.state.policy.observe(event.step)
                row.steps.append(event.step)
                out.append((row, self._finish(row, event)))
        # rows leave after every row committed (a leaving row moves another's slots)
        for row in [*(r for r, _ in self.failed), *(r for r, e in out if e.finish_reason is not None)]:
            self._drop(row)
        self._record(rows, [p for p in pending.values() if p is not None], out, speculate, t0, verify)
        return out

    def _verify(self, rows: list[Row], pending: dict[int, Pending]) -> dict:
        """Row id -> the forward verifying its tree: every batched row in ONE forward (a row alone, as
        engine.decode verifies: no padding, no batch masks). When that forward fails, each row is verified
        by a forward of its own, so only a row whose own forward fails leaves the batch."""
        if not rows:
            return {}
        if len(rows) > 1:
            tokens, trees = [pending[r.id].tokens for r in rows], [pending[r.id].tree for r in rows]
            try:
                hidden = any(r.state.reads_hidden for r in rows)
                # a grammar's forced nodes need no logits
                outputs = [_outputs(r, pending[r.id]) for r in rows]
                fwds = self.engine.base.forward_batch(tokens, trees, self.kv, hidden=hidden, outputs=outputs)
                return {r.id: f for r, f in zip(rows, fwds, strict=True)}
            except Exception:  # noqa: BLE001 - whose? each row's own forward says
                pass
        fwds = {r.id: self._own_forward(r, pending[r.id]) for r in rows}
        return {rid: f for rid, f in fwds.items() if f is not None}

    def _own_forward(self, row: Row, p: Pending):
        """`row`'s tree verified by a forward of its own, as engine.decode does (None: it failed)."""
        forward = functools.partial(
            self.engine.base.forward, hidden=row.state.reads_hidden, outputs=_outputs(row, p)
        )
        return self._own(row, forward, p.tokens, p.tree, row.state.cache)

    def _own(self, row: Row, fn, *args):
        """`fn(*args)`, a part of the step that is `row`'s alone; None when it fails (the row is then in
        `failed` with the error)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - this row's own failure: it ends this row only
            self._fail(row, e)
            return None

    def _fail(self, row: Row, error: Exception) -> None:
        self.failed.append((row, error))

    def _record(self, rows, pending, out, speculate: bool, t0: float, verify: float) -> None:
        """The step's record (`last`), and the gate's measurement of it."""
        if not pending:
            return
        nodes = tuple(p.tree.num_nodes for p in pending)
        padded = max(p.tokens.numel() for p in pending)
        self.last = BatchStep(len(pending), nodes, padded, time.perf_counter() - t0, verify)
        if self.gate is not None and any(_gated(r) for r in rows):
            tokens = sum(len(e.token_ids) for r, e in out if not r.alone)
            self.gate.observe(len(rows), speculate, tokens, self.last.seconds)

    def _joint(self, rows: list[Row], steps: list[RowStep], latency) -> None:
        """Every greedy or gumbel row's tree within the node budget best for the whole step (policy.joint_budget),
        redrafted where it changes."""
        menus = [p.menu if _gated(r) else None for r, p in zip(rows, steps, strict=True)]
        budget = joint_budget(menus, [p.pending.tree.num_nodes for p in steps], latency)
        if budget is None:
            return
        for row, step, menu in zip(rows, steps, menus, strict=True):
            if menu is not None:
                tree = menu.tree(min(budget, len(menu.expected) - 1))
                p = step.pending
                if tree is not p.tree:  # drafted again: its drafting time adds up
                    step.pending = draft(
                        self.engine, row.state, Choice(tree, p.signals), step.probe, p.clock, p.times
                    )
                step.pending.signals["budget"] = float(budget)

    def _prepare(self, row: Row, latency, speculate: bool, probe: Probe | None) -> RowStep:
        """A greedy or gumbel row weighs its trees by the whole batched step's cost and follows the gate
        (neither changes its tokens): on the gate's plain step its policy is neither asked nor told; a row
        sampled otherwise chooses on its own text alone, so its seeded output is what it is alone."""
        engine, state, gated = self.engine, row.state, _gated(row)
        clock, times = Clock(engine.base.device), {}
        if (forced := forced_step(engine, state, clock, times)) is not None:  # a grammar's: no choice
            return RowStep(forced, chosen=False)
        if gated and not speculate:
            times["probe"] = clock.lap()
            times["choose"] = clock.lap()
            pending = draft(engine, state, Choice(Tree.root_only(), {}), None, clock, times)
            return RowStep(pending, chosen=False)
        choice, probe = choose(engine, state, clock, times, probe=probe, latency=latency if gated else None)
        return RowStep(draft(engine, state, choice, probe, clock, times), menu=choice.menu, probe=probe)

    def _finish(self, row: Row, event: TokenEvent) -> TokenEvent:
        """The event, with its result when it ends the row (the caller then drops the row)."""
        if event.finish_reason is None:
            return event
        seconds = time.perf_counter() - row.t0
        return replace(
            event, result=row.state.result(row.steps, seconds, row.prefill_seconds, event.finish_reason)
        )

    def _drop(self, row: Row) -> None:
        """`row` leaves the batch, wherever it is (prefilling, alone, in the batch tensor)."""
        if row in self._prefills:
            self._prefills.remove(row)
        if row in self._alone:
            self._alone.remove(row)
        cache = row.state.cache
        if self._rows.pop(id(cache), None) is not None:
            self.kv.remove(cache)
        else:  # llama.cpp: a cache of its own gives its sequence id back now
            cache.release()


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


def _outputs(row: Row, p: Pending) -> list[bool] | None:
    """The nodes of `row`'s tree whose logits verification reads, as engine.decode asks (Pending.outputs)."""
    return p.outputs(row.state.logprobs is not None)


def _gated(row: Row) -> bool:
    return row.state.sampling.rule.tree_invariant  # the gate changes steps, never these rules' tokens


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
    engine: Engine, prompts: Sequence, options: BatchOptions = BatchOptions(), **generation
) -> Iterator[tuple[int, TokenEvent]]:
    """(prompt index, event) as rows step together, at most `options.max_batch` at once; a prompt joins as soon
    as a row leaves. `generation`: `Engine.stream`'s keyword arguments, the same for every prompt; a row's last
    event carries its `finish_reason` and `result`."""
    rows = options.max_batch or max(1, len(prompts))
    batch = Batch(engine, dataclasses.replace(options, max_batch=rows))
    waiting = list(enumerate(prompts))[::-1]
    index: dict[int, int] = {}  # row id -> prompt index
    while waiting or len(batch):
        while waiting and (len(batch) < rows):
            i, prompt = waiting.pop()
            row, event = batch.add(prompt, **generation)
            index[row.id] = i
            yield i, event
        for row, event in batch.step():
            yield index[row.id], event
        if batch.failed:
            raise batch.failed[0][1]


def generate_batch(
    engine: Engine, prompts: Sequence, options: BatchOptions = BatchOptions(), **generation
) -> list[Result]:
    """Every prompt's `Result`, in prompt order, the prompts decoded together as one continuous batch
    (`stream_batch`'s arguments)."""
    results: list[Result | None] = [None] * len(prompts)
    for i, event in stream_batch(engine, prompts, options, **generation):
        if event.result is not None:
            results[i] = event.result
    return results  # type: ignore[return-value]
