"""Build the draft vocabulary of the shipped heads: the most frequent tokens of the training corpus.

The shipped heads were trained on an H200 whose self-distillation data did not come back, so the counts are
taken from the training corpus text (prompts and reference responses of ../shared/data: never the benchmark
sets), tokenized with the embedded model's tokenizer. `entmtp train-heads` instead counts the base model's own
tokens in its distillation data.

    .venv/bin/python scripts/build_draft_vocab.py --size 8192 [--data-dir ../shared/data]   # what ships
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from entmtp.heads import DRAFT_VOCAB_FILE, frequent_tokens
from entmtp.model import load_model
from entmtp.shipped import HEAD_KINDS, shipped_heads_dir
from entmtp.train.prompt_sources import read_records, training_prompt_sources


def corpus_texts(data_dir: Path) -> list[str]:
    keys = ("instruction", "input", "output", "response", "question", "answer")
    return [
        str(r[k])
        for p in training_prompt_sources(data_dir)
        for r in read_records(p)
        for k in keys
        if r.get(k)
    ]


def corpus_counts(tokenizer, texts: list[str]) -> torch.Tensor:
    """[V] how often each token id occurs in `texts`, tokenized without special tokens."""
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for i in range(0, len(texts), 2048):
        for ids in tokenizer(texts[i : i + 2048], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(tokenizer))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = ap.parse_args()
    _, tok = load_model(dtype="float32")
    texts = corpus_texts(Path(args.data_dir))
    counts = corpus_counts(tok, texts)
    ids = frequent_tokens(counts, args.size, keep=tok.all_special_ids)
    covered = counts[ids].sum().item() / counts.sum().item()
    print(f"{len(texts)} texts, {counts.sum().item()} tokens; {ids.numel()} draft tokens cover {covered:.4f}")
    for kind in HEAD_KINDS:
        save_file({"ids": ids}, str(shipped_heads_dir(kind) / DRAFT_VOCAB_FILE))
        print(f"wrote {shipped_heads_dir(kind) / DRAFT_VOCAB_FILE}")


if __name__ == "__main__":
    main()
