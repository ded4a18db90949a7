"""The heads on llama.cpp's Q4_1 features (issue #42, item 3): how often each head's top-1 draft is the base
model's next token when the heads read the hidden states of the Q4_1 GGUF on llama.cpp (the llama-cpp
backend), against the same heads on the PyTorch bf16 model's stored features. Nothing is timed.

Each side is scored against its own base model's argmax, as verification would check it: the Q4 side against
llama.cpp's argmax, the bf16 side against the stored top-1. Sequences: the first N of the v3 validation
split (the base model's own answers to held-out training prompts, greedy and sampled). Top-1 is over each heads'
draft vocabulary, as they draft; ``chain`` at depth k: heads 1..k all right (a chain of k drafts accepted).

    PYTHONPATH=src .venv/bin/python docs/results/heads-v3-cpu/q4_features.py heads-v3/distill \\
        --heads hydra,medusa,heads-v3/runs/hydra --sequences 60 --out docs/results/heads-v3-cpu/q4.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from entmtp.backends.llama_cpp import N_BATCH, Runtime
from entmtp.heads import load_heads
from entmtp.machine import record as machine_record
from entmtp.model import embedded_gguf, load_model
from entmtp.shipped import heads_path
from entmtp.train.shards import Manifest, load_split


def q4_states(runtime: Runtime, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's (hidden [L, H], argmax [L]) of one sequence, decoded alone in sequence 0."""
    runtime.seq_rm(0, 0, -1)
    hidden, argmax = [], []
    for a in range(0, len(tokens), N_BATCH):
        chunk = tokens[a : a + N_BATCH]
        logits, states = runtime.decode(
            chunk, list(range(a, a + len(chunk))), [[0]] * len(chunk), [True] * len(chunk)
        )
        hidden.append(torch.from_numpy(np.array(states)))
        argmax.append(torch.from_numpy(np.array(logits)).argmax(-1))
    return torch.cat(hidden), torch.cat(argmax)


@torch.no_grad()
def score(
    heads, hidden: torch.Tensor, tokens: torch.Tensor, truth: torch.Tensor, first: int, acc: dict
) -> None:
    """Add one sequence's hits: head k at anchor t (t >= first) drafts x_{t+k+1}, right if it is ``truth[t+k]``
    (the base argmax after x_{t+k}); Hydra heads read the true tokens before it."""
    K = heads.config.num_heads
    feats = heads.features(hidden[None].to(heads.dtype), tokens[None])  # K x [1, L, H]
    L = tokens.numel()
    right = []
    for k in range(1, K + 1):
        stop = L - k  # anchors t < stop have truth[t+k]
        if stop <= first:
            return
        logits = heads.draft_logits(k - 1, feats[k - 1][0, first:stop])  # [n, Vd]
        drafted = heads._draft_ids(logits.argmax(-1))
        right.append(drafted == truth[first + k : stop + k])
    n = right[-1].numel()
    for k in range(K):
        acc["top1"][k] += int(right[k].sum())
        acc["count"][k] += right[k].numel()
        acc["chain"][k] += int(torch.stack([r[:n] for r in right[: k + 1]]).all(0).sum())
        acc["chain_count"][k] += n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("distill", help="a distillation directory with a val split")
    p.add_argument("--heads", default="hydra,medusa", help="comma list: hydra | medusa | heads directories")
    p.add_argument("--sequences", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = load_split(args.distill, "val", Manifest.read(args.distill))
    model, _ = load_model(None, dtype="bfloat16")
    runtime = Runtime(embedded_gguf(), threads=args.threads, n_ctx=2048)
    seqs = []
    for s in range(min(args.sequences, data.num_sequences)):
        lo, hi = int(data.offsets[s]), int(data.offsets[s + 1])
        tokens = data.tokens[lo:hi]
        q4_hidden, q4_argmax = q4_states(runtime, tokens.tolist())
        bf16 = (data.hidden[lo:hi].float(), data.topk_ids[lo:hi, 0])
        seqs.append((tokens, int(data.prompt_lens[s]) - 1, bf16, (q4_hidden, q4_argmax)))
    agree = sum(int((b[1] == q[1]).sum()) for _, _, b, q in seqs) / sum(t.numel() for t, *_ in seqs)
    report = {"sequences": len(seqs), "argmax_agreement_q4_vs_bf16": agree, "heads": {}}
    print(f"{len(seqs)} val sequences; Q4_1 and bf16 argmax agree at {agree:.3f} of positions")
    for spec in args.heads.split(","):
        heads = load_heads(heads_path(spec), dtype=torch.float32)
        heads.bind(model)
        heads.eval()
        K = heads.config.num_heads
        out = {}
        for side, i in (("bf16", 2), ("q4_1", 3)):
            acc = {"top1": [0] * K, "count": [0] * K, "chain": [0] * K, "chain_count": [0] * K}
            for seq in seqs:
                tokens, first = seq[0], seq[1]
                hidden, truth = seq[i]
                score(heads, hidden, tokens, truth, first, acc)
            out[side] = {
                "top1": [h / max(1, c) for h, c in zip(acc["top1"], acc["count"], strict=True)],
                "chain": [h / max(1, c) for h, c in zip(acc["chain"], acc["chain_count"], strict=True)],
                "positions": acc["count"],
            }
            out[side]["chain_tokens_per_step"] = 1 + sum(out[side]["chain"])
            print(
                f"{spec:>30s} {side:5s} top-1 {'/'.join(f'{x:.3f}' for x in out[side]['top1'])}  chain "
                f"tokens/step {out[side]['chain_tokens_per_step']:.3f}",
                flush=True,
            )
        report["heads"][spec] = out
    if args.out:
        record = {
            "command": "docs/results/heads-v3-cpu/q4_features.py",
            "machine": machine_record(),
            **report,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
