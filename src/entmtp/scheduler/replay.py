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

from ..heads import Probe
from ..records import Step, StepContext
from ..tree import Tree
from .search import accepted_length
from .traces import Trace


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    ms: float = 0.0
    usage: dict[str, int] = field(default_factory=dict)  # tree name -> steps

    @property
    def tokens_per_second(self) -> float:
        return 1000.0 * self.tokens / self.ms if self.ms else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.steps)

    def to_json(self) -> dict:
        return {
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_step": self.tokens_per_step,
            "steps": self.steps,
            "usage": self.usage,
        }


_EMPTY = torch.empty(0, dtype=torch.long)


def replay(policy, traces: Sequence[Trace], ms_of: Callable[[Tree], float]) -> Replay:
    """Run `policy` (choose/observe, as in the engine) over the traces; `ms_of(tree)`: its step latency."""
    out = Replay()
    paths_of: dict[int, frozenset] = {}
    for tr in traces:
        policy.reset()
        rows, raw = tr.ranks.tolist(), tr.raw.tolist()
        masks = tr.passmask.tolist() if tr.passmask is not None else [None] * len(rows)
        j, end, index = 0, len(rows), 0
        while j < end - 1:
            ctx = StepContext(
                index,
                tr.prompt_len + j,
                end - 1 - j,
                None,
                probe=Probe(_EMPTY, tr.probe[j]),
                raw_signals=raw[j],
            )
            tree = policy.choose(ctx)
            paths = paths_of.get(id(tree))
            if paths is None:
                paths = paths_of[id(tree)] = frozenset(tree.paths)
            a = accepted_length(paths, rows[j], masks[j])
            n = min(a + 1, end - 1 - j)
            policy.observe(Step(tree.name, tree.num_nodes, a, n, []))
            out.tokens, out.steps, out.ms = out.tokens + n, out.steps + 1, out.ms + ms_of(tree)
            out.usage[tree.name] = out.usage.get(tree.name, 0) + 1
            j, index = j + n, index + 1
    return out


def oracle(bank: Sequence[Tree], traces: Sequence[Trace], ms_of: Callable[[Tree], float]) -> Replay:
    """The fastest schedule over `bank` in hindsight (dynamic programme over positions, see above)."""
    out = Replay()
    sets = [frozenset(t.paths) for t in bank]
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
