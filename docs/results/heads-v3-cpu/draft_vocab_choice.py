"""Choose the draft vocabulary by measurement (issue #42): acceptance against cost, without timing anything.

Acceptance: the heads (the shipped ones by default) run teacher-forced over the validation split of a
distillation directory (the stored features: no base-model forward), and for each candidate size N the
draft vocabulary is the N most frequent tokens of its training split plus the special tokens, as
`entmtp train-heads --draft-vocab N` makes it (before any training shard exists: of the first half of the
validation sequences, the other half being measured). Per N: how often the base model's next token (its argmax,
rank 0 of the stored top-k) is in the vocabulary at all, each head's top-1 over the vocabulary against it,
and the chain acceptance (heads 1..k all right), whose sum plus one is the tokens a step of a chain of
top-1 drafts.

Cost: the heads' drafting ms per step at the shipped vocabulary comes from a cost curve record (costs.py:
``draft_ms`` at one drafted node, ``step_ms`` at none, this machine's cached curve for the shipped heads);
how it grows with N comes from the probe ms measured at three draft vocabularies on one machine
(docs/results/hardware-aware/draft-vocab/float32.json: a line fitted per task, then averaged), scaled to the
record. The estimate per N: chain tokens a step / (plain step + drafting ms), against the shipped size.

    PYTHONPATH=src .venv/bin/python docs/results/heads-v3-cpu/draft_vocab_choice.py heads-v3/distill \\
        --sizes 4096,8192,12288,16384,24576,32768 --out docs/results/heads-v3-cpu/draft-vocab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from entmtp.heads import frequent_tokens, load_heads
from entmtp.model import load_model
from entmtp.shipped import heads_path
from entmtp.train.shards import Manifest, SplitData, load_split, token_counts
from entmtp.train.trainer import Windows, make_batch, make_windows

PROBE_RECORD = Path("docs/results/hardware-aware/draft-vocab/float32.json")
SHIPPED = "16387 (shipped)"  # that record's name for its 16,387-token row


@torch.no_grad()
def acceptance(
    heads, data, vocabs: dict[int, torch.Tensor], max_windows: int = 0, window: int = 128, batch: int = 8
) -> dict:
    """Per vocabulary size: coverage of the base argmax, top-1 per head and chain acceptance per depth, over
    the first ``max_windows`` windows of ``window`` anchors (0: all)."""
    K = heads.config.num_heads
    windows = make_windows(data, window, K)
    if max_windows:
        windows = Windows(*(t[:max_windows] for t in dataclasses.astuple(windows)))
    stats = {n: {"cover": [0] * K, "top1": [0] * K, "chain": [0] * K} for n in vocabs}
    counts = [0] * K
    for b in range(0, len(windows), batch):
        bt = make_batch(data, windows, torch.arange(b, min(b + batch, len(windows))))
        feats = heads.features(bt.hidden, bt.tokens)  # K x [B, T, H]
        j = torch.arange(bt.anchor.shape[1])
        first = bt.anchor & (j[None] + 1 < bt.length[:, None])  # [B, T] anchors head 1 has a target for
        truth, logits, valid = [], [], []
        for k in range(1, K + 1):
            v = bt.anchor & (j[None] + k < bt.length[:, None])
            valid.append(v[first])  # [M] within head 1's anchors
            truth.append(data.topk_ids[(bt.index + k).clamp(max=data.tokens.numel() - 1)][first][:, 0])
            logits.append(heads.project(k - 1, feats[k - 1][first]).float())  # [M, V]
            counts[k - 1] += int(v.sum())
        for n, ids in vocabs.items():
            chain = torch.ones_like(valid[0])
            for k in range(K):
                pick = ids[logits[k][:, ids].argmax(-1)]  # [M] the head's top-1 within the vocabulary
                right = (pick == truth[k]) & valid[k]
                chain &= right
                s = stats[n]
                s["cover"][k] += int((torch.isin(truth[k], ids) & valid[k]).sum())
                s["top1"][k] += int(right.sum())
                s["chain"][k] += int(chain.sum())
    out = {}
    for n, s in stats.items():
        rates = {key: [h / max(1, c) for h, c in zip(v, counts, strict=True)] for key, v in s.items()}
        rates["chain_tokens_per_step"] = 1 + sum(rates["chain"])
        out[n] = rates
    return {"positions": counts, "by_size": out}


def probe_line(record: Path) -> tuple[float, float]:
    """(intercept ms, ms per token of vocabulary) of the probe: a line through each task's three sizes, averaged."""
    tasks = json.loads(record.read_text())["tasks"]
    fits = []
    for task in tasks.values():
        pts = [(16387 if name == SHIPPED else int(name), m["probe"]) for name, m in task["methods"].items()]
        x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
        slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        fits.append((float(y.mean() - slope * x.mean()), slope))
    return sum(f[0] for f in fits) / len(fits), sum(f[1] for f in fits) / len(fits)


