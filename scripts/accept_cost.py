"""What acceptance costs per step on this machine: `accept()` of each rule over SmolLM2-sized logits (49,152
tokens, bf16, random) for trees of several sizes, median of repeated calls; and one row of the gumbel rule's
noise (GumbelNoise.row). Prints a table and writes JSON.

    .venv/bin/python scripts/accept_cost.py [--threads 2] [--rules greedy,sample,typical,gumbel] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from entmtp.accept import GumbelNoise, Sampling, accept
from entmtp.machine import describe, hardware
from entmtp.tree import Tree, load_tree

VOCAB = 49152
TREES = ("root", "chain_4", "tree_8", "mc_sim_7b_63")
RULES = (("greedy", 0.0), ("sample", 0.7), ("typical", 0.7), ("gumbel", 0.7))


def median_ms(fn, reps: int = 200) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _accept_ms(tree, tokens, logits, sampling, generator, noise) -> float:
    return median_ms(lambda: accept(tree, tokens, logits, sampling, generator, noise))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rules", default=",".join(r for r, _ in RULES))
    ap.add_argument("--out", type=Path, default=Path("docs/results/sampling/accept-cost.json"))
    args = ap.parse_args()
    asked = [r for r in args.rules.split(",") if r]
    unknown = [r for r in asked if r not in dict(RULES)]
    if not asked or unknown:
        raise SystemExit(f"--rules {args.rules}: use some of {', '.join(r for r, _ in RULES)} (comma list)")
    rules = [(r, t) for r, t in RULES if r in asked]
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    machine = describe(hardware(torch.empty(0, dtype=torch.bfloat16)))
    rows = {}
    for name in TREES:
        tree = Tree.root_only() if name == "root" else load_tree(name)
        logits = (3 * torch.randn(tree.size, VOCAB, generator=g)).to(torch.bfloat16)
        tokens = logits.float().topk(tree.size, dim=-1).indices[0]  # likely drafts: walks go below the root
        noise = GumbelNoise(1, VOCAB).at(range(tree.depth + 1))
        rows[name] = {
            rule: _accept_ms(tree, tokens, logits, Sampling(t, rule), g, noise) for rule, t in rules
        }
    position = iter(range(10**9))
    fresh = GumbelNoise(2, VOCAB)
    noise_row = median_ms(lambda: fresh.row(next(position)))
    table = Table(title=f"accept() ms per step, {VOCAB}-token bf16 logits; {machine}")
    for col in ("tree", *(r for r, _ in rules)):
        table.add_column(col, justify="left" if col == "tree" else "right")
    for name, r in rows.items():
        table.add_row(name, *(f"{r[rule]:.3f}" for rule, _ in rules))
    console = Console(width=160)
    console.print(table)
    console.print(f"gumbel noise: {noise_row:.3f} ms per row (one per emitted token)")
    args.out.write_text(
        json.dumps({"machine": machine, "accept_ms": rows, "noise_row_ms": noise_row}, indent=1)
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
