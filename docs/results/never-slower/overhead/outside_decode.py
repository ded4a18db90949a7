"""Per emitted token after the first: the wall time and the time outside llama_decode's one-token calls, for
entmtp's plain and default engines on llama.cpp and llama-cpp-python's plain decoding (the patched build, its
AMX kernels on), the three interleaved per prompt (3 GSM8K and 3 MT-Bench test prompts, 96 new tokens, greedy,
2 threads). Run it alone on the machine.

    PYTHONPATH=src python docs/results/never-slower/overhead/outside_decode.py --rounds 3 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import llama_cpp
import llama_cpp._internals as internals
import torch

from entmtp.bench.peers import LlamaCppPlain
from entmtp.build import EngineSpec, build_engine
from entmtp.lookup import Lookup
from entmtp.prompts import load_prompts

N = 96


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    plain = build_engine(EngineSpec(backend="llama-cpp", heads="none", lookup=None, threads=2))
    default = build_engine(EngineSpec(backend="llama-cpp", lookup=Lookup(), threads=2))
    peer = LlamaCppPlain(plain.model.path, n_threads=2, as_patched=True)
    inside = [0.0]  # seconds in one-token llama_decode calls since the last reset

    def timer(decode):
        def timed(ctx, batch):
            t0 = time.perf_counter()
            rc = decode(ctx, batch)
            if batch.n_tokens == 1:
                inside[0] += time.perf_counter() - t0
            return rc

        return timed

    lib = plain.model.runtime.lib  # the engines' (one llama_cpp module)
    lib.llama_decode = timer(lib.llama_decode)
    internals.llama_cpp.llama_decode = timer(llama_cpp.llama_cpp.llama_decode)  # the peer's `Llama`

    def engine(e):
        def run(ids):
            r = e.generate(ids, max_new_tokens=N)
            return r.seconds - r.prefill_seconds, len(r.token_ids) - 1

        return run

    def lcp(ids):
        peer.llm.reset()
        tokens = peer.llm.generate(
            ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True
        )
        stamps = []
        for t in tokens:
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                inside[0] = 0.0  # from the first token on, as the engines' decode time
            if len(stamps) == N or t in peer.eos_ids:
                break
        tokens.close()
        return stamps[-1] - stamps[0], len(stamps) - 1

    runs = {"entmtp plain": engine(plain), "entmtp default": engine(default), "llama-cpp-python": lcp}
    prompts = load_prompts("gsm8k", "test", 3) + load_prompts("mt_bench", "test", 3)
    ids = [plain.encode(p, N) for p in prompts]
    for i in ids[:2]:  # warm
        for f in runs.values():
            f(i)
    total = {k: [0.0, 0, 0.0] for k in runs}  # wall, tokens, inside
    for _ in range(args.rounds):
        for i in ids:
            for k, f in runs.items():
                inside[0] = 0.0
                wall, n = f(i)
                total[k][0] += wall
                total[k][1] += n
                total[k][2] += inside[0]
    out = {}
    for k, (wall, n, d) in total.items():
        out[k] = dict(ms_per_token=1000 * wall / n, outside_decode=1000 * (wall - d) / n, tokens=n)
        print(f"{k:18s} {1000 * wall / n:.3f} ms a token, {1000 * (wall - d) / n:.3f} outside llama_decode")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
