"""`entmtp serve --backend llama-cpp` with and without --batch-invariant (issue #67, item 1): the issue's 8
prompts sent each alone, then all 8 at once (greedy, 40 new tokens), for how many replies change with their
batch-mates; then 16 requests at once (96 new tokens) for the throughput. Run from the checkout's root:

    .venv/bin/python docs/results/server-invariance/measure.py

Prints a table and writes results.json beside this file. Nothing else should run meanwhile."""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
PROMPTS = [
    "Describe a cat to someone who has never seen one.",
    "Explain why the sky is blue.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a paperclip.",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
    "How do vaccines work?",
]


def start(*flags: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "entmtp.cli", "serve", "--port", str(port), "--backend", "llama-cpp"]
    cmd += ["--threads", "2", "--max-batch", "8", "--max-queue", "16", "--no-access-log", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def ask(url: str, prompt: str, tokens: int) -> tuple[str, int]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def together(url: str, prompts: list[str], tokens: int) -> tuple[list[tuple[str, int]], float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda p: ask(url, p, tokens), prompts))
    return out, time.perf_counter() - t0


def main() -> None:
    rows = {}
    for name, flags in (("default", ()), ("--batch-invariant", ("--batch-invariant",))):
        proc, url = start(*flags)
        try:
            ask(url, "Hello!", 8)  # warm-up
            alone = [ask(url, p, 40)[0] for p in PROMPTS]
            both, _ = together(url, PROMPTS, 40)
            changed = sum(a != b for a, (b, _) in zip(alone, both, strict=True))
            load, seconds = together(url, PROMPTS * 2, 96)
            tokens = sum(n for _, n in load)
            rows[name] = {
                "changed_of_8": changed,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_second": tokens / seconds,
            }
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print("| server | greedy replies that changed beside 7 others (of 8) | 16 requests at once: tokens/s |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['changed_of_8']} | {r['tokens_per_second']:.1f} |")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = sorted({w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split()})
    machine = {
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))],
        "cores": os.cpu_count(),
    }
    meta = {
        "command": "python docs/results/server-invariance/measure.py",
        "commit": commit,
        "machine": machine,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (HERE / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
