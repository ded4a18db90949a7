"""Why a tree step costs 2-5x a plain step on llama.cpp here, and which weight types make it cheap: the raw
`llama_decode` cost of n tokens (n = 1, 2, 3, 4, 8, 16; a chain after a 96-token prompt, hidden states on as in
a verification) for the shipped SmolLM2 Q4_1 GGUF and the same weights requantized by llama.cpp itself
(`llama_model_quantize` of the F32 file entmtp writes from the Q4_1 one) to Q4_0, Q8_0, BF16, F16 and F32,
each with llama.cpp's repacked weights (extra buffer types) on and off.

    python docs/results/llama-cpp/weight-types/weight_types.py --out docs/results/llama-cpp/weight-types/curves.json

Sizes are timed interleaved (round after round) so drift hits all alike; medians of --reps rounds. Run it on a
quiet machine: it times. The files go to $ENTMTP_CACHE/models (written once).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from entmtp.backends.llama_cpp import Runtime, embedded_f32_gguf, import_llama_cpp
from entmtp.machine import record
from entmtp.model import cache_dir, embedded_gguf

SIZES = (1, 2, 3, 4, 8, 16)
TYPES = ("Q4_1", "Q4_0", "Q8_0", "BF16", "F16", "F32")
PROMPT = 96


def gguf_of(kind: str) -> Path:
    """The model's GGUF with `kind` weights: the shipped file (Q4_1), entmtp's F32 copy, or llama.cpp's
    quantization of that copy (written once)."""
    if kind == "Q4_1":
        return embedded_gguf()
    if kind == "F32":
        return embedded_f32_gguf()
    lib = import_llama_cpp()
    out = cache_dir() / "models" / f"smollm2-135m-instruct-{kind.lower()}.gguf"
    if not out.is_file():
        params = lib.llama_model_quantize_default_params()
        params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.nthread = 2
        tmp = out.with_name(out.name + ".tmp")
        rc = lib.llama_model_quantize(
            str(embedded_f32_gguf()).encode(), str(tmp).encode(), ctypes.byref(params)
        )
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama_model_quantize to {kind} failed ({rc})")
        tmp.rename(out)
    return out


def curve(rt: Runtime, reps: int) -> dict[int, float]:
    """Median ms of a decode of n tokens after the prompt, per n, interleaved over `reps` rounds."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, PROMPT).tolist()
    rt.decode(prompt, list(range(PROMPT)), [[0]] * PROMPT, [False] * (PROMPT - 1) + [True], embeddings=False)
    times: dict[int, list[float]] = {n: [] for n in SIZES}
    for r in range(reps + 2):  # two warm-up rounds
        for n in SIZES:
            toks = rng.integers(100, 40000, n).tolist()
            t0 = time.perf_counter()
            rt.decode(toks, list(range(PROMPT, PROMPT + n)), [[0]] * n, [True] * n, embeddings=True)
            dt = time.perf_counter() - t0
            rt.seq_rm(0, PROMPT)
            if r >= 2:
                times[n].append(1000 * dt)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="docs/results/llama-cpp/weight-types/curves.json")
    args = ap.parse_args()
    rows = []
    for kind in args.types.split(","):
        path = gguf_of(kind)
        for extra in (True, False):
            rt = Runtime(path, threads=args.threads, n_ctx=512, kv_type="f16", extra_bufts=extra)
            ms = curve(rt, args.reps)
            rows.append({"weights": kind, "repack": extra, "file_mb": path.stat().st_size / 2**20, "ms": ms})
            print(kind, "repack" if extra else "plain", {n: round(v, 2) for n, v in ms.items()}, flush=True)
            del rt
    table = Table(
        title=f"llama_decode of n tokens after {PROMPT}, ms (x the 1-token decode); {args.threads} threads"
    )
    for col in ("weights", "repack", "MB", *[f"n={n}" for n in SIZES]):
        table.add_column(col, justify="right")
    for r in rows:
        one = r["ms"][1]
        cells = [f"{r['ms'][n]:.2f}" + ("" if n == 1 else f" ({r['ms'][n] / one:.2f}x)") for n in SIZES]
        table.add_row(r["weights"], "on" if r["repack"] else "off", f"{r['file_mb']:.0f}", *cells)
    Console(width=160).print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "reps": args.reps, "prompt_tokens": PROMPT, "machine": record("cpu")}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
