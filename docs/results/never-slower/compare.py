"""Before (206d074) / after (bb4d8e2) the hybrid's change: the default on llama.cpp against entmtp's plain steps
on llama.cpp and llama-cpp-python's plain decoding, per task, over the two interleaved rounds."""

import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
rows = {}
for side in ("before", "after"):
    for rnd in (1, 2):
        d = json.loads((root / f"{side}-{rnd}" / "results.json").read_text())
        for task, r in d["summary"].items():
            acc = rows.setdefault((task, side), {"tok": {}, "sec": {}, "choose": [], "steps": {}})
            for m in ("default@llama-cpp", "plain@llama-cpp", "lookup@llama-cpp", "llama-cpp", "default"):
                acc["tok"][m] = acc["tok"].get(m, 0) + r[m]["tokens"]
                acc["sec"][m] = acc["sec"].get(m, 0) + r[m]["seconds"]
            acc["choose"].append(r["default@llama-cpp"]["choose_ms_per_step"])
print(
    "| task | side | default@llama-cpp / plain@llama-cpp | lookup@llama-cpp / plain@llama-cpp | default@llama-cpp / llama-cpp-python | choose ms/step |"
)
print("|---|---|---|---|---|---|")
for (task, side), acc in rows.items():
    tps = {m: acc["tok"][m] / acc["sec"][m] for m in acc["tok"]}
    choose = sum(acc["choose"]) / len(acc["choose"])
    print(
        f"| {task} | {side} | {tps['default@llama-cpp'] / tps['plain@llama-cpp']:.3f} | "
        f"{tps['lookup@llama-cpp'] / tps['plain@llama-cpp']:.3f} | {tps['default@llama-cpp'] / tps['llama-cpp']:.3f} | {choose:.3f} |"
    )
