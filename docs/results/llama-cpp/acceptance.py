"""The shipped Hydra heads on llama.cpp's Q4_1 features: tokens per step with tree_8 and mc_sim_7b_63 (greedy),
llama.cpp backend against transformers bf16, on test prompts of each task; and how often the Q4_1 backend's
speculative greedy text equals its own plain greedy text, with where the first difference falls (a near-tie:
one-token and many-token decodes round differently). Counts only: nothing is timed.

    python docs/results/llama-cpp/acceptance.py --num-prompts 5 --out docs/results/llama-cpp/acceptance.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from entmtp.backends.llama_cpp import load_gguf
    from entmtp.engine import Engine
    from entmtp.machine import cpu_info
    from entmtp.metrics import mean_tokens_per_step, step_tokens
    from entmtp.model import embedded_gguf, embedded_model_dir, load_model
    from entmtp.policy import static
    from entmtp.prompts import load_prompts
    from entmtp.shipped import resolve_heads
    from entmtp.tree import Tree

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tasks", default="humaneval,sharegpt,gsm8k,writing")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    q4, tok = load_gguf(embedded_gguf(), threads=2, tokenizer_dir=str(embedded_model_dir()))
    bf16, _ = load_model(dtype="bfloat16")
    models = {"llama.cpp Q4_1": q4, "transformers bf16": bf16}
    heads = {name: resolve_heads("hydra", m) for name, m in models.items()}
    trees = ("tree_8", "mc_sim_7b_63")
    result: dict = {"machine": cpu_info(), "tasks": {}}
    table = Table(title="Hydra tokens/step (greedy), and Q4_1 speculative == Q4_1 plain")
    for col in (
        "task",
        *(f"{t} {m}" for t in trees for m in models),
        "Q4_1 same text",
        "first difference at",
    ):
        table.add_column(col)
    n = args.max_new_tokens
    for task in args.tasks.split(","):
        prompts = load_prompts(task, "test", args.num_prompts)
        row: dict = {}
        for tree in trees:
            for name, model in models.items():
                engine = Engine(model, tok, heads=heads[name], policy=static(tree))
                runs = [engine.generate(p, max_new_tokens=n) for p in prompts]
                tokens = step_tokens(sum(len(r.token_ids) for r in runs), len(runs))
                row[f"{tree} {name}"] = mean_tokens_per_step(tokens, sum(len(r.steps) for r in runs))
                if name == "llama.cpp Q4_1" and tree == "tree_8":
                    spec = [r.token_ids for r in runs]
        plain = Engine(q4, tok, heads=None, policy=static(Tree.root_only()))
        diffs = [
            first_difference(s, plain.generate(p, max_new_tokens=n).token_ids)
            for s, p in zip(spec, prompts, strict=True)
        ]
        row["same"] = sum(d is None for d in diffs)
        row["first_difference"] = [d for d in diffs if d is not None]
        result["tasks"][task] = row
        table.add_row(
            task, *(f"{row[f'{t} {m}']:.2f}" for t in trees for m in models),
            f"{row['same']}/{len(prompts)}", ", ".join(map(str, row["first_difference"])) or "-",
        )  # fmt: skip
    Console().print(table)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
