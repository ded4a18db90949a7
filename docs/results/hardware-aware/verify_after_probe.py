"""Does the heads' probe slow the verify forward that follows it (its weights displacing the model's from the
caches)? The default engine's one-token forward timed right after a Hydra probe and without one, interleaved,
on a translation prompt's prefilled cache; then the probe alone.

    .venv/bin/python docs/results/hardware-aware/verify_after_probe.py [--dtype bfloat16] [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from entmtp import engine as decoding
from entmtp.build import EngineSpec, build_engine
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts
from entmtp.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    engine = build_engine(EngineSpec(lookup=Lookup(), dtype=args.dtype, threads=args.threads))
    if engine.heads is None or engine.policy.master is None:
        raise SystemExit("the default engine here drafts no heads' tree: nothing to probe")
    ids = engine.encode(load_prompts("specbench-translation", "test", 1)[0], 8)
    state = engine.new_state(ids, engine.base.new_cache(len(ids) + 64), max_new_tokens=8)
    decoding.prefill(engine, state)
    root, master = torch.tensor([state.root]), state.policy.master
    ms: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * args.reps):  # the forward's keys go to the scratch slots: nothing is committed
        probed = i % 2 == 0
        if probed:
            state.drafter.probe(master, root)
        t0 = time.perf_counter()
        engine.base.forward(root, Tree.root_only(), state.cache)
        ms[probed].append(1000 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    for _ in range(args.reps):
        state.drafter.probe(master, root)
    probe = 1000 * (time.perf_counter() - t0) / args.reps
    print(f"{describe(hardware(engine.model))}; {args.dtype}, {args.threads} threads")
    print(
        f"one-token forward, median of {args.reps}: {statistics.median(ms[True]):.2f} ms right after a probe, "
        f"{statistics.median(ms[False]):.2f} ms without; the probe alone {probe:.3f} ms (its feature cached)"
    )


if __name__ == "__main__":
    main()
