"""Does entmtp's patched llama-cpp-python build change anything on a CPU without AMX? The raw `llama_decode`
cost of n tokens (a chain after a 96-token prompt, hidden states on as in a verification) on the shipped Q4_1
file, for two installs of llama-cpp-python 0.3.36 side by side: pip's build and entmtp's (backends/llama_build.py),
each in a child process, alternating round after round so drift hits both alike.

    python docs/results/llama-cpp/amx-build/ab.py --build stock=DIR --build patched=DIR \
        --out docs/results/llama-cpp/amx-build/ab.json

DIR: a folder holding an installed `llama_cpp` package (`pip install --no-deps --target DIR <wheel>`). Run it on
a quiet machine: it times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SIZES = (1, 2, 4, 8, 16)
PROMPT = 96

CHILD = """
import json, sys, time
import numpy as np
from entmtp.backends.llama_cpp import Runtime
from entmtp.backends.llama_build import build_tag
from entmtp.model import embedded_gguf
sizes, reps, threads = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = Runtime(embedded_gguf(), threads=threads, n_ctx=512, kv_type="f16")
rng = np.random.default_rng(0)
prompt = rng.integers(100, 40000, 96).tolist()
rt.decode(prompt, list(range(96)), [[0]] * 96, [False] * 95 + [True], embeddings=False)
times = {n: [] for n in sizes}
for r in range(reps + 1):  # one warm-up round
    for n in sizes:
        toks = rng.integers(100, 40000, n).tolist()
        t0 = time.perf_counter()
        rt.decode(toks, list(range(96, 96 + n)), [[0]] * n, [True] * n, embeddings=True)
        dt = time.perf_counter() - t0
        rt.seq_rm(0, 96)
        if r:
            times[n].append(1000 * dt)
print(json.dumps({"build": build_tag(), "repacked": rt.extra_bufts, "ms": times}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=DIR, twice or more")
    ap.add_argument("--rounds", type=int, default=6, help="child processes per build, alternating")
    ap.add_argument("--reps", type=int, default=10, help="timed decodes per size in each child")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/llama-cpp/amx-build/ab.json")
    args = ap.parse_args()
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from entmtp.machine import record

    builds = dict(b.split("=", 1) for b in args.build)
    src = str(Path(__file__).resolve().parents[4] / "src")
    samples = {name: {n: [] for n in SIZES} for name in builds}
    tags = {}
    for _ in track(range(args.rounds), description="alternating builds"):
        for name, folder in builds.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([folder, src])}
            cmd = [sys.executable, "-c", CHILD, json.dumps(SIZES), str(args.reps), str(args.threads)]
            out = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
            tags[name] = {"build": out["build"], "repacked": out["repacked"]}
            for n, ms in out["ms"].items():
                samples[name][int(n)] += ms
    medians = {name: {n: statistics.median(v) for n, v in s.items()} for name, s in samples.items()}
    table = Table(title=f"llama_decode of n tokens after {PROMPT} (Q4_1), median ms; {args.threads} threads")
    for col in ("build", "tag", "repacked", *[f"n={n}" for n in SIZES]):
        table.add_column(col, justify="right")
    names = list(builds)
    for name in names:
        cells = [f"{medians[name][n]:.2f}" for n in SIZES]
        table.add_row(name, tags[name]["build"], str(tags[name]["repacked"]), *cells)
    if len(names) == 2:
        a, b = names
        table.add_row(f"{b}/{a}", "", "", *[f"{medians[b][n] / medians[a][n]:.3f}" for n in SIZES])
    Console(width=140).print(table)
    meta = {"threads": args.threads, "rounds": args.rounds, "reps": args.reps, "machine": record("cpu")}
    Path(args.out).write_text(
        json.dumps({"meta": meta, "builds": tags, "median_ms": medians}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
