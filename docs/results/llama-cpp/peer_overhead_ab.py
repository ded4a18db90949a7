"""Per token, old (801078a, imported as entmtp_old) vs new (worktree) entmtp plain generate on llama.cpp vs the
bench's llama.cpp peer (its Llama.generate loop, same settings): thread CPU outside llama_decode per token and
in total, ONE llama.cpp thread (the decode runs on the calling thread), interleaved in one process, same prompt
ids, same tokens (asserted). Under load, indicative only. argv: rounds, tokens.
Old code: git archive 801078a src/entmtp | tar -x -C llstep/old; mv llstep/old/src/entmtp
llstep/old/entmtp_old. Run: PYTHONPATH=src python docs/results/llama-cpp/peer_overhead_ab.py 2 64"""

import sys
import time

sys.path.insert(0, "llstep/old")
import numpy as np
import torch

torch.set_num_threads(1)
import llama_cpp
import llama_cpp._internals as _int

R, N = int(sys.argv[1]), int(sys.argv[2])
IN = {"t": 0.0}


def dec(c, b):
    t0 = time.thread_time()
    rc = llama_cpp.llama_decode(c, b)
    IN["t"] += time.thread_time() - t0
    return rc


class Lib:
    def __getattr__(s, k):
        return getattr(llama_cpp, k)

    def llama_decode(s, c, b):
        return dec(c, b)


_int.llama_cpp = Lib()  # the peer's LlamaContext.decode goes through this module attribute
from importlib import import_module

from entmtp.bench.peers import LlamaCppPlain
from entmtp.model import embedded_gguf, embedded_model_dir, encode_prompt
from entmtp.prompts import load_prompts

engines = {}
for pkg in ("entmtp_old", "entmtp"):
    lc, E = import_module(pkg + ".backends.llama_cpp"), import_module(pkg + ".engine")
    m, tok = lc.load_gguf(embedded_gguf(), threads=1, tokenizer_dir=str(embedded_model_dir()))
    m.runtime.lib = Lib()
    engines[pkg] = E.Engine(m, tok, heads=None)
peer = LlamaCppPlain(n_threads=1)
prompts = [
    encode_prompt(tok, p)
    for t in ("sharegpt", "specbench-math", "humaneval")
    for p in load_prompts(t, "test", 2)
]
runs = {
    "old": lambda ids: engines["entmtp_old"].generate(ids, max_new_tokens=N),
    "new": lambda ids: engines["entmtp"].generate(ids, max_new_tokens=N),
    "peer": lambda ids: peer.generate(ids, max_new_tokens=N),
}
out = {k: [] for k in runs}
tot = {k: [] for k in runs}
for r in range(R):
    for i, ids in enumerate(prompts):
        toks = {}
        for k in list(runs) if (r + i) % 2 == 0 else list(runs)[::-1]:
            c0, d0 = time.thread_time(), IN["t"]
            res = runs[k](ids)
            c, d = (time.thread_time() - c0) * 1e3, (IN["t"] - d0) * 1e3
            n = len(res.token_ids)
            toks[k] = res.token_ids
            out[k].append((c - d) / n)
            tot[k].append(c / n)
        assert toks["old"] == toks["new"] == toks["peer"], (i, {k: len(v) for k, v in toks.items()})
    print(
        "round",
        r,
        "per token cpu ms, median over prompts: outside decode",
        {k: round(float(np.median(v)), 3) for k, v in out.items()},
        "total",
        {k: round(float(np.median(v)), 3) for k, v in tot.items()},
        flush=True,
    )
