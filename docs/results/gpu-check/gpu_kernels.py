"""Where a verification forward's time goes on a GPU (random weights, bf16, 300-token past).

For each way of running the forward (transformers' DynamicCache called bare, entmtp's preallocated cache,
entmtp's graph replay) and token count: the wall time, the host time to enqueue it, and, from the torch
profiler, how many kernels ran and how long the GPU was busy in them; then the top kernels of the replays.
If enqueueing takes as long as the whole forward, the step is host-bound: the GPU waits for Python.

Usage: PYTHONPATH=src python3 docs/results/gpu-check/gpu_kernels.py [smollm2-135m|llama-7b|CONFIG.json]
"""

import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from entmtp.backends.transformers import BaseModel
from entmtp.graphs import VerifyGraphs
from entmtp.random_model import random_model
from entmtp.tree import Tree, load_tree

PAST = 300


def timed(fn, reps=20):
    """(median wall ms, median enqueue ms): enqueue = until fn returns, before waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    return 1000 * sorted(walls)[reps // 2], 1000 * sorted(hosts)[reps // 2]


def kernels(fn):
    """(kernel launches, GPU-busy ms, profiler) over one call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    count, busy = 0, 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            count += 1
            busy += getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
    return count, busy / 1000, prof


def main(shape):
    model, _ = random_model(shape, dtype=torch.bfloat16, device="cuda")
    base = BaseModel(model)
    dev = base.device
    ids = torch.randint(0, model.config.vocab_size, (PAST,), device=dev)
    print(f"{shape}: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'forward':<44} {'tokens':>6} {'wall ms':>8} {'enqueue ms':>10} {'kernels':>8} {'GPU busy ms':>11}"
    )

    def report(name, n, fn):
        try:
            wall, host = timed(fn)
            count, busy, prof = kernels(fn)
        except Exception as e:  # a diagnostic: say what broke and go on with the next measurement
            print(f"{name:<44} {n:>6} failed: {type(e).__name__}: {e}")
            return None
        print(f"{name:<44} {n:>6} {wall:>8.2f} {host:>10.2f} {count:>8} {busy:>11.2f}")
        return prof

    # transformers alone: the decoder + LM head with its DynamicCache, cut back after each call
    dyn = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids[None], past_key_values=dyn, use_cache=True)

        def bare():
            model(
                input_ids=ids[None, :1], position_ids=torch.tensor([[PAST]], device=dev), past_key_values=dyn
            )
            dyn.crop(-1)

        report("transformers model(), DynamicCache", 1, bare)

        trees = {
            1: Tree.root_only(),
            2: load_tree("chain_1"),
            17: load_tree("tree_16"),
            64: load_tree("mc_sim_7b_63"),
        }
        kv = base.new_cache(1024)
        base.forward(ids, None, kv)
        base.commit(kv, list(range(PAST)))
        for n, tree in trees.items():
            tokens = ids[:n]
            report("entmtp eager, preallocated cache", n, lambda t=tokens, tr=tree: base.forward(t, tr, kv))
        graphs = VerifyGraphs(base, verbose=False)
        cache = graphs.cache_for(1024, 1024)
        base.forward(ids, None, cache)
        base.commit(cache, list(range(PAST)))
        profs = {}
        for n, tree in trees.items():
            tokens = ids[:n]
            profs[n] = report("entmtp graph replay", n, lambda t=tokens, tr=tree: graphs.forward(t, tr))
    # eager forwards whose key length grows by one each call, as in decoding: cuDNN attention (allowed with
    # fixed_shape) plans every new shape; PyTorch's own kernels do not
    with torch.inference_mode():
        for fixed in (True, False):
            kv = base.new_cache(1024)
            base.forward(ids, None, kv)
            base.commit(kv, list(range(PAST)))
            times = []
            for i in range(20):
                past = kv.length
                mask = torch.ones(1, past + 1, dtype=torch.bool, device=dev)
                kv.begin(1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                base.run(ids[i : i + 1], torch.tensor([past], device=dev), mask, kv, fixed_shape=fixed)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                base.commit(kv, [0])
            label = "cuDNN attention allowed" if fixed else "PyTorch attention kernels"
            print(f"eager forward, key length growing each call, {label}: {1000 * sorted(times)[10]:.2f} ms")
        from entmtp.engine import Engine
        from entmtp.random_model import IdTokenizer

        tok = IdTokenizer(model.config.vocab_size)
        for kv_mode in ("dynamic", "auto"):
            engine = Engine(model, tok, kv=kv_mode, graphs=False)
            for attempt in ("first", "second"):
                result = engine.generate(ids.tolist(), max_new_tokens=24)
                verify = sorted(s.seconds["verify"] for s in result.steps[3:])
                print(
                    f"engine plain step, {kv_mode} cache, eager, {attempt} generation: verify {1000 * verify[len(verify) // 2]:.2f} ms"
                )
    for n in (1, 64):
        if profs.get(n) is not None:
            print(f"\ntop kernels of the {n}-token replay:")
            table = (
                profs[n]
                .key_averages()
                .table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70)
            )
            print(table)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
