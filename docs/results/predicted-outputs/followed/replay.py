"""Replay the hybrid's choices for a prediction's chains on llama.cpp's greedy outputs of edits, on a measured
curve: how the chains are sized against an oracle's, without running the model per policy.

    python docs/results/predicted-outputs/followed/replay.py --out docs/results/predicted-outputs/followed/replay.json

1. llama-cpp-python's greedy outputs (the embedded Q4_1 GGUF, plain decoding) of the `edits` task's 20
   calibration prompts and first 30 test prompts, 160 new tokens;
2. on each, the steps entmtp's default on llama.cpp takes with the prediction where no heads' tree pays (a
   lookup branch of up to `prediction.PREDICTION.tokens`, `scheduler.hybrid.HybridPolicy`, priced on the curve of
   `../bound/amx.json`, the AMX Xeon's): every step's chain is the one the text's index offers
   (`lookup.NgramIndex` with the prediction's session), accepted as far as it matches the output; and an oracle
   that drafts each chain's right part;
3. per step, the prediction's alignment (how many of the text's last tokens it holds, up to MAX_ALIGN), the
   chain drafted and how far the chain offered was right.
Decode only (the prefill is the same for all): tokens per step and tokens per one-token decode's time.
Greedy outputs are the same whatever drafts, so a replay walks the steps a run would take (up to the Q4_1
rounding of a many-token step, which can part the texts at near ties). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from entmtp.bench.peers import LlamaCppPlain
from entmtp.lookup import NgramIndex
from entmtp.machine import cpu_info, versions
from entmtp.model import embedded_model_dir, encode_prompt
from entmtp.policy import StaticPolicy
from entmtp.prediction import MAX_ALIGN, PREDICTION, Prediction
from entmtp.prompts import load_prompts
from entmtp.records import Step, StepContext
from entmtp.scheduler.hybrid import HybridPolicy
from entmtp.scheduler.policies import LatencyModel
from entmtp.tree import Tree

HERE = Path(__file__).parent


def outputs(split: str, n: int | None, max_new_tokens: int) -> list[dict]:
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    peer = LlamaCppPlain(n_threads=torch.get_num_threads())
    rows = []
    for p in load_prompts("edits", split=split, n=n):
        ids = encode_prompt(tok, p)
        out = list(peer.generate(ids, max_new_tokens=max_new_tokens).token_ids)
        rows.append(
            {"prompt": ids, "prediction": tok.encode(p.prediction, add_special_tokens=False), "output": out}
        )
    return rows


def right(chain, output, p) -> int:
    a = 0
    while a < len(chain) and p + a < len(output) and chain[a] == output[p + a]:
        a += 1
    return a


def replay(row: dict, curve: LatencyModel, oracle: bool) -> list[dict]:
    """The steps over `row`'s output: {aligned, drafted, right (of the chain offered, up to 31)}."""
    session = Prediction(row["prediction"]).begin(row["prompt"])
    index = NgramIndex(row["prompt"], PREDICTION.max_ngram, prefix=row["prediction"], prediction=session)
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), PREDICTION, curve)
    out, p, steps = row["output"], 0, []
    while p < len(out):
        text = index.tokens[index.start :]
        # (the code before PredictionSession, run with its src on PYTHONPATH: no alignment to report)
        aligned = session.prediction.align(text)[0] if hasattr(session, "prediction") else 0
        offered = right(index.draft(text, 31).tokens, out, p)
        if oracle:
            k = offered
        else:
            k = policy.choose(
                StepContext(len(steps), len(index.tokens), len(out) - p, None, lookup=index)
            ).tree
            k = k.num_lookup
        a = min(k, offered)
        new = out[p : p + a + 1]
        if not oracle:
            policy.observe(
                Step(f"L{k}", k, a, len(new), new, lookup_nodes=k, sources={"heads": 0, "lookup": a})
            )
        steps.append({"aligned": aligned, "drafted": k, "right": offered})
        index.extend(new)
        p += len(new)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curve", default=str(HERE.parent / "bound" / "amx.json"))
    ap.add_argument("--test-prompts", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    bound = json.loads(Path(args.curve).read_text())["summary"]
    rel = {int(k): v for k, v in bound["relative_curve"].items()}
    one = bound["one_token_ms"]
    curve = LatencyModel([k - 1 for k in sorted(rel)], [rel[k] * one for k in sorted(rel)])

    def cost(drafted: int) -> float:
        return float(curve([drafted])[0]) / one

    report, table = {}, []
    for split, n in (("calib", None), ("test", args.test_prompts)):
        rows = outputs(split, n, args.max_new_tokens)
        tokens = sum(len(r["output"]) for r in rows)
        for name, oracle in (("default", False), ("oracle", True)):
            steps = [s for r in rows for s in replay(r, curve, oracle)]
            time = sum(cost(s["drafted"]) for s in steps)
            by = defaultdict(list)
            for s in steps:
                by[min(s["aligned"], MAX_ALIGN)].append(s)
            report[f"{split}/{name}"] = {
                "tokens": tokens, "steps": len(steps), "tokens_per_step": tokens / len(steps),
                "decode_speedup": tokens / time,
                "by_alignment": {a: {"steps": len(v), "mean_drafted": sum(s["drafted"] for s in v) / len(v),
                                     "first_right": sum(s["right"] > 0 for s in v) / len(v),
                                     "mean_right": sum(s["right"] for s in v) / len(v)} for a, v in sorted(by.items())},
            }  # fmt: skip
            table.append((split, name, tokens / len(steps), tokens / time))
    print("| prompts | chains | tokens/step | decode over plain (this curve) |\n|---|---|---|---|")
    for split, name, tps, speed in table:
        print(f"| {split} | {name} | {tps:.2f} | {speed:.2f}x |")
    full = report["calib/default"]["by_alignment"]
    print("\ncalibration prompts, the default's steps by the prediction's alignment:")
    for a, s in full.items():
        print(
            f"  aligned {a}: {s['steps']} steps, drafted {s['mean_drafted']:.1f} on average, the chain offered right "
            f"at its first token {s['first_right']:.0%}, {s['mean_right']:.1f} tokens deep on average"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "command": f"python docs/results/predicted-outputs/followed/replay.py --out {args.out}",
                "machine": cpu_info(),
                "versions": versions(),
                "curve": _shown(args.curve),
                "report": report,
            },
            indent=1,
        )
    )


def _shown(path: str) -> str:
    """A path as the results record it: relative to docs/results/predicted-outputs where it lies there, else its
    name (no machine's absolute path)."""
    try:
        return str(Path(path).resolve().relative_to(HERE.parent.resolve()))
    except ValueError:
        return Path(path).name


if __name__ == "__main__":
    main()
