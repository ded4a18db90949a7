"""How fast edits with a prediction could be on llama.cpp here, at best: the bound behind issue #61's goal.

    python docs/results/predicted-outputs/bound/bound.py --out docs/results/predicted-outputs/bound/amx.json

On the `edits` task's first 10 test prompts (the bench's), with the strongest plain baseline of this machine
(llama-cpp-python's plain decoding of the embedded Q4_1 GGUF, the patched build with its repacked weights on
where the AMX canary passes, as bench/peers.py's `llama-cpp-amx`; else pip's build as `llama-cpp`):
  1. the baseline's time per request, and how much of it is the prompt's prefill (timed alone, same build);
  2. this machine's verification curve: a decode of k tokens (every row an output, as a speculative step's) after
     each prompt's context, over a one-token decode, medians;
  3. the baseline's greedy outputs, and for each the steps an oracle would take with the prediction's drafts as
     entmtp offers them (lookup.NgramIndex with the prediction, the chain the root's branch copies): at every
     step it drafts exactly the chain's right part (up to `--max-draft` tokens), so each step costs the curve at
     that length and emits it and one more; and the steps perfect drafts would take (every chain right, the
     longest chain of best tokens per unit of time on the curve);
  4. the end-to-end bound: prefill as the baseline's, decode at the oracle's or the perfect drafts' speed.
Every timing runs alone on the given threads. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from entmtp.backends.amx import has_amx
from entmtp.backends.llama_build import build_tag, describe_build
from entmtp.bench.peers import LlamaCppPlain
from entmtp.lookup import NgramIndex
from entmtp.machine import cpu_info, versions
from entmtp.model import embedded_model_dir, encode_prompt
from entmtp.prediction import Prediction
from entmtp.prompts import load_prompts

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens of a timed decode


def decode_ms(llm, llama_cpp, context: list[int], k: int, reps: int) -> float:
    """Median ms of decoding k tokens (all outputs) after `context` (in the KV cache), the cache rolled back."""
    n = len(context)
    batch = llama_cpp.llama_batch_init(k, 0, 1)
    try:
        batch.n_tokens = k
        for i in range(k):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = context[i % n], n + i, 1, True
            batch.seq_id[i][0] = 0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert llama_cpp.llama_decode(llm._ctx.ctx, batch) == 0
            times.append((time.perf_counter() - t0) * 1e3)
            llm._ctx.kv_cache_seq_rm(0, n, -1)
        return statistics.median(times)
    finally:
        llama_cpp.llama_batch_free(batch)


def oracle_steps(prompt: list[int], prediction: list[int], output: list[int], max_draft: int) -> list[int]:
    """Per step of an oracle with the prediction's drafts: how many drafted tokens it verifies (the right part
    of the chain the root's lookup branch copies)."""
    index = NgramIndex(prompt, 3, prefix=prediction, prediction=Prediction(prediction))
    drafted, p = [], 0
    while p < len(output):
        chain = index.draft(index.tokens[index.start :], max_draft).tokens
        a = 0
        while a < len(chain) and p + a < len(output) and chain[a] == output[p + a]:
            a += 1
        drafted.append(a)
        index.extend(output[p : p + a + 1])
        p += a + 1
    return drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--max-draft", type=int, default=31)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    patched = build_tag() != "stock" and has_amx()
    peer = LlamaCppPlain(n_threads=args.threads, as_patched=patched)
    llm = peer.llm
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    prompts = load_prompts("edits", n=args.prompts)
    ids = [encode_prompt(tok, p) for p in prompts]
    preds = [tok.encode(p.prediction, add_special_tokens=False) for p in prompts]
    peer.generate(ids[0], max_new_tokens=16)  # warm

    rows = []
    for i, (prompt, pred) in enumerate(zip(ids, preds, strict=True)):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        curve = {k: decode_ms(llm, llama_cpp, prompt, k, args.reps) for k in SIZES}
        result = peer.generate(prompt, max_new_tokens=args.max_new_tokens)
        output = list(result.token_ids)
        t0 = time.perf_counter()
        peer.generate(prompt, max_new_tokens=args.max_new_tokens)
        whole = time.perf_counter() - t0
        rows.append(
            {
                "prompt": i,
                "prompt_tokens": len(prompt),
                "output_tokens": len(output),
                "prefill_s": prefill,
                "whole_s": whole,
                "curve_ms": curve,
                "oracle_drafted": oracle_steps(prompt, pred, output, args.max_draft),
            }
        )
        print(
            f"prompt {i}: {len(prompt)} + {len(output)} tokens, prefill {prefill:.3f} s of {whole:.3f} s",
            flush=True,
        )

    one = np.median([r["curve_ms"][1] for r in rows])
    rel = {k: float(np.median([r["curve_ms"][k] for r in rows]) / one) for k in SIZES}

    def cost(
        drafted: int,
    ) -> float:  # a step verifying `drafted` tokens (decoding drafted + 1), in one-token decodes
        k = drafted + 1
        lo = max(s for s in SIZES if s <= k)
        hi = min((s for s in SIZES if s >= k), default=lo)
        return rel[lo] if hi == lo else rel[lo] + (rel[hi] - rel[lo]) * (k - lo) / (hi - lo)

    tokens = sum(r["output_tokens"] for r in rows)
    oracle_cost = sum(cost(a) for r in rows for a in r["oracle_drafted"])
    oracle_steps_n = sum(len(r["oracle_drafted"]) for r in rows)
    perfect = max((s / rel[s], s) for s in SIZES)  # tokens per one-token decode's time, at the best size
    prefill = sum(r["prefill_s"] for r in rows)
    whole = sum(r["whole_s"] for r in rows)
    share = prefill / whole

    def end_to_end(decode_speedup: float) -> float:
        return 1.0 / (share + (1.0 - share) / decode_speedup)

    summary = {
        "prefill_share": share,
        "relative_curve": rel,
        "one_token_ms": float(one),
        "oracle": {
            "tokens_per_step": tokens / oracle_steps_n,
            "decode_speedup": tokens / oracle_cost,
            "end_to_end": end_to_end(tokens / oracle_cost),
        },
        "perfect": {
            "tokens_per_step": perfect[1],
            "decode_speedup": perfect[0],
            "end_to_end": end_to_end(perfect[0]),
        },
    }
    print(f"\n{peer.settings}\nprefill share of the baseline's time: {share:.3f}")
    print(
        "curve (a k-token decode over a one-token decode, median over the prompts' contexts): "
        + ", ".join(f"{k}: {v:.2f}" for k, v in rel.items())
    )
    print("\n| drafts | tokens/step | decode over plain | end to end over plain (prefill included) |")
    print("|---|---|---|---|")
    for name, key in (
        ("oracle sizing of the prediction's chains", "oracle"),
        ("every chain right", "perfect"),
    ):
        s = summary[key]
        print(
            f"| {name} | {s['tokens_per_step']:.2f} | {s['decode_speedup']:.2f}x | {s['end_to_end']:.2f}x |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": "python docs/results/predicted-outputs/bound/bound.py "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                "machine": cpu_info(),
                "versions": versions(),
                "build": describe_build(),
                "baseline": peer.settings,
                "summary": summary,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
