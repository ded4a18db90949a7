"""A/B of the llama.cpp backend's plain step, old (HEAD before this branch's change, imported as entmtp_old)
against new (the worktree), interleaved in ONE process: (1) Python CPU per step with llama_decode a no-op
(thread_time: the overhead around the decode), (2) wall ms per engine step (median), beside the raw
Runtime.decode of one token. Prompt: 100 token ids."""

import sys
import time

sys.path.insert(0, "llstep_old")  # git archive 659a974 src/entmtp | tar -x; mv src/entmtp entmtp_old
import numpy as np
import torch

torch.set_num_threads(2)
import entmtp_old
from entmtp_old.scheduler.hybrid import hybrid as hybrid_old

import entmtp
from entmtp.model import embedded_gguf, embedded_model_dir
from entmtp.scheduler.hybrid import hybrid


def setup(pkg, hyb):
    from importlib import import_module

    lc, eng_mod, tree_mod, lk = (
        import_module(pkg.__name__ + m) for m in (".backends.llama_cpp", ".engine", ".tree", ".lookup")
    )
    model, tok = lc.load_gguf(embedded_gguf(), threads=2, tokenizer_dir=str(embedded_model_dir()))
    rt = model.runtime
    real = rt.lib.llama_decode

    class L:
        noop = False

        def __getattr__(s, k):
            return getattr(lc.import_llama_cpp(), k)

        def llama_decode(s, ctx, b):
            return 0 if s.noop else real(ctx, b)

    rt.lib = L()
    plain = eng_mod.Engine(model, tok, heads=None)
    lookup = eng_mod.Engine(model, tok, None, hyb(None, lk.Lookup()))  # positional: old and new signatures
    return rt, plain, lookup


prompt = list(range(100, 200))


def cpu_per_step(rt, eng, n=100):
    ev = eng.stream(prompt, max_new_tokens=n)
    next(ev)
    rt.lib.noop = True
    t0, k = time.thread_time(), 0
    for _ in ev:
        k += 1
    rt.lib.noop = False
    return (time.thread_time() - t0) / k * 1e6


def wall_steps(eng, n=16):
    return [s.seconds["total"] * 1000 for s in eng.generate(prompt, max_new_tokens=n).steps]


def raw(rt, k=16):
    s = rt.take_seq()
    rt.decode(prompt, list(range(100)), [[s]] * 100, [False] * 99 + [True], embeddings=False)
    ts = []
    for i in range(k):
        t0 = time.perf_counter()
        rt.decode([5], [100 + i], [[s]], [True], embeddings=False)
        ts.append((time.perf_counter() - t0) * 1000)
    rt.give_seq(s)
    return ts


A, B = setup(entmtp_old, hybrid_old), setup(entmtp, hybrid)
res = {k: [] for k in ("cpu_old", "cpu_new", "wall_old", "wall_new", "raw", "lk_old", "lk_new")}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    print("round", r, {k: round(float(np.median(v)), 2) for k, v in res.items() if v}, flush=True)
    res["cpu_old"].append(cpu_per_step(A[0], A[1]))
    res["cpu_new"].append(cpu_per_step(B[0], B[1]))
    res["wall_old"] += wall_steps(A[1])
    res["wall_new"] += wall_steps(B[1])
    res["raw"] += raw(B[0])
    res["lk_old"] += wall_steps(A[2])
    res["lk_new"] += wall_steps(B[2])
print(
    "python CPU per plain step, decode a no-op (us, median of rounds): old {:.0f} new {:.0f}".format(
        np.median(res["cpu_old"]), np.median(res["cpu_new"])
    )
)
print(
    "wall per plain step (ms, median): old {:.2f} new {:.2f} raw 1-token decode {:.2f}".format(
        np.median(res["wall_old"]), np.median(res["wall_new"]), np.median(res["raw"])
    )
)
print(
    "wall per lookup-only step (ms, median): old {:.2f} new {:.2f}".format(
        np.median(res["lk_old"]), np.median(res["lk_new"])
    )
)
