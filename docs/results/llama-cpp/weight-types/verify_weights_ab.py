"""Does a GGUF with BF16 weights make the default faster than plain llama.cpp on the user's Q4_1 file? On this
CPU, llama.cpp's multi-token decode of Q4_1 weights costs ~1.8x a one-token decode for 2 tokens and ~4x for 8
(`weight_types.py`), so no tree pays and the default decodes plain steps; on BF16 weights 2 tokens cost ~1.2x
and 8 ~1.8x. The same weights (the Q4_1 file's values, rounded to bf16 by `llama_model_quantize`), run five
ways, interleaved per prompt (the order reversed on alternate prompts), wall time per generation with the
prefill included, greedy:

  llama.cpp Q4_1        llama-cpp-python's own plain decoding of the shipped Q4_1 file (the user's baseline)
  llama.cpp BF16        the same on the BF16 file
  default Q4_1          `entmtp generate`'s engine on the Q4_1 file (llama.cpp backend, heads, lookup, costs)
  default BF16          the same on the BF16 file
  plain BF16            entmtp's plain decoding on the BF16 file (llama.cpp backend)

    python docs/results/llama-cpp/weight-types/verify_weights_ab.py --out docs/results/llama-cpp/weight-types/ab.json

Quiet machine only: it times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from entmtp.bench.peers import LlamaCppPlain
from entmtp.build import EngineSpec, build
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.model import embedded_gguf, encode_prompt
from entmtp.prompts import FOUR_TASKS, load_prompts

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "hardware-aware"))
from interleave import finish  # noqa: E402
from weight_types import gguf_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", default=None, help="heads for both defaults (default: the shipped)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    q4, bf16 = embedded_gguf(), gguf_of("BF16")
    spec = EngineSpec(lookup=Lookup(), threads=args.threads, backend="llama-cpp", heads=args.heads,
                      profile=args.profile)  # fmt: skip
    built = {
        "default Q4_1": build(replace(spec, model=str(q4)), route=False, log=print),
        "default BF16": build(replace(spec, model=str(bf16)), route=False, log=print),
        "plain BF16": build(
            replace(spec, model=str(bf16), heads="none", lookup=None), route=False, log=print
        ),
    }
    tokenizer = built["default Q4_1"].engine.tokenizer
    runners = {
        "llama.cpp Q4_1": LlamaCppPlain(q4, n_threads=args.threads),
        "llama.cpp BF16": LlamaCppPlain(bf16, n_threads=args.threads),
        **{name: b.engine for name, b in built.items()},
    }
    machine = describe(hardware(built["default Q4_1"].engine.model))
    results: dict = {
        "machine": machine,
        "plans": {name: b.plan.describe() for name, b in built.items()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": {},
    }
    for r in runners.values():  # warm-up
        r.generate(encode_prompt(tokenizer, "Hello!"), max_new_tokens=8)
    table = Table(title=f"{machine}, llama.cpp, {args.num_prompts} prompts x {args.reps}, "
                        f"{args.max_new_tokens} new tokens, greedy, prefill included")  # fmt: skip
    for col in ("task", "engine", "tokens/s", "vs llama.cpp Q4_1", "tokens/step"):
        table.add_column(col, justify="left" if col in ("task", "engine") else "right")
    for task in args.tasks.split(","):
        prompts = [encode_prompt(tokenizer, p) for p in load_prompts(task, "test", args.num_prompts)]
        tally = {n: {"tokens": 0, "seconds": 0.0, "steps": 0, "texts": []} for n in runners}
        for rep in range(args.reps):
            for i, ids in enumerate(prompts):
                order = list(runners) if (i + rep) % 2 == 0 else list(runners)[::-1]
                for name in order:
                    t0 = time.perf_counter()
                    res = runners[name].generate(ids, max_new_tokens=args.max_new_tokens)
                    dt = time.perf_counter() - t0
                    t = tally[name]
                    t["tokens"] += len(res.token_ids)
                    t["seconds"] += dt
                    t["steps"] += len(res.steps) or len(res.token_ids)
                    if rep == 0:
                        t["texts"].append(res.token_ids)
        base = tally["llama.cpp Q4_1"]["tokens"] / tally["llama.cpp Q4_1"]["seconds"]
        for name, t in tally.items():
            t["tokens_per_second"] = t["tokens"] / t["seconds"]
            t["vs_llama_cpp_q4_1"] = t["tokens_per_second"] / base
            table.add_row(task, name, f"{t['tokens_per_second']:.1f}", f"{t['vs_llama_cpp_q4_1']:.2f}x",
                          f"{t['tokens'] / t['steps']:.2f}")  # fmt: skip
        same = {
            "default BF16 = plain BF16": sum(a == b for a, b in zip(tally["default BF16"]["texts"], tally["plain BF16"]["texts"], strict=False)),
            "plain BF16 = llama.cpp BF16": sum(a == b for a, b in zip(tally["plain BF16"]["texts"], tally["llama.cpp BF16"]["texts"], strict=False)),
            "default Q4_1 = llama.cpp Q4_1": sum(a == b for a, b in zip(tally["default Q4_1"]["texts"], tally["llama.cpp Q4_1"]["texts"], strict=False)),
        }  # fmt: skip
        table.add_row("", f"identical texts (of {len(prompts)}): " + ", ".join(f"{k} {v}" for k, v in same.items()),
                      end_section=True)  # fmt: skip
        for t in tally.values():
            del t["texts"]
        results["runs"][task] = {"methods": tally, "identical_texts": same}
        print(f"{task}: done", flush=True)
    geo = {n: statistics.geometric_mean(r["methods"][n]["vs_llama_cpp_q4_1"] for r in results["runs"].values())
           for n in runners}  # fmt: skip
    results["geometric_mean_vs_llama_cpp_q4_1"] = geo
    for n, g in geo.items():
        table.add_row("geometric mean", n, "", f"{g:.2f}x", "")
    finish(table, results, args.out)


if __name__ == "__main__":
    main()
