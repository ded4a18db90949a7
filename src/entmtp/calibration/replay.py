"""Replays: decode the calibration traces again, offline, under any policy, with measured step latencies.

Because a trace fixes every tree's accepted length at every position (traces.py), a replay walks the same
steps a real greedy decode would take under the policy, and charges each step its tree's measured latency:
tokens per second without running the model (decode steps only; the prefill is the same for every policy).
A step that verifies no head node is charged without the heads' drafting, and a step whose policy computed
the heads' probe and then drafted nothing from it pays for the probe, both at the measured curve's draft share
(`step_ms`: the constant of another machine only when no measured curve exists, and the replay says so). Every
step of a policy also pays for the policy's choice, as measured on this machine for that policy
(`StepPrices.with_choice`, costs/choice.py); without a measurement it is not charged, and the replay says so.
A replay's JSON records where each charge came from (`charges`: measured / constant / none).
The oracle is the best schedule over the bank in hindsight: a dynamic programme over positions,
time(j) = min over trees of latency(tree) + time(j + accepted + 1), so no policy's replay can beat it.

Batches (`replay_batch`, `oracle_batch`): several traces step together as rows of a continuous batch, each
step charged once by the cost surface (costs/) for its rows and its largest tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from .. import metrics
from ..accept import accept_targets
from ..costs.choice import ChoiceCost
from ..costs.curves import HEADS_DRAFT_COST, CostCurve, LatencyModel
from ..engine import draft_tree, step_record
from ..errors import EntMTPError
from ..heads import Draft, LazyProbe, Probe, taken
from ..lookup import NgramIndex
from ..policy import StaticPolicy, joint_budget
from ..records import Step, StepContext
from ..tree import Tree
from .search import TraceAcceptance
from .traces import MISS, TOPK, Trace


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    ms: float = 0.0
    usage: dict[str, int] = field(default_factory=dict)  # tree name -> steps
    pricing: str | None = None  # what the heads' drafting and probe were charged at (`StepPrices.note`)
    charges: dict | None = None  # where each charge came from (`StepPrices.charges`)

    @property
    def tokens_per_second(self) -> float:
        return metrics.replay_tokens_per_second(self.tokens, self.ms)  # decode steps only

    @property
    def tokens_per_step(self) -> float:
        return metrics.mean_tokens_per_step(self.tokens, self.steps)

    def add(self, step: Step, ms: float) -> None:
        self.tokens, self.steps, self.ms = self.tokens + step.tokens, self.steps + 1, self.ms + ms
        self.usage[step.tree] = self.usage.get(step.tree, 0) + 1

    def to_json(self) -> dict:
        return {
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_step": self.tokens_per_step,
            "steps": self.steps,
            "usage": self.usage,
            **({"pricing": self.pricing} if self.pricing is not None else {}),
            **({"charges": self.charges} if self.charges is not None else {}),
        }


def replay(
    policy, traces: Sequence[Trace], ms_of: Callable[[Tree], float], record: list[Step] | None = None
) -> Replay:
    """Run `policy` (fresh per trace, choose/observe, as in the engine) over the traces; `ms_of(tree)`: its
    step latency (a `StepPrices` also charges the probes computed and not drafted from); `record`, when given,
    receives every replayed `Step`.

    Trees with prompt-lookup nodes (a hybrid policy's, scheduler/hybrid.py) are replayed too, from the
    traces' tokens, by the engine's own drafting, acceptance and step record (`_hybrid_step`): a lookup node
    copies what the n-gram index of the text so far proposes (greedy traces only; a lookup node below a wrong
    head draft, never accepted, is kept or dropped as the index answers for a stand-in branch)."""
    priced = isinstance(ms_of, StepPrices)
    out = Replay(pricing=ms_of.note if priced else None, charges=ms_of.charges if priced else None)
    for tr in traces:
        row = TraceRow(policy, tr)
        while not row.done:
            choice = row.policy.choose(row.context())
            step = row.take(choice.tree, choice.signals)
            if record is not None:
                record.append(step)
            probed = priced and row.probed
            out.add(step, ms_of(row.last_tree, probed) if probed else ms_of(row.last_tree))
    return out


class TraceRow:
    """One trace replayed step by step under its own `policy.fresh()`: `context()` before a step, `take(tree,
    signals)` to verify the chosen tree there (the policy observes the step), `done` at the trace's end."""

    def __init__(self, policy, tr: Trace):
        self.policy, self.trace = policy.fresh(), tr
        self.rows, self.raw = tr.ranks.tolist(), tr.raw.tolist()
        self.acceptance = TraceAcceptance(tr)
        self.toks = tr.tokens.tolist() if tr.tokens is not None else None
        self.index = _index(self.policy.lookup, tr, self.toks)
        self.j = self.steps = 0  # the step's root row; steps taken
        self.last_tree: Tree | None = None
        self.probed = False  # whether the last step's policy computed the heads' probe

    @property
    def done(self) -> bool:
        return self.j >= len(self.rows) - 1

    def context(self, latency=None) -> StepContext:
        """What the policy sees before the step; the heads' probe is offered as the engine offers it: when the
        policy has a master tree, computed when first read (`probed`)."""
        tr, j, toks = self.trace, self.j, self.toks
        self._probe = None
        if self.policy.master is not None:
            self._probe = LazyProbe(lambda: _probe(tr, j, toks))
        root, n_max = tr.prompt_len + j, len(self.rows) - 1 - j  # tokens[root]: the root; tokens left
        return StepContext(
            self.steps,
            root,
            n_max,
            None,
            self._probe,
            raw_signals=self.raw[j],
            lookup=self.index,
            latency=latency,
        )

    def accepted(self, tree: Tree) -> int:
        """Drafts `tree` would have accepted at this step (head trees: from the trace's ranks)."""
        return self.acceptance(self.j, tree.path_set)

    def take(self, tree: Tree, signals: dict[str, float]) -> Step:
        j, root, n_max = self.j, self.trace.prompt_len + self.j, len(self.rows) - 1 - self.j
        probe = taken(self._probe)
        self.probed = probe is not None
        if tree.num_lookup:  # the tree the step verified: lookup nodes without a proposal dropped
            tree, step = _hybrid_step(tree, self.rows[j], self.toks, root, self.index, probe, signals, n_max)
        else:
            accepted = self.accepted(tree)
            n = min(accepted + 1, n_max)
            new = self.toks[root + 1 : root + 1 + n] if self.toks is not None else []
            step = Step(tree.name, tree.num_nodes, accepted, n, new, signals=signals)
        self.policy.observe(step)
        if self.index is not None:
            self.index.extend(step.token_ids)
        self.j, self.steps, self.last_tree = j + step.tokens, self.steps + 1, tree
        return step


def _index(lookup, tr: Trace, toks: list[int] | None) -> NgramIndex | None:
    """The n-gram index of the trace's prompt and root, for a policy with lookup branches."""
    if lookup is None:
        return None
    if toks is None or tr.passes is not None:
        raise EntMTPError(
            "a replay with prompt-lookup drafts needs traces of greedy or lossless sampled generations with "
            "their tokens (typical acceptance's accepted paths leave the recorded trajectory)"
        )
    return NgramIndex(toks[: tr.prompt_len + 1], lookup.max_ngram)


_EMPTY = torch.empty(0, dtype=torch.long)


NO_CHOICE = {"source": "none", "ms": 0.0, "note": "choice not charged: no measurement"}


@dataclass(frozen=True)
class StepPrices:
    """What a replay charges a step (ms): its tree's latency (measured with the heads drafting); less the heads'
    drafting when it drafts no head node (a lookup-only step, as the hybrid policy itself assumes); plus the
    heads' probe when its policy computed one and then drafted no head node from it (the engine pays for a
    probe whatever the policy chose; drafted from, the probe's work is the drafting's). Both at `draft_ms`,
    the heads' drafting; `note` says where that figure comes from. Plus `choose_ms`, the policy's choice, on
    every step (`with_choice`; 0 until a measurement is given). `charges` records each charge's source:
    "step", "drafting" (and probe), "choice", each {"source": measured | constant | none, "ms" (for "step":
    the plain step's), "note"}."""

    latency: LatencyModel
    draft_ms: float
    note: str
    charges: dict = field(default_factory=lambda: {"choice": dict(NO_CHOICE)})
    choose_ms: float = 0.0

    def __call__(self, tree: Tree, probed: bool = False) -> float:
        ms = self.latency.ms_of(tree) + self.choose_ms
        if tree.heads_tree.num_nodes:
            return ms
        saved = self.draft_ms if tree.num_nodes else 0.0  # a plain step's latency drafts nothing
        return ms - saved + (self.draft_ms if probed else 0.0)

    def with_choice(self, choice: ChoiceCost | None) -> StepPrices:
        """These prices with every step also charged `choice`, one policy's measured choice (costs/choice.py);
        None: not charged, and `charges` says so. The oracle chooses in hindsight: its prices have none."""
        said = choice_charge(choice)
        return replace(self, choose_ms=said["ms"], charges={**self.charges, "choice": said})


def choice_charge(choice: ChoiceCost | None) -> dict:
    """What a step of a policy pays for its choice, and where that comes from: `choice` measured on this
    machine (costs/choice.py), or nothing (None: no measurement, which the charge says)."""
    if choice is None:
        return dict(NO_CHOICE)
    note = f"{choice.policy}'s choice, measured on this machine (median of {choice.steps} engine steps)"
    return {"source": "measured", "ms": choice.ms_per_step, "note": note}


def step_ms(costs: CostCurve | LatencyModel) -> StepPrices:
    """A replay's step prices from this machine's measured `CostCurve` (its drafting share measured with it)
    or from a profile's `LatencyModel` (no drafting split: the constant `HEADS_DRAFT_COST`, measured on another
    machine, which `note` says). No choice is charged until `StepPrices.with_choice` gives one."""
    latency = costs.latency() if isinstance(costs, CostCurve) else costs
    share = costs.draft_share if isinstance(costs, CostCurve) else None
    plain = float(latency(0))
    if share is not None:
        source, where = "measured", f"measured ({costs.source} curve)"
    else:
        source, share = "constant", HEADS_DRAFT_COST
        where = "the constant HEADS_DRAFT_COST, another machine's: no measured curve"
    note = f"heads' drafting and probe charged {share * plain:.2f} ms ({share:.3f} plain steps), {where}"
    drafting = {"source": source, "ms": share * plain, "note": note}
    charges = {"step": _step_source(costs, plain), "drafting": drafting, "choice": dict(NO_CHOICE)}
    return StepPrices(latency, share * plain, note, charges)


def _step_source(costs: CostCurve | LatencyModel, plain_ms: float) -> dict:
    """Where a replay's tree latencies come from: this machine's probe (measured, or corrected by its own
    generations), else figures given from elsewhere (a profile's stored latencies, a file: constant)."""
    if isinstance(costs, CostCurve) and costs.source in ("probe", "corrected"):
        return {"source": "measured", "ms": plain_ms, "note": f"this machine's {costs.source} curve"}
    where = f"the {costs.source} curve" if isinstance(costs, CostCurve) else "latencies given (a profile's)"
    return {"source": "constant", "ms": plain_ms, "note": f"{where}, not measured by this run's probe"}


def _probe(tr: Trace, j: int, toks: list[int] | None) -> Probe:
    """The online probe at row j: its recorded log-probabilities and, where the trace has its tokens, each
    depth's right token at its recorded rank (the other candidates' ids were not recorded: -1, never right)."""
    if toks is None:
        return Probe(_EMPTY, tr.probe[j])
    depth = tr.probe.shape[1]
    ids = torch.full((depth, TOPK), -1, dtype=torch.long)  # [Dp, K]
    for d, r in enumerate(tr.ranks[j, :depth].tolist()):
        t = tr.prompt_len + j + d + 1
        if r < MISS and t < len(toks):
            ids[d, r] = toks[t]
    return Probe(ids, tr.probe[j])


class _TraceDrafter:
    """The heads at one replayed step, from the trace: a head node drafts the recorded next token where the
    trace ranks it at the node's rank, else a token that is never right (-1)."""

    def __init__(self, ranks: list[int], truth: list[int]):
        self.ranks, self.truth = ranks, truth

    def draft(self, tree: Tree, root_token: torch.Tensor, probe=None) -> Draft:
        tokens = [
            self.truth[d - 1] if d <= len(self.truth) and self.ranks[d - 1] == r else -1
            for d, r in zip(tree.depths[1:].tolist(), tree.ranks[1:].tolist(), strict=True)
        ]
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.zeros(len(tokens)))


