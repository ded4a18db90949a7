"""How well the machine probe repeats: the step-cost curve measured N times back to back, per size the spread
of its cost in plain steps (what every policy's choice reads), and the plain step's ms.

The shipped Hydra heads on the embedded model (bf16 unless `--dtype float32`), the probe's default plan and
budget (costs.measure), nothing cached or written to the cache. `--disturb S`: a noisy neighbour, a process
spinning on one core for S seconds from 1 s into every probe (a machine whose speed changes while it is
measured: another tenant of the host, a throttled core).

    .venv/bin/python docs/results/probe-sizes/probe_repeat.py [--runs 5] [--disturb 0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from entmtp.build import EngineSpec, build
from entmtp.costs import measure
from entmtp.machine import describe, hardware

SPIN = "import time\nend = time.perf_counter() + {s}\nwhile time.perf_counter() < end: pass\n"


def disturbed(run, seconds: float):
    """run(), with a process spinning on one core from 1 s in, for `seconds` (0: none)."""
    if seconds <= 0:
        return run()
    spin: list[subprocess.Popen] = []
    timer = threading.Timer(
        1.0, lambda: spin.append(subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)]))
    )
    timer.start()
    try:
        return run()
    finally:
        timer.cancel()
        for p in spin:
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--disturb", type=float, default=0.0, help="seconds of one spinning core per probe")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    built = build(EngineSpec(heads="hydra", tree="tree_8", dtype=args.dtype, probe=False), log=lambda m: None)
    model, heads = built.engine.model, built.engine.heads
    machine = describe(hardware(model))
    curves = [
        disturbed(lambda: measure(model, heads, progress=False), args.disturb) for _ in range(args.runs)
    ]
    nodes = curves[0].nodes
    rel = {n: [c.step_ms[i] / c.plain_ms for c in curves] for i, n in enumerate(nodes)}
    disturb = f", a core spun for {args.disturb:g} s of each" if args.disturb else ""
    table = Table(
        title=f"{args.runs} probes back to back{disturb}: {machine}, {args.threads} threads, {args.dtype}"
    )
    for col in ("nodes", "plain steps: median", "min-max", "spread"):
        table.add_column(col, justify="right")
    table.add_row("plain ms", f"{statistics.median(c.plain_ms for c in curves):.2f}",
                  f"{min(c.plain_ms for c in curves):.2f}-{max(c.plain_ms for c in curves):.2f}", "")  # fmt: skip
    for n in nodes[1:]:
        r = rel[n]
        table.add_row(
            str(n), f"{statistics.median(r):.3f}", f"{min(r):.3f}-{max(r):.3f}", f"{max(r) - min(r):.3f}"
        )
    Console(width=120).print(table)
    spread = statistics.mean(max(rel[n]) - min(rel[n]) for n in nodes[1:] if n <= 8)
    print(
        f"mean spread over 1-8 nodes: {spread:.3f} plain steps; probe seconds {[round(c.seconds, 1) for c in curves]}"
    )
    if args.out is not None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {
            "command": f"python docs/results/probe-sizes/probe_repeat.py --runs {args.runs} --dtype {args.dtype} "
            f"--disturb {args.disturb:g} --out {args.out}",
            "machine": machine,
            "threads": args.threads,
            "dtype": args.dtype,
            "commit": commit,
            "mean_spread_1_to_8": spread,
            "curves": [c.to_json() for c in curves],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
