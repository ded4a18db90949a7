"""How well the default engine's policy (without lookup drafts) predicts its own steps, live: per size of the
chosen tree, the tokens the policy expected a step to emit (`expected_tokens`, what it chose by) against the
tokens the steps emitted, and the online calibration's scale. A model that overstates the big trees' steps
picks them too often; one that understates the small trees' picks plain steps too often. A second table groups
the steps by the acceptance model's context bucket (head 1's top probability, bucketed by the model's
`ctx_edges`: 0 = least confident), the trees' steps and the plain ones apart.

    .venv/bin/python docs/results/sampling/expected_vs_realized.py --task writing --temperature 0.7 [--acceptance sample]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from entmtp.build import EngineSpec, build_engine
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts
from entmtp.scheduler.policies import DynamicPolicy

BUCKETS = ((0, 0), (1, 3), (4, 5), (6, 10_000))  # tree nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="writing")
    ap.add_argument(
        "--profile", default=None, help="a task's shipped profile or a profile file (default: mixed)"
    )
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--acceptance", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    contexts: list[int] = []  # per choice of the dynamic policy: its context bucket
    choose = DynamicPolicy.choose

    def noting_context(policy, ctx):
        lp = ctx.probe.logprobs.float()
        contexts.append(int(torch.bucketize(lp[0, 0].exp(), policy.paths.ctx_edges)))
        return choose(policy, ctx)

    DynamicPolicy.choose = noting_context
    engine = build_engine(EngineSpec(dtype=args.dtype, threads=args.threads, profile=args.profile))
    steps, context = [], []
    for i, prompt in enumerate(load_prompts(args.task, "test", args.num_prompts)):
        contexts.clear()
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i)
        new = engine.generate(prompt, acceptance=args.acceptance, **kw).steps
        if len(contexts) != len(new):
            raise SystemExit("the default engine here is not the dynamic policy alone: nothing to break down")
        steps += new
        context += contexts
    print(
        f"{describe(hardware(engine.model))}; {engine.model.dtype}; {args.task}, T={args.temperature}, "
        f"{args.acceptance} acceptance, {args.num_prompts} prompts: {len(steps)} steps"
    )
    print(f"{'tree nodes':<12}{'steps':>7}{'expected':>10}{'emitted':>9}{'calibration':>13}")
    for lo, hi in BUCKETS:
        group = [s for s in steps if lo <= s.tree_nodes <= hi]
        if group:
            expected = statistics.mean(s.signals.get("expected_tokens", 1.0) for s in group)
            emitted = statistics.mean(s.tokens for s in group)
            scale = statistics.mean(s.signals.get("calibration", 1.0) for s in group)
            name = f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 10_000 else f"{lo}+"
            print(f"{name:<12}{len(group):>7}{expected:>10.2f}{emitted:>9.2f}{scale:>13.2f}")

    print(f"{'context':<12}{'tree steps':>11}{'expected':>10}{'emitted':>9}{'nodes':>7}{'plain steps':>13}")
    for c in sorted(set(context)):
        trees = [s for s, k in zip(steps, context, strict=True) if k == c and s.tree_nodes]
        plain = sum(k == c and not s.tree_nodes for s, k in zip(steps, context, strict=True))
        row = f"{c:<12}{len(trees):>11}"
        if trees:
            expected = statistics.mean(s.signals["expected_tokens"] for s in trees)
            emitted, nodes = (
                statistics.mean(s.tokens for s in trees),
                statistics.mean(s.tree_nodes for s in trees),
            )
            row += f"{expected:>10.2f}{emitted:>9.2f}{nodes:>7.1f}"
        else:
            row += f"{'':>26}"
        print(f"{row}{plain:>13}")


if __name__ == "__main__":
    main()
