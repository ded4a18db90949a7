"""Which tree sizes the machine probe must measure: a dense cost curve against the sparse one, by replay.

Measures this machine's step costs (the shipped Hydra heads on the embedded model, bf16 unless `--dtype float32`)
at every size up to 8 and sparser above (costs.SIZES), prints the curve, and takes the old sparse plan
(0, 1, 2, 4, 8, 16, 32, 64) out of the same measurement. Then it replays `dynamic` and EntMTP* of each shipped
task profile's traces (greedy, lossless sampling and typical acceptance: each section's own calibration
traces), each policy built once on the sparse curve and once on the dense one, and charges every replayed step
the dense curve's cost (the measured truth at every size). So the table says what interpolating between sparse
sizes costs a policy on this machine, without timing noise.

    .venv/bin/python docs/results/probe-sizes/probe_sizes.py [--dtype bfloat16] [--out docs/results/probe-sizes]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from entmtp.build import EngineSpec, build
from entmtp.calibration.replay import replay, step_ms
from entmtp.calibration.traces import load_traces
from entmtp.costs import SIZES, CostCurve, measure
from entmtp.machine import describe, hardware
from entmtp.policy import StaticPolicy
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.profiles import resolve_profile

SPARSE = (0, 1, 2, 4, 8, 16, 32, 64)  # the probe's plan before 2026-12-02
TASKS = ("humaneval", "sharegpt", "gsm8k", "writing")
RULES = ("greedy", "sample", "typical")


def sparse_of(dense: CostCurve) -> CostCurve:
    idx = [dense.nodes.index(n) for n in SPARSE]
    return CostCurve(SPARSE, tuple(dense.step_ms[i] for i in idx), tuple(dense.draft_ms[i] for i in idx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--budget", type=float, default=60.0, help="seconds for the measurement")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=150)
    built = build(EngineSpec(heads="hydra", tree="tree_8", dtype=args.dtype, probe=False), log=lambda m: None)
    model, heads = built.engine.model, built.engine.heads
    machine = describe(hardware(model))
    dense = measure(model, heads, sizes=SIZES, budget_s=args.budget, progress=False)
    console.print(f"{machine}, {args.threads} threads, {model.dtype}: {dense.summary()}")
    sparse = sparse_of(dense)
    truth = step_ms(dense.latency())
    rows = {}
    for rule in RULES:
        for task in TASKS:
            profile = resolve_profile(task, "hydra")
            mode = profile.mode_for_rule(rule)
            traces = load_traces(profile, mode)
            speeds = {}
            for name, curve in (("sparse", sparse), ("dense", dense)):
                latency = curve.latency()
                dynamic = profile_policy(profile, "dynamic", mode, latency=latency)
                static = StaticPolicy(profile.best_tree(mode, latency))
                speeds[f"dynamic/{name}"] = replay(dynamic, traces, truth).tokens_per_second
                speeds[f"EntMTP*/{name}"] = replay(static, traces, truth).tokens_per_second
                speeds[f"EntMTP* tree/{name}"] = static.trees[0].name
            rows[f"{rule}/{task}"] = speeds
    table = Table(
        title="replayed tokens/s over EntMTP* built on the sparse curve (steps charged the dense one)"
    )
    for col in ("rule/task", "EntMTP* sparse", "EntMTP* dense", "dynamic sparse", "dynamic dense"):
        table.add_column(col, justify="left" if col == "rule/task" else "right")
    for key, s in rows.items():
        base = s["EntMTP*/sparse"]
        table.add_row(
            key,
            f"1.000 ({s['EntMTP* tree/sparse']})",
            f"{s['EntMTP*/dense'] / base:.3f} ({s['EntMTP* tree/dense']})",
            f"{s['dynamic/sparse'] / base:.3f}",
            f"{s['dynamic/dense'] / base:.3f}",
        )
    console.print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {
            "command": f"python docs/results/probe-sizes/probe_sizes.py --dtype {args.dtype} --out {args.out}",
            "machine": machine,
            "threads": args.threads,
            "dtype": str(model.dtype),
            "commit": commit,
            "curve": dense.to_json(),
            "rows": rows,
        }
        (args.out / "probe-sizes.json").write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"wrote {args.out / 'probe-sizes.json'}")


if __name__ == "__main__":
    main()
