"""How often the lookup hybrid's greedy text parts from plain greedy text on llama.cpp, per written format, with
flash attention on or off: 8 test prompts (2 Spec-Bench summarization, 3 GSM8K, 3 HumanEval), 96 new tokens.

    PYTHONPATH=src python docs/results/llama-cpp-attention/exactness.py --flash 0 --formats Q4_1 Q8_0 F16 BF16 F32
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flash", choices=["0", "1"], required=True)
    ap.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "F16", "BF16", "F32"])
    args = ap.parse_args()
    os.environ["ENTMTP_LLAMA_FLASH_ATTN"] = args.flash  # read when each file loads (backends/attention.py)
    torch.set_num_threads(2)
    from entmtp.backends.gguf import embedded_in_format
    from entmtp.backends.llama_cpp import load_gguf
    from entmtp.engine import Engine
    from entmtp.lookup import Lookup
    from entmtp.model import embedded_gguf, embedded_model_dir
    from entmtp.prompts import load_prompts
    from entmtp.scheduler.hybrid import hybrid

    prompts = (
        load_prompts("specbench-summarization", "test", 2)
        + load_prompts("gsm8k", "test", 3)
        + load_prompts("humaneval", "test", 3)
    )
    for fmt in args.formats:
        path = embedded_gguf() if fmt == "Q4_1" else embedded_in_format(fmt)
        model, tok = load_gguf(path, dtype=torch.float32, threads=2, tokenizer_dir=str(embedded_model_dir()))
        plain, lookup = Engine(model, tok), Engine(model, tok, policy=hybrid(None, Lookup()))
        parted, accepted = [], 0
        for p in prompts:
            ids = plain.encode(p, 96)
            a = plain.generate(ids, max_new_tokens=96).token_ids
            r = lookup.generate(ids, max_new_tokens=96)
            accepted += sum(s.accepted for s in r.steps)
            if r.token_ids != a:
                parted.append(
                    next(
                        (i for i, (x, y) in enumerate(zip(a, r.token_ids, strict=False)) if x != y),
                        min(len(a), len(r.token_ids)),
                    )
                )
        print(f"{fmt}: flash attention {'on' if model.runtime.flash_attn else 'off'}, {len(parted)} of {len(prompts)} "
              f"texts part from plain greedy (at tokens {parted}), {accepted} lookup tokens accepted")  # fmt: skip


if __name__ == "__main__":
    main()
