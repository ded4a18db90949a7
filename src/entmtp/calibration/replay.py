"""Replays: decode the calibration traces again, offline, under any policy, with measured step latencies.

Because a trace fixes every tree's accepted length at every position (traces.py), a replay walks the same
steps a real greedy decode would take under the policy, and charges each step its tree's measured latency:
tokens per second without running the model (decode steps only; the prefill is the same for every policy).
The oracle is the best schedule over the bank in hindsight: a dynamic programme over positions,
time(j) = min over trees of latency(tree) + time(j + accepted + 1), so no policy's replay can beat it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .. import metrics
from ..accept import accept_targets
from ..engine import draft_tree, step_record
from ..errors import EntMTPError
from ..heads import Draft, Probe
from ..lookup import NgramIndex
from ..records import Step, StepContext
from ..scheduler.hybrid import HEADS_DRAFT_COST
from ..tree import Tree
from .search import accepted_length
from .traces import MISS, TOPK, Trace


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    ms: float = 0.0
    usage: dict[str, int] = field(default_factory=dict)  # tree name -> steps

    @property
    def tokens_per_second(self) -> float:
        return metrics.replay_tokens_per_second(self.tokens, self.ms)  # decode steps only

    @property
    def tokens_per_step(self) -> float:
        return metrics.mean_tokens_per_step(self.tokens, self.steps)

    def to_json(self) -> dict:
        return {
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_step": self.tokens_per_step,
            "steps": self.steps,
            "usage": self.usage,
        }


def replay(
    policy, traces: Sequence[Trace], ms_of: Callable[[Tree], float], record: list[Step] | None = None
) -> Replay:
    """Run `policy` (fresh per trace, choose/observe, as in the engine) over the traces; `ms_of(tree)`: its
    step latency; `record`, when given, receives every replayed `Step`.

    Trees with prompt-lookup nodes (a hybrid policy's, scheduler/hybrid.py) are replayed too, from the
    traces' tokens, by the engine's own drafting, acceptance and step record (`_hybrid_step`): a lookup node
    copies what the n-gram index of the text so far proposes (greedy traces only; a lookup node below a wrong
    head draft, never accepted, is kept or dropped as the index answers for a stand-in branch)."""
    out = Replay()
    for tr in traces:
        run = policy.fresh()
        rows, raw = tr.ranks.tolist(), tr.raw.tolist()
        masks = tr.passmask.tolist() if tr.passmask is not None else [None] * len(rows)
        toks = tr.tokens.tolist() if tr.tokens is not None else None
        index = _index(policy.lookup, tr, toks)
        j, end, step_i = 0, len(rows), 0
        while j < end - 1:
            root, n_max = (
                tr.prompt_len + j,
                end - 1 - j,
            )  # tokens[root] is the step's root; n_max: tokens left
            probe = _probe(tr, j, toks)
            ctx = StepContext(step_i, root, n_max, None, probe=probe, raw_signals=raw[j], lookup=index)
            tree, signals = run.choose(ctx)[:2]
            if tree.num_lookup:  # the tree the step verified: lookup nodes without a proposal dropped
                tree, step = _hybrid_step(tree, rows[j], toks, root, index, probe, signals, n_max)
            else:
                accepted = accepted_length(tree.path_set, rows[j], masks[j])
                n = min(accepted + 1, n_max)
                new = toks[root + 1 : root + 1 + n] if toks is not None else []
                step = Step(tree.name, tree.num_nodes, accepted, n, new, signals=signals)
            run.observe(step)
            if record is not None:
                record.append(step)
            out.tokens, out.steps = out.tokens + step.tokens, out.steps + 1
            out.ms += ms_of(tree)
            out.usage[tree.name] = out.usage.get(tree.name, 0) + 1
            if index is not None:
                index.extend(step.token_ids)
            j, step_i = j + step.tokens, step_i + 1
    return out


def _index(lookup, tr: Trace, toks: list[int] | None) -> NgramIndex | None:
    """The n-gram index of the trace's prompt and root, for a policy with lookup branches."""
    if lookup is None:
        return None
    if toks is None or tr.passmask is not None:
        raise EntMTPError("a replay with prompt-lookup drafts needs greedy traces with their tokens")
    return NgramIndex(toks[: tr.prompt_len + 1], lookup.max_ngram)


_EMPTY = torch.empty(0, dtype=torch.long)


def step_ms(latency) -> Callable[[Tree], float]:
    """A replay's step cost from a profile's `LatencyModel` (measured with the heads drafting): a tree without
    head nodes (lookup only) is charged less the heads' drafting, as the hybrid policy itself assumes."""
    draft_ms = HEADS_DRAFT_COST * float(latency(0))

    def ms_of(tree: Tree) -> float:
        ms = latency.ms_of(tree)
        return ms - draft_ms if tree.num_nodes and not tree.heads_tree.num_nodes else ms

    return ms_of


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
    pruned, tokens = draft_tree(_TraceDrafter(ranks, truth), tree, root_t, probe, index)
    target = torch.tensor([truth[d] if d < len(truth) else -2 for d in pruned.depths.tolist()])  # [N+1]
    acc = accept_targets(pruned, tokens, target)  # target: the token that must follow each node
    emitted = truth[: min(len(acc.path), n_max)]
    return pruned, step_record(pruned, tokens, acc, {}, signals, emitted)


def oracle(bank: Sequence[Tree], traces: Sequence[Trace], ms_of: Callable[[Tree], float]) -> Replay:
    """The fastest schedule over `bank` in hindsight (dynamic programme over positions, see above)."""
    out = Replay()
    sets = [t.path_set for t in bank]
    costs = [ms_of(t) for t in bank]
    for tr in traces:
        rows = tr.ranks.tolist()
        masks = tr.passmask.tolist() if tr.passmask is not None else [None] * len(rows)
        end = len(rows)
        time = [0.0] * end  # time[j]: least ms to emit every token after root j
        pick = [0] * end
        for j in range(end - 2, -1, -1):
            best = None
            for b, paths in enumerate(sets):
                n = min(accepted_length(paths, rows[j], masks[j]) + 1, end - 1 - j)
                t = costs[b] + time[j + n]
                if best is None or t < best:
                    best, pick[j] = t, b
            time[j] = best
        j = 0
        while j < end - 1:
            b = pick[j]
            n = min(accepted_length(sets[b], rows[j], masks[j]) + 1, end - 1 - j)
            out.tokens, out.steps, out.ms = out.tokens + n, out.steps + 1, out.ms + costs[b]
            out.usage[bank[b].name] = out.usage.get(bank[b].name, 0) + 1
            j += n
    return out
