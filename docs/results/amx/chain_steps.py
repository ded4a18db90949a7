"""Median phases (ms) of the default engine's steps on llama.cpp by drafted nodes, over 5 GSM8K test prompts
(96 new tokens, greedy, 2 threads), and the wall time between two of its events. Run it alone on the machine.

    PYTHONPATH=src python docs/results/amx/chain_steps.py
"""

from __future__ import annotations

import collections
import statistics
import time

import torch

from entmtp.build import EngineSpec, build_engine
from entmtp.lookup import Lookup
from entmtp.prompts import load_prompts

PHASES = ("choose", "draft", "verify", "accept", "commit", "total")


def main() -> None:
    torch.set_num_threads(2)
    engine = build_engine(EngineSpec(backend="llama-cpp", lookup=Lookup(), threads=2))
    prompts = load_prompts("gsm8k", "test", 5)
    engine.generate(prompts[0], max_new_tokens=96)  # warm
    phases, walls = collections.defaultdict(list), collections.defaultdict(list)
    for p in prompts:
        t0 = time.perf_counter()
        for event in engine.stream(p, max_new_tokens=96, incremental_text=False):
            now = time.perf_counter()
            if event.step is not None:
                phases[event.step.tree_nodes].append(event.step.seconds)
                walls[event.step.tree_nodes].append(now - t0)
            t0 = now
    for n in sorted(phases):
        row = {k: round(1000 * statistics.median(s.get(k, 0.0) for s in phases[n]), 3) for k in PHASES}
        print(
            f"{n} drafted: {len(phases[n])} steps, {row}, {1000 * statistics.median(walls[n]):.2f} ms between events"
        )


if __name__ == "__main__":
    main()
