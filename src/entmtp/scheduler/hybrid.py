"""Hybrid trees per step: the heads' tree (any inner policy) plus a prompt-lookup branch of a chosen length.

Each step the policy reads the lookup index's match at the root (`match`: the longest suffix of the text that
occurred before with a continuation; 0 = nothing to copy) and weighs, in expected tokens per unit of time:

  heads    the inner policy's tree alone
  hybrid   the inner tree plus a lookup chain of L tokens (L = 1 .. Lookup.tokens)
  lookup   the lookup chain alone (drops the heads' tree when copying is the better bet)

  expected tokens = 1 + sum_k P(some branch is right to depth k)
                  = 1 + sum_k [1 - (1 - H_k)(1 - r_m^k)]     (the two sources taken as independent)

H_k: how often the heads' tree was right to depth k; r_m: how often a lookup token was right after a match of
length m (the chain is taken as geometric; each step weighs the same, so a long run cannot outvote the misses
that follow it). Both are running estimates over this generation (steps decay with
window `WINDOW`) started from priors (`HEADS_PRIOR`, `LOOKUP_PRIOR`), read from every step's `Step.sources`:
exact counterfactuals for greedy decoding. Cost: a step of n verified tokens costs 1 + c n one-token steps,
c = `Lookup.node_cost` (measured per machine: high on a CPU where every token costs, near 0 on a GPU where
verifying up to ~64 tokens is nearly free), so the same rule copies short runs on one and long on the other.

With `Lookup.adaptive` False the branch is always `Lookup.tokens` long (prompt lookup decoding's rule).
"""

from __future__ import annotations

from ..lookup import Lookup
from ..policy import TreePolicy
from ..records import Step, StepContext
from ..tree import Tree, with_lookup

WINDOW = 16  # steps; older evidence decays by (1 - 1/WINDOW) per step
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior
HEADS_PRIOR = 0.6  # H_k prior: 0.6^k
LOOKUP_PRIOR = {0: 0.0, 1: 0.25, 2: 0.45, 3: 0.6}  # r_m prior by match length (3 = 3 or more)
MAX_MATCH = max(LOOKUP_PRIOR)


class _Rate:
    """A decayed success rate with a prior: (s + w p) / (t + w)."""

    def __init__(self, prior: float, weight: float = PRIOR_WEIGHT):
        self.prior, self.weight = prior, weight
        self.s = self.t = 0.0

    def add(self, successes: float, trials: float, decay: float) -> None:
        self.s = decay * self.s + successes
        self.t = decay * self.t + trials

    @property
    def value(self) -> float:
        return (self.s + self.weight * self.prior) / (self.t + self.weight)


class HybridPolicy:
    """Adds a lookup branch, sized per step (see the module docstring), to the trees of `inner`."""

    def __init__(self, inner: TreePolicy, lookup: Lookup):
        self.inner, self.lookup = inner, lookup
        self.trees = list(inner.trees)
        self.master = getattr(inner, "master", None)
        self.last_signals: dict[str, float] = {}
        self._hybrids: dict[tuple[int, int], Tree] = {}
        self.reset()

    def reset(self) -> None:
        self.inner.reset()
        self.heads = [_Rate(HEADS_PRIOR**k) for k in range(1, 65)]  # H_k, k = 1..64
        self.copy = {m: _Rate(p) for m, p in LOOKUP_PRIOR.items()}
        self._chosen: tuple[int, int] = (0, 0)  # (match bucket, heads depth) of the running step

    def choose(self, ctx: StepContext) -> Tree:
        tree = self.inner.choose(ctx)
        signals = dict(getattr(self.inner, "last_signals", None) or {})
        index = ctx.lookup
        match = 0
        if index is not None:
            cands, match = index.candidates(index.tokens[-index.max_ngram :], self.lookup.branches)
            if not cands:
                match = 0
        m = min(match, MAX_MATCH)
        if match == 0:
            length, tree_kind = 0, "heads"
        elif not self.lookup.adaptive:
            length, tree_kind = self.lookup.tokens, "hybrid"
        else:
            length, tree_kind = self._best(tree, m)
        if tree_kind == "lookup":
            tree = Tree.root_only()
        self._chosen = (m, tree.depth)
        signals.update(match=float(match), lookup_tokens=float(length))
        self.last_signals = signals
        return self._hybrid(tree, length)

    def _best(self, tree: Tree, m: int) -> tuple[int, str]:
        """(lookup tokens, kind) of most expected tokens per unit time."""
        c, r = self.lookup.node_cost, self.copy[m].value
        heads = [self.heads[k].value for k in range(tree.depth)]  # H_1..H_D of the inner tree
        base_expected = 1.0 + sum(heads)
        best = (base_expected / (1.0 + c * tree.num_nodes), 0, "heads")
        for length in range(1, self.lookup.tokens + 1):
            copy = [r**k for k in range(1, length + 1)]
            span = max(length, len(heads))
            hit = sum(
                1.0 - (1.0 - (heads[k] if k < len(heads) else 0.0)) * (1.0 - (copy[k] if k < length else 0.0))
                for k in range(span)
            )
            cost = 1.0 + c * (tree.num_nodes + length)
            best = max(best, ((1.0 + hit) / cost, length, "hybrid"), key=lambda x: x[0])
            if tree.num_nodes:
                best = max(
                    best, ((1.0 + sum(copy)) / (1.0 + c * length), length, "lookup"), key=lambda x: x[0]
                )
        return best[1], best[2]

    def _hybrid(self, tree: Tree, length: int) -> Tree:
        if not length:
            return tree
        key = (id(tree), length)
        entry = self._hybrids.get(key)
        if entry is None or entry[0] is not tree:  # built once per (tree, length)
            if len(self._hybrids) > 4096:
                self._hybrids.clear()
            entry = self._hybrids[key] = (tree, with_lookup(tree, length, self.lookup.branches))
        return entry[1]

    def observe(self, step: Step) -> None:
        self.inner.observe(step)
        decay = 1.0 - 1.0 / WINDOW
        m, heads_depth = self._chosen
        if step.sources:
            if step.lookup_nodes:
                run = step.sources["lookup"]  # right tokens before the first wrong one (or the end)
                self.copy[m].add(run / (run + (run < step.lookup_nodes)), 1.0, decay)  # one step, one vote
            depth = step.sources["heads"]
        else:
            depth = step.accepted
        for k, rate in enumerate(self.heads[:heads_depth], start=1):
            rate.add(float(depth >= k), 1.0, decay)
