"""Replay continuous batching on the shipped profiles' calibration traces, charged by a measured cost surface
(calibration/replay.py: replay_batch, oracle_batch): tokens per second of the whole batch without timing
noise, for plain batched decoding, EntMTP* (the profile's static tree), `dynamic` choosing alone on the
single-row costs, `dynamic` choosing batch-aware (the whole step's latency and the joint budget), and the
per-step hindsight oracle over the bank.

    .venv/bin/python docs/results/batching/replay_batch.py --surface docs/results/batching/offline-float32.json \
        --batches 1,4,8,16 --out docs/results/batching/replay-float32.json

`--surface`: a JSON with a "surface" entry (what docs/results/batching/bench_batch.py writes) or a surface file itself.
"""

from __future__ import annotations

import argparse
import json
import sys

from entmtp.calibration.replay import oracle_batch, replay_batch
from entmtp.calibration.traces import load_traces
from entmtp.costs import CostSurface
from entmtp.policy import StaticPolicy
from entmtp.prompts import FOUR_TASKS
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.profiles import resolve_profile
from entmtp.tree import Tree

METHODS = ("plain", "EntMTP*", "dynamic-alone", "dynamic-batch-aware", "oracle-per-step")


def methods(profile, surface):
    """name -> (policy or bank, aware)."""
    dynamic = profile_policy(profile, "dynamic", latency=surface.latency(1))
    return {
        "plain": (StaticPolicy(Tree.root_only()), False),
        "EntMTP*": (profile_policy(profile, "static", latency=surface.latency(1)), False),
        "dynamic-alone": (dynamic, False),
        "dynamic-batch-aware": (dynamic, True),
        "oracle-per-step": (profile.bank(), None),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--surface", required=True)
    ap.add_argument("--heads", default="hydra")
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    doc = json.loads(open(args.surface, encoding="utf-8").read())
    surface = CostSurface.from_json(doc.get("surface", doc))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for task in args.tasks.split(","):
        profile = resolve_profile(task, args.heads)
        traces = load_traces(profile)
        for name, (what, aware) in methods(profile, surface).items():
            for b in batches:
                if aware is None:
                    r = oracle_batch(what, traces, surface, b)
                else:
                    r = replay_batch(what, traces, surface, b, aware=aware)
                rows.append({"task": task, "method": name, "batch": b, **r.to_json()})
    print(f"replayed tokens/s of the whole batch over plain batched decoding ({args.heads} heads)")
    print(f"{'task':10s} {'method':22s} " + " ".join(f"{'B=' + str(b):>7s}" for b in batches))
    for task in args.tasks.split(","):
        plain = {
            r["batch"]: r["tokens_per_second"] for r in rows if r["task"] == task and r["method"] == "plain"
        }
        for name in METHODS:
            mine = {
                r["batch"]: r["tokens_per_second"] for r in rows if r["task"] == task and r["method"] == name
            }
            print(f"{task:10s} {name:22s} " + " ".join(f"{mine[b] / plain[b]:7.2f}" for b in batches))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {"command": " ".join(sys.argv), "surface": surface.to_json(), "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
