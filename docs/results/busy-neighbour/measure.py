"""Decoding beside a busy neighbour (issue #67, item 5): tokens/s of one greedy generation (48 new tokens, plain
steps) on each backend at 1 and 2 threads, and with GNU OpenMP's passive wait, with the machine idle and with
one core taken by a busy loop in another process. Each configuration runs in a fresh process (OpenMP reads its
environment once). Run from the checkout's root:

    .venv/bin/python docs/results/busy-neighbour/measure.py

Prints a table and writes results.json beside this file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ONE = """
import json, sys, time, torch
from entmtp.build import EngineSpec, build
backend, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
engine = build(EngineSpec(backend=backend, heads="none", threads=threads, probe=False), log=lambda m: None).engine
engine.generate("Hello", max_new_tokens=8)
t = time.perf_counter()
r = engine.generate("Write a short story about a robot.", max_new_tokens=48)
print(json.dumps(len(r.token_ids) / (time.perf_counter() - t)))
"""
CONFIGS = [  # (backend, threads, extra environment)
    ("transformers", 2, {}),
    ("transformers", 1, {}),
    ("transformers", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("llama-cpp", 2, {}),
    ("llama-cpp", 1, {}),
]


def run(backend: str, threads: int, env: dict) -> float:
    out = subprocess.run(
        [sys.executable, "-c", ONE, backend, str(threads)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=600, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    rows = []
    for busy in (False, True):
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            time.sleep(1.0 if busy else 0.0)
            for backend, threads, env in CONFIGS:
                tps = run(backend, threads, env)
                rows.append(
                    {"busy_neighbour": busy, "backend": backend, "threads": threads, "env": env, "tps": tps}
                )
        finally:
            if neighbour is not None:
                neighbour.kill()
    print("| backend | threads | OpenMP wait | idle machine, tokens/s | one core busy, tokens/s |")
    print("|---|---|---|---|---|")
    for backend, threads, env in CONFIGS:
        got = {
            r["busy_neighbour"]: r["tps"]
            for r in rows
            if (r["backend"], r["threads"], r["env"]) == (backend, threads, env)
        }
        wait = env.get("OMP_WAIT_POLICY", "default")
        print(f"| {backend} | {threads} | {wait} | {got[False]:.1f} | {got[True]:.1f} |")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = sorted({w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split()})
    meta = {
        "command": "python docs/results/busy-neighbour/measure.py",
        "commit": commit,
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))],
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (HERE / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
