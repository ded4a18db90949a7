"""Tree policies that schedule: which bank tree to verify at each step, from the online signals.

  static   one tree (EntMTP*, the task's fastest static tree on this hardware, or any named tree)
  binary   a small and a large tree with hysteresis: switch up when the signal reaches tau_on, back down when
           it falls below tau_off (tau_off <= tau_on), so a signal oscillating inside the band never flips it
  ladder   K-1 increasing thresholds over a signal onto K trees sorted by size
  cost     per step, for every bank tree: expected tokens = 1 + its expected accepted drafts under the
           acceptance rule (`ExpectedAccepted`, from the calibrated per-node rates and the heads' probabilities
           in this step's probe), divided by the tree's measured step latency; take the best
  dynamic  the same rule over subtrees of a master tree: the master's nodes sorted by path probability, and
           the best prefix of that order (exact for greedy and lossless sampling, where the best n-node
           subtree holds the n nodes of highest path probability: one sort, a cumsum and an argmax over n)

The acceptance rule decides how node rates combine into a tree's expected accepted drafts:
  greedy, sample  at most one child of an accepted node is accepted (the base model's token, or the sampled
                  token: accept.py), so P(accepted >= k) is the sum of the depth-k nodes' path probabilities
                  and a tree's expectation is the sum of its nodes' path probabilities
  typical         several siblings may pass; with passes independent given the parent,
                  R_k(v) = 1 - prod over v's children c of (1 - f_c R_{k-1}(c)), R_0 = 1, is the probability
                  that a passing chain of k more nodes hangs below v, and the expectation is sum_k R_k(root)

In a batched step (batch.py) `cost` and `dynamic` weigh trees by `StepContext.latency`, the ms of the whole
step at that batch size (costs/curves.py), instead of the single-row latency they were built with.

`cost` and `dynamic` also recalibrate online (`OnlineCalibration`): their acceptance model was fitted on the
calibration prompts, and heads are often more (or less) often right on the text at hand. Every step shows
exactly whether head 1 was right, whatever tree ran: the probe's depth-1 candidates are what any tree drafts
first, and the step's first emitted token is the base model's. The ratio of those hits to the model's
predictions over recent steps scales every path probability (every path passes through depth 1).

Every policy reads its signals with one host sync per step. `master` is the tree the heads probe before the
choice (None: the policy needs no probe); every tree a policy returns is a subtree of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..accept import ACCEPTANCE, Rule
from ..codec import JsonForm
from ..costs.curves import LatencyModel
from ..errors import EntMTPError
from ..policy import Choice, Menu, Settings, Stateful
from ..records import Step, StepContext
from ..tree import Tree, subtree_index, union_tree
from .signals import DEFAULT_WINDOW, SIGNALS, SignalTracker, root_stats

POLICIES = ("static", "binary", "ladder", "cost", "dynamic")
PROBE_SIGNALS = ("path", "chain")  # signals that need the heads' probabilities before the choice
MAX_SUBTREES = 4096  # distinct subtrees the dynamic policy keeps built (each holds its masks and plans)


@dataclass(frozen=True)
class AcceptanceModel(JsonForm):
    """Calibrated P(node accepted | its parent accepted), per depth and per step context.

    The context of a step is how sure head 1 is of its top candidate (the probe's first probability, which
    every policy with a master tree sees, Hydra included), binned at `ctx_edges`: on a step where head 1 is
    sure, the deeper heads are right more often too. Within a context, a node's rate comes from the head's
    probability q of the node's token, binned at `edges`, for depths the probe covers, and from the node's
    rank for the others (Hydra's deeper heads). Rates are made non-decreasing in q and non-increasing in rank
    at calibration, so the best n-node subtree is prefix-closed and rank-contiguous.
    """

    edges: tuple[float, ...]  # [nb + 1] bin edges over q in [0, 1]
    ctx_edges: tuple[float, ...]  # [C + 1] bin edges over head 1's top-1 probability
    rates: tuple[tuple[tuple[float, ...], ...], ...]  # [Dq, C, nb]
    rank_rates: tuple[tuple[tuple[float, ...], ...], ...]  # [D, C, K]
    rule: str = "greedy"  # the acceptance rule it was fitted under (accept.ACCEPTANCE): how rates combine

    def __post_init__(self):
        if self.rule not in ACCEPTANCE:
            raise EntMTPError(
                f"unknown acceptance rule {self.rule!r} in an acceptance model: use {ACCEPTANCE}"
            )


class PathProbabilities:
    """Per node of a master tree, from a step's probe: `rates` P(node accepted | parent accepted) and
    (calling it) P(node's path accepted), both [M+1] with the root's 1."""

    def __init__(self, master: Tree, acceptance: AcceptanceModel):
        self.depth = master.depths[1:] - 1  # [M] row in the per-depth tables
        self.rank = master.ranks[1:]  # [M]
        self.ancestors = master.mask.float()  # [M+1, M+1]: row i sums log-rates over i's path
        self.edges = torch.tensor(acceptance.edges[1:-1])  # inner edges for bucketize
        self.ctx_edges = torch.tensor(acceptance.ctx_edges[1:-1])
        self.q_rates = torch.tensor(acceptance.rates).reshape(
            -1, len(acceptance.ctx_edges) - 1, len(acceptance.edges) - 1
        )
        ranks = torch.tensor(acceptance.rank_rates)  # [D, C, K]
        if int(self.depth.max()) >= ranks.shape[0] or int(self.rank.max()) >= ranks.shape[2]:
            raise EntMTPError(
                f"the acceptance model covers depth {ranks.shape[0]} and rank {ranks.shape[2] - 1}, less than "
                f"tree {master.name!r}: calibrate again for these trees"
            )
        self.by_rank = ranks[self.depth, :, self.rank]  # [M, C]
        self._known: dict[int, torch.Tensor] = {}

    def __call__(self, probe_logprobs: torch.Tensor | None) -> torch.Tensor:
        return self.along_paths(self.rates(probe_logprobs))

    def along_paths(self, rates: torch.Tensor) -> torch.Tensor:
        """[M+1] path probabilities: the product of `rates` [M+1] over each node's path."""
        return path_products(self.ancestors, rates)

    def rates(self, probe_logprobs: torch.Tensor | None) -> torch.Tensor:
        if probe_logprobs is None:  # no context: the average over contexts
            f = self.by_rank.mean(dim=1)
        else:
            lp = probe_logprobs.float().cpu()  # [Dp, k]
            c = int(torch.bucketize(lp[0, 0].exp(), self.ctx_edges))
            f = self.by_rank[:, c].clone()  # [M]
            dp = min(lp.shape[0], self.q_rates.shape[0])
            known = self._known.get(dp)
            if known is None:
                known = self._known[dp] = (self.depth < dp).nonzero().flatten()
            d, r = self.depth[known], self.rank[known]
            f[known] = self.q_rates[d, c, torch.bucketize(lp[d, r].exp(), self.edges)]
        return torch.cat([torch.ones(1), f])  # [M+1]


def path_products(ancestors: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """[M+1] the product of `rates` [M+1] over each node's path (`ancestors`: the tree's [M+1, M+1] mask)."""
    return (ancestors @ rates.clamp_min(1e-9).log()).exp()


class ExpectedAccepted:
    """Expected accepted drafts of subtrees of a master tree under an acceptance rule (module docstring):
    call with per-node rates [M+1] (root 1) and memberships [S, M+1] (1 where the subtree holds the node; the
    root column is ignored) for [S] expectations; `reach` gives P(accepted >= k) per depth k, [S, D]."""

    def __init__(self, master: Tree, rule: str):
        self.rule, self.depth = rule, master.depth
        self.ancestors = master.mask.float()  # [M+1, M+1]
        self.to_parent = torch.zeros(master.size, master.size)  # [M+1, M+1]: child row -> parent column
        kids = (master.parents >= 0).nonzero().flatten()
        self.to_parent[kids, master.parents[kids]] = 1.0
        self.at_depth = (master.depths[:, None] == torch.arange(1, master.depth + 1)).float()  # [M+1, D]

    def __call__(self, rates: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
        return self.reach(rates, member).sum(dim=1)

    def reach(self, rates: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
        member = member.clone()
        member[:, 0] = 0.0
        if Rule(self.rule).exclusive:  # the depth-k nodes' path probabilities add up
            return member @ (path_products(self.ancestors, rates)[:, None] * self.at_depth)
        out = torch.zeros(member.shape[0], self.depth)
        chain = torch.ones_like(member)  # R_{k-1} per subtree and node
        for k in range(self.depth):
            miss = torch.log1p(-(rates * chain).clamp(max=1 - 1e-6)) * member  # [S, M+1]: log(1 - f_c R(c))
            chain = 1.0 - (miss @ self.to_parent).exp()  # R_k of every node: over its children in the subtree
            out[:, k] = chain[:, 0]
        return out


CALIBRATION_WINDOW = 32  # steps; older hits and predictions decay by (1 - 1/CALIBRATION_WINDOW) per step
CALIBRATION_PRIOR = 2.0  # pseudo-steps of predicted hits behind the starting scale of 1


class OnlineCalibration(Stateful):
    """Scale for a calibrated acceptance model on the text at hand: decayed sums of head 1's observed hits
    over its predicted hit probability, (hits + w) / (predicted + w), starting at 1.

    `predict(rates, probe)` takes the master tree's per-node rates [M+1] from the acceptance model and the
    step's probe, notes head 1's predicted hit probability (the depth-1 nodes' sum: they are exclusive), and
    returns the rates with the depth-1 ones scaled (so every path probability is: each path passes through
    depth 1), capped so that they never sum above 1. `observe(step)` then checks the probe's depth-1
    candidates against the step's first emitted token. Without probe token ids (replays of traces without
    tokens) nothing is observed and the scale stays 1. For the exclusive rules only (greedy, sample): under
    typical acceptance the first emitted token is not "head 1's candidate was right".
    """

    def __init__(self, master: Tree, window: int = CALIBRATION_WINDOW, weight: float = CALIBRATION_PRIOR):
        self.first = (master.depths == 1).nonzero().flatten()  # [K1] node ids of the depth-1 nodes
        self.ranks = {int(master.ranks[i]) for i in self.first}
        self.decay, self.weight = 1.0 - 1.0 / window, weight
        self.reset()

    def reset(self) -> None:
        self.hits = self.predicted = 0.0
        self._pending: tuple[float, list[int]] | None = None

    @property
    def scale(self) -> float:
        return (self.hits + self.weight) / (self.predicted + self.weight)

    def predict(self, rates: torch.Tensor, probe) -> torch.Tensor:
        total = float(rates[self.first].sum())
        self._pending = None
        if probe is not None and probe.tokens.numel():
            self._pending = (min(total, 1.0), probe.tokens[0].tolist())
        scale = min(self.scale, 1.0 / total) if total > 0 else 1.0
        out = rates.clone()
        out[self.first] *= scale
        return out

    def observe(self, step: Step) -> None:
        if self._pending is None or not step.token_ids:
            return
        predicted, cands = self._pending
        first = step.token_ids[0]
        hit = first in cands and cands.index(first) in self.ranks
        self.hits = self.decay * self.hits + float(hit)
        self.predicted = self.decay * self.predicted + predicted
        self._pending = None


class _SignalPolicy(Settings, Stateful):
    """Shared by the signal-driven policies: the tracker (per generation: `fresh`), its observe, the signals;
    equal when built from the same `SETTINGS` (policy.Settings)."""

    signal = "entropy"
    master: Tree | None = None
    lookup = None  # no lookup branches (scheduler.hybrid adds them)

    def __init__(self, trees: Sequence[Tree], window: int):
        self.trees = list(trees)
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.tracker = SignalTracker(self.window)

    def observe(self, step: Step) -> None:
        self.tracker.observe(step.accepted)

    def _signals(self, ctx: StepContext) -> dict[str, float]:
        probe = None if ctx.probe is None else ctx.probe.logprobs
        if ctx.raw_signals is not None:  # a replay supplies the recorded values
            return self.tracker.update(ctx.raw_signals)
        return self.tracker.read(root_stats(ctx.root_logits), probe)


def _check_signal(signal: str) -> None:
    if signal not in SIGNALS:
        raise EntMTPError(f"unknown signal {signal!r}: use one of {', '.join(SIGNALS)}")


class BinaryPolicy(_SignalPolicy):
    """A small and a large tree with hysteresis (tau_off <= tau_on)."""

    SETTINGS = ("small", "large", "signal", "tau_off", "tau_on", "window")

    def __init__(
        self,
        small: Tree,
        large: Tree,
        signal: str,
        tau_off: float,
        tau_on: float,
        window: int = DEFAULT_WINDOW,
    ):
        _check_signal(signal)
        if not tau_off <= tau_on:
            raise EntMTPError(f"binary policy needs tau_off <= tau_on, got {tau_off} > {tau_on}")
        super().__init__([small, large], window)
        self.small, self.large, self.signal = small, large, signal
        self.tau_off, self.tau_on = tau_off, tau_on
        self.master = union_tree(self.trees, "binary-master") if signal in PROBE_SIGNALS else None
        self.high = False

    def reset(self) -> None:
        super().reset()
        self.high = False

    def choose(self, ctx: StepContext) -> Choice:
        signals = self._signals(ctx)
        s = signals[self.signal]
        if self.high and s < self.tau_off:
            self.high = False
        elif not self.high and s >= self.tau_on:
            self.high = True
        return Choice(self.large if self.high else self.small, signals)


class LadderPolicy(_SignalPolicy):
    """K trees sorted by size; tree i is chosen when thresholds[i-1] <= signal < thresholds[i]."""

    SETTINGS = ("trees", "signal", "thresholds", "window")

    def __init__(
        self, trees: Sequence[Tree], signal: str, thresholds: Sequence[float], window: int = DEFAULT_WINDOW
    ):
        _check_signal(signal)
        trees = sorted(trees, key=lambda t: t.num_nodes)
        if len(thresholds) != len(trees) - 1 or list(thresholds) != sorted(set(thresholds)):
            raise EntMTPError(
                f"a ladder over {len(trees)} trees needs {len(trees) - 1} strictly increasing thresholds, "
                f"got {list(thresholds)}"
            )
        super().__init__(trees, window)
        self.signal, self.thresholds = signal, list(thresholds)
        self.master = union_tree(self.trees, "ladder-master") if signal in PROBE_SIGNALS else None

    def choose(self, ctx: StepContext) -> Choice:
        signals = self._signals(ctx)
        return Choice(
            self.trees[int(np.searchsorted(self.thresholds, signals[self.signal], side="right"))], signals
        )


class _CalibratedPolicy(_SignalPolicy):
    """Shared by `cost` and `dynamic`: node rates from the acceptance model, recalibrated online (exclusive
    rules), and the rule's expected accepted drafts."""

    paths: PathProbabilities
    expected: ExpectedAccepted
    calibration: OnlineCalibration | None = None

    def _model(self, acceptance: AcceptanceModel, online: bool) -> None:
        self.acceptance, self.online = acceptance, online
        self.paths = PathProbabilities(self.master, acceptance)
        self.expected = ExpectedAccepted(self.master, acceptance.rule)
        online = online and Rule(acceptance.rule).exclusive
        self.calibration = OnlineCalibration(self.master) if online else None

    def reset(self) -> None:
        super().reset()
        if self.calibration is not None:
            self.calibration = self.calibration.fresh()

    def observe(self, step: Step) -> None:
        super().observe(step)
        if self.calibration is not None:
            self.calibration.observe(step)

    def _rates(self, ctx: StepContext) -> torch.Tensor:
        """[M+1] P(each master node accepted | its parent accepted) this step."""
        f = self.paths.rates(None if ctx.probe is None else ctx.probe.logprobs)
        return f if self.calibration is None else self.calibration.predict(f, ctx.probe)

    def _scale(self) -> dict[str, float]:
        return {} if self.calibration is None else {"calibration": self.calibration.scale}


class CostPolicy(_CalibratedPolicy):
    """Per step, the bank tree of most expected tokens per second (see the module docstring)."""

    SETTINGS = ("trees", "acceptance", "inv_ms", "online")

    def __init__(
        self,
        trees: Sequence[Tree],
        acceptance: AcceptanceModel,
        ms_per_step: Sequence[float],
        online: bool = True,
    ):
        if len(ms_per_step) != len(trees) or min(ms_per_step) <= 0:
            raise EntMTPError("the cost policy needs one positive step latency per bank tree")
        super().__init__(trees, DEFAULT_WINDOW)
        self.master = union_tree(self.trees, "cost-master")
        self._model(acceptance, online)
        member = torch.zeros(len(self.trees), self.master.size)  # [B, M+1]
        for b, tree in enumerate(self.trees):
            member[b, subtree_index(tree, self.master)[1:]] = 1.0
        self.member = member
        self.inv_ms = 1.0 / torch.tensor(ms_per_step, dtype=torch.float32)  # [B]

    def choose(self, ctx: StepContext) -> Choice:
        expected = 1.0 + self.expected(self._rates(ctx), self.member)  # [B] tokens per step
        inv_ms = self.inv_ms
        if ctx.latency is not None:  # a batched step: the whole step's ms at this batch size
            inv_ms = 1.0 / torch.tensor([ctx.latency.ms_of(t) for t in self.trees], dtype=torch.float32)
        best = int((expected * inv_ms).argmax())
        signals = {"expected_tokens": float(expected[best]), **self._scale()}
        return Choice(self.trees[best], signals, self._menu(expected))

    def _menu(self, expected: torch.Tensor) -> Menu:
        """Per node budget n, the bank tree of most expected tokens with at most n nodes (the root alone below
        the smallest)."""
        sizes = [t.num_nodes for t in self.trees]
        best: list[tuple[float, Tree]] = []
        top = (1.0, Tree.root_only())
        for n in range(max(sizes) + 1):
            for t, e in zip(self.trees, expected.tolist(), strict=True):
                if t.num_nodes == n and e > top[0]:
                    top = (e, t)
            best.append(top)
        return Menu(np.array([e for e, _ in best]), lambda n: best[min(n, len(best) - 1)][1])


class DynamicPolicy(_CalibratedPolicy):
    """Per step, the best subtree of `master` by expected tokens per second (see the module docstring)."""

    SETTINGS = ("master", "acceptance", "inv_ms", "require_contiguous", "online")

    def __init__(
        self,
        master: Tree,
        acceptance: AcceptanceModel,
        latency: LatencyModel,
        require_contiguous: bool = True,
        online: bool = True,
    ):
        super().__init__([master], DEFAULT_WINDOW)
        self.master = master
        self._model(acceptance, online)
        self.prefixes = torch.ones(master.size, master.size).tril()  # row n: the first n nodes of an order
        self.inv_ms = torch.tensor(1.0 / latency(np.arange(master.size)), dtype=torch.float32)  # [M+1]
        self.require_contiguous = require_contiguous
        self._subtrees: dict[tuple[int, ...], Tree] = {(): Tree.root_only()}

    def choose(self, ctx: StepContext) -> Choice:
        rates = self._rates(ctx)  # [M+1]
        p = self.paths.along_paths(rates)[1:]  # [M]
        order = torch.sort(p, descending=True, stable=True).indices  # parents before children on ties
        if Rule(
            self.expected.rule
        ).exclusive:  # the best n-node subtree: the n nodes of highest path probability
            expected = torch.cat([torch.ones(1), 1.0 + p[order].cumsum(0)])  # [M+1]
        else:  # the first n nodes of that order, each prefix scored as a whole (siblings overlap)
            member = torch.zeros(self.master.size, self.master.size)  # [M+1 prefixes, M+1 nodes]
            member[:, 1 + order] = self.prefixes[:, 1:]
            expected = 1.0 + self.expected(rates, member)  # [M+1]
        inv_ms = self.inv_ms
        if ctx.latency is not None:  # a batched step: the whole step's ms at this batch size
            inv_ms = torch.tensor(1.0 / ctx.latency(np.arange(self.master.size)), dtype=torch.float32)
        n = (expected * inv_ms).argmax()
        picked = torch.cat([n.reshape(1), order]).tolist()
        n, ids = picked[0], tuple(sorted(picked[1 : 1 + picked[0]]))
        signals = {"expected_tokens": float(expected[n]), "nodes": float(n), **self._scale()}
        ranked = picked[1:]  # master nodes by path probability: the best k-node subtree is the first k
        menu = Menu(expected.numpy(), lambda k: self._subtree(tuple(sorted(ranked[:k]))))
        return Choice(self._subtree(ids), signals, menu)

    def _subtree(self, ids: tuple[int, ...]) -> Tree:
        tree = self._subtrees.get(ids)
        if tree is None:
            if len(self._subtrees) >= MAX_SUBTREES:  # bounded memory on long runs; hot subtrees come back
                self._subtrees = {(): Tree.root_only()}
            paths = tuple(self.master.paths[i] for i in ids)
            closed = all(len(p) == 1 or p[:-1] in set(paths) for p in paths)
            tree = Tree(f"dyn{len(ids)}", paths) if closed else None
            if tree is None or (self.require_contiguous and not tree.is_rank_contiguous):
                tree = self._fallback(len(ids))
            self._subtrees[ids] = tree
        return tree

    def _fallback(self, n: int) -> Tree:
        """The first n master nodes in canonical order close to the same size (never reached with monotone
        acceptance tables; kept so a malformed table cannot build an invalid tree)."""
        return Tree(f"dyn{n}", self.master.paths[:n]) if n else Tree.root_only()
