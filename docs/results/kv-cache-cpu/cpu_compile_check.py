"""Does torch.compile pay for itself on this CPU within one generation? (issue #8, part 3)

Times the static-shape verification forward (the one CUDA graphs replay: preallocated cache, whole-capacity
mask) eagerly and compiled with inductor, for 1 and 17 tokens, and prints the compile time, the saving per
step and the steps needed to earn the compile time back. Embedded SmolLM2-135M, bf16, 300-token past.

Usage: python docs/results/kv-cache-cpu/cpu_compile_check.py [--threads 2] [--json OUT.json]
"""

import argparse
import json
import statistics
import time

import torch

from entmtp.backends.transformers import BaseModel
from entmtp.cache import static_mask
from entmtp.model import load_model
from entmtp.tree import Tree, load_tree

PAST, CAPACITY, REPS = 300, 1024, 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(dtype="bfloat16")
    base = BaseModel(model)
    ids = torch.randint(0, model.config.vocab_size, (PAST,), generator=torch.Generator().manual_seed(0))
    results = {}
    with torch.inference_mode():
        cache = base.new_cache(CAPACITY, static=True)
        base.forward(ids, None, cache)
        base.commit(cache, list(range(PAST)))
        past = torch.tensor(PAST)

        def step(tokens, depths, mask):
            cache.slots = past + torch.arange(tokens.shape[0])
            return base.run(tokens, past + depths, static_mask(mask, past, CAPACITY), cache).logits

        compiled = torch.compile(step, dynamic=False)
        for n, tree in ((1, Tree.root_only()), (17, load_tree("tree_16"))):
            inputs = (ids[:n], tree.depths, tree.mask)
            t0 = time.perf_counter()
            compiled(*inputs)
            first = time.perf_counter() - t0
            eager, comp = [], []
            for _ in range(REPS):  # interleaved
                t0 = time.perf_counter()
                step(*inputs)
                eager.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                compiled(*inputs)
                comp.append(time.perf_counter() - t0)
            e, c = 1000 * statistics.median(eager), 1000 * statistics.median(comp)
            saving = e - c
            results[n] = {
                "eager_ms": e,
                "compiled_ms": c,
                "compile_s": first,
                "break_even_steps": first * 1000 / saving if saving > 0 else None,
            }
            pays = f"pays back after {first * 1000 / saving:.0f} steps" if saving > 0 else "never pays back"
            print(f"{n:>3} tokens: eager {e:.1f} ms, compiled {c:.1f} ms, compile {first:.1f} s, {pays}")
    if args.json:
        meta = {"threads": args.threads, "torch": torch.__version__, "past": PAST, "capacity": CAPACITY}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
