"""The probe: times the engine's own decode steps on synthetic trees, one row at a time or a batch of rows.

A probed step is the engine's, not a copy of it: `engine.prepare` (the tree chosen by a static policy of one
synthetic tree per size, then drafted), the verification forward, and `engine.conclude` (acceptance under
the generation's rule, commit, the end of the step), on a `DecodeState` made by `Engine.new_state` over random
tokens (what a step costs does not depend on what it holds). A row alone is stepped by `engine.decode`
itself, and its ms are read from the engine's own clock (`Step.seconds`, by `priced_ms`: the numbers the
corrector later compares with the curve). A batch of rows is a `batch.Batch`, the server's, stepped by its
own `step` (each row's choice and drafts, ONE `forward_batch` for all, a row alone its own forward, each row
concluded); its ms are the whole step's. So a sampled rule's acceptance, the graphs' padded forward or any later change of the step is
timed as the engine runs it. Nothing here binds, moves or packs the heads: they come ready from the caller.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import torch

from ..accept import Sampling
from ..heads import Draft
from ..policy import StaticPolicy
from ..tree import Tree
from .curves import CostsError, priced_ms

DEPTH_STEP, RANK_STEP = 1.0, 0.45  # -log score per depth and per rank: mc_sim_7b_63-like widths
NO_HEADS_DEPTH = 4  # how deep the synthetic trees go without heads (the shipped heads' count)
DRIFT = 64  # before each step a row's context is cut back to at most its first context + DRIFT tokens


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


def now(dev: torch.device) -> float:
    """The time once the device's queued work is done."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


