"""Replays the lookup policy (scheduler/hybrid.py, no heads: what the default on llama.cpp runs where no tree
pays) on plain greedy outputs (`outputs.py`), under variants of its rule, priced on the curve measured with
them: tokens per step and modelled speed over plain steps per task, and the chains' yield by length. A greedy
lookup step's outcome is fixed by the text (the chain the index offers against the tokens plain decoding
emits), so the replay takes the engine's own decisions, step for step, at no timing cost.

    python docs/results/never-slower/chains/replay.py [outputs.json] [--variants mean,first-z1]

Variants: `mean` the rule before (every rate as it is), `first-zZ` the library's (the first token's rate less Z
standard errors; Lookup.caution), `every-zZ` every depth's rate bounded so, `carry` the rates carried from one
generation to the next (one policy over every task's prompts in turn, as a server's).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from entmtp.costs.curves import LatencyModel
from entmtp.lookup import Lookup, NgramIndex
from entmtp.policy import StaticPolicy
from entmtp.records import Step, StepContext
from entmtp.scheduler.hybrid import HybridPolicy, _DepthRates, copy_chain
from entmtp.tree import Tree

VARIANTS = {  # name -> (Lookup settings, the policy's class)
    "mean": ({"caution": 0.0}, "plain"),  # the rule before: every rate as it is
    **{f"first-z{z:g}": ({"caution": z}, "plain") for z in (0.5, 1.0, 1.25, 1.5, 2.0)},  # the library's rule
    **{f"every-z{z:g}": ({"caution": z}, "every") for z in (0.5, 1.0, 2.0)},  # every depth's rate bounded
    "carry": ({"caution": 0.0}, "carry"),  # the rates carried across generations
}


class EveryRates(_DepthRates):
    """Copy rates whose caution lowers every depth's rate (the library lowers the first one's only)."""

    def values(self, caution: float = 0.0) -> list[float]:
        n = self.t + self.weight
        rate = (self.s + self.weight * self.prior) / n
        return np.clip(rate - caution * np.sqrt(rate * (1.0 - rate) / n), 0.0, 1.0).tolist()


class Every(HybridPolicy):
    def reset(self) -> None:
        super().reset()
        for m, r in self.copy.items():
            self.copy[m] = EveryRates(len(r.k), r.prior)


class Carried(HybridPolicy):
    """The lookup policy whose copy rates start where the last generation left them (not at the priors)."""

    def reset(self) -> None:
        copy = getattr(self, "copy", None)
        super().reset()
        if copy is not None:
            self.copy = copy


KINDS = {"plain": HybridPolicy, "every": Every, "carry": Carried}


def replay(policy: HybridPolicy, prompt: list[int], output: list[int], cost) -> tuple[int, float, dict]:
    """(tokens after the first, cost in plain steps, {drafted nodes: [steps, tokens]}) of one generation."""
    policy.reset()
    index = NgramIndex(prompt + output[:1], max_ngram=policy.lookup.max_ngram)
    pos, spent, by_len = 1, 0.0, {}
    while pos < len(output):
        choice = policy.choose(StepContext(0, len(index.tokens), 100, None, lookup=index))
        n = choice.tree.num_lookup
        chain = copy_chain(index, n)
        n = len(chain)  # the nodes the index could fill
        right = 0
        while right < n and pos + right < len(output) and chain[right] == output[pos + right]:
            right += 1
        emitted = output[pos : pos + right + 1]
        policy.observe(
            Step(choice.tree.name, n, right, len(emitted), emitted, lookup_nodes=n, lookup_accepted=right,
                 sources={"heads": 0, "lookup": right})
        )  # fmt: skip
        index.extend(emitted)
        pos += len(emitted)
        spent += cost(n)
        b = by_len.setdefault(n, [0, 0])
        b[0] += 1
        b[1] += len(emitted)
    return len(output) - 1, spent, by_len


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outputs", nargs="?", default=str(Path(__file__).parent / "outputs.json"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "replay.json"))
    args = ap.parse_args()
    data = json.loads(Path(args.outputs).read_text())
    lat = LatencyModel(data["curve"]["nodes"], data["curve"]["step_ms"])
    plain = float(lat(0))

    def cost(n):
        return float(lat(n)) / plain

    print("curve:", [round(cost(n), 2) for n in range(11)])
    names = args.variants.split(",")
    table: dict[str, dict[str, float]] = {}
    for name in names:
        settings, kind = VARIANTS[name]
        policy = KINDS[kind](StaticPolicy(Tree.root_only()), Lookup(**settings), lat)
        for task, rows in data["tasks"].items():
            tokens = spent = 0.0
            for prompt, output in rows:
                t, s, _ = replay(policy, prompt, output, cost)
                tokens, spent = tokens + t, spent + s
            table.setdefault(task, {})[name] = tokens / spent if spent else 1.0
    print("| task | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for task, row in table.items():
        print(f"| {task} | " + " | ".join(f"{row[n]:.3f}" for n in names) + " |")
    geo = {n: math.exp(sum(math.log(r[n]) for r in table.values()) / len(table)) for n in names}
    worst = {n: min(r[n] for r in table.values()) for n in names}
    print("| geomean | " + " | ".join(f"{geo[n]:.3f}" for n in names) + " |")
    Path(args.out).write_text(json.dumps({"curve": data["curve"], "speed_over_plain": table}, indent=1))
    print("| worst | " + " | ".join(f"{worst[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
