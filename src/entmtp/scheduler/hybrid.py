"""Hybrid trees per step: the heads' tree (any inner policy) plus a prompt-lookup branch of a chosen length.

Each step the policy reads the lookup index's match at the root (`match`: the longest suffix of the text that
occurred before with a continuation; 0 = nothing to copy) and weighs, in expected tokens per unit of time:

  heads    the inner policy's tree alone
  hybrid   the inner tree plus a lookup chain of L tokens (L = 1 .. Lookup.tokens)
  lookup   the lookup chain alone (drops the heads' tree when copying is the better bet)
  plain    neither (a one-token step, when the heads have been wrong lately and there is nothing to copy)

  expected tokens = 1 + sum_k P(some branch is right to depth k)
                  = 1 + sum_k [1 - (1 - H_k)(1 - L_k)]     (the two sources taken as independent)

H_k = c_1 ... c_k: how often the heads' tree was right to depth k, from c_d, how often it was right at depth d
when it was right to depth d - 1. L_k = q_1 ... q_k the same for the lookup chain after a match of length m
(q_{m,d}, per match bucket), kept per source of the chain (drafts.py: the source of its first token, the text's
own n-grams, a prediction or the suffix cache), so a source that copies well is not priced at another's
misses; a source that estimates its own tokens (the suffix cache's empirical probabilities, a prediction's copy
rate) gives the step's prior of each q_d, so the cache's near-certain chains are drafted from a generation's
first step and its guesses are not. Copying is bursty: a chain is often wholly right (the text copies a span)
or wrong at its first token, so q_1 is low and the deeper q_d near 1; a geometric chain (one rate r_m, L_k = r_m^k,
what this policy took before) read that as r_m ~ 0.5 and kept branches short where long ones pay (Hydra
dynamic+lookup on the 2-core EPYC, 3 prompts a task: RAG 2.10 -> 2.82 tokens/step, translation 2.19 -> 2.51). All are running estimates over
this generation (steps decay with window `WINDOW`) started from priors (`HEADS_PRIOR`, `LOOKUP_PRIOR` at every
depth), read from every step's `Step.sources`: exact counterfactuals for greedy decoding. On a step that drops the heads' tree, its probe (the candidates the tree drafts first, computed
before the choice) against the emitted tokens still says exactly whether it would have been right to the
depths the probe holds (`counterfactual_depth`: depth 1 for Hydra, every depth for Medusa); deeper evidence
not verified for a while ages towards its prior. The lookup chain is judged one token past what a step
drafted of it, where that part was right (none drafted: its first token): the chain the match offered
(`copy_chain`, read before the step) against the emitted tokens. That token is emitted whatever the heads did
(the bonus token after a chain right to its end), so its judgement is unbiased; deeper emitted tokens exist only
where the heads were right too, and would bias the rate upwards. Without it a branch kept short beside the
heads' tree never learned its deeper rates (they stayed at the prior) however far the text copied.

A chain is sized on its first token's rate less `Lookup.caution` standard errors of it (one, by default), the
deeper rates as they are. Where a drafted node costs about what a plain step does (llama.cpp on a CPU: 1.7-1.9
plain steps for one), a chain pays only when it starts right most of the time, and a rate read off a few steps
is high by chance as often as it is low: on the rate itself the default on llama.cpp drafted 1-token chains
that yielded 1.5-1.7 tokens for 1.8 plain steps' cost, below plain decoding on GSM8K and math. The deeper,
conditional rates are near 1 where text copies (a chain right at its first token is usually right to its end),
and a lower bound on each of them, compounded, kept long chains short on copy-heavy text: replayed on plain
outputs of the 13 bench tasks, 10 prompts each (docs/results/never-slower/chains/), the first rate's bound
took the worst task from 0.977 to 0.995 of plain steps and the geometric mean from 1.021 to 1.029, the bound on
every rate the worst to 0.998 but the geometric mean to 1.023 (copy-heavy edits 1.102 -> 1.074).

Lookup alone (a root-only inner policy: the default where no heads' tree pays) has a fast path: a chain of n
tokens takes at most 1 + n q_1 tokens (every L_k <= q_1), so where q_1 (with its caution) is below `pays_from`,
the least first-token rate at which any chain could pay on this curve, or there is no match, the step is plain
without building the estimates or weighing the options; the choice is the one the weighing makes
(`tests/test_hybrid.py`). On text that does not copy, that is nearly every step.

When there is a match and no heads' tree could pay at the heads' current rates (`_heads_lose`: the best option
without them beats the cheapest tree of every depth with them), the step is chosen without asking the inner
policy, so the engine's lazy probe (heads.LazyProbe) is never computed: on copy-heavy text many steps then cost
what prompt lookup alone costs. Such a step judges no head, so the heads' evidence ages towards the prior until
they are worth probing again; the inner policy still observes it. The choice is the one the full weighing
would make (`tests/test_hybrid.py`). Without a match the heads are probed while probing pays: a step that drops
them for a plain step still learns from their probe (counterfactual_depth), but pays for it, so the policy keeps
`probe_yield`, the tokens such probed steps took per plain step's cost (the probe's included; decayed, from a
prior above 1), and takes an unprobed plain step while it is below 1. Skipped steps age it back towards the
prior, so the heads are probed again now and then (about one step in 16 where they keep missing); on text
where they are right (yield above 1) every step is probed. Measured: `scripts/hybrid_skip_ab.py`.

Cost, in one-token steps: the measured step latency of n drafted tokens relative to a plain step (`latency`:
this machine's cost curve, costs/, or a profile's stored latencies; else `costs.CPU_COST`, another machine's),
less the heads' drafting (`draft_cost`: the curve's measured share, `CostCurve.draft_share`, else
`costs.HEADS_DRAFT_COST`, another machine's) on steps that use no head; a probe that is computed and then not
drafted from costs the same drafting. Or, with `Lookup.node_cost` set, 1 + c n (c near 0 on a GPU, where
verifying up to ~64 tokens is nearly free). The choice depends on the text alone, so seeded sampling repeats
exactly.

With `Lookup.adaptive` False the branch is always `Lookup.tokens` long when there is a match (prompt lookup
decoding's rule) and the heads' tree is always kept.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ..costs.curves import HEADS_DRAFT_COST, CostCurve, LatencyModel, relative_cost
from ..drafts import COPIED, LOOKUP
from ..heads import taken
from ..lookup import Lookup, NgramIndex
from ..policy import Choice, Menu, Settings, Stateful, TreePolicy, require_policy, static
from ..records import Step, StepContext
from ..tree import Tree, with_lookup

WINDOW = 16  # steps; older evidence decays by (1 - 1/WINDOW) per step
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior
HEADS_PRIOR = 0.6  # c_d prior, so H_k starts at 0.6^k
LOOKUP_PRIOR = {0: 0.0, 1: 0.25, 2: 0.45, 3: 0.6}  # q_{m,d} prior by match length (3 = 3 or more), every d
# tokens per plain step's cost of the steps without a match that probed the heads, before any such step: above
# 1 (a plain step's), so the heads are probed until their probed steps are seen not to pay
PROBE_YIELD_PRIOR = 1.25
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


class _DepthRates:
    """c_1 .. c_D as decayed `_Rate`s: every depth ages each step, the judged ones with a trial. Plain lists: a
    step's update is a loop over D <= ~32 depths, a few microseconds, where numpy's temporaries took ~40 us
    (every step of the llama.cpp default pays it; the same float64 operations, so the same rates)."""

    def __init__(self, depth: int, prior: float, weight: float = PRIOR_WEIGHT):
        self.prior, self.weight = prior, weight
        self.s, self.t = [0.0] * depth, [0.0] * depth

    def add(self, depth: int, known: int, decay: float) -> None:
        """One step right to `depth`, judged to depth `known`: c_k is tried where k <= known and the step was
        right to k - 1 (succeeding where it was right to k); the other depths only age."""
        s, t = self.s, self.t
        for i in range(len(s)):  # depth k = i + 1
            tried = i < known and depth >= i
            s[i] = decay * s[i] + (tried and depth > i)
            t[i] = decay * t[i] + tried

    def first(self, caution: float = 0.0, prior: Sequence[float] = ()) -> float:
        """c_1 less `caution` standard errors of it (a binomial rate's, on its decayed evidence). `prior`: this
        step's prior of c_1, c_2, ... where a draft source estimates them (a source's own estimate of its
        tokens, drafts.py), in place of the fixed one."""
        n = self.t[0] + self.weight
        rate = (self.s[0] + self.weight * (prior[0] if prior else self.prior)) / n
        return max(0.0, rate - caution * math.sqrt(rate * (1.0 - rate) / n)) if caution else float(rate)

    def values(self, caution: float = 0.0, prior: Sequence[float] = ()) -> list[float]:
        """c_1 .. c_D; c_1 as `first` gives it; `prior` as there (beyond its length, the fixed prior)."""
        w, fixed = self.weight, self.weight * self.prior
        rate = [
            (s + (w * prior[i] if i < len(prior) else fixed)) / (t + w)
            for i, (s, t) in enumerate(zip(self.s, self.t, strict=True))
        ]
        if caution:
            rate[0] = self.first(caution, prior)
        return rate


class Estimates:
    """Expected tokens of a step's options at one step's rates: heads' trees right to depth k with probability
    H_k = c_1 ... c_k (k <= the tree's depth d), lookup chains right to depth k with L_k = q_1 ... q_k (k <= the
    chain's length l), the two independent (module docstring):

        E(d, l) = 1 + sum_k [1 - (1 - H_k)(1 - L_k)] = 1 + sum_{k<=d} H_k + sum_{k<=l} L_k - sum_{k<=min(d,l)} H_k L_k

    computed from three prefix sums, so each option costs O(1)."""

    def __init__(self, c: Sequence[float], q: Sequence[float], length: int):
        heads, copy, both = [0.0], [0.0], [0.0]  # prefix sums of H_k, L_k, H_k L_k
        h = lk = 1.0
        for k in range(max(len(c), length)):
            h = h * c[k] if k < len(c) else 0.0
            lk = lk * q[k] if k < length else 0.0
            heads.append(heads[-1] + h)
            copy.append(copy[-1] + lk)
            both.append(both[-1] + h * lk)
        self.heads, self.copy, self.both = heads, copy, both

    def expected(self, depth: int, length: int) -> float:
        """Expected tokens of a heads' tree of `depth` (0: none) with a lookup chain of `length` (0: none)."""
        return 1.0 + self.heads[depth] + self.copy[length] - self.both[min(depth, length)]


class HybridPolicy(Settings, Stateful):
    """Adds a lookup branch, sized per step (see the module docstring), to the trees of `inner`."""

    SETTINGS = ("inner", "lookup", "counterfactual", "cost", "draft_cost")

    def __init__(
        self,
        inner: TreePolicy,
        lookup: Lookup,
        latency: LatencyModel | None = None,
        counterfactual: bool = True,
        draft_cost: float | None = None,
    ):
        self.inner, self.lookup, self.counterfactual = inner, lookup, counterfactual
        self.trees = list(inner.trees)
        self.master = inner.master
        self.depth = max([t.depth for t in self.trees] + [self.master.depth if self.master else 0] + [1])
        self._hybrids: dict[tuple[int, int], tuple[Tree, Tree]] = {}
        n = np.arange(max(t.num_nodes for t in self.trees) + lookup.tokens + 1)  # [n] drafted nodes
        if lookup.node_cost is not None:
            cost, self.draft_cost = 1.0 + lookup.node_cost * n, 0.0
        else:
            cost = relative_cost(latency)(n)
            self.draft_cost = HEADS_DRAFT_COST if draft_cost is None else draft_cost
        self.cost: list[float] = cost.tolist()  # [n] a step's cost in plain steps by drafted nodes
        # the curve at each step's context, where it was measured at several (LatencyModel.at): its costs there
        self.latency = latency if lookup.node_cost is None else None
        # id(the curve at a context) -> its costs and their `pays_from`
        self._costs_at: dict[int, tuple[list[float], float]] = {}
        # lookup alone (no heads' tree ever): a chain of n tokens takes at most 1 + n q_1 tokens (every L_k <= q_1),
        # so below this first-token rate no chain pays and the step is plain without weighing the options
        self.lookup_only = self.master is None and all(t.num_nodes == 0 for t in self.trees)
        self.pays_from = self._pays_from(self.cost)
        self.reset()

    def _pays_from(self, cost: list[float]) -> float:
        """The first-token rate below which no lookup chain pays on `cost` (see `lookup_only`)."""
        return min((c - self.draft_cost - 1.0) / n for n, c in enumerate(cost[: self.lookup.tokens + 1]) if n)

    def reset(self) -> None:
        self.inner = self.inner.fresh()
        self.heads = _DepthRates(self.depth, HEADS_PRIOR)  # c_d, d = 1..D
        # q_{m,d}, d = 1..Lookup.tokens, per source of the branch (drafts.COPIED) and match bucket m
        self.rates = {
            s: {m: _DepthRates(self.lookup.tokens, p) for m, p in LOOKUP_PRIOR.items()} for s in COPIED
        }
        self._source = LOOKUP  # the running step's branch's source
        self.probe_yield = _Rate(PROBE_YIELD_PRIOR)  # tokens per cost of probed steps without a match
        self._chosen: tuple[int, int] = (0, 0)  # (match bucket, heads depth) of the running step
        self._unmatched: float | None = None  # the running step without a match: its cost (0: not probed)
        self._unverified: tuple[Tree, object] | None = None  # (inner tree, probe) when the heads were dropped
        self._offer: tuple | None = None  # (index, its size) whose match offered the running step a chain

    @property
    def copy(self) -> dict[int, _DepthRates]:
        """q_{m,d} of the text's own n-grams (prompt lookup's), per match bucket m."""
        return self.rates[LOOKUP]

    def choose(self, ctx: StepContext) -> Choice:
        index = ctx.lookup
        match, source, prior = 0, LOOKUP, ()
        if index is not None:
            found = index.ranked(index.tail(index.max_ngram), self.lookup.branches, depth=0)
            if found.tokens:  # a branch from the source of its first token, at that source's rates
                match, source = found.match, found.origins[0]
                prior = index.estimates(source=source) if source != LOOKUP else ()
        m = min(match, MAX_MATCH)
        self._source, rates = source, self.rates[source][m]
        # the chain the match offers: `observe` reads as much of it as it judges (the index as it is now)
        self._offer = (index, len(index.tokens)) if m and self.counterfactual else None
        costs, pays_from = self._priced(ctx)
        length = self.lookup.tokens if m else 0
        # lookup alone where no chain can pay at the first token's rate: a plain step, nothing weighed
        plain = (
            self.lookup_only
            and self.lookup.adaptive
            and ctx.latency is None
            and (not m or rates.first(self.lookup.caution, prior) < pays_from)
        )
        est = (
            None
            if plain
            else Estimates(self.heads.values(), rates.values(self.lookup.caution, prior), length)
        )
        skip = (
            self.lookup.adaptive and self.master is not None
        )  # never with `plain` (lookup alone: no master)
        if m:  # no heads' tree can pay at the heads' rates
            skip = skip and self._heads_lose(est, length, costs)
        else:  # lately the probed steps without a match took fewer tokens than their cost in plain steps
            skip = skip and self.probe_yield.value < 1.0
        if skip:
            # choose among the other options without asking the inner policy, so the heads' probe is never
            # computed (ctx.probe is lazy) and their evidence ages towards the prior
            tree, signals, probe = Tree.root_only(), {"match": float(match), "probed": 0.0}, None
        else:
            tree, signals = self.inner.choose(ctx)[:2]
            signals = dict(signals, match=float(match))
            probe = taken(ctx.probe)  # read by the inner policy (or None: it had no master)
        step = (tree, m, probe, signals, costs)
        if not self.lookup.adaptive:
            return Choice(self._take(step, (True, length)), signals)
        if plain:  # what the weighing would take
            return Choice(self._take(step, (False, 0)), signals)
        options = self._options(tree, est, length)
        value = [e / self._option_cost(tree, keep, n, costs) for keep, _, n, e in options]
        keep, length, _, _ = options[value.index(max(value))]
        # a menu only for a batched step's joint choice (ctx.latency: the whole step's), where it is read
        menu = self._menu(step, options) if ctx.latency is not None else None
        return Choice(self._take(step, (keep, length)), signals, menu)

    def _heads_lose(self, est: Estimates, length: int, costs: list[float]) -> bool:
        """Whether, at the heads' current rates, the best option without them beats every option with them.
        Each heads' tree is taken as the cheapest of its depth (a chain of d nodes: an option's expected tokens
        depend on the tree's depth only, `Estimates`), up to the master's depth, so this never drops a tree the
        full choice would keep."""
        root = Tree.root_only()
        without = max(
            est.expected(0, n) / self._option_cost(root, False, n, costs) for n in range(length + 1)
        )
        return all(
            est.expected(d, n) / self._option_cost(_chain(d), True, d + n, costs) < without
            for d in range(1, self.master.depth + 1)
            for n in range(length + 1)
        )

    def _take(self, step: tuple, option: tuple[bool, int]) -> Tree:
        """The step's tree for `option` (keep the heads' tree?, lookup tokens), noted as the step's choice; `step`
        is (the inner tree, match bucket, probe, signals, costs)."""
        tree, m, probe, signals, costs = step
        heads, length = option
        dropped = not heads and tree.num_nodes and self.counterfactual
        self._unverified = (tree, probe) if dropped else None
        inner = tree if heads else Tree.root_only()
        self._chosen = (m, inner.depth)
        self._unmatched = None  # a step without a match: its cost, the probe's included (0: not probed)
        if not m:
            used = heads and tree.num_nodes > 0
            cost = self._option_cost(tree, heads, inner.num_nodes + length, costs)
            self._unmatched = 0.0 if probe is None else cost + (0.0 if used else self.draft_cost)
        signals.update(lookup_tokens=float(length), heads=float(heads))
        return self._hybrid(inner, length)

    def _menu(self, step: tuple, options) -> Menu:
        """The best option within each node budget (a batch's joint choice, policy.joint_budget); taking one
        makes it the step's choice."""
        top = max(n for _, _, n, _ in options)
        expected, pick = np.zeros(top + 1), [(True, 0)] * (top + 1)
        for keep, length, n, e in sorted(options, key=lambda o: o[2]):
            for k in range(n, top + 1):
                if e > expected[k]:
                    expected[k], pick[k] = e, (keep, length)
        return Menu(expected, lambda k: self._take(step, pick[min(k, top)]))

    def _option_cost(self, tree: Tree, keep: bool, n: int, costs: list[float]) -> float:
        """A step of `n` drafted nodes in plain steps; the heads' drafting saved when no head node is drafted
        (the plain step and the inner tree alone cost what they cost)."""
        if n == 0 or (keep and n == tree.num_nodes):
            return costs[n]
        return costs[n] - (self.draft_cost if not keep or not tree.num_nodes else 0.0)

    def _priced(self, ctx: StepContext) -> tuple[list[float], float]:
        """(step cost in plain steps by drafted nodes, its `pays_from`): the policy's own at this step's context
        (its curve's, where measured at several contexts; each context's worked out once), or in a batched step
        the whole step's at that batch size (`ctx.latency`)."""
        if self.lookup.node_cost is not None:
            return self.cost, self.pays_from
        if ctx.latency is None:
            if self.latency is None or not self.latency.contexts.size:
                return self.cost, self.pays_from
            curve = self.latency.at(ctx.position)
            found = self._costs_at.get(id(curve))
            if found is None:
                cost = relative_cost(curve)(np.arange(len(self.cost))).tolist()
                found = self._costs_at[id(curve)] = (cost, self._pays_from(cost))
            return found
        ms = ctx.latency(np.arange(len(self.cost)))
        cost = (ms / ms[0]).tolist()
        return cost, self._pays_from(cost)

    def _options(self, tree: Tree, est: Estimates, length: int) -> list[tuple[bool, int, int, float]]:
        """(keep the heads' tree?, lookup tokens, drafted nodes, expected tokens) of every option: the heads'
        tree alone, plus a lookup chain of 1 .. `length` tokens, the lookup chain alone, and a plain step."""
        out = []
        for keep in (True, False) if tree.num_nodes else (False,):
            depth, base = (tree.depth, tree.num_nodes) if keep else (0, 0)
            out += [(keep, n, base + n, est.expected(depth, n)) for n in range(length + 1)]
        return out

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
        right, known = (step.sources["lookup"], step.lookup_nodes) if step.sources else (0, 0)
        if right == known and self._offer is not None:  # the drafted chain right to its end: judge one more
            index, size = self._offer  # the chain it offered then, as far as the judgement reads
            chain = copy_chain(index, min(self.lookup.tokens, known + 1), size)
            more, seen = chain_depth(chain, step.token_ids, known, 1)
            right, known = right + more, known + seen
        if known:
            # right tokens before the first wrong one (or the end): q_d is tried where d <= the depth judged and
            # the chain was right to d - 1
            self.rates[self._source][m].add(right, known, decay)
        depth = step.sources["heads"] if step.sources else step.accepted
        if self._unmatched is not None:  # what probing paid on steps without a match (a skipped one ages it)
            self.probe_yield.add(step.tokens if self._unmatched else 0.0, self._unmatched, decay)
        if self._unverified is not None:  # the heads were dropped: what their probe says they would have done
            depth, heads_depth = counterfactual_depth(*self._unverified, step.token_ids)
        # c_k is tried where depth k was judged and the step was right to k - 1; the rest ages, so a dropped
        # tree is tried again in time (lookup alone has no heads' tree: its rates are never read)
        if not self.lookup_only:
            self.heads.add(depth, heads_depth, decay)


def hybrid(
    inner: TreePolicy | None = None, lookup: Lookup | None = None, costs: CostCurve | None = None
) -> HybridPolicy:
    """`inner` (a policy, e.g. `policy.static("tree_8")`, taken as it is; None: the root alone, i.e. prompt
    lookup decoding) with a lookup branch (`lookup`, default `Lookup()`) sized per step on `costs` (this
    machine's cost curve, costs/; its measured draft share prices lookup-only steps and the probe; None:
    `CPU_COST` and `HEADS_DRAFT_COST`, another machine's)."""
    policy = static(Tree.root_only()) if inner is None else require_policy(inner, "hybrid")
    latency, share = (costs.latency(), costs.draft_share) if costs is not None else (None, None)
    return HybridPolicy(policy, lookup or Lookup(), latency, draft_cost=share)


@functools.cache
def _chain(depth: int) -> Tree:
    """A chain of `depth` nodes (each its depth's top candidate): the cheapest heads' tree of that depth."""
    return Tree(f"chain{depth}", tuple((0,) * d for d in range(1, depth + 1)))


def copy_chain(index: NgramIndex, length: int, size: int | None = None) -> list[int]:
    """The lookup chain of up to `length` tokens that `index` offers after its last tokens: each token the top
    continuation of the tokens before it, drafted ones included (what a chain of `length` lookup nodes drafts,
    lookup.draft_lookup). `size`: the chain the index offered when it held its first `size` tokens."""
    return list(index.draft(index.tail(index.max_ngram, size), length, size).tokens)


def chain_depth(chain: Sequence[int], emitted: Sequence[int], start: int, most: int) -> tuple[int, int]:
    """(right, judged): how far `chain` would have been right past its first `start` tokens, judged by the
    step's emitted tokens to at most `most` more; (0, 0) when those `start` tokens are not what was emitted
    (the right branch was another). Exact for greedy decoding."""
    if list(chain[:start]) != list(emitted[:start]):
        return 0, 0
    judged = max(0, min(len(chain), len(emitted), start + most) - start)
    right = 0
    while right < judged and chain[start + right] == emitted[start + right]:
        right += 1
    return right, judged


def counterfactual_depth(tree: Tree, probe, emitted: list[int]) -> tuple[int, int]:
    """(depth, known): how deep `tree` would have been right at a step it did not verify, judged to the depths
    its probe holds (Medusa: all of them; Hydra: depth 1) and the step emitted; `known` is the deepest depth
    that judgement covers (0: none, e.g. no probe tokens), and a miss at depth d settles every depth below it.
    Exact for greedy decoding: a probe's candidates are the tokens the tree would have drafted."""
    if probe is None or probe.tokens.numel() == 0:
        return 0, 0
    cands = probe.tokens.tolist()  # [Dp][k]
    limit = min(len(cands), len(emitted), tree.depth)
    path: tuple[int, ...] = ()
    for d in range(limit):
        row = cands[d]
        r = row.index(emitted[d]) if emitted[d] in row else -1
        if r < 0 or (*path, r) not in tree.path_set:
            return d, tree.depth  # wrong at depth d + 1: so at every depth below
        path = (*path, r)
    return limit, limit
