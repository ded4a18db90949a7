"""Does a decode step cost more right after a step of another size? Live, in the engine's own decodes.

Decodes N test prompts of TASK twice over with the default engine (`dynamic`, sizes change from step to step)
and with EntMTP* (`--policy static`: the same size every step), interleaved, and prints the median verify ms
of each (policy, drafted nodes, what the previous step was: the same size, a plain step, another size) with
at least 8 steps: whether a policy that changes its tree from step to step pays for the change.

    .venv/bin/python docs/results/probe-sizes/step_transitions.py [--task writing] [--num-prompts 5] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch

from entmtp.build import EngineSpec, build_engine
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="writing")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = EngineSpec(profile=args.task, temperature=args.temperature)
    engines = {
        "dynamic": build_engine(spec),
        "static": build_engine(EngineSpec(**{**spec.__dict__, "policy": "static"})),
    }
    by = collections.defaultdict(list)
    for _ in range(2):
        for i, prompt in enumerate(load_prompts(args.task, "test", args.num_prompts)):
            for name, engine in engines.items():
                r = engine.generate(prompt, max_new_tokens=96, temperature=args.temperature, seed=i)
                for prev, step in zip(r.steps, r.steps[1:], strict=False):
                    after = (
                        "same"
                        if prev.tree_nodes == step.tree_nodes
                        else ("plain" if prev.tree_nodes == 0 else "other")
                    )
                    by[(name, step.tree_nodes, after)].append(1000 * step.seconds["verify"])
    print(f"{describe(hardware(engines['static'].model))}, {args.threads} threads, {engines['static'].model.dtype}, "
          f"{args.task}, T={args.temperature}: median verify ms by (policy, nodes, previous step)")  # fmt: skip
    for key in sorted(by):
        if len(by[key]) >= 8:
            print(
                f"  {key[0]:8} {key[1]:3d} nodes after {key[2]:6} {len(by[key]):4d} steps {statistics.median(by[key]):7.2f}"
            )


if __name__ == "__main__":
    main()
