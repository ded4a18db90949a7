"""`entmtp serve` beside a busy neighbour (issue #67, item 5): the live choice of threads against fixed ones.

For each backend and each way of setting the threads (the default: 2 threads, chosen live, server/threads.py;
`--fixed-threads` at 2; `--fixed-threads --threads 1`), one server (`--max-batch 4`) serves four bursts of 8
greedy chats at once (48 new tokens each): idle; then with one of the 2 cores taken by a busy loop in another
process (the first busy burst includes the server's reaction); again busy; and idle again after the neighbour
left and `--settle` seconds passed. Tokens/s of each burst (all its tokens over its wall time). Prints a table
and writes serve.json beside this file. Run from the checkout's root, nothing else running:

    .venv/bin/python docs/results/busy-neighbour/serve.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).parent
MODES = {
    "live (default)": [],
    "fixed 2": ["--fixed-threads"],
    "fixed 1": ["--fixed-threads", "--threads", "1"],
}
PROMPTS = [
    "Write a short story about a robot.",
    "Explain how a bicycle works.",
    "List five uses of a paperclip.",
    "Describe a rainy day in a city.",
    "What makes a good friend?",
    "Summarize the plot of a fairy tale.",
    "Give advice to a new gardener.",
    "Describe the sea to someone who has never seen it.",
]


def start(backend: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "entmtp.cli",
        "serve",
        "--backend",
        backend,
        "--max-batch",
        "4",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the {backend} server did not start")


def burst(url: str) -> float:
    """Tokens/s of 8 chats sent at once."""

    def one(prompt: str) -> int:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 48, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        tokens = sum(pool.map(one, PROMPTS))
    return tokens / (time.perf_counter() - t0)


def run(backend: str, extra: list[str], settle: float) -> dict:
    proc, url = start(backend, extra)
    try:
        burst(url)  # warm-up
        out = {"idle": burst(url)}
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.0)
            out["busy, first"] = burst(url)
            out["busy, again"] = burst(url)
        finally:
            neighbour.kill()
            neighbour.wait()
        time.sleep(settle)
        out["idle again, first"] = burst(url)
        out["idle again"] = burst(url)
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="llama-cpp,transformers")
    ap.add_argument(
        "--settle", type=float, default=1.0, help="seconds between the neighbour's end and the next burst"
    )
    args = ap.parse_args()
    rows = []
    for backend in args.backends.split(","):
        for mode, extra in MODES.items():
            rows.append({"backend": backend, "mode": mode, "tps": run(backend, extra, args.settle)})
            print(backend, mode, {k: round(v, 1) for k, v in rows[-1]["tps"].items()}, flush=True)
    bursts = list(rows[0]["tps"])
    print("\n| backend | threads | " + " | ".join(f"{b}, tokens/s" for b in bursts) + " |")
    print("|---|---|" + "---|" * len(bursts))
    for r in rows:
        print(f"| {r['backend']} | {r['mode']} | " + " | ".join(f"{r['tps'][b]:.1f}" for b in bursts) + " |")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    flags = sorted({w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split()})
    meta = {
        "command": "python docs/results/busy-neighbour/serve.py",
        "commit": commit,
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))],
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settle_s": args.settle,
    }
    (HERE / "serve.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
