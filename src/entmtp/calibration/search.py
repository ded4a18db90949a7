"""Offline tree search on calibration traces: EntMTP's greedy growth and the acceptance frontier.

A tree accepts, at a step whose rank vector is R (see traces.py), the longest prefix of R that is one of its
paths. Over all positions of the traces, a path's value is how often R starts with it (`PathCounts`), and a
tree's mean accepted length is the sum of its paths' values: so scoring a candidate tree is a sum, and the
paper's per-round union rollouts are not needed. `simulate` replays whole decodes step by step (the steps a
tree really takes, each starting where the previous one ended): the debiased, own-tree number.

Typical acceptance (T > 0) accepts the longest path whose every draft passes the typical test, so several
siblings may pass and values no longer add up: `PassScores` keeps every position's current accepted length
and scores a candidate by how much it raises them (the same growth, the same tie rules).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


class PassScores:
    """Typical acceptance on traces with pass masks: node (prefix, r) at depth d is accepted at a position
    when `prefix` is the trajectory's own prefix (each of its drafts passing) and rank r passes there."""

    def __init__(self, traces: Sequence[Trace]):
        ranks = np.concatenate([t.ranks.numpy() for t in traces])  # [N, D]
        masks = np.concatenate([t.passmask.numpy() for t in traces])  # [N, D]
        n, depth = ranks.shape
        self.positions = n
        self.masks = masks
        traj_ok = (ranks < MISS) & (
            ((masks >> np.minimum(ranks, TOPK - 1)) & 1) == 1
        )  # trajectory draft passes
        self.valid = np.concatenate([np.ones((n, 1), bool), np.cumprod(traj_ok, axis=1).astype(bool)], axis=1)
        self.codes = np.zeros((n, depth + 1), dtype=np.int64)  # [N, D+1]: code of the trajectory's d-prefix
        for d in range(depth):
            self.codes[:, d + 1] = self.codes[:, d] * (TOPK + 1) + ranks[:, d] + 1
        self.acc = np.zeros(n)

    @staticmethod
    def _code(path: RankPath) -> int:
        code = 0
        for r in path:
            code = code * (TOPK + 1) + r + 1
        return code

    def fires(self, path: RankPath) -> np.ndarray:
        """[N] bool: positions where the node is accepted (given its ancestors are in the tree)."""
        d = len(path)
        prefix = (self.codes[:, d - 1] == self._code(path[:-1])) & self.valid[:, d - 1]
        return prefix & (((self.masks[:, d - 1] >> path[-1]) & 1) == 1)

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


class Scores:
    @staticmethod
    def for_traces(traces: Sequence[Trace]) -> PathCounts | PassScores:
        """The scorer for the traces' acceptance rule: greedy (rank vectors) or typical (pass masks)."""
        return PassScores(traces) if traces and traces[0].passmask is not None else PathCounts(traces)


@dataclass(frozen=True)
class Grown:
    """One greedy growth: the order nodes were added in, for one max depth."""

    max_depth: int
    order: tuple[RankPath, ...]

    def tree(self, nodes: int, name: str | None = None) -> Tree:
        return Tree(name or f"d{self.max_depth}n{nodes}", self.order[:nodes])


def grow(
    counts: PathCounts | PassScores, max_depth: int, max_nodes: int = MAX_NODES, max_rank: int = TOPK
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


def accepted_length(
    paths: frozenset[RankPath], ranks: Sequence[int], masks: Sequence[int] | None = None
) -> int:
    """Drafts a tree (its path set) accepts at a step with rank vector `ranks`; with pass `masks` (typical
    acceptance), the deepest passing node below the trajectory's own passing prefix."""
    n = 0
    path: tuple[int, ...] = ()
    if masks is None:
        for r in ranks:
            path = (*path, r)
            if path not in paths:
                break
            n += 1
        return n
    for d, (r, bits) in enumerate(zip(ranks, masks, strict=True), start=1):
        if not any(bits >> k & 1 and (*path, k) in paths for k in range(TOPK)):
            break
        n = d
        if r >= MISS or not bits >> r & 1 or (*path, r) not in paths:
            break
        path = (*path, r)
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
    paths = tree.path_set
    rows = trace.ranks.tolist()
    masks = trace.passmask.tolist() if trace.passmask is not None else [None] * len(rows)
    out = []
    j, end = 0, len(rows)  # row j = root prompt_len + j; the last root is the last token
    while j < end - 1:
        step = min(accepted_length(paths, rows[j], masks[j]) + 1, end - 1 - j)
        out.append(step)
        j += step
    return out
