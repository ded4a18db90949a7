"""A one-off record: greedy tokens of entmtp's plain decoding now, with the prefill as it was before this
change (ab.py's head_forward), with the one-token step without an attention mask (the variant not adopted),
and transformers' generate (as the benchmark's peer runs it), on 18 test prompts of 7 tasks.

    python docs/results/plain-step/identity.py --dtype bfloat16 [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

import entmtp.cache as C
from entmtp.bench.peers import HFGenerate
from entmtp.engine import Engine
from entmtp.model import encode_prompt, load_model
from entmtp.prompts import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import NEW_FORWARD, head_forward, run_hf, step_without_mask  # noqa: E402

TASKS = {"mt_bench": 4, "gsm8k": 3, "humaneval": 3, "sharegpt": 3, "specbench-summarization": 2,
         "specbench-rag": 1, "writing": 2}  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    model, tok = load_model(dtype=args.dtype)
    engine, peer = Engine(model, tok), HFGenerate(model, tok)
    pairs = [
        ("now", "head prefill"),
        ("now", "hf"),
        ("step without mask", "hf"),
        ("step without mask", "now"),
    ]
    counts = dict.fromkeys(pairs, 0)
    n = 0
    for task, k in TASKS.items():
        for i, prompt in enumerate(load_prompts(task, "test")[:k]):
            ids = encode_prompt(tok, prompt)
            out = {}
            for name, forward in (
                ("now", NEW_FORWARD),
                ("head prefill", head_forward),
                ("step without mask", step_without_mask),
            ):
                C.BaseModel.forward = forward
                out[name] = engine.generate(ids, max_new_tokens=args.tokens).token_ids
            C.BaseModel.forward = NEW_FORWARD
            out["hf"] = run_hf(peer, ids, args.tokens)["tokens"]
            n += 1
            cells = []
            for a, b in pairs:
                d = first_difference(out[a], out[b])
                counts[(a, b)] += d is None
                cells.append(f"{a} vs {b}: {'same' if d is None else f'differ from token {d}'}")
            print(f"{args.dtype} {task} #{i} (P={len(ids)}): " + "; ".join(cells), flush=True)
    print(
        f"{args.dtype}, {n} prompts x {args.tokens} tokens, identical: "
        + ", ".join(f"{a} vs {b} {c}/{n}" for (a, b), c in counts.items())
    )


if __name__ == "__main__":
    main()
