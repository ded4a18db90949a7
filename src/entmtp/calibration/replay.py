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
from ..errors import EntMTPError
from ..heads import Probe
from ..lookup import NgramIndex, draft_lookup, source_depths
from ..records import Step, StepContext
from ..scheduler.hybrid import HEADS_DRAFT_COST
from ..tree import Tree, prune
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
    """Run `policy` (choose/observe, as in the engine) over the traces; `ms_of(tree)`: its step latency;
    `record`, when given, receives every replayed `Step`.

    Trees with prompt-lookup nodes (a hybrid policy's, scheduler/hybrid.py) are replayed too, from the
    traces' tokens: a lookup node copies what the n-gram index of the text so far proposes, exactly as the
    engine drafts it (greedy traces only; a lookup node below a wrong head draft, never accepted, is kept or
    dropped as the index answers for a stand-in branch)."""
    out = Replay()
    lookup = getattr(policy, "lookup", None)
    for tr in traces:
        policy.reset()
        rows, raw = tr.ranks.tolist(), tr.raw.tolist()
        masks = tr.passmask.tolist() if tr.passmask is not None else [None] * len(rows)
        toks = tr.tokens.tolist() if tr.tokens is not None else None
        index = None
        if lookup is not None:
            if toks is None or tr.passmask is not None:
                raise EntMTPError("a replay with prompt-lookup drafts needs greedy traces with their tokens")
            index = NgramIndex(toks[: tr.prompt_len + 1], lookup.max_ngram)
        j, end, step_i = 0, len(rows), 0
        while j < end - 1:
            root = tr.prompt_len + j  # tokens[root] is the step's root
            ctx = StepContext(
                step_i,
                root,
                end - 1 - j,
                None,
                probe=_probe(tr, j, toks),
                raw_signals=raw[j],
                lookup=index,
            )
            tree = policy.choose(ctx)
            if tree.num_lookup:
                step = _lookup_step(tree, rows[j], toks, root, index)
                tree = prune(tree, step.pop("keep"))
            else:
                step = {"accepted": accepted_length(tree.path_set, rows[j], masks[j])}
            n = min(step["accepted"] + 1, end - 1 - j)
            new = toks[root + 1 : root + 1 + n] if toks is not None else []
            record_step = Step(
                tree.name,
                tree.num_nodes,
                step["accepted"],
                n,
                new,
                lookup_nodes=tree.num_lookup,
                sources=step["sources"] if tree.num_lookup else {},  # as the engine: after pruning
            )
            policy.observe(record_step)
            if record is not None:
                record.append(record_step)
            out.tokens, out.steps, out.ms = out.tokens + n, out.steps + 1, out.ms + ms_of(tree)
            out.usage[tree.name] = out.usage.get(tree.name, 0) + 1
            if index is not None:
                index.extend(new)
            j, step_i = j + n, step_i + 1
    return out


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


def _lookup_step(tree: Tree, ranks: list[int], toks: list[int], root: int, index: NgramIndex) -> dict:
    """What the engine's greedy step with hybrid `tree` at `root` does: the lookup nodes that get a proposal
    (`keep`), the drafts accepted, and how far each source was right (lookup.source_depths)."""
    depths = tree.depths.tolist()
    is_lookup, tree_ranks = tree.lookup.tolist(), tree.ranks.tolist()
    truth = toks[root + 1 :]
    tokens: list[int | None] = [toks[root]] + [None] * tree.num_nodes
    for i in range(1, tree.size):  # head drafts: the right token at its rank, else one that is never right
        if not is_lookup[i]:
            d = depths[i]
            tokens[i] = truth[d - 1] if d <= len(truth) and ranks[d - 1] == tree_ranks[i] else -1
    keep = draft_lookup(tree, tokens, index)
    pruned = prune(tree, tuple(keep))
    ptokens = [tokens[0], *(tokens[i] for i in keep)]
    right = [True] + [False] * pruned.num_nodes
    accepted = 0
    for i, (p, d) in enumerate(zip(pruned.parents.tolist(), pruned.depths.tolist(), strict=True)):
        if i and right[p] and d <= len(truth) and ptokens[i] == truth[d - 1]:
            right[i], accepted = True, max(accepted, d)
    new = truth[: accepted + 1]
    return {"keep": tuple(keep), "accepted": accepted, "sources": source_depths(pruned, ptokens, new)}


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
