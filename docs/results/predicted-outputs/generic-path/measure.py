"""Edits with a prediction on llama.cpp's generic path, the one the CPUs without AMX run (issue #61's goal
there: >= 2x llama-cpp-python's plain decoding), measured on an AMX Xeon with the repacked weights off.

    ENTMTP_LLAMA_EXTRA_BUFTS=0 python docs/results/predicted-outputs/generic-path/measure.py --out DIR
    (PYTHONPATH=<an earlier wheel, unpacked> for the build before the patch's Q4_1 tiles)

Engines, 2 threads each, alternating per prompt (which goes first rotates), greedy, the embedded Q4_1 GGUF:
  llama-cpp-python  its own plain decoding (bench/peers.py's `llama-cpp`, as pip's build runs it here)
  plain             entmtp's plain steps on llama.cpp (no heads, no lookup, no prediction)
  llama-cpp-amx     with --patched-peer: the patched build's own plain decoding, its repacked weights on
  default           entmtp's default on llama.cpp (`EngineSpec(backend="llama-cpp")`: heads, lookup and trees as
                    this machine's curve chooses) with the prompt's prediction
The `edits` task (prompts.py: HumanEval test solutions, one of five edit requests in turn, the code as the
prediction), as `entmtp bench --tasks edits` runs it. Prints a table and writes results.json: tokens/s by the
ratio of sums (prefill included), each engine over llama-cpp-python, a 95% bootstrap interval of the mean
per-prompt ratio, tokens per step, and the prediction's accepted and rejected tokens.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from entmtp.backends.llama_build import describe_build
from entmtp.bench.peers import LlamaCppPlain
from entmtp.build import build
from entmtp.build.loaded import Loader
from entmtp.engine_args import EngineSpec
from entmtp.machine import cpu_info, versions
from entmtp.model import encode_prompt
from entmtp.prompts import load_prompts

HERE = Path(__file__).parent
PEER = "llama-cpp-python"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--patched-peer",
        action="store_true",
        help="also llama-cpp-amx: the patched build's plain decoding with its repacked weights on (an AMX CPU)",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    loader = Loader()
    built = build(EngineSpec(backend="llama-cpp", threads=2), loader=loader, log=lambda m: None)
    plain = build(
        replace(built.loaded.spec, heads="none", lookup=None), loader=loader, log=lambda m: None
    ).engine
    engines = {PEER: LlamaCppPlain(n_threads=2), "plain": plain, "default": built.engine}
    if args.patched_peer:
        engines = {"llama-cpp-amx": LlamaCppPlain(n_threads=2, as_patched=True), **engines}
    prompts = load_prompts("edits", "test", args.prompts)
    ids = [encode_prompt(built.engine.tokenizer, p) for p in prompts]
    for name, e in engines.items():  # warm: first calls of each shape
        e.generate(
            ids[0], max_new_tokens=16, **({"prediction": prompts[0].prediction} if name == "default" else {})
        )
    runs = []
    for rnd in range(args.rounds):
        for i, (prompt, tokens) in enumerate(zip(prompts, ids, strict=True)):
            names = list(engines)
            order = names[(rnd + i) % len(names) :] + names[: (rnd + i) % len(names)]
            row = {"round": rnd, "prompt": i}
            for name in order:
                extra = {"prediction": prompt.prediction} if name == "default" else {}
                r = engines[name].generate(tokens, max_new_tokens=args.max_new_tokens, **extra)
                used = getattr(r, "prediction", None)
                row[name] = dict(
                    tokens=len(r.token_ids),
                    seconds=r.seconds,
                    steps=getattr(r, "num_steps", None),
                    accepted=None if used is None else used.accepted,
                    rejected=None if used is None else used.rejected,
                    ids=list(r.token_ids),
                )
            runs.append(row)
    summary = report(runs, list(engines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        command="python docs/results/predicted-outputs/generic-path/measure.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        machine=cpu_info(), versions=versions(), build=describe_build(), plan=built.plan.describe(),
        summary=summary,
        runs=[{k: ({kk: vv for kk, vv in v.items() if kk != "ids"} if isinstance(v, dict) else v)
               for k, v in r.items()} for r in runs],
    ), indent=1) + "\n")  # fmt: skip


def report(runs: list[dict], names: list[str]) -> dict:
    """The table (printed) and its figures, each engine over llama-cpp-python."""
    print("| engine | tokens/s | over llama-cpp-python (ratio of sums) | per-prompt mean (95% CI) | tokens/step | "
          "prediction accepted / rejected | outputs equal plain's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    summary = {}
    peer = [x[PEER] for x in runs]
    rate_peer = sum(x["tokens"] for x in peer) / sum(x["seconds"] for x in peer)
    for name in names:
        rows = [x[name] for x in runs]
        rate = sum(x["tokens"] for x in rows) / sum(x["seconds"] for x in rows)
        ratios = np.array(
            [
                (a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"])
                for a, b in zip(rows, peer, strict=True)
            ]
        )
        lo, hi = np.percentile(
            np.random.default_rng(0).choice(ratios, (2000, len(ratios))).mean(axis=1), [2.5, 97.5]
        )
        steps = [x["steps"] for x in rows if x["steps"]]
        per_step = sum(x["tokens"] for x in rows) / sum(steps) if steps else None
        acc = sum(x["accepted"] or 0 for x in rows)
        rej = sum(x["rejected"] or 0 for x in rows)
        equal = sum(x[name]["ids"] == x["plain"]["ids"] for x in runs)
        summary[name] = dict(tps=rate, over_peer=rate / rate_peer, mean=float(ratios.mean()), ci=[float(lo), float(hi)],
                             tokens_per_step=per_step, accepted=acc, rejected=rej, equal=f"{equal}/{len(runs)}")  # fmt: skip
        print(
            f"| {name} | {rate:.1f} | {rate / rate_peer:.2f}x | {ratios.mean():.2f}x ({lo:.2f}-{hi:.2f}) | "
            f"{'' if per_step is None else f'{per_step:.2f}'} | "
            f"{f'{acc} / {rej}' if name == 'default' else ''} | {equal}/{len(runs)} |"
        )
    return summary


if __name__ == "__main__":
    main()
