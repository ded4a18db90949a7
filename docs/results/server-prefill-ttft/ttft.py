"""A short request's time to first token while a long prompt prefills (#67 item 4), on `entmtp serve`.

For each backend: start `entmtp serve --backend B --max-batch 4` (its own 2 threads, nothing else running),
then (1) short chats alone, (2) the long prompt alone (its time to first token is its prefill), (3) the long
prompt again with a short chat sent every `--every` s while it prefills, each waiting for its own first token.
Time to first token is the first streamed event that carries a token. Prints a table and writes JSON.

    python docs/results/server-prefill-ttft/ttft.py --label after
    PYTHONPATH=<checkout of the commit before>/src python docs/results/server-prefill-ttft/ttft.py --label before
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
SHORT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(backend: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "entmtp.cli", "serve", "--backend", backend, "--max-batch", "4"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def first_token_s(url: str, path: str, body: dict) -> float:
    """Seconds from sending `body` (streamed) to the first event that carries a token; the stream is read to
    its end."""
    t0, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter() - t0
    return first


def run(backend: str, long_tokens: int, every: float, alone_n: int) -> dict:
    proc, url = start(backend)
    try:
        rng = random.Random(0)
        long = {"prompt": [rng.randrange(100, 20_000) for _ in range(long_tokens)], "max_tokens": 2}
        first_token_s(url, "/v1/chat/completions", SHORT)  # warm-up
        alone = [first_token_s(url, "/v1/chat/completions", SHORT) for _ in range(alone_n)]
        long_alone = first_token_s(url, "/v1/completions", long)
        during, done = [], threading.Event()

        def shorts():
            time.sleep(every)
            while not done.is_set():
                sent = time.perf_counter()
                ttft = first_token_s(url, "/v1/chat/completions", SHORT)
                if not done.is_set():  # it ran wholly beside the prefill
                    during.append(ttft)
                time.sleep(max(0.0, every - (time.perf_counter() - sent)))

        thread = threading.Thread(target=shorts)
        thread.start()
        long_beside = first_token_s(url, "/v1/completions", long)
        done.set()
        thread.join()
    finally:
        proc.terminate()
        proc.wait(60)
    return {
        "backend": backend,
        "short_alone_s": alone,
        "short_during_s": during,
        "long_alone_s": long_alone,
        "long_beside_shorts_s": long_beside,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="before | after: the JSON's name")
    ap.add_argument("--backends", default="transformers,llama-cpp")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between the short chats' sends")
    ap.add_argument("--alone", type=int, default=5, help="short chats timed alone")
    args = ap.parse_args()
    import entmtp  # the code the servers run: this checkout's, or the one PYTHONPATH names

    code = Path(entmtp.__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=code)
    flags = sorted(
        f
        for f in Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
        if f in {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "fma"}
    )
    rows = [run(b, args.long_tokens, args.every, args.alone) for b in args.backends.split(",")]
    out = {
        "label": args.label,
        "commit": commit.stdout.strip(),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "flags": flags,
            "cores": os.cpu_count(),
        },
        "long_tokens": args.long_tokens,
        "every_s": args.every,
        "rows": rows,
    }
    (HERE / f"ttft-{args.label}.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.label}: long prompt {args.long_tokens} tokens, a short chat every {args.every} s beside it")
    print(
        f"{'backend':14} {'short alone p50':>15} {'during p50':>11} {'during max':>11} {'n':>3} "
        f"{'p50 ratio':>9} {'long alone':>10} {'long beside':>11}"
    )
    for r in rows:
        a, d = statistics.median(r["short_alone_s"]), r["short_during_s"] or [float("nan")]
        print(
            f"{r['backend']:14} {a:15.3f} {statistics.median(d):11.3f} {max(d):11.3f} {len(r['short_during_s']):3d} "
            f"{statistics.median(d) / a:9.2f} {r['long_alone_s']:10.2f} {r['long_beside_shorts_s']:11.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