class NoText:
    """The probe's tokenizer: random tokens have no text to decode, and no end-of-text token of its own."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


class _RandomDrafts:
    """Without heads, what drafts a synthetic tree: random tokens (a lookup-only step's verification costs
    this much; the lookup index's own drafting is next to free), nothing to read from committed positions:
    its steps ask the backend for no hidden states, as a lookup-only engine's do."""

    reads_hidden = False

    def __init__(self, vocab: int, generator: torch.Generator, device: torch.device):
        self.vocab, self.generator, self.device = vocab, generator, device

    def draft(self, tree: Tree, root_token: torch.Tensor, probe=None) -> Draft:
        tokens = torch.randint(0, self.vocab, (tree.num_nodes,), generator=self.generator)
        return Draft(tokens.to(self.device), torch.zeros(tree.num_nodes))

    def extend(self, hidden: torch.Tensor) -> None:
        pass


class Probe:
    """Decode steps of the engine over `model` and `heads` (bound, and packed with the model) under `sampling`
    (None: greedy), through the verification graphs when `graphs` (on a CPU: their padded forward, eagerly).
    The trees it steps: a synthetic tree of each of `sizes` (keyed by its size) and each of `trees` (given
    ones, e.g. a profile bank's, keyed by name). `row(context, room)` starts one generation over `context`
    random tokens, `step(row, key)` times one of its steps of tree `key`; `batch(rows, context, room)` starts
    a batch, `batch_step(batch, b, key)` times one step of its first `b` rows."""

    def __init__(
        self,
        model,
        heads,
        sizes: Sequence[int],
        sampling: Sampling | None = None,
        graphs=False,
        trees: Sequence[Tree] = (),
    ):
        # imported here, not above: the engine imports this package (the curve's types, the corrector)
        from .. import engine as engine_mod

        self.loop = engine_mod  # the engine's decode, prefill, prepare and conclude (looked up at each call)
        # no policy of its own (plain decoding): each state is given its synthetic tree's static policy
        self.engine = engine = engine_mod.Engine(model, NoText(), heads, graphs=False)
        engine.eos_ids = set()  # the model's end-of-text tokens too: a probe's generation ends when it stops
        self.graphs = None
        if graphs and engine.base.preallocate:  # as the engine verifies on CUDA (quiet: no capture lines)
            from ..graphs import VerifyGraphs

            self.graphs = VerifyGraphs(engine.base, capture=engine.base.device.type == "cuda", verbose=False)
        # rows in the preallocated cache are cut back before each step (the slots past are written over), so
        # every step of a measurement runs at about its context; other caches keep room for every step
        self.rewinds = engine.base.preallocate
        self.heads, self.sampling = heads, sampling or Sampling()
        depth = heads.config.num_heads if heads is not None else NO_HEADS_DEPTH
        self.trees: dict[int | str, Tree] = {n: synthetic_tree(n, depth) for n in sizes}
        self.trees |= {t.name: t for t in trees}
        self.policies = {n: StaticPolicy(t) for n, t in self.trees.items()}
        self.largest = self.policies[max(self.trees, key=lambda k: self.trees[k].num_nodes)]
        self.depth = max(t.depth for t in self.trees.values())
        self.gen = torch.Generator().manual_seed(0)
        self.vocab, self.dev = engine.base.vocab_size, engine.base.device
        self.prefill_ms_per_token: float | None = None  # the latest row's prefill

    def room(self, steps: int) -> int:
        """Slots a row needs past its context for `steps` steps: what they may commit (one step past `DRIFT`
        where rows are cut back), with the largest tree's scratch after them."""
        committed = DRIFT + self.depth + 1 if self.rewinds else steps * (self.depth + 1)
        return committed + max(t.size for t in self.trees.values()) + 2

    def _rewind(self, state, context: int) -> None:
        if self.rewinds:  # the length is where the next step writes
            state.cache.length = min(state.cache.length, context + DRIFT)

    def _state(self, context: int, room: int):
        """A generation's fresh state over `context` random tokens (not prefilled), room for `room` more."""
        ids = torch.randint(0, self.vocab, (context,), generator=self.gen).tolist()
        graphs = self.graphs
        need = context + room
        cache = graphs.cache_for(need, self.engine.window) if graphs else self.engine.base.new_cache(need)
        s = self.sampling  # the drafting state is made when a tree drafts: under the largest tree's policy
        state = self.engine.new_state(
            ids, cache, graphs, max_new_tokens=1 << 30, temperature=s.temperature,
            acceptance=s.acceptance, seed=0, policy=self.largest,
        )  # fmt: skip
        if self.heads is None:
            state.drafter = _RandomDrafts(self.vocab, self.gen, self.dev)
        return state

    def row(self, context: int, room: int):
        """One generation, prefilled by `engine.decode` (timed: `prefill_ms_per_token`), ready to step."""
        state = self._state(context, room)
        events = self.loop.decode(self.engine, state)
        t0 = now(self.dev)
        next(events)  # the prefill's token
        self.prefill_ms_per_token = 1000 * (now(self.dev) - t0) / context
        return state, events, context

    def step(self, row, key: int | str) -> tuple[float, float]:
        """(ms, ms of the heads' drafting) of `row`'s next step, verifying tree `key` (a size: its synthetic
        tree; a name: that given tree): one step of `engine.decode`, priced from the engine's own clock."""
        if key not in self.trees:
            raise CostsError(f"the probe holds no tree {key!r}: it steps {', '.join(map(str, self.trees))}")
        state, events, context = row
        state.policy = self.policies[key]
        self._rewind(state, context)
        n = self.trees[key].num_nodes
        event = next(events, None)
        if event is None:
            raise CostsError(f"the probe's generation ended before its {n}-node step")
        step = event.step
        if step.tree_nodes != n:  # the engine fell back to a plain step
            raise CostsError(f"the probe's {n}-node step verified {step.tree_nodes}: no room left for it")
        return priced_ms(step.seconds), 1000 * step.seconds["draft"] if self.heads is not None else 0.0

    def batch(self, rows: int, context: int, room: int):
        """A continuous batch (batch.Batch, as a server runs it: no gate, no cost surface) of `rows`
        generations of `context` random tokens each, each prefilled and taken in as the batch takes a new
        row, with room for `room` more tokens (the rows are cut back before each step)."""
        from ..batch import Batch, BatchOptions  # the batch imports the engine, which imports this package

        batch, s = Batch(self.engine, BatchOptions(gate=False)), self.sampling
        # the drafting state is made when a tree drafts (without heads: random drafts, set below)
        largest = self.largest if self.heads is not None else None
        for _ in range(rows):
            ids = torch.randint(0, self.vocab, (context,), generator=self.gen).tolist()
            row, _ = batch.add(
                ids, chat=False, policy=largest, max_new_tokens=room, temperature=s.temperature,
                acceptance=s.acceptance,
            )  # fmt: skip
            row.state.max_new_tokens = 1 << 30  # its cache holds `room` more; the steps never end it
            if self.heads is None:
                row.state.drafter = _RandomDrafts(self.vocab, self.gen, self.dev)
        return batch, list(batch.kv.rows), context

    def batch_step(self, batch, b: int, key: int | str) -> float:
        """ms of one `Batch.step` of the batch's first `b` rows, each verifying tree `key` (as `step`'s): the
        server's batched step itself (each row's choice and drafts, one forward, acceptance, commit)."""
        batch, caches, context = batch
        batch.kv.rows = caches[:b]  # the first b rows take part (their views stay in place)
        n = self.trees[key].num_nodes
        for row in batch.rows:
            row.state.policy = self.policies[key]
            self._rewind(row.state, context)
        t0 = now(self.dev)
        batch.step()
        ms = 1000 * (now(self.dev) - t0)
        if batch.failed:
            raise CostsError(f"the probe's batched step failed: {batch.failed[0][1]}")
        if batch.last is None or set(batch.last.nodes) != {n}:  # a row fell back to a plain step
            raise CostsError(f"the probe's batched {n}-node step verified fewer nodes: no room left for it")
        return ms
