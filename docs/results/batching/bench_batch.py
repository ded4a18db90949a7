"""Offline continuous batching on this machine: aggregate tokens/s of `batch.stream_batch` at several batch
sizes, for plain batched decoding (every row the root alone), speculation with trees chosen per row on the
single-row cost curve, and speculation with trees chosen on the cost of the whole batched step (the surface,
surface.py). Prints a table and writes JSON; in float32 it also checks every row against plain decoding.

    .venv/bin/python docs/results/batching/bench_batch.py --dtype float32 --batches 1,4,8,16 --prompts 16 --max-new 128 \
        --out docs/results/batching/offline.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

from entmtp.batch import BatchOptions, stream_batch
from entmtp.build import EngineSpec, build
from entmtp.costs import surface_for
from entmtp.lookup import Lookup
from entmtp.machine import hardware
from entmtp.policy import static
from entmtp.prompts import FOUR_TASKS, load_prompts
from entmtp.tree import Tree

METHODS = ("plain", "spec-single-row-costs", "spec-batch-aware")


def run(engine, prompts, batch: int, method: str, surface, max_new: int) -> dict:
    policy = static(Tree.root_only()) if method == "plain" else None
    costs = surface if method == "spec-batch-aware" else None
    t0 = time.perf_counter()
    results = [None] * len(prompts)
    steps = rows = 0
    options = BatchOptions(max_batch=batch, costs=costs)
    for i, event in stream_batch(engine, prompts, options, max_new_tokens=max_new, policy=policy):
        if event.step is not None:
            rows += 1
        if event.result is not None:
            results[i] = event.result
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.num_steps for r in results)
    nodes = [s.tree_nodes for r in results for s in r.steps]
    return {
        "method": method,
        "batch": batch,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "tokens_per_step": tokens / max(1, steps),
        "mean_nodes": sum(nodes) / max(1, len(nodes)),
        "token_ids": [r.token_ids for r in results],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts, mixed over the four tasks")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--lookup", action="store_true", help="add the lookup branch to the speculative policy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    spec = EngineSpec(dtype=args.dtype, graphs=False, lookup=Lookup() if args.lookup else None)
    built = build(spec)
    engine = built.engine
    print(built.plan.describe(), file=sys.stderr)
    per_task = -(-args.prompts // len(FOUR_TASKS))
    prompts = [p for k in range(per_task) for t in FOUR_TASKS for p in load_prompts(t, "test")[k : k + 1]]
    prompts = prompts[: args.prompts]
    surface = surface_for(engine.model, engine.heads, max_batch=max(batches))
    print(surface.summary(), file=sys.stderr)
    rows = []
    for method in args.methods.split(","):
        for b in batches:
            r = run(engine, prompts, b, method, surface, args.max_new)
            rows.append(r)
            print(
                f"{method:24s} batch {b:3d}: {r['tokens_per_second']:7.1f} tokens/s, {r['tokens_per_step']:.2f} "
                f"tokens/step, {r['mean_nodes']:.1f} nodes/row, {r['seconds']:.1f} s",
                flush=True,
            )
    plain = {r["batch"]: r for r in rows if r["method"] == "plain"}
    print(f"\n{'method':24s} " + " ".join(f"{'B=' + str(b):>8s}" for b in batches) + "   (x plain batched)")
    for method in args.methods.split(","):
        mine = {r["batch"]: r for r in rows if r["method"] == method}
        cells = [
            f"{mine[b]['tokens_per_second'] / plain[b]['tokens_per_second']:8.2f}" if b in plain else ""
            for b in batches
        ]
        print(f"{method:24s} " + " ".join(cells))
    exact = None
    if args.dtype == "float32" and plain:
        ref = next(iter(plain.values()))["token_ids"]
        exact = all(r["token_ids"] == ref for r in rows)
        print(f"\nevery row of every run equals plain decoding token for token: {exact}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(
            subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True).stdout
        )
        doc = {
            "command": " ".join(sys.argv),
            "commit": commit + (" (src modified)" if dirty else ""),
            "machine": {
                "hardware": hardware(engine.model),
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            "plan": built.plan.describe(),
            "surface": surface.to_json(),
            "prompts": len(prompts),
            "identical_to_plain": exact,
            "runs": rows,
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