def _hybrid_step(
    tree: Tree, ranks: list[int], toks: list[int], root: int, index: NgramIndex, probe, signals, n_max: int
) -> tuple[Tree, Step]:
    """What the engine's greedy step with hybrid `tree` at `root` verifies and records: its drafting
    (`draft_tree`: head drafts from the trace, lookup drafts from the index, nodes without a proposal pruned),
    greedy acceptance against the recorded continuation, and `step_record` of the emitted tokens."""
    truth = toks[root + 1 : root + 2 + tree.depth]  # the recorded continuation, as far as the tree can reach
    root_t = torch.tensor([toks[root]])
    pruned, tokens, origins = draft_tree(_TraceDrafter(ranks, truth), tree, root_t, probe, index)
    target = torch.tensor([truth[d] if d < len(truth) else -2 for d in pruned.depths.tolist()])  # [N+1]
    acc = accept_targets(pruned, tokens, target)  # target: the token that must follow each node
    emitted = truth[: min(len(acc.path), n_max)]
    return pruned, step_record(pruned, tokens, acc, {}, signals, False, origins, emitted)


def oracle(bank: Sequence[Tree], traces: Sequence[Trace], ms_of: Callable[[Tree], float]) -> Replay:
    """The fastest schedule over `bank` in hindsight (dynamic programme over positions, see above); it chooses
    nothing at run time, so no choice is charged (`ms_of`'s own choice, if any, is left out)."""
    out = Replay()
    if isinstance(ms_of, StepPrices):
        ms_of = ms_of.with_choice(None)
        hindsight = {**NO_CHOICE, "note": "the oracle chooses in hindsight: no choice charged"}
        out.pricing, out.charges = ms_of.note, {**ms_of.charges, "choice": hindsight}
    sets = [t.path_set for t in bank]
    costs = [ms_of(t) for t in bank]
    for tr in traces:
        accepted = TraceAcceptance(tr)
        end = len(tr.ranks)
        time = [0.0] * end  # time[j]: least ms to emit every token after root j
        pick = [0] * end
        for j in range(end - 2, -1, -1):
            best = None
            for b, paths in enumerate(sets):
                n = min(accepted(j, paths) + 1, end - 1 - j)
                t = costs[b] + time[j + n]
                if best is None or t < best:
                    best, pick[j] = t, b
            time[j] = best
        j = 0
        while j < end - 1:
            b = pick[j]
            n = min(accepted(j, sets[b]) + 1, end - 1 - j)
            out.tokens, out.steps, out.ms = out.tokens + n, out.steps + 1, out.ms + costs[b]
            out.usage[bank[b].name] = out.usage.get(bank[b].name, 0) + 1
            j += n
    return out


