"""Print one Markdown table of speedups (task x method) from an `entmtp bench` results.json: docs/results.md's
summary tables are this script's output.

    python scripts/results_table.py docs/results/bench-v2/results.json [--methods plain,lookup,...]
    python scripts/results_table.py NEW/results.json --against OLD/results.json   # two runs, method by method

Each cell is the speedup over plain decoding (ratio of sums, prefill included); the best method of a task is in
bold; `replay` columns are the replayed policies' decode-only tokens/s over the replayed EntMTP* (static).
With `--against`, each cell is instead the method's tokens/s in this run over its tokens/s in the other run
(e.g. the same bench before and after an engine change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def table(data: dict, methods: list[str] | None, replay: list[str], against: dict | None = None) -> str:
    summary = data["summary"]
    if methods is None:  # every method of the first task, in the run's order
        methods = list(next(iter(summary.values())))
    head = ["task", *methods, "best"] + [f"replay {p} / static" for p in replay]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, rows in summary.items():
        if against is None:
            speed = {m: rows[m]["speedup"] for m in methods if m in rows}
        else:
            other = against["summary"].get(task, {})
            speed = {
                m: rows[m]["tokens_per_second"] / other[m]["tokens_per_second"]
                for m in methods
                if m in rows and m in other
            }
        best = max(speed, key=speed.get)
        cells = [task]
        for m in methods:
            cell = f"{speed[m]:.2f}x" if m in speed else ""
            cells.append(f"**{cell}**" if m == best else cell)
        cells.append(best)
        for p in replay:
            rep = data.get("replays", {}).get(task, {}).get("hydra", {})
            ok = p in rep and "static" in rep
            cells.append(
                f"{rep[p]['tokens_per_second'] / rep['static']['tokens_per_second']:.2f}x" if ok else ""
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--methods", default=None, help="comma list of config names (default: all)")
    p.add_argument("--replay", default="", help="comma list of replayed hydra policies, e.g. cost,oracle")
    p.add_argument("--against", type=Path, default=None, help="another run's results.json: tokens/s ratios")
    args = p.parse_args()
    data = json.loads(args.results.read_text())
    against = json.loads(args.against.read_text()) if args.against else None
    methods = args.methods.split(",") if args.methods else None
    print(table(data, methods, [x for x in args.replay.split(",") if x], against))


if __name__ == "__main__":
    main()
