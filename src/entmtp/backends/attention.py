"""Whether llama.cpp runs its flash-attention kernel: both timed on this CPU once, the faster kept.

llama.cpp's default ("auto") turns flash attention on for the CPU, and entmtp kept it on, measured ~5-9% cheaper
a one-token decode than off on short prompts on a 2-core EPYC. On a 2-core Xeon with AMX (2026-12-07,
docs/results/llama-cpp-attention) the kernel was the costliest part of a step past a short context: after 512
tokens, a one-token decode took 13.7 ms with it and 8.5 ms without, a verified chain of 8 tokens 55.2 against 19.7,
of 32 tokens 203 against 50; after 64 tokens it was ahead by 13% on one token, and in a prefill by 15-20%. What
wins is a property of the CPU, the build and the model's shapes, not of a flag: so it is timed.

Both settings are timed on the model as loaded (two scratch contexts, the backend's settings otherwise): a
one-token decode and a verified chain of `CHAIN` tokens after each of `CONTEXTS` tokens of context, alternating
between the settings, the median of `REPS` each; the setting whose steps take less in sum is kept. A context has
one setting for its life (llama.cpp lays out its V cache another way without flash attention), so the decoding
steps decide, not the prefill. About 2-3 s, once: the verdict is cached per CPU, llama-cpp-python build, the
model's attention shapes (layers, heads, key-value heads, width) and thread count, not per file: the weights'
format moves both settings' steps alike (the AMX Xeon, 2026-12-07: with and without it took 85.9 and 42.2 ms on
the Q4_1 file, 93.9 and 48.6 on Q8_0, 157.8 and 112.1 on BF16, 150.4 and 106.0 on F16), and a first run under
`--dtype auto` on a CPU with AMX loads four formats of the embedded model. `ENTMTP_LLAMA_FLASH_ATTN=1` or `0`
decides instead. The two settings round differently (other greedy texts on the Q4_1 model), so the bench's
llama.cpp peer reads the same verdict (`llama_cpp.gguf_attention_shapes`: the shapes from the file's header).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from .. import console
from ..errors import EntMTPError

ENV = "ENTMTP_LLAMA_FLASH_ATTN"
CONTEXTS = (128, 512)  # tokens of context before the timed steps: a short prompt's, a longer one's
CHAIN = 8  # tokens of the timed verification (a lookup chain's, a small tree's)
REPS = 5  # timed decodes of each shape and setting (after one untimed)
PROMPT_CHUNK = 256  # tokens per prefill decode (the backend's batch holds 512)


def flash_attention(
    lib,
    model,
    shapes: dict,
    threads: int,
    params: Callable[[int, bool], object],
    *,
    repacked: bool,
    say=None,
) -> bool:
    """Whether llama.cpp's contexts for `model` (its attention `shapes`: `attention_shapes`; its weights
    `repacked` for the CPU's kernels or not) decode with flash attention on `threads` threads:
    `ENTMTP_LLAMA_FLASH_ATTN` when set, else the cached verdict, else both timed now (`measure`, with one line
    to `say`, default stderr). `params(n_ctx, flash)`: the backend's context parameters."""
    from ..files import read_json_or_empty, write_text_atomic

    known = verdict(shapes, threads, repacked)
    if known is not None:
        return known
    cache, key = _verdicts_path(), _key(shapes, threads, repacked)
    verdicts = read_json_or_empty(cache)
    (say or console.say)(
        "timing llama.cpp's attention kernels on this CPU, with and without flash attention (once, ~3 s)"
    )
    t0 = time.perf_counter()
    ms = measure(lib, model, params)
    on = ms["on"] <= ms["off"]
    (say or console.say)(
        f"llama.cpp's flash attention {'on' if on else 'off'}: the timed steps took {ms['on']:.1f} ms with it, "
        f"{ms['off']:.1f} ms without ({time.perf_counter() - t0:.1f} s; {ENV}=1 or 0 decides instead)"
    )
    from .llama_build import build_tag

    verdicts[key] = {
        "on": on, "ms": ms, "shapes": shapes, "threads": threads, "repacked": repacked, "build": build_tag(),
    }  # fmt: skip
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cache, json.dumps(verdicts, indent=1) + "\n")
    return on


