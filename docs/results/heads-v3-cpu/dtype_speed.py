"""Which dtype the heads v3 data job should run the base model in on this CPU (issue 42): the teacher-forced
pass's speed in float32 and bfloat16, and the one matmul shape behind it. Run it with nothing else running.

    PYTHONPATH=src .venv/bin/python docs/results/heads-v3-cpu/dtype_speed.py --threads 2 \\
        --out docs/results/heads-v3-cpu/dtype-speed-avx2.json

The pass is the embedded SmolLM2's decoder over a batch of random token ids (4 x 256, as the data job's batches
of whole sequences), after a warm-up; the matmul is [512, 576] x [576, 1536], the MLP's up projection over 512
positions. Prints a table and writes JSON with the machine's record.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from entmtp.machine import record as machine_record
from entmtp.model import load_model

DTYPES = ("float32", "bfloat16")


def best_of(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    x, w = torch.randn(512, 576), torch.randn(1536, 576)
    ids = torch.randint(100, 40000, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    for name in DTYPES:
        dtype = getattr(torch, name)
        a, b = x.to(dtype), w.to(dtype)
        linear = best_of(lambda a=a, b=b: F.linear(a, b), args.reps)
        model, _ = load_model(None, dtype=name)
        with torch.no_grad():
            forward = best_of(lambda model=model: model.model(input_ids=ids), args.reps)
        rows[name] = {
            "linear_ms": linear * 1e3,
            "linear_gflops": 2 * 512 * 576 * 1536 / linear / 1e9,
            "teacher_forced_tokens_per_s": ids.numel() / forward,
        }
        del model
    print(f"| dtype | [512, 576] x [576, 1536] | teacher-forced pass, {args.batch} x {args.length} tokens |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['linear_ms']:.1f} ms ({r['linear_gflops']:.1f} GFLOP/s) |"
            f" {r['teacher_forced_tokens_per_s']:.0f} tokens/s |"
        )
    if args.out:
        record = {
            "command": "docs/results/heads-v3-cpu/dtype_speed.py",
            "settings": vars(args) | {"out": str(args.out)},
            "machine": machine_record(),
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
