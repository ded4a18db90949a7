"""Load an `entmtp serve` on this machine: 1, 8 and 16 concurrent streaming clients, each asking one chat
completion after another for a bounded time; prints throughput, p50/p95 latency and time to first token.

    .venv/bin/python scripts/load_server.py                       # starts its own server (float32, defaults)
    .venv/bin/python scripts/load_server.py --url http://127.0.0.1:8000 --clients 1,4

Loopback only (it refuses any other host), bounded in time (--seconds per level; requests in flight then
finish) and in count (--requests per client per level). Latency: request sent to [DONE]; time to first token:
request sent to the first chunk with text. Throughput: completion tokens (usage) of all requests of a level
over the level's wall time. Every answer is checked: 200, one finish chunk, [DONE] last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is 17 times 3? Explain briefly.",
    "Give a one-line definition of entropy.",
    "Name four programming languages and one strength of each.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "entmtp.cli", "serve", "--port", str(port), "--no-access-log"]
    cmd += ["--max-queue", str(max(args.clients) + 1), *args.serve_args.split()]
    print("server:", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, tokens, finishes, last = None, 0, 0, None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code}
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            last = line[5:].strip()
            if last == "[DONE]":
                break
            obj = json.loads(last)
            if "error" in obj:
                return {"status": "error"}
            for choice in obj["choices"]:
                if choice["delta"].get("content") and first is None:
                    first = time.perf_counter() - t0
                finishes += choice["finish_reason"] is not None
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    ok = last == "[DONE]" and finishes == 1
    return {
        "status": 200 if ok else "malformed",
        "latency": time.perf_counter() - t0,
        "ttft": first,
        "tokens": tokens,
    }


def level(url: str, clients: int, args) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + args.seconds

    def run(i: int):
        with httpx.Client(timeout=600) as client:
            for n in range(args.requests):
                if time.perf_counter() >= stop_at:
                    return
                res = one_request(client, url, PROMPTS[(i + n) % len(PROMPTS)], args.max_tokens)
                with lock:
                    results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    good = [r for r in results if r["status"] == 200]
    lat = sorted(r["latency"] for r in good)
    ttft = sorted(r["ttft"] for r in good if r["ttft"] is not None)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(results) - len(good),
        "wall_s": wall,
        "tokens": sum(r["tokens"] for r in good),
        "tokens_per_s": sum(r["tokens"] for r in good) / wall,
        "requests_per_min": 60 * len(good) / wall,
        "latency_p50_s": statistics.median(lat) if lat else float("nan"),
        "latency_p95_s": pct(lat, 0.95),
        "ttft_p50_s": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p95_s": pct(ttft, 0.95),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server on this machine (default: start one)")
    p.add_argument("--serve-args", default="--dtype float32", help="options for the server it starts")
    p.add_argument("--clients", default="1,8,16", help="concurrent clients per level")
    p.add_argument("--seconds", type=float, default=20.0, help="per level: no new request after this")
    p.add_argument("--requests", type=int, default=8, help="per client per level, at most")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json", default=None, help="also write the levels to this JSON file")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    if not 1 <= max(args.clients) <= 64 or not 0 < args.seconds <= 120 or not 1 <= args.requests <= 100:
        p.error("bounded: clients 1..64, --seconds up to 120, --requests 1..100")
    proc = None
    if args.url is None:
        proc, args.url = start_server(args)
    elif urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        p.error(f"--url must be on this machine (loopback), got {args.url}")
    try:
        one_request(httpx.Client(timeout=600), args.url, PROMPTS[0], 4)  # warm-up, not counted
        rows = []
        print(
            f"{'clients':>7} {'reqs':>5} {'fail':>4} {'tok/s':>7} {'req/min':>8} {'p50 lat':>8} {'p95 lat':>8} "
            f"{'p50 TTFT':>9} {'p95 TTFT':>9}",
            flush=True,
        )
        for clients in args.clients:
            r = level(args.url, clients, args)
            rows.append(r)
            print(
                f"{r['clients']:>7} {r['requests']:>5} {r['failed']:>4} {r['tokens_per_s']:>7.1f} "
                f"{r['requests_per_min']:>8.1f} {r['latency_p50_s']:>7.2f}s {r['latency_p95_s']:>7.2f}s "
                f"{r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s",
                flush=True,
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items()}, "levels": rows}, f, indent=1)
        return 0 if all(r["failed"] == 0 for r in rows) else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
