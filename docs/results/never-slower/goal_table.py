"""The issue #62 goal table of goal-11-tasks/results.json: per task, each default over its backend's own plain
decoding and over lookup alone on that backend, the llama.cpp peer beside them; geometric means last.

    python docs/results/never-slower/goal_table.py docs/results/never-slower/goal-11-tasks/results.json
"""

import argparse
import json
import math


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    summary = json.load(open(p.parse_args().results))["summary"]
    cols = {
        "default@llama-cpp / plain@llama-cpp": ("default@llama-cpp", "plain@llama-cpp"),
        "default@llama-cpp / lookup@llama-cpp": ("default@llama-cpp", "lookup@llama-cpp"),
        "lookup@llama-cpp / plain@llama-cpp": ("lookup@llama-cpp", "plain@llama-cpp"),
        "default@transformers / plain (bf16)": ("default@transformers", "plain"),
        "default / llama-cpp-python plain": ("default", "llama-cpp"),
        "plain@llama-cpp / llama-cpp-python plain": ("plain@llama-cpp", "llama-cpp"),
    }
    print("| task | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    logs = {c: [] for c in cols}
    for task, rows in summary.items():
        cells = []
        for c, (a, b) in cols.items():
            ratio = rows[a]["tokens_per_second"] / rows[b]["tokens_per_second"]
            logs[c].append(math.log(ratio))
            cells.append(f"{ratio:.3f}")
        print(f"| {task} | " + " | ".join(cells) + " |")
    geo = [f"{math.exp(sum(v) / len(v)):.3f}" for v in logs.values()]
    below = {c: sum(x < 0 for x in v) for c, v in logs.items()}
    print("| geometric mean | " + " | ".join(geo) + " |")
    print("| tasks below 1.00 | " + " | ".join(str(below[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
