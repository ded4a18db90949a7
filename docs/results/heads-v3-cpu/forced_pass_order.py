"""The teacher-forced pass of the heads v3 data job (issue 42), batched in the shard's order (before) or by length
(`base_targets` since the twelfth session): how much of each pass is padding, and the positions/s of both. Run
it with nothing else running.

    PYTHONPATH=src .venv/bin/python docs/results/heads-v3-cpu/forced_pass_order.py --threads 2 \\
        --shard heads-v3/distill/val-00000.safetensors --out docs/results/heads-v3-cpu/forced-pass-order-avx2.json

The sequences are a shard's own (its stored tokens, prompt and answer), so the lengths are the data job's. The
padding is counted over the whole shard; the timing takes its first --sequences sequences, in batches of 8 as the
job runs them: "shard order" passes each 8 in the order they were generated (what base_targets did before),
"sorted" lets base_targets sort them. Prints a table and writes JSON with the machine's record.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open

from entmtp.machine import auto_dtype
from entmtp.machine import record as machine_record
from entmtp.model import load_model
from entmtp.train.shards import base_targets

BATCH = 8  # the data job's teacher-forced batch (--gen-batch-size 32 // 4)


def shard_sequences(path: Path) -> list[list[int]]:
    with safe_open(str(path), "pt") as f:
        tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
    return [
        tokens[lo:hi].tolist() for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]


def padded_share(lengths: list[int]) -> float:
    """Padded positions over all positions of the passes, batches of BATCH taken in the order given."""
    batches = [lengths[b : b + BATCH] for b in range(0, len(lengths), BATCH)]
    total = sum(max(b) * len(b) for b in batches)
    return 1 - sum(lengths) / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shard", type=Path, required=True, help="a shard of the data job (*.safetensors)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the base model's dtype (auto: as train-heads chooses)")
    ap.add_argument("--sequences", type=int, default=64, help="sequences timed (a multiple of 8)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = auto_dtype("cpu") if args.dtype == "auto" else args.dtype
    seqs = shard_sequences(args.shard)
    lengths = [len(s) for s in seqs]
    timed = seqs[: args.sequences]
    model, _ = load_model(None, dtype=dtype)
    base_targets(model, [s[:64] for s in timed[:BATCH]], top_k=10, batch_size=BATCH)  # warm-up
    arms = {
        "shard order": lambda: [
            base_targets(model, timed[b : b + BATCH], top_k=10, batch_size=BATCH)
            for b in range(0, len(timed), BATCH)
        ],  # fmt: skip
        "sorted": lambda: base_targets(model, timed, top_k=10, batch_size=BATCH),
    }
    positions = sum(len(s) - 1 for s in timed)
    rows = {}
    for name, run in arms.items():
        t = time.perf_counter()
        run()
        seconds = time.perf_counter() - t
        order = [len(s) for s in (timed if name == "shard order" else sorted(timed, key=len))]
        rows[name] = {
            "padded_share_shard": padded_share(lengths if name == "shard order" else sorted(lengths)),
            "padded_share_timed": padded_share(order),
            "seconds": seconds,
            "positions_per_s": positions / seconds,
        }
    print(f"{args.shard.name}: {len(seqs)} sequences, {sum(lengths):,} positions; timed: the first {len(timed)} "
          f"({positions:,} positions), {dtype}, {args.threads} threads")  # fmt: skip
    print("| batches | padding, whole shard | padding, timed | seconds | positions/s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['padded_share_shard']:.0%} | {r['padded_share_timed']:.0%} | {r['seconds']:.1f} |"
            f" {r['positions_per_s']:.0f} |"
        )
    if args.out:
        record = {
            "command": "docs/results/heads-v3-cpu/forced_pass_order.py",
            "settings": vars(args) | {"shard": str(args.shard), "out": str(args.out), "dtype": dtype},
            "machine": machine_record(),
            "sequences": len(seqs),
            "timed_sequences": len(timed),
            "timed_positions": positions,
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
