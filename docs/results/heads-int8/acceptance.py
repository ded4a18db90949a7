"""Int8 drafting weights (heads/int8.py) against the heads' own bf16 weights: tokens per step of static trees,
greedy, on the four tasks' test prompts and the copy-heavy dev categories. Nothing is timed (tokens per step do
not depend on the machine's load); outputs are the base model's either way, and the script checks that the two
heads' texts are identical.

    PYTHONPATH=src .venv/bin/python docs/results/heads-int8/acceptance.py --out docs/results/heads-int8/acceptance.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from entmtp.build import EngineSpec, load
from entmtp.engine import Engine
from entmtp.files import write_text_atomic
from entmtp.machine import describe, hardware
from entmtp.policy import static
from entmtp.prompts import FOUR_TASKS, load_prompts
from entmtp.shipped import resolve_heads
from entmtp.tree import load_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="hydra")
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--trees", default="tree_8,mc_sim_7b_63")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = EngineSpec(model=args.model, backend=args.backend, dtype="bfloat16", heads="none", probe=False)
    loaded = load(spec)
    model, tok = loaded.model, loaded.tokenizer
    heads = {"bf16": resolve_heads(args.heads, model), "int8": resolve_heads(args.heads, model)}
    quantized = heads["int8"].quantize_int8()
    if not quantized:
        raise SystemExit("nothing was quantized: int8 drafting needs bf16 heads on a CPU and torch's kernel")
    machine = describe(hardware(model))
    table = Table(title=f"tokens/step, greedy, {args.heads} heads, bf16 vs int8 drafting weights; {machine}, "
                        f"{args.backend}, {args.num_prompts} test prompts x {args.max_new_tokens} tokens")  # fmt: skip
    for col in ("task", "tree", "bf16", "int8", "int8 / bf16", "same texts"):
        table.add_column(col, justify="left" if col in ("task", "tree") else "right")
    results = {"machine": machine, "settings": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    for task in args.tasks.split(","):
        prompts = load_prompts(task, "test", args.num_prompts)
        for tree in args.trees.split(","):
            per, texts = {}, {}
            for name, h in heads.items():
                engine = Engine(model, tok, heads=h, policy=static(load_tree(tree)))
                outs = [engine.generate(p, max_new_tokens=args.max_new_tokens) for p in prompts]
                per[name] = sum(len(r.token_ids) for r in outs) / sum(r.num_steps for r in outs)
                texts[name] = [r.token_ids for r in outs]
            same = sum(a == b for a, b in zip(texts["bf16"], texts["int8"], strict=False))
            row = {"task": task, "tree": tree, **per, "ratio": per["int8"] / per["bf16"], "same_texts": same}
            results["rows"].append(row)
            table.add_row(task, tree, f"{per['bf16']:.3f}", f"{per['int8']:.3f}", f"{row['ratio']:.3f}",
                          f"{same}/{len(prompts)}")  # fmt: skip
            print(row, flush=True)
    for tree in args.trees.split(","):
        rows = [r for r in results["rows"] if r["tree"] == tree]
        b, i = (sum(r[k] for r in rows) / len(rows) for k in ("bf16", "int8"))
        table.add_row("mean", tree, f"{b:.3f}", f"{i:.3f}", f"{i / b:.3f}", "")
    Console(width=160).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
