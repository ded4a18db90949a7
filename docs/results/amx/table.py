"""The AMX goal table: `entmtp generate`'s default against llama-cpp-python's plain decoding as a user gets it
(pip's build: repacked weights off on an AMX CPU), the patched build's own plain decoding (AMX kernels on), and
entmtp's own plain steps and lookup alone on llama.cpp, per task, from a bench's results.json.

    python docs/results/amx/table.py docs/results/amx/goal/results.json
"""

from __future__ import annotations

import argparse
import json
import math


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    summary = json.load(open(ap.parse_args().results))["summary"]
    cols = {
        "llama-cpp": "llama-cpp-python plain (pip's build as run)",
        "llama-cpp-amx": "patched build's plain (AMX on)",
        "plain@llama-cpp": "entmtp plain on llama.cpp",
        "lookup@llama-cpp": "entmtp lookup alone on llama.cpp",
    }
    print(
        "| task | default tokens/s | " + " | ".join(f"over {c}" for c in cols.values()) + " | tokens/step |"
    )
    print("|---|---|" + "---|" * len(cols) + "---|")
    ratios: dict[str, list[float]] = {k: [] for k in cols}
    for task, methods in summary.items():
        default = methods["default"]
        row = []
        for k in cols:
            r = default["tokens_per_second"] / methods[k]["tokens_per_second"]
            ratios[k].append(r)
            row.append(f"{r:.2f}x")
        print(
            f"| {task} | {default['tokens_per_second']:.1f} | "
            + " | ".join(row)
            + f" | {default['tokens_per_step']:.2f} |"
        )
    geo = [math.exp(sum(map(math.log, v)) / len(v)) for v in ratios.values()]
    low = [min(v) for v in ratios.values()]
    print("| geometric mean | | " + " | ".join(f"{g:.3f}x" for g in geo) + " | |")
    print("| lowest | | " + " | ".join(f"{m:.3f}x" for m in low) + " | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
