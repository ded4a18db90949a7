"""A one-off record: entmtp's plain decoding with this change against the code before it (or against a variant
not adopted), interleaved in one process with transformers' generate as the control.

    python docs/results/plain-step/ab.py --against head [--rounds 6] [--tokens 64] [--out FILE.json]
    python docs/results/plain-step/ab.py --against step-without-mask ...

`--against head` swaps back, for the "before" runs, what the change replaced: the prefill's explicit causal
mask and LM head over every prompt position (`BaseModel.forward` as at commit 0fa7d19), the detokenizer that
decodes the whole output every step, and the zero-filled KV cache. `--against step-without-mask` runs, as
"before", a variant NOT adopted: the one-token step with no attention mask (what transformers' generate
runs; faster, but it rounds differently in bfloat16, see README.md). Same prompts, timing and quiet-waiting
as docs/results/plain-step/plain_step_check.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers

import entmtp.cache as C
from entmtp.bench.peers import HFGenerate
from entmtp.engine import Engine
from entmtp.model import encode_prompt, load_model
from entmtp.prompts import load_prompts
from entmtp.text import Detokenizer as _Detokenizer  # engine.py's until 9564a0a

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plain_step_check.py, beside this file
from plain_step_check import PROMPTS, machine, run_entmtp, run_hf, wait_quiet  # noqa: E402

NEW_FORWARD, NEW_PUSH, TORCH = C.BaseModel.forward, _Detokenizer.push, C.torch


def head_forward(self, tokens, tree, cache, *, logits_to_keep=0):  # BaseModel.forward at 0fa7d19 (KVCache)
    n, past, dev = tokens.numel(), cache.length, tokens.device
    depths = torch.arange(n) if tree is None else tree.depths
    positions = (past + depths).to(dev)
    cache.begin(n)
    mask = torch.ones(n, past + n, dtype=torch.bool, device=dev)
    mask[:, past:] = C.tree_mask(tree, n).to(dev)
    return self.run(tokens, positions, mask, cache)


def head_push(self, new, final=False):  # _Detokenizer.push at 0fa7d19 (no stop-string hold-back then)
    self.ids += new
    text = self.final_text()
    if text.endswith("\ufffd") and self.stopped_at is None:
        return ""
    delta, self.sent = text[self.sent :], len(text)
    return delta


class _ZeroFilled:  # torch, with the KV cache's torch.empty back to torch.zeros
    empty = staticmethod(torch.zeros)

    def __getattr__(self, name):
        return getattr(torch, name)


def step_without_mask(self, tokens, tree, cache, *, logits_to_keep=0):
    if tree is not None and tree.num_nodes == 0 and not cache.static and cache.length > 0:
        cache.begin(1)
        return self.run(tokens, (cache.length + tree.depths).to(tokens.device), None, cache)
    return NEW_FORWARD(self, tokens, tree, cache, logits_to_keep=logits_to_keep)


def use(before: bool, against: str) -> None:
    if against == "head":
        C.BaseModel.forward = head_forward if before else NEW_FORWARD
        _Detokenizer.push = head_push if before else NEW_PUSH
        C.torch = _ZeroFilled() if before else TORCH
    else:
        C.BaseModel.forward = step_without_mask if before else NEW_FORWARD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", choices=["head", "step-without-mask"], required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    report = {"machine": machine(), "args": vars(args), "runs": {}}
    keys = ("prefill", "step", "wall_per_token", "total")
    for dtype in ("bfloat16", "float32"):
        model, tok = load_model(dtype=dtype)
        engine, peer = Engine(model, tok), HFGenerate(model, tok)
        prompts = {k: encode_prompt(tok, load_prompts(t, "test")[i]) for k, (t, i) in PROMPTS.items()}
        runs = {k: {"before": [], "after": [], "hf": []} for k in prompts}
        for r in range(args.rounds):
            for name, ids in prompts.items():
                wait_quiet()
                for who in ["before", "after", "hf"] if r % 2 == 0 else ["hf", "after", "before"]:
                    if who == "hf":
                        runs[name][who].append(run_hf(peer, ids, args.tokens))
                    else:
                        use(who == "before", args.against)
                        runs[name][who].append(run_entmtp(engine, ids, args.tokens))
                        use(False, args.against)
            print(f"{dtype}: round {r + 1}/{args.rounds}", flush=True)
        for name, ids in prompts.items():
            got = {w: runs[name][w][1:] for w in runs[name]}  # the first round is the warm-up
            med = {w: {k: statistics.median(x[k] for x in got[w]) * 1e3 for k in keys} for w in got}
            spread = {
                w: {k: [min(x[k] for x in got[w]) * 1e3, max(x[k] for x in got[w]) * 1e3] for k in keys}
                for w in got
            }
            toks = {w: [x["tokens"] for x in runs[name][w]] for w in runs[name]}
            same = all(t == toks["after"][0] for t in toks["before"] + toks["after"])
            report["runs"][f"{dtype}/{name}"] = {
                "prompt_tokens": len(ids),
                "median_ms": med,
                "min_max_ms": spread,
                "before_after_same_tokens": same,
                "hf_same_tokens": toks["hf"][0] == toks["after"][0],
            }
            print(
                f"{dtype} {name} (P={len(ids)}): before/after same tokens {same}, hf same {toks['hf'][0] == toks['after'][0]}"
            )
            for k in keys:
                b, a, h = (med[w][k] for w in ("before", "after", "hf"))
                sb, sa, sh = (spread[w][k] for w in ("before", "after", "hf"))
                print(
                    f"  {k:15s} before {b:8.2f} [{sb[0]:.2f}-{sb[1]:.2f}]  after {a:8.2f} [{sa[0]:.2f}-{sa[1]:.2f}]"
                    f"  hf {h:8.2f} [{sh[0]:.2f}-{sh[1]:.2f}]  after/before {a / b:.3f}  hf/after {h / a:.3f}"
                    f"  hf/before {h / b:.3f}"
                )
        del engine, peer, model
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