def replay_batch(
    policy,
    traces: Sequence[Trace],
    surface,
    batch: int,
    *,
    aware: bool = True,
    choice: ChoiceCost | None = None,
) -> Replay:
    """Continuous batching replayed: up to `batch` traces step together (one joins as soon as one ends), each
    under its own `policy.fresh()`, and each step is charged once, the surface's ms (costs/curves.py) for its rows
    and its largest tree, plus `choice` (the policy's measured choice, costs/choice.py) once per row: the rows
    choose one after another (None: not charged, and `charges` says so). `aware`: every row chooses on the
    whole step's latency at this batch size and the rows' trees are set within the joint budget
    (policy.joint_budget), as `Batch.step` does; else each row chooses alone on the policy's own single-row
    costs. Tokens per second of the whole batch; `steps` counts rows' steps."""
    said = choice_charge(choice)
    out = Replay(charges={"choice": said})
    for rows in _continuous(policy, traces, batch):
        latency = surface.latency(len(rows))
        # a row alone chooses on its policy's own costs, as `Batch.step` lets it
        choices = [r.policy.choose(r.context(latency if aware and len(rows) > 1 else None)) for r in rows]
        trees = [c.tree for c in choices]
        budget = (
            joint_budget([c.menu for c in choices], [t.num_nodes for t in trees], latency) if aware else None
        )
        if budget is not None and len(rows) > 1:
            trees = [
                t if c.menu is None else c.menu.tree(min(budget, len(c.menu.expected) - 1))
                for c, t in zip(choices, trees, strict=True)
            ]
        for r, t, c in zip(rows, trees, choices, strict=True):
            out.add(r.take(t, c.signals), said["ms"])
        out.ms += float(latency(max(r.last_tree.num_nodes for r in rows)))
    return out


