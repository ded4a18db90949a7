"""Training speed of the heads on this CPU: trained positions per second of whole optimiser steps (the heads'
forward and backward, the loss, AdamW), on real distillation data (the val split of DISTILL), for each
kind of heads, the loss's vocabulary (full 49,152 tokens, or the shipped heads' ~8k draft vocabulary) and
precision. No base-model forward: the features are the stored ones. Time it on a quiet machine.

    PYTHONPATH=src python docs/results/heads-v3-cpu/train_speed.py heads-v3/distill --threads 2 \
        --out docs/results/heads-v3-cpu/train_speed.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from entmtp.machine import record as machine_record
from entmtp.model import load_model
from entmtp.train.pipeline import HeadsSettings, _init_heads
from entmtp.train.shards import Manifest, load_split
from entmtp.train.trainer import TrainSettings, batch_windows, make_batch, make_windows, train_step

# (label, kind, head_arch, init): the shipped heads, and Hydra++ grown from the shipped Hydra
KINDS = [
    ("hydra", "hydra", "mlp", "hydra"),
    ("hydra++", "hydra", "prefix-mlp", "hydra"),
    ("medusa", "medusa", "mlp", "medusa"),
]


def time_steps(heads, data, windows, settings: TrainSettings, steps: int) -> dict:
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    seconds, positions = [], 0
    for step in range(steps + 1):  # step 0 warms up (allocations, weight casts, the draft slice)
        batch = make_batch(data, windows, batch_windows(len(windows), 0, step, settings.batch_size))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, _, counts = train_step(heads, data, batch, settings, "cpu")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step:
            seconds.append(time.perf_counter() - t0)
            positions += counts[0]
    total = sum(seconds)
    return {
        "steps": steps,
        "positions": positions,
        "seconds": round(total, 3),
        "per_second": positions / total,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("distill", help="a distillation directory with a val split")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration (after one warm-up)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON file for the table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(None, dtype="bfloat16")
    data = load_split(args.distill, "val", Manifest.read(args.distill))
    rows = []
    for label, kind, arch, init in KINDS:
        config = HeadsSettings(num_heads=4, head_arch=arch).config(model, kind, "smollm2-135m-instruct")
        heads = _init_heads(init, config, Path(args.distill))
        heads.bind(model)
        heads.train()
        shipped_vocab = heads.draft_vocab
        windows = make_windows(data, args.window, 4, whole_sequences=arch == "prefix-mlp")
        for vocab in ("full", "draft"):
            for precision in ("float32", "bfloat16"):
                if precision == "float32" and label != "hydra":
                    continue  # fp32 once, for the ratio
                heads.set_draft_vocab(shipped_vocab if vocab == "draft" else None)
                s = TrainSettings(batch_size=args.batch_size, window=args.window, vocab=vocab)
                s = replace(s, precision=precision)
                r = time_steps(heads, data, windows, s, args.steps)
                cols = shipped_vocab.numel() if vocab == "draft" else config.vocab_size
                rows.append({"heads": label, "vocab": vocab, "columns": cols, "precision": precision, **r})
                print(
                    f"{label:8s} {vocab:5s} ({cols:5d} columns) {precision:8s} "
                    f"{r['per_second']:7.0f} positions/s  ({r['positions']} positions in {r['seconds']:.1f} s)",
                    flush=True,
                )
    if args.out:
        record = {
            "command": "docs/results/heads-v3-cpu/train_speed.py",
            "machine": machine_record(),
            "threads": args.threads,
            "batch_size": args.batch_size,
            "window": args.window,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