def curve_costs(curve: Path) -> tuple[float, float]:
    """(plain step ms, drafting ms at one node) of a cost curve record."""
    d = json.loads(curve.read_text())
    i = d["nodes"].index(1)
    return d["step_ms"][0], d["draft_ms"][i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("distill", type=Path)
    p.add_argument("--heads", default="hydra,medusa", help="comma list: hydra | medusa | heads directories")
    p.add_argument("--sizes", default="4096,8192,12288,16384,24576,32768")
    cost = p.add_mutually_exclusive_group(required=True)
    cost.add_argument("--curve", type=Path, help="a cost curve record (~/.cache/entmtp/costs/*.json)")
    cost.add_argument(
        "--costs",
        help="PLAIN_MS,DRAFT_MS: a plain step and the drafting at one node, read off such a record elsewhere "
        "(say where in the notes)",
    )
    p.add_argument(
        "--max-windows", type=int, default=0, help="measure the first N windows of 128 anchors (0: all)"
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    manifest = Manifest.read(args.distill)
    model, tokenizer = load_model(None, dtype="bfloat16")
    data = load_split(args.distill, "val", manifest)
    if manifest.shard_files("train"):
        counts, counted = token_counts(args.distill, "train", manifest), "train split"
    else:  # no training shard yet: count the first half of the val sequences, measure on the second
        half = data.num_sequences // 2
        cut = int(data.offsets[half])
        counts = torch.bincount(data.tokens[:cut], minlength=manifest.vocab_size)
        data = SplitData(
            data.hidden[cut:],
            data.tokens[cut:],
            data.topk_ids[cut:],
            data.topk_logp[cut:],
            data.offsets[half:] - cut,
            data.prompt_lens[half:],
        )
        counted = f"first {half} val sequences (measured on the other {data.num_sequences})"
    sizes = [int(s) for s in args.sizes.split(",")]
    vocabs = {n: frequent_tokens(counts, n, keep=tokenizer.all_special_ids) for n in sizes}
    intercept, slope = probe_line(PROBE_RECORD)
    if args.curve is not None:
        plain_ms, draft_ms = curve_costs(args.curve)
    else:
        try:
            plain_ms, draft_ms = (float(x) for x in args.costs.split(","))
        except ValueError:
            p.error(f"--costs takes PLAIN_MS,DRAFT_MS (two numbers), got {args.costs!r}")
    report = {
        "distill": str(args.distill),
        "counted": counted,
        "tokens_counted": int(counts.sum()),
        "val_sequences": data.num_sequences,
        "curve": str(args.curve) if args.curve is not None else f"given: --costs {args.costs}",
        "plain_ms": plain_ms,
        "draft_ms_at_one_node": draft_ms,
        "probe_line_ms": [intercept, slope],
        "heads": {},
    }
    for spec in args.heads.split(","):
        heads = load_heads(heads_path(spec), dtype=torch.float32)
        shipped_size = (
            int(heads.draft_vocab.numel()) if heads.draft_vocab is not None else manifest.vocab_size
        )
        heads.set_draft_vocab(None)
        heads.bind(model)
        every = {**vocabs, manifest.vocab_size: torch.arange(manifest.vocab_size)}
        acc = acceptance(heads, data, every, args.max_windows)
        scale = draft_ms / (intercept + slope * shipped_size)  # the record's drafting at the shipped size
        rows = {}
        for n, r in acc["by_size"].items():
            ms = plain_ms + scale * (intercept + slope * n)
            rows[n] = {
                **r,
                "draft_ms": scale * (intercept + slope * n),
                "tokens_per_ms": r["chain_tokens_per_step"] / ms,
            }
        report["heads"][spec] = {
            "shipped_draft_vocab": shipped_size,
            "positions": acc["positions"],
            "by_size": rows,
        }
        print(f"{spec} (shipped draft vocabulary {shipped_size}); positions per head {acc['positions']}")
        print("size   cover(h1)  top1 per head              chain tok/step  draft ms  tok/ms")
        for n, r in rows.items():
            top1 = "/".join(f"{x:.3f}" for x in r["top1"])
            print(
                f"{n:>6} {r['cover'][0]:.4f}     {top1}  {r['chain_tokens_per_step']:.3f}"
                f"           {r['draft_ms']:.2f}      {r['tokens_per_ms']:.4f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
