"""Prefill (+1 token) wall time: entmtp's llama.cpp engine vs the bench's llama-cpp-python peer, 2 threads,
interleaved, same prompt ids. Quiet machine only."""

import statistics as st
import time

from entmtp.backends.llama_cpp import load_gguf
from entmtp.bench.peers import LlamaCppPlain
from entmtp.engine import Engine
from entmtp.model import embedded_gguf, embedded_model_dir, encode_prompt
from entmtp.prompts import load_prompts

m, tok = load_gguf(embedded_gguf(), threads=2, tokenizer_dir=str(embedded_model_dir()))
eng = Engine(m, tok, heads=None)
peer = LlamaCppPlain(n_threads=2)
for task in ("humaneval", "mt_bench", "specbench-summarization"):
    for p in load_prompts(task, "test", 2):
        ids = encode_prompt(tok, p)
        a, b = [], []
        for r in range(4):
            for k in (0, 1) if r % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                (eng.generate(ids, max_new_tokens=1) if k == 0 else peer.generate(ids, max_new_tokens=1))
                (a if k == 0 else b).append(time.perf_counter() - t0)
        print(
            f"{task:24s} {len(ids):5d} tokens: entmtp {st.median(a) * 1e3:7.1f} ms  peer {st.median(b) * 1e3:7.1f} ms  ratio {st.median(a) / st.median(b):.2f}",
            flush=True,
        )