def shapes(layers: int, heads: int, kv_heads: int, width: int) -> dict:
    """What the verdict is kept for: a model's layers, query and key-value heads and width (the attention's work
    per token of context; the weights' format is not in it)."""
    return {"layers": int(layers), "heads": int(heads), "kv_heads": int(kv_heads), "width": int(width)}


def attention_shapes(lib, model) -> dict:
    """`shapes` of a loaded llama.cpp `model`."""
    return shapes(
        lib.llama_model_n_layer(model),
        lib.llama_model_n_head(model),
        lib.llama_model_n_head_kv(model),
        lib.llama_model_n_embd(model),
    )


def verdict(shapes: dict, threads: int, repacked: bool) -> bool | None:
    """`ENTMTP_LLAMA_FLASH_ATTN` when set, else the cached verdict for a model of these attention `shapes`
    (None: not timed yet)."""
    from ..files import read_json_or_empty

    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise EntMTPError(
            f"{ENV}={forced!r}: give 1 (flash attention on) or 0 (off), or unset it to have both timed once"
        )
    found = read_json_or_empty(_verdicts_path()).get(_key(shapes, threads, repacked))
    return None if found is None else bool(found["on"])


def measure(lib, model, params: Callable[[int, bool], object]) -> dict:
    """{"on": ms, "off": ms, "rows": [...]}: per setting, the sum over `CONTEXTS` of the median one-token and
    `CHAIN`-token decode after that context, timed in alternation on two scratch contexts of `model`."""
    n_ctx = max(CONTEXTS) + CHAIN + PROMPT_CHUNK
    ctxs = {}
    batch = lib.llama_batch_init(PROMPT_CHUNK, 0, 1)
    try:
        for flash in (True, False):
            ctx = lib.llama_init_from_model(model, params(n_ctx, flash))
            if not ctx:
                raise EntMTPError(
                    f"llama.cpp could not make a context of {n_ctx} cells to time its attention"
                )
            ctxs[flash] = ctx
        rows, filled = [], 0
        for context in CONTEXTS:
            # any tokens: the cost is alike
            prompt = [100 + (i * 7919) % 30000 for i in range(filled, context)]
            for ctx in ctxs.values():
                for s in range(0, len(prompt), PROMPT_CHUNK):
                    timed_decode(lib, ctx, batch, prompt[s : s + PROMPT_CHUNK], filled + s)
            filled = context
            for n in (1, CHAIN):
                times: dict[bool, list[float]] = {True: [], False: []}
                for rep in range(REPS + 1):
                    for flash, ctx in ctxs.items():
                        seconds = timed_decode(
                            lib, ctx, batch, [500 + (rep + i) % 97 for i in range(n)], context
                        )
                        # back to the context
                        lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, context, -1)
                        if rep:
                            times[flash].append(seconds)
                on, off = (1000 * statistics.median(times[f]) for f in (True, False))
                rows.append({"context": context, "tokens": n, "on_ms": on, "off_ms": off})
        return {
            "on": sum(r["on_ms"] for r in rows),
            "off": sum(r["off_ms"] for r in rows),
            "rows": rows,
        }
    finally:
        lib.llama_batch_free(batch)
        for ctx in ctxs.values():
            lib.llama_free(ctx)


def timed_decode(lib, ctx, batch, tokens: list[int], start: int) -> float:
    """Seconds of one llama_decode of `tokens`, a causal chain at positions start.. of sequence 0."""
    n = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, start + i, 1, i == n - 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = n
    t0 = time.perf_counter()
    rc = lib.llama_decode(ctx, batch)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise EntMTPError(f"llama_decode failed ({rc}) while timing llama.cpp's attention")
    return seconds


def _key(shapes: dict, threads: int, repacked: bool) -> str:
    import llama_cpp

    from ..machine import cpu_info, digest
    from .llama_build import build_tag

    return digest(
        {"cpu": cpu_info(), "llama_cpp": llama_cpp.__version__, "build": build_tag(), "shapes": shapes,
         "threads": threads, "repacked": repacked}
    )  # fmt: skip


def _verdicts_path() -> Path:
    from ..model import cache_dir

    return cache_dir() / "llama-attention.json"
