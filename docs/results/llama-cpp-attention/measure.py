"""llama.cpp's flash attention on or off, on this CPU: a decode of n tokens (1: a plain step; 8, 32: a verified
chain) after a context of c tokens, and the prefill of those c tokens, each timed with the setting on and off in
alternation on one loaded model (the shipped Q4_1 GGUF, entmtp's context settings otherwise). Prints a table and
writes JSON.

    python docs/results/llama-cpp-attention/measure.py --out docs/results/llama-cpp-attention/<machine>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from entmtp.backends.attention import timed_decode
from entmtp.backends.llama_cpp import Runtime, import_llama_cpp
from entmtp.bench.peers import embedded_gguf
from entmtp.machine import cpu_info

CONTEXTS = (64, 128, 256, 512, 1024, 2048)
SIZES = (1, 8, 32)
CHUNK = 256  # prompt tokens per llama_decode (the backend's batch is 512)


def context(runtime: Runtime, flash: bool):
    """A scratch context of 4096 cells on the runtime's model: the backend's settings, flash attention as given."""
    ctx = runtime.lib.llama_init_from_model(runtime.model, runtime._flash_params(4096, flash))
    assert ctx, "llama.cpp could not make the context"
    return ctx


def decode(lib, ctx, tokens: list[int], start: int) -> float:
    """Seconds of one llama_decode of `tokens` at positions start.. (a causal chain in sequence 0)."""
    batch = lib.llama_batch_init(len(tokens), 0, 1)
    try:
        return timed_decode(lib, ctx, batch, tokens, start)
    finally:
        lib.llama_batch_free(batch)


def prefill(lib, ctx, c: int) -> float:
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    ids = [100 + (i * 7919) % 40000 for i in range(c)]
    return sum(decode(lib, ctx, ids[s : s + CHUNK], s) for s in range(0, c, CHUNK))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=24, help="timed decodes per (context, size, setting)")
    args = ap.parse_args()
    lib = import_llama_cpp()
    path = embedded_gguf()
    runtime = Runtime(path, threads=args.threads, n_ctx=512)  # loads the model (repacked weights where safe)
    ctxs = {flash: context(runtime, flash) for flash in (True, False)}
    mem = {flash: lib.llama_get_memory(ctx) for flash, ctx in ctxs.items()}
    rows = []
    for c in CONTEXTS:
        pre = {flash: prefill(lib, ctx, c) for flash, ctx in ctxs.items()}
        for n in SIZES:
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.reps + 2):  # the first two dropped (warm-up)
                for flash, ctx in ctxs.items():
                    s = decode(lib, ctx, [500 + (r + i) % 97 for i in range(n)], c)
                    lib.llama_memory_seq_rm(mem[flash], 0, c, -1)  # back to the context
                    if r >= 2:
                        times[flash].append(s)
            on, off = (1000 * statistics.median(times[f]) for f in (True, False))
            rows.append(dict(context=c, tokens=n, on_ms=on, off_ms=off, prefill_on_ms=1000 * pre[True],
                             prefill_off_ms=1000 * pre[False]))  # fmt: skip
            print(
                f"context {c:5d} tokens {n:3d}: on {on:7.2f} ms  off {off:7.2f} ms  off/on {off / on:.2f}",
                flush=True,
            )
    print()
    print(
        "| context | prefill on / off (ms) | 1 token on / off (ms) | 8 tokens on / off | 32 tokens on / off |"
    )
    print("|---|---|---|---|---|")
    for c in CONTEXTS:
        r = {x["tokens"]: x for x in rows if x["context"] == c}
        cells = " | ".join(f"{r[n]['on_ms']:.2f} / {r[n]['off_ms']:.2f}" for n in SIZES)
        print(f"| {c} | {r[1]['prefill_on_ms']:.0f} / {r[1]['prefill_off_ms']:.0f} | {cells} |")
    here = Path(__file__).resolve().parents[3]
    commit = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    out = dict(machine=cpu_info(), threads=args.threads, model=path.name, extra_bufts=runtime.extra_bufts,
               checkout=commit.stdout.strip(), at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               reps=args.reps, rows=rows)  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