def _continuous(policy, traces: Sequence[Trace], batch: int) -> Iterator[list[TraceRow]]:
    """The rows of each step of a continuous batch over `traces` (a trace joins as soon as one ends); the
    caller steps every row before asking for the next step's."""
    waiting, rows = list(traces)[::-1], []
    while waiting or rows:
        while waiting and len(rows) < batch:
            rows.append(TraceRow(policy, waiting.pop()))
        yield rows
        rows = [r for r in rows if not r.done]


def oracle_batch(bank: Sequence[Tree], traces: Sequence[Trace], surface, batch: int) -> Replay:
    """Continuous batching with every step chosen in hindsight: the node budget, and each row's bank tree
    within it, of most tokens actually emitted per ms of the whole step. Chosen step by step (what a per-step
    scheduler could do knowing each tree's accepted length), not a schedule over the whole run like `oracle`."""
    sizes = sorted({t.num_nodes for t in bank} | {0})
    bank = [Tree.root_only(), *bank]
    out = Replay()
    for rows in _continuous(StaticPolicy(Tree.root_only()), traces, batch):
        latency = surface.latency(len(rows))
        for r in rows:
            r.context()
        gains = [[min(r.accepted(t) + 1, len(r.rows) - 1 - r.j) for t in bank] for r in rows]  # [rows][bank]
        best = None
        for n in sizes:
            fits = [i for i, t in enumerate(bank) if t.num_nodes <= n]
            picks = [max(fits, key=lambda i, g=g: (g[i], -bank[i].num_nodes)) for g in gains]
            value = sum(g[i] for g, i in zip(gains, picks, strict=True)) / float(latency(n))
            if best is None or value > best[0]:
                best = (value, picks)
        for r, i in zip(rows, best[1], strict=True):
            out.add(r.take(bank[i], {}), 0.0)
        out.ms += float(latency(max(r.last_tree.num_nodes for r in rows)))
    return out
