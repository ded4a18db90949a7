"""Decode ms/token: entmtp's llama.cpp engine with torch at 1 vs 2 threads, vs the peer; 2 llama.cpp threads."""

import time

import torch

from entmtp.backends.llama_cpp import load_gguf
from entmtp.bench.peers import LlamaCppPlain
from entmtp.engine import Engine
from entmtp.model import embedded_gguf, embedded_model_dir, encode_prompt
from entmtp.prompts import load_prompts

m, tok = load_gguf(embedded_gguf(), threads=2, tokenizer_dir=str(embedded_model_dir()))
eng = Engine(m, tok, heads=None)
peer = LlamaCppPlain(n_threads=2)
ids = encode_prompt(tok, load_prompts("sharegpt", "test", 1)[0])
res = {}
for _round in range(3):
    for name in ("t1", "t2", "peer"):
        if name != "peer":
            torch.set_num_threads(int(name[1]))
        f = (
            (lambda n: peer.generate(ids, max_new_tokens=n))
            if name == "peer"
            else (lambda n: eng.generate(ids, max_new_tokens=n))
        )
        t0 = time.perf_counter()
        f(1)
        t1 = time.perf_counter()
        out = f(97)
        t2 = time.perf_counter()
        res.setdefault(name, []).append(((t2 - t1) - (t1 - t0)) / 96 * 1e3)
print(
    {k: [round(x, 2) for x in v] for k, v in res.items()}, "torch threads at start", torch.get_num_threads()
)
