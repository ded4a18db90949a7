"""What the default engine's hybrid did, step by step, on a task's test prompts: how many steps took the heads'
tree with a lookup chain, the heads' tree alone, the chain alone or a plain step, what each kind emitted and
cost, and where the rest of a step's time went (probe, choose, draft, verify). With `--lookup-alone`, entmtp's
prompt lookup alone instead, for comparison.

    .venv/bin/python docs/results/hardware-aware/hybrid_steps.py --task specbench-rag --dtype float32 [--lookup-alone]
"""

from __future__ import annotations

import argparse
import statistics

from entmtp.build import EngineSpec, build_engine
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts

PHASES = ("probe", "choose", "draft", "verify", "accept", "commit", "total")


def kind(step) -> str:
    heads, chain = step.tree_nodes > step.lookup_nodes, step.lookup_nodes > 0
    return {(True, True): "heads + chain", (True, False): "heads alone", (False, True): "chain alone"}.get(
        (heads, chain), "plain"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="specbench-translation")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup-alone", action="store_true")
    args = ap.parse_args()
    heads = "none" if args.lookup_alone else None
    engine = build_engine(EngineSpec(heads=heads, lookup=Lookup(), dtype=args.dtype, threads=args.threads))
    prompts = load_prompts(args.task, "test", args.num_prompts)
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    results = [engine.generate(p, max_new_tokens=args.max_new_tokens) for p in prompts]
    steps = [s for r in results for s in r.steps]
    method = "lookup alone" if args.lookup_alone else "default"
    print(f"{describe(hardware(engine.model))}; {args.dtype}, {args.threads} threads; {args.task}, {method}")
    tokens, seconds = sum(s.tokens for s in steps), sum(s.seconds["total"] for s in steps)
    print(
        f"{len(steps)} steps, {tokens} tokens, {tokens / len(steps):.2f} a step, {tokens / seconds:.1f} tokens/s"
    )
    print(f"{'kind':<14}{'steps':>7}{'tokens/step':>13}{'ms/step':>9}{'nodes':>7}{'tokens/s':>10}")
    for name in ("heads + chain", "heads alone", "chain alone", "plain"):
        group = [s for s in steps if kind(s) == name]
        if group:
            t, sec = sum(s.tokens for s in group), sum(s.seconds["total"] for s in group)
            nodes = statistics.mean(s.tree_nodes for s in group)
            row = f"{name:<14}{len(group):>7}{t / len(group):>13.2f}{1000 * sec / len(group):>9.1f}"
            print(f"{row}{nodes:>7.1f}{t / sec:>10.1f}")
    skipped = sum(s.signals.get("probed") == 0.0 for s in steps)
    print(f"steps chosen without probing the heads: {skipped}")
    print("ms a step by phase:")
    print(f"{'kind':<14}" + "".join(f"{p:>8}" for p in PHASES))
    for name in ("heads + chain", "heads alone", "chain alone", "plain", "all"):
        group = [s for s in steps if name in ("all", kind(s))]
        if group:
            print(
                f"{name:<14}"
                + "".join(
                    f"{1000 * statistics.mean(s.seconds.get(p, 0.0) for s in group):>8.2f}" for p in PHASES
                )
            )
    # the policy's observe and the event's text, between one step's clock and the next
    between = sum(r.seconds - r.prefill_seconds for r in results) - seconds
    print(
        f"ms a step outside the steps' clocks (observe, the event's text): {1000 * between / len(steps):.2f}"
    )


if __name__ == "__main__":
    main()
