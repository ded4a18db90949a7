"""How much a smaller draft vocabulary would buy the default (#21: the Hydra probe is memory-bound on its
[16387, 576] draft projection): the default engine's policy with the shipped heads' draft vocabulary and with
the N most frequent tokens only (counted as scripts/build_draft_vocab.py counts them: the training corpus,
never the benchmark sets), interleaved per prompt in one process.

No retraining is involved: the heads project through the base model's lm_head rows of the draft vocabulary, so
a smaller one only drops rare tokens from the drafts (a right token outside it is a missed draft). The policy
and its cost curve are the default's as built (measured with the shipped vocabulary), so this measures the
per-step saving and the acceptance lost, not a recalibrated schedule. In float32 every variant writes plain
greedy decoding's text.

    .venv/bin/python scripts/draft_vocab_ab.py --sizes 8192,4096 --tasks specbench-translation,humaneval \
        --out docs/results/hardware-aware/draft-vocab.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from build_draft_vocab import corpus_texts
from interleave import finish, interleaved
from rich.table import Table

from entmtp.build import EngineSpec, build_engine
from entmtp.engine import Engine
from entmtp.heads import frequent_tokens
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts
from entmtp.shipped import resolve_heads

ROOT = Path(__file__).resolve().parents[1]


def corpus_counts(tokenizer, data_dir: Path) -> torch.Tensor:
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    texts = corpus_texts(data_dir)
    for i in range(0, len(texts), 2048):
        for ids in tokenizer(texts[i : i + 2048], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(tokenizer))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8192,4096")
    ap.add_argument("--tasks", default="specbench-translation,humaneval")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    default = build_engine(EngineSpec(lookup=Lookup(), dtype=args.dtype, threads=args.threads))
    counts = corpus_counts(default.tokenizer, args.data_dir)
    shipped = default.heads.draft_vocab.numel()
    engines = {f"{shipped} (shipped)": default}
    for size in (int(s) for s in args.sizes.split(",")):
        heads = resolve_heads("hydra", default.model)
        heads.set_draft_vocab(frequent_tokens(counts, size, keep=default.tokenizer.all_special_ids))
        engines[str(size)] = Engine(  # the same policy: each generation runs its own policy.fresh()
            default.model, default.tokenizer, heads=heads, tree=default.policy, costs=default.costs
        )
    machine = describe(hardware(default.model))
    results: dict = {"machine": machine, "dtype": args.dtype, "tasks": {}}
    table = Table(
        title=f"{machine}, {args.dtype}, {args.num_prompts} prompts x 2, {args.max_new_tokens} new tokens"
    )
    for col in ("task", "draft vocabulary", "tokens/s", "vs shipped", "tokens/step", "ms/step", "probe ms"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for task in args.tasks.split(","):
        prompts = load_prompts(task, "test", args.num_prompts)
        tally, same = interleaved(engines, prompts, args.max_new_tokens)
        base = tally[f"{shipped} (shipped)"]
        for name, t in tally.items():
            t["tokens_per_second"] = t["tokens"] / t["seconds"]
            t["vs_shipped"] = t["tokens_per_second"] / (base["tokens"] / base["seconds"])
            table.add_row(
                task,
                name,
                f"{t['tokens_per_second']:.1f}",
                f"{t['vs_shipped']:.3f}x",
                f"{t['tokens'] / t['steps']:.2f}",
                f"{1000 * t['seconds'] / t['steps']:.1f}",
                f"{1000 * t['probe'] / t['steps']:.2f}",
            )
        table.add_row(task, "identical outputs" if same else "OUTPUTS DIFFER", end_section=True)
        results["tasks"][task] = {"identical_outputs": same, "methods": tally}
        print(f"{task}: done", flush=True)
    finish(table, results, args.out)


if __name__ == "__main__":
    main()
