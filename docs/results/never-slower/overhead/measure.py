"""Where a decode step's time goes, per backend (issue #62's overhead breakdown): the default that `entmtp
generate` builds on each backend against that backend's plain decoding, split into the engine's phases
(`Step.seconds`: the heads' probe, the policy's choice, drafting, the verification forward, acceptance, the
commit) and what lies outside them (the step record, the text, the policy's observation: wall time between two
steps less the phases). Run it with the code of one commit on the path; it prints a table and writes JSON.

    PYTHONPATH=src python docs/results/never-slower/overhead/measure.py --out docs/results/never-slower/overhead/HEAD.json
    # the code before #62's work, from a worktree of 206d074 (git worktree add BEFORE 206d074):
    PYTHONPATH=BEFORE/src python docs/results/never-slower/overhead/measure.py --out docs/results/never-slower/overhead/before.json

Prompts: the first GSM8K and MT-Bench test prompts (4 of each), greedy, 96 new tokens, 2 threads, each engine
built once and run twice over the prompts (the second pass is kept).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from entmtp.build import EngineSpec, build_engine
from entmtp.lookup import Lookup
from entmtp.machine import cpu_info
from entmtp.prompts import load_prompts

PHASES = ("probe", "choose", "draft", "verify", "accept", "commit")
NEW_TOKENS = 96


def steps_of(engine, prompts: list[str]) -> tuple[list, float, int]:
    """(every step of the prompts' generations, their decode wall seconds, their tokens after the first)."""
    steps, wall, tokens = [], 0.0, 0
    for p in prompts:
        r = engine.generate(p, max_new_tokens=NEW_TOKENS)
        steps += r.steps
        wall += r.seconds - r.prefill_seconds
        tokens += len(r.token_ids) - 1
    return steps, wall, tokens


def breakdown(steps: list, wall: float, tokens: int) -> dict:
    """ms per token of each phase (summed over the steps, over the tokens they emitted), and the rest."""
    row = {p: 1000 * sum(s.seconds.get(p, 0.0) for s in steps) / tokens for p in PHASES}
    row["outside"] = 1000 * wall / tokens - sum(row.values())
    row["ms_per_token"] = 1000 * wall / tokens
    row["tokens_per_step"] = tokens / len(steps)
    row["median_step_ms"] = 1000 * statistics.median(s.seconds["total"] for s in steps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    prompts = load_prompts("gsm8k", "test", 4) + load_prompts("mt_bench", "test", 4)
    rows = {}
    for backend in ("llama-cpp", "transformers"):
        engines = {
            "default": build_engine(EngineSpec(backend=backend, lookup=Lookup(), threads=2)),
            "plain": build_engine(EngineSpec(backend=backend, heads="none", lookup=None, threads=2)),
        }
        for name, engine in engines.items():
            steps_of(engine, prompts[:2])  # warm
            rows[f"{name}@{backend}"] = breakdown(*steps_of(engine, prompts))
    import entmtp

    here = Path(entmtp.__file__).resolve().parents[2]  # the checkout whose code ran
    commit = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    commit = commit.stdout.strip()
    print("| engine | ms/token | tokens/step | " + " | ".join(PHASES) + " | outside the phases |")
    print("|---" * (len(PHASES) + 4) + "|")
    for name, r in rows.items():
        cells = " | ".join(f"{r[p]:.3f}" for p in PHASES)
        print(
            f"| {name} | {r['ms_per_token']:.2f} | {r['tokens_per_step']:.2f} | {cells} | {r['outside']:.3f} |"
        )
    out = dict(
        machine=cpu_info(), torch=torch.__version__, checkout=commit, at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        new_tokens=NEW_TOKENS, prompts=len(prompts), rows=rows,
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
