"""The drafting heads' matrix products on a CPU, cold (a 64 MB buffer is written between calls, as the base
model's forward does between drafts): dense bf16 (`F.linear`, what llama.cpp-backed heads ran), bf16 prepacked
for oneDNN (packing.py, what transformers-backed heads ran), and int8 weight-only (`_weight_int8pack_mm`,
heads/int8.py). Shapes: the shipped Hydra's 8,192-token draft projection (and 4,096), a level-1 block (1,152 ->
576) and a level-4 block (2,880 -> 576); M rows (1: one branch, 4: a level of 4 nodes).

    PYTHONPATH=src .venv/bin/python docs/results/heads-int8/matvec.py --out docs/results/heads-int8/matvec.json

Quiet machine only: it times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from entmtp.heads.int8 import int8_linear, int8_weight
from entmtp.machine import record
from entmtp.packing import linear, packed_weight

SHAPES = ((8192, 576), (4096, 576), (576, 1152), (576, 2880))  # (out, in)


def median_ms(fn, flush: torch.Tensor, n: int = 100) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        flush.add_(1.0)  # evicts the weights from the caches
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flush = torch.empty(64 * 2**20 // 4)
    rows = []
    print(f"{'out x in':>12} {'M':>2} {'bf16':>7} {'packed':>7} {'int8':>7}  (ms, cold)")
    for out, inp in SHAPES:
        w = torch.randn(out, inp).bfloat16()
        packed, (q, s) = packed_weight(w), int8_weight(w)
        for m in (1, 4):
            x = torch.randn(m, inp).bfloat16()
            row = {
                "out": out,
                "in": inp,
                "rows": m,
                "bf16_ms": median_ms(lambda: F.linear(x, w), flush),
                "packed_bf16_ms": median_ms(lambda: linear(x, w, None, packed), flush)
                if packed is not None
                else None,
                "int8_ms": median_ms(lambda: int8_linear(x, q, s, None), flush),
            }
            rows.append(row)
            p = f"{row['packed_bf16_ms']:7.3f}" if packed is not None else "      -"
            print(f"{out:>5} x {inp:<4} {m:>2} {row['bf16_ms']:7.3f} {p} {row['int8_ms']:7.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": record("cpu"), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
