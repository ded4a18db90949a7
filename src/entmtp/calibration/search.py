"""Offline tree search on calibration traces: EntMTP's greedy growth and the acceptance frontier.

A tree accepts, at a step whose rank vector is R (see traces.py), the longest prefix of R that is one of its
paths. Over all positions of the traces, a path's value is how often R starts with it (`PathCounts`), and a
tree's mean accepted length is the sum of its paths' values: so scoring a candidate tree is a sum, and the
paper's per-round union rollouts are not needed. `simulate` replays whole decodes step by step (the steps a
tree really takes, each starting where the previous one ended): the debiased, own-tree number.

Typical acceptance (T > 0) accepts the longest path whose every draft passes the typical test, so several
siblings may pass and values no longer add up: `UnionPasses` keeps every position's current accepted length
and scores a candidate by how much it raises them (the same growth, the same tie rules), over the union tree
the typical traces verified at every root.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import metrics
from ..tree import RankPath, Tree
from .traces import MISS, TOPK, Trace

MAX_NODES = 90  # growth history length per max depth (the paper grows to about 90 nodes)


class PathCounts:
    """How many trace positions start with each rank path (every prefix of every rank vector)."""

    def __init__(self, traces: Sequence[Trace]):
        self.counts: Counter[RankPath] = Counter()
        self.positions = 0
        for tr in traces:
            for row in tr.ranks.tolist():
                self.positions += 1
                path: tuple[int, ...] = ()
                for r in row:
                    if r >= MISS:
                        break
                    path = (*path, r)
                    self.counts[path] += 1

    def value(self, path: RankPath) -> float:
        """P(a step's rank vector starts with `path`) = the path's contribution to mean accepted drafts."""
        return self.counts.get(path, 0) / max(1, self.positions)

    def mean_accepted(self, paths: Sequence[RankPath]) -> float:
        return sum(self.value(p) for p in paths)

    def reset(self) -> None:  # a greedy path's value does not depend on the rest of the tree
        pass

    def add(self, path: RankPath) -> None:
        pass


def reachable(passes: torch.Tensor, union: Tree) -> np.ndarray:
    """[R, N] bool: node i + 1 of `union` is accepted at root j under typical acceptance, given the whole union
    tree: it passes and so does every ancestor."""
    alive = passes.numpy().copy()
    for i, parent in enumerate(union.parents[1:].tolist()):  # parents before children (canonical order)
        if parent > 0:
            alive[:, i] &= alive[:, parent - 1]
    return alive


class UnionPasses:
    """Typical acceptance on traces verified on a union tree: a node is accepted at a position when it and its
    ancestors pass there (`reachable`); a tree accepts its deepest such node. Values do not add up (siblings
    may both pass), so it keeps every position's current accepted length and scores a candidate by how much
    it raises them; a path outside the union tree was never verified and scores nothing."""

    def __init__(self, traces: Sequence[Trace]):
        union = traces[0].union
        if any(t.union is None or t.union.paths != union.paths for t in traces):
            raise ValueError("typical traces verified on different union trees cannot be scored together")
        self.alive = np.concatenate([reachable(t.passes, union) for t in traces])  # [P, N]
        self.col = {p: i for i, p in enumerate(union.paths)}
        self.positions = len(self.alive)
        self.acc = np.zeros(self.positions)

    def fires(self, path: RankPath) -> np.ndarray:
        """[P] bool: positions where the node is accepted (given its ancestors are in the tree)."""
        col = self.col.get(path)
        return np.zeros(self.positions, bool) if col is None else self.alive[:, col]

    def value(self, path: RankPath) -> float:
        gain = np.maximum(self.acc, len(path) * self.fires(path)) - self.acc
        return float(gain.sum()) / max(1, self.positions)

    def reset(self) -> None:
        self.acc = np.zeros(self.positions)

    def add(self, path: RankPath) -> None:
        self.acc = np.maximum(self.acc, len(path) * self.fires(path))

    def mean_accepted(self, paths: Sequence[RankPath]) -> float:
        acc = np.zeros(self.positions)
        for p in paths:
            acc = np.maximum(acc, len(p) * self.fires(p))
        return float(acc.mean())


class TraceAcceptance:
    """Drafts any tree accepts at each root of one trace, under the trace's rule: from its rank vectors
    (greedy, sample) or its union tree's passes (typical)."""

    def __init__(self, trace: Trace):
        self.rows = trace.ranks.tolist()
        self.alive = None if trace.passes is None else reachable(trace.passes, trace.union)
        self.col = {} if trace.union is None else {p: i for i, p in enumerate(trace.union.paths)}

    def __call__(self, j: int, paths: frozenset[RankPath]) -> int:
        if self.alive is None:
            return accepted_length(paths, self.rows[j])
        row = self.alive[j]
        return max((len(p) for p in paths if p in self.col and row[self.col[p]]), default=0)


class Scores:
    @staticmethod
    def for_traces(traces: Sequence[Trace]) -> PathCounts | UnionPasses:
        """The scorer for the traces' acceptance rule: rank vectors (greedy, sample) or union passes (typical)."""
        return UnionPasses(traces) if traces and traces[0].passes is not None else PathCounts(traces)


@dataclass(frozen=True)
class Grown:
    """One greedy growth: the order nodes were added in, for one max depth."""

    max_depth: int
    order: tuple[RankPath, ...]

    def tree(self, nodes: int, name: str | None = None) -> Tree:
        return Tree(name or f"d{self.max_depth}n{nodes}", self.order[:nodes])


def grow(
    counts: PathCounts | UnionPasses, max_depth: int, max_nodes: int = MAX_NODES, max_rank: int = TOPK
) -> Grown:
    """EntMTP's greedy growth from the one-node tree {(0,)}: each round, every node (root included) may take
    its next child (rank = its current number of children); add the candidate of highest value; ties go to
    the smaller rank sum, then the shallower node. Stops early when no candidate was ever accepted."""
    order: list[RankPath] = [(0,)]
    children: Counter[RankPath] = Counter({(): 1})
    counts.reset()
    counts.add((0,))
    while len(order) < max_nodes:
        best, best_key = None, None
        for parent in [(), *order]:
            k = children[parent]
            if len(parent) >= max_depth or k >= max_rank:
                continue
            cand = (*parent, k)
            key = (-counts.value(cand), sum(cand), len(cand))
            if best_key is None or key < best_key:
                best, best_key = cand, key
        if best is None or best_key[0] == 0:  # nothing left that ever accepts: more nodes only cost
            break
        order.append(best)
        counts.add(best)
        children[best[:-1]] += 1
    return Grown(max_depth, tuple(order))


@dataclass(frozen=True)
class FrontierTree:
    tree: Tree
    mean_accepted: float  # all-position mean accepted drafts (the search's score)
    tokens_per_step: float  # own-tree simulation over the traces (accepted + bonus per real step)


def acceptance_frontier(
    counts: PathCounts, traces: Sequence[Trace], grown: Sequence[Grown]
) -> list[FrontierTree]:
    """Trees of the growth histories not dominated in (nodes, mean accepted): per size the best depth,
    kept only if it beats every smaller tree. Each is re-scored by simulating its own decodes."""
    best: dict[int, tuple[float, Tree]] = {}
    for g in grown:
        for n in range(1, len(g.order) + 1):
            score = counts.mean_accepted(g.order[:n])
            if n not in best or score > best[n][0] + 1e-12:
                best[n] = (score, g.tree(n))
    frontier, top = [], -1.0
    for n in sorted(best):
        score, tree = best[n]
        if score > top + 1e-12:
            top = score
            tree = Tree(f"n{n}d{tree.depth}", tree.paths)
            frontier.append(FrontierTree(tree, score, simulate(tree, traces).tokens_per_step))
    return frontier


@dataclass(frozen=True)
class Simulated:
    tokens: int  # generated tokens (the prefill's first one excluded)
    steps: int

    @property
    def tokens_per_step(self) -> float:
        return metrics.mean_tokens_per_step(self.tokens, self.steps)


def accepted_length(paths: frozenset[RankPath], ranks: Sequence[int]) -> int:
    """Drafts a tree (its path set) accepts at a step with rank vector `ranks`: the longest prefix of it that is
    one of its paths."""
    n = 0
    path: tuple[int, ...] = ()
    for r in ranks:
        path = (*path, r)
        if path not in paths:
            break
        n += 1
    return n


def simulate(tree: Tree, traces: Sequence[Trace]) -> Simulated:
    """Decoding of every trace with `tree`, step by step: exact tokens per step for greedy traces (up to bf16
    rounding) and for lossless sampling's (for the sampled outcome: traces.py); for typical traces, as if every
    step had emitted the sampled trajectory's tokens."""
    steps = [n for tr in traces for n in step_tokens(tree, tr)]
    return Simulated(sum(steps), len(steps))


def step_tokens(tree: Tree, trace: Trace) -> list[int]:
    """Tokens of each step of `trace`'s generation decoded with `tree` (accepted drafts + the bonus, the last
    step cut at the generation's end)."""
    paths, accepted = tree.path_set, TraceAcceptance(trace)
    out = []
    j, end = 0, len(trace.ranks)  # row j = root prompt_len + j; the last root is the last token
    while j < end - 1:
        step = min(accepted(j, paths) + 1, end - 1 - j)
        out.append(step)
        j += step
    return out
