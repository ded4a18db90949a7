"""llama.cpp's verification curve on this CPU, by build: a decode of k tokens (1: a plain step; 2-16: a verified
chain) after a context of c tokens, on the shipped Q4_1 GGUF and the Q8_0 file entmtp writes, with the weights
repacked and flash attention as the backend chooses them here (backends/amx.py, backends/attention.py). Each
size is timed in alternation with the others, medians of --reps. Prints a table and writes JSON naming the build.

    python docs/results/llama-cpp-rows/measure.py --label after --out docs/results/llama-cpp-rows/<machine>-after.json

The build measured is whichever llama_cpp Python imports: put an unpacked earlier wheel first on PYTHONPATH
to measure it (README.md says which).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from entmtp.backends.gguf import embedded_in_format
from entmtp.backends.llama_build import build_record
from entmtp.backends.llama_cpp import Runtime
from entmtp.bench.peers import embedded_gguf
from entmtp.machine import cpu_info, versions

CONTEXTS = (128, 512)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CHUNK = 256  # prompt tokens per llama_decode (the backend's batch is 512)


def curve(path: Path, threads: int, reps: int) -> tuple[list[dict], dict]:
    """Rows {format, context, tokens, ms, ratio} of the file at `path`, and the runtime's settings."""
    rt = Runtime(path, threads=threads, n_ctx=1024)
    seq = rt.take_seq()
    rows = []
    for c in CONTEXTS:
        rt.seq_rm(seq, 0)
        ids = [100 + (i * 7919) % 40000 for i in range(c)]
        for s in range(0, c, CHUNK):
            part = ids[s : s + CHUNK]
            rt.decode(
                part,
                list(range(s, s + len(part))),
                [[seq]] * len(part),
                [False] * (len(part) - 1) + [True],
                False,
            )
        times: dict[int, list[float]] = {k: [] for k in SIZES}
        for r in range(reps + 2):  # the first two rounds dropped (warm-up)
            for k in SIZES:
                tokens = [500 + (r * 31 + i) % 997 for i in range(k)]
                t = time.perf_counter()
                rt.decode(tokens, list(range(c, c + k)), [[seq]] * k, [True] * k, embeddings=False)
                seconds = time.perf_counter() - t
                rt.seq_rm(seq, c)  # back to the context
                if r >= 2:
                    times[k].append(seconds)
        one = statistics.median(times[1])
        for k in SIZES:
            ms = 1000 * statistics.median(times[k])
            rows.append(dict(context=c, tokens=k, ms=ms, ratio=ms / (1000 * one)))
    settings = dict(repacked=rt.extra_bufts, flash_attention=rt.flash_attn)
    rt.give_seq(seq)
    return rows, settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", required=True, help="the build's name in the table (before, after)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="timed decodes per (file, context, size)")
    args = ap.parse_args()
    files = {"Q4_1": Path(embedded_gguf()), "Q8_0": Path(embedded_in_format("Q8_0"))}
    out = dict(label=args.label, build=build_record(), machine=cpu_info(), versions=versions(),
               threads=args.threads, reps=args.reps, formats={})  # fmt: skip
    print(f"| format | context | {' | '.join(f'{k} tok' for k in SIZES)} |")
    print(f"|---|---|{'---|' * len(SIZES)}")
    for fmt, path in files.items():
        rows, settings = curve(path, args.threads, args.reps)
        out["formats"][fmt] = dict(file=path.name, settings=settings, rows=rows)
        for c in CONTEXTS:
            cells = [f"{r['ms']:.2f} ({r['ratio']:.2f}x)" for r in rows if r["context"] == c]
            print(f"| {fmt} | {c} | {' | '.join(cells)} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
