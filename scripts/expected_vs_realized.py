"""How well the default engine's policy (without lookup drafts) predicts its own steps, live: per size of the
chosen tree, the tokens the policy expected a step to emit (`expected_tokens`, what it chose by) against the
tokens the steps emitted, and the online calibration's scale. A model that overstates the big trees' steps
picks them too often; one that understates the small trees' picks plain steps too often.

    .venv/bin/python scripts/expected_vs_realized.py --task writing --temperature 0.7 [--acceptance sample]
"""

from __future__ import annotations

import argparse
import statistics

from entmtp.build import EngineSpec, build_engine
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts

BUCKETS = ((0, 0), (1, 3), (4, 5), (6, 10_000))  # tree nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="writing")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--acceptance", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = build_engine(EngineSpec(dtype=args.dtype, threads=args.threads))
    steps = []
    for i, prompt in enumerate(load_prompts(args.task, "test", args.num_prompts)):
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i)
        steps += engine.generate(prompt, acceptance=args.acceptance, **kw).steps
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


if __name__ == "__main__":
    main()
