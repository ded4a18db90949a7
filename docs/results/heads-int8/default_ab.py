"""Int8 drafting weights in the default engine: `entmtp generate`'s engine (shipped heads, profile, lookup, this
machine's measured costs) with the heads drafting from int8 copies of their weights (the default) against their
own bf16 weights (`--no-draft-int8`), interleaved per prompt in one process (`../hardware-aware/interleave.py`:
a slow stretch of the machine hits both alike), on the four tasks' test splits, greedy and at T=0.7 (lossless
`sample` acceptance, prompt i seeded with i for both). Each engine's cost curve is measured for its own heads,
so its policy is sized on its own drafting cost.

    PYTHONPATH=src .venv/bin/python docs/results/heads-int8/default_ab.py --backend transformers \\
        --out docs/results/heads-int8/default-ab-transformers.json

Quiet machine only: it times.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardware-aware"))
from interleave import finish, per_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--backend", default=None, help="both on this backend (default: the one the default picks)"
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = EngineSpec(lookup=Lookup(), threads=args.threads, model=args.model)
    if args.backend:
        spec = replace(spec, backend=args.backend)
    first = build(spec, route=False, log=lambda m: None)
    pinned = replace(spec, backend=first.plan.backend, dtype=first.plan.dtype)
    built = {
        "bf16 drafting": build(replace(pinned, draft_int8=False), route=False, log=lambda m: None),
        "int8 drafting": build(pinned, route=False, log=lambda m: None),
    }
    engines = {name: b.engine for name, b in built.items()}
    machine = describe(hardware(first.engine.model))
    results: dict = {
        "machine": machine,
        "plans": {name: b.plan.describe() for name, b in built.items()},
        "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "runs": {},
    }
    for name, b in built.items():
        print(f"{name}: {b.plan.describe()}\n", flush=True)
    table = Table(
        title=f"{machine}, {first.plan.backend} {first.plan.dtype}, the default's engine, {args.num_prompts} "
        f"prompts x {args.reps}, {args.max_new_tokens} new tokens (decode steps' time, prefill left out)"
    )
    for col in ("T", "task", "drafting", "tokens/s", "int8 / bf16", "tokens/step", "ms/step"):
        table.add_column(col, justify="left" if col in ("task", "drafting") else "right")
    per_task(engines, "bf16 drafting", table, results, args)
    finish(table, results, args.out)


if __name__ == "__main__":
    main()
