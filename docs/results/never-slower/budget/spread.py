"""How much a first run's curves move with their measuring budget: the default llama.cpp candidate (the embedded
Q4_1 file with the shipped heads) measured again and again in one process, its heads' curve at `AUTO_BUDGET_S`
and its curve without heads at `HEADS_LESS_BUDGET_S` (what a first run under --dtype auto spends), against the
same at half those budgets, alternating; each pair composed as `entmtp generate` would (its expected tokens/s,
the policy it picks, whether it keeps the heads). Prints a table and writes JSON (issue #62 item 5).

    python docs/results/never-slower/budget/spread.py --rounds 4 --out docs/results/never-slower/budget/amx.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from entmtp.backends.registry import at
from entmtp.build.choose import AUTO_BUDGET_S
from entmtp.build.composed import compose
from entmtp.build.loaded import HEADS_LESS_BUDGET_S, Loader
from entmtp.build.spec import EngineSpec
from entmtp.costs import measure
from entmtp.machine import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--candidate", default="llama-cpp/bfloat16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = EngineSpec(threads=2)
    bare = Loader().load(replace(at(spec, args.candidate), probe=False))
    configs = {
        "full": (AUTO_BUDGET_S, HEADS_LESS_BUDGET_S),
        "half": (AUTO_BUDGET_S / 2, HEADS_LESS_BUDGET_S / 2),
    }
    rows = []
    for r in range(args.rounds):
        for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
            heads_s, less_s = configs[name]
            t0 = time.perf_counter()
            curve = measure(bare.model, bare.heads, budget_s=heads_s, progress=False)
            less = measure(bare.model, None, budget_s=less_s, progress=False)
            seconds = time.perf_counter() - t0
            composed = compose(replace(bare, costs=curve, heads_less=less), spec, log=lambda _: None)
            rows.append(
                dict(round=r, budget=name, seconds=round(seconds, 2), expected=round(composed.expected, 2),
                     policy=composed.name, heads=composed.uses_heads, plain_ms=round(curve.plain_ms, 3),
                     plain_ms_without=round(less.plain_ms, 3), curve=curve.summary(), without=less.summary())
            )  # fmt: skip
            print(f"round {r} {name:4}: {seconds:5.1f} s, expected {composed.expected:6.1f} tokens/s, "
                  f"{composed.name} (heads: {composed.uses_heads}), plain {curve.plain_ms:.2f} / "
                  f"{less.plain_ms:.2f} ms", flush=True)  # fmt: skip
    print("\n| budget | measuring s (mean) | expected tokens/s: mean | stdev | range | keeps the heads |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name in configs:
        got = [x for x in rows if x["budget"] == name]
        e = [x["expected"] for x in got]
        summary[name] = dict(seconds=statistics.mean(x["seconds"] for x in got), mean=statistics.mean(e),
                             stdev=statistics.stdev(e) if len(e) > 1 else 0.0, low=min(e), high=max(e),
                             heads=sum(x["heads"] for x in got), runs=len(got))  # fmt: skip
        s = summary[name]
        print(f"| {name} ({configs[name][0]:.0f} + {configs[name][1]:.0f} s) | {s['seconds']:.1f} | "
              f"{s['mean']:.1f} | {s['stdev']:.1f} | {s['low']:.1f}-{s['high']:.1f} | {s['heads']} of {s['runs']} |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(command="python docs/results/never-slower/budget/spread.py "
                                        f"--rounds {args.rounds} --candidate {args.candidate} --out {args.out}",
                                        machine=record(torch.device("cpu")), rows=rows, summary=summary),
                                   indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
