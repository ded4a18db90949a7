"""Is the default below llama.cpp's plain steps on MT-Bench, or is that row noise? (issue #62)

The 13-task run on the AMX Xeon (docs/results/amx/goal-rows-priced) had the default at 0.96x `plain@llama-cpp`
on specbench-mtbench, with the same steps as `default@llama-cpp` (1.00x) and lookup alone (1.01x): five prompts,
one round. This times the default on llama.cpp (`EngineSpec(backend="llama-cpp")`, what `generate` builds there)
against llama.cpp's plain steps through entmtp's engine (no heads, no lookup) on more prompts, in several
rounds, the two alternating (which goes first alternates too), greedy, 96 new tokens, the embedded model.

    python docs/results/never-slower/mtbench/measure.py [--task mt_bench] [--prompts 20] [--rounds 3] [--out DIR]

Prints a table and writes results.json: per round and in all, the default's tokens/s over plain's (ratio of
sums; prefill included, a request's whole time), a 95% bootstrap interval of the mean per-prompt ratio, the
share of the default's steps that drafted, and how many outputs equal plain's (on llama.cpp's Q4_1 weights a
verified chain rounds otherwise than one-token steps, so greedy texts part at near-ties: the bench's "identical").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from entmtp.build import build
from entmtp.build.loaded import Loader
from entmtp.engine_args import EngineSpec
from entmtp.lookup import Lookup
from entmtp.machine import cpu_info, versions
from entmtp.model import encode_prompt
from entmtp.prompts import load_prompts

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mt_bench")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(HERE / "amx"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    loader = Loader()
    spec = EngineSpec(backend="llama-cpp", threads=2, lookup=Lookup())
    built = build(spec, loader=loader, log=lambda m: None)
    plain_spec = replace(built.loaded.spec, heads="none", lookup=None)
    plain = build(plain_spec, loader=loader, log=lambda m: None).engine
    engines = {"default": built.engine, "plain": plain}
    prompts = load_prompts(args.task, "test", args.prompts)
    ids = [encode_prompt(built.engine.tokenizer, p) for p in prompts]
    for e in engines.values():  # warm: first calls of each shape
        e.generate(ids[0], max_new_tokens=16)
    runs = []
    for rnd in range(args.rounds):
        for i, prompt in enumerate(ids):
            order = list(engines) if (rnd + i) % 2 == 0 else list(engines)[::-1]
            row = {"round": rnd, "prompt": i}
            for name in order:
                r = engines[name].generate(prompt, max_new_tokens=args.max_new_tokens)
                row[name] = dict(tokens=len(r.token_ids), seconds=r.seconds, steps=r.num_steps,
                                 drafted=sum(1 for s in r.steps if s.tree_nodes > 0), ids=r.token_ids)  # fmt: skip
            runs.append(row)
    summary = report(runs, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        command="python docs/results/never-slower/mtbench/measure.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        machine=cpu_info(), versions=versions(), plan=built.plan.describe(), summary=summary,
        runs=[{k: ({kk: vv for kk, vv in v.items() if kk != "ids"} if isinstance(v, dict) else v)
               for k, v in r.items()} for r in runs],
    ), indent=1) + "\n")  # fmt: skip


def report(runs: list[dict], rounds: int) -> dict:
    """The table (printed) and its figures: per round and all rounds."""
    print("| rounds | prompts | default tokens/s | plain tokens/s | default / plain (ratio of sums) | "
          "per-prompt mean (95% CI) | default's steps that drafted | outputs equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for label, rows in [
        *((f"{r + 1}", [x for x in runs if x["round"] == r]) for r in range(rounds)),
        ("all", runs),
    ]:
        d, p = ([x[name] for x in rows] for name in ("default", "plain"))
        rate_d = sum(x["tokens"] for x in d) / sum(x["seconds"] for x in d)
        rate_p = sum(x["tokens"] for x in p) / sum(x["seconds"] for x in p)
        ratios = np.array(
            [(a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"]) for a, b in zip(d, p, strict=True)]
        )
        boot = np.random.default_rng(0).choice(ratios, (2000, len(ratios))).mean(axis=1)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        drafted = sum(x["drafted"] for x in d) / sum(x["steps"] for x in d)
        equal = sum(a["ids"] == b["ids"] for a, b in zip(d, p, strict=True))
        summary[label] = dict(default_tps=rate_d, plain_tps=rate_p, ratio=rate_d / rate_p, mean=float(ratios.mean()),
                              ci=[float(lo), float(hi)], drafted=drafted, equal=f"{equal}/{len(rows)}")  # fmt: skip
        print(
            f"| {label} | {len(rows)} | {rate_d:.1f} | {rate_p:.1f} | {rate_d / rate_p:.3f}x | "
            f"{ratios.mean():.3f}x ({lo:.3f}-{hi:.3f}) | {100 * drafted:.0f}% | {equal}/{len(rows)} |"
        )
    return summary


if __name__ == "__main__":
    main()
