"""The README's replay tables from replay-sampling.json, and, given an older file, old -> new per cell.

    python docs/results/sampling/replay_tables.py docs/results/sampling/replay-sampling.json [--heads hydra]
        [--old OLD.json]

Prints, per acceptance rule, one markdown table (curve, task, each method's speed-up over plain on that curve);
with --old, each cell as "old -> new" where the older file has that curve."""

from __future__ import annotations

import argparse
import json

METHODS = ("mc_sim_7b_63", "EntMTP*", "binary", "cost", "dynamic", "dynamic+lookup", "oracle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new")
    ap.add_argument("--old")
    ap.add_argument("--heads", default="hydra")
    args = ap.parse_args()
    new = json.load(open(args.new))["replays"]
    old = json.load(open(args.old))["replays"] if args.old else None
    for rule, by_heads in new.items():
        rows = by_heads.get(args.heads)
        if not rows:
            continue
        tasks = list(rows)
        curves = list(rows[tasks[0]])
        methods = [m for m in METHODS if any(m in rows[t][c] for t in tasks for c in curves)]
        print(f"\n{rule}, {args.heads} heads\n")
        print("| curve | task | " + " | ".join(methods) + " |")
        print("|---|---|" + "---|" * len(methods))
        for c in curves:
            for i, t in enumerate(tasks):
                cells = []
                for m in methods:
                    r = rows[t][c].get(m)
                    if r is None:
                        cells.append("-")
                        continue
                    cell = f"{r['speedup']:.2f}x"
                    prev = old and old.get(rule, {}).get(args.heads, {}).get(t, {}).get(c, {}).get(m)
                    cells.append(f"{prev['speedup']:.2f}x -> {cell}" if prev else cell)
                print(f"| {c if i == 0 else ''} | {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
