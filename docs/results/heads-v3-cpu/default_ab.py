"""Issue 42, item 4: does the default get faster with the v3 heads? The default engine as `entmtp generate`
builds it (the shipped Hydra, the mixed profile, lookup drafts, this machine's measured costs), against the
same engine with other heads and their re-derived profile, interleaved per prompt in one process
(`../hardware-aware/interleave.py`: a slow stretch of the machine hits both alike), on the four tasks' test
splits, greedy and at T=0.7 (lossless `sample` acceptance; prompt i seeded with i, both engines alike).

Both engines run on the backend and dtype the default picks here (`--backend`: on that one, with the dtype
it would pick), on one engine each (no routing by prompt length): the comparison is of heads, not backends. Re-derive the profile for the new heads first, without
decoding anything (`calibrate --retrace` teacher-forces the shipped profile's stored generations through them):

    mkdir -p DIR/profiles && cp src/entmtp/assets/profiles/hydra/mixed.{json,traces.safetensors} DIR/profiles/
    PYTHONPATH=src .venv/bin/python -m entmtp.cli calibrate --heads DIR --retrace --profile DIR/profiles/mixed.json
    PYTHONPATH=src .venv/bin/python docs/results/heads-v3-cpu/default_ab.py --heads DIR \\
        --profile DIR/profiles/mixed.json --out docs/results/heads-v3-cpu/default-ab.json

Time it on a quiet machine: nothing else on the cores (pause the data job: kill -STOP).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from entmtp.build import EngineSpec, build
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import FOUR_TASKS

ROOT = Path(__file__).resolve().parents[3]  # the checkout (this file: docs/results/heads-v3-cpu/)
sys.path.insert(0, str(ROOT / "docs" / "results" / "hardware-aware"))
from interleave import finish, per_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True, help="the new heads' directory")
    ap.add_argument(
        "--profile", required=True, help="their profile (calibrate --retrace of the shipped mixed)"
    )
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--backend", default=None, help="run both on this backend (default: the one the default picks here)"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    spec = EngineSpec(lookup=Lookup(), threads=args.threads)
    if args.backend:
        spec = replace(spec, backend=args.backend)
    first = build(spec, log=lambda m: None)  # what `entmtp generate` builds here: its backend and dtype
    pinned = replace(spec, backend=first.plan.backend, dtype=first.plan.dtype)
    shipped = build(pinned, route=False, log=lambda m: None)
    new = build(replace(pinned, heads=args.heads, profile=args.profile), route=False, log=lambda m: None)
    engines = {"shipped heads": shipped.engine, "new heads": new.engine}
    machine = describe(hardware(shipped.engine.model))
    results: dict = {
        "machine": machine,
        "heads": args.heads,
        "profile": args.profile,
        "plans": {"shipped heads": shipped.plan.describe(), "new heads": new.plan.describe()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": {},
    }
    table = Table(
        title=f"{machine}, {first.plan.backend} {first.plan.dtype}, the default's engine, {args.num_prompts} "
        f"prompts x {args.reps}, {args.max_new_tokens} new tokens"
    )
    for col in ("T", "task", "heads", "tokens/s", "vs shipped", "tokens/step", "ms/step"):
        table.add_column(col, justify="left" if col in ("task", "heads") else "right")
    per_task(engines, "shipped heads", table, results, args)
    finish(table, results, args.out)


if __name__ == "__main__":
    main()
