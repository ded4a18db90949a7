"""Each method of an `entmtp bench --defaults` run against the faster of plain decoding's two dtypes, per task.

    python scripts/against_faster_plain.py RUN_DIR        # reads RUN_DIR/results.json, writes against-plain.{md,json}

`plain` is the bench's dtype and `plain@<other>` the other CPU dtype; tokens/s pool every prompt of a task
(prefill included, as in the bench). The row `all` pools the tasks' ratios by their geometric mean.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "run", type=Path, help="the folder of an `entmtp bench --defaults` run (holds results.json)"
    )
    run = ap.parse_args().run
    data = json.loads((run / "results.json").read_text())
    summary = data["summary"]
    methods: list[str] = []
    out: dict[str, dict] = {}
    for task, rows in summary.items():
        plains = {
            m: r["tokens_per_second"] for m, r in rows.items() if m == "plain" or m.startswith("plain@")
        }
        faster = max(plains, key=plains.get)
        out[task] = {"faster_plain": faster, "ratios": {}}
        for m, r in rows.items():
            if m not in methods:
                methods.append(m)
            out[task]["ratios"][m] = r["tokens_per_second"] / plains[faster]
    geo = {
        m: math.exp(sum(math.log(out[t]["ratios"][m]) for t in out) / len(out))
        for m in methods
        if all(m in out[t]["ratios"] for t in out)
    }
    lines = [
        f"Against the faster plain dtype per task (tokens/s ratio; run `{data['meta']['command']}`, "
        f"{data['meta']['date']}, commit {data['meta']['commit']})",
        "",
        "| task | faster plain | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for task, row in out.items():
        cells = [f"{row['ratios'][m]:.2f}x" if m in row["ratios"] else "" for m in methods]
        lines.append(f"| {task} | {row['faster_plain']} | " + " | ".join(cells) + " |")
    lines.append(
        "| all (geometric mean) | | "
        + " | ".join(f"{geo[m]:.2f}x" if m in geo else "" for m in methods)
        + " |"
    )
    text = "\n".join(lines) + "\n"
    print(text)
    (run / "against-plain.md").write_text(text)
    (run / "against-plain.json").write_text(json.dumps({"tasks": out, "geometric_mean": geo}, indent=1))


if __name__ == "__main__":
    main()
