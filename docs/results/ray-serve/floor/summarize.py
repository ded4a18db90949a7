"""ab.txt: python docs/results/ray-serve/floor/summarize.py docs/results/ray-serve/floor  (tokens/s mean and median per
configuration; each run: tokens/s, p50 latency s, p50 time to first token s, errors)."""

import glob
import json
import re
import statistics as st
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "helpers/s5/ab"
rows = {}
for f in sorted(glob.glob(f"{d}/*.json")):
    name = re.sub(r"-\d+$", "", f.split("/")[-1][:-5])
    lv = json.load(open(f))["configs"][0]["levels"][0]
    rows.setdefault(name, []).append(
        (
            f.split("/")[-1],
            round(lv["tokens_per_s"], 1),
            round(lv["latency_p50_s"], 1),
            round(lv["ttft_p50_s"], 2),
            lv["errors"],
        )
    )
for k, v in rows.items():
    tps = [x[1] for x in v]
    print(f"{k:12s} mean {st.mean(tps):5.1f} median {st.median(tps):5.1f}  ", [x[1:] for x in v])
