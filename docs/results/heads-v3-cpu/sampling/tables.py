"""The sampling comparison with the heads v3 (issue 42): replay-sampling.json files, each over some of the
four tasks, merged into one table per acceptance rule and cost curve.

    python docs/results/heads-v3-cpu/sampling/tables.py docs/results/heads-v3-cpu/sampling/{a,a-shipped,b} \
        [--out docs/results/heads-v3-cpu/sampling/summary.json]

Each row is one heads' replays (shipped `hydra`, or a heads directory, named by its last part); each cell is the
mean over the tasks of the replayed speed-up over plain decoding on that curve, with the mean tokens/step in
brackets. The tasks of a row are listed: a mean over fewer than four tasks says so. Writes the rows as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CURVES = (
    "calibration",
    "avx512 bf16",
    "avx2 bf16",
    "h200 graphs",
)  # the README's; the JSON keeps every curve


def merged(dirs: list[Path]) -> tuple[dict, list[str]]:
    """{rule: {heads: {task: {curve: {method: replay}}}}} over the directories' replay-sampling.json, and their
    commands (a task replayed twice for the same heads is refused: the files would disagree)."""
    out: dict = {}
    commands = []
    for d in dirs:
        report = json.loads((d / "replay-sampling.json").read_text())
        commands.append(report["command"])
        for rule, by_heads in report["replays"].items():
            for heads, rows in by_heads.items():
                name = Path(heads).name
                mine = out.setdefault(rule, {}).setdefault(name, {})
                for task, curves in rows.items():
                    if task in mine:
                        raise SystemExit(f"{d}: {task} replayed twice for {name} ({rule})")
                    mine[task] = curves
    return out, commands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    replays, commands = merged(args.dirs)
    summary: dict = {"commands": commands, "rows": []}
    for rule, by_heads in replays.items():
        for curve in CURVES:
            replayed = [c[curve] for rows in by_heads.values() for c in rows.values()]
            methods = [m for m in replayed[0] if all(m in c for c in replayed)]  # in the replays' order
            print(f"\nT=0.7 {rule}, {curve} costs: speed-up over plain, mean of the tasks (tokens/step)\n")
            print("| heads | tasks | " + " | ".join(methods) + " |")
            print("|---|---|" + "---|" * len(methods))
            for heads, rows in by_heads.items():
                tasks = list(rows)
                cells, row = [], {"rule": rule, "curve": curve, "heads": heads, "tasks": tasks}
                for m in methods:
                    speed = sum(rows[t][curve][m]["speedup"] for t in tasks) / len(tasks)
                    tps = sum(rows[t][curve][m]["tokens_per_step"] for t in tasks) / len(tasks)
                    row[m] = {"speedup": round(speed, 4), "tokens_per_step": round(tps, 4)}
                    cells.append(f"{speed:.2f}x ({tps:.2f})")
                label = "four tasks" if len(tasks) == 4 else " + ".join(tasks)
                print(f"| {heads} | {label} | " + " | ".join(cells) + " |")
                summary["rows"].append(row)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
