"""The same plain greedy generation on the thread that built the engine and on a second thread: median verify
ms per step of each (why `entmtp serve` builds and decodes on one thread: src/entmtp/server/thread.py).

    .venv/bin/python docs/results/server-batching/torch_thread_check.py --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import threading

import torch

from entmtp.build import EngineSpec, build
from entmtp.machine import cpu_info

PROMPT = "Tell me a short story about a robot learning to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    engine = build(EngineSpec(dtype=args.dtype, threads=args.threads, heads="none")).engine
    cpu = cpu_info()
    print(f"machine: {cpu['name']}, flags {' '.join(cpu['flags'])}; torch {torch.__version__}, {args.dtype}")

    def run(where: str) -> None:
        result = engine.generate(PROMPT, max_new_tokens=args.max_new)
        ms = 1000 * statistics.median(s.seconds["verify"] for s in result.steps)
        print(f"{where:28s} median verify {ms:5.1f} ms/step ({len(result.steps)} steps)")

    run("the thread that built it")
    run("the thread that built it")
    for _ in range(2):
        t = threading.Thread(target=run, args=("a second thread",))
        t.start()
        t.join()


if __name__ == "__main__":
    main()
