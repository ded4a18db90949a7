"""A/B, live: `dynamic` built on this machine's probed step-cost curve (A) or on the curve with EXTRA ms added
to every size (B: a per-step cost the probe does not see), against EntMTP* (`--policy static`), each task's
own profile, lossless acceptance at T (0: greedy), N test prompts twice over, interleaved per prompt.

    .venv/bin/python docs/results/sampling/live-epyc-avx512/overhead_ab.py TASK EXTRA N [T]
"""

import sys

import torch

import entmtp.costs as costs
from entmtp.build import EngineSpec, build_engine
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts

torch.set_num_threads(2)
task, extra, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
T = float(sys.argv[4]) if len(sys.argv) > 4 else 0.7
orig = costs.CostCurve.latency
engines = {}
engines["A"] = build_engine(EngineSpec(profile=task, temperature=T, acceptance="auto"))
costs.CostCurve.latency = lambda self: costs.LatencyModel(self.nodes, [m + extra for m in self.step_ms])
engines["B"] = build_engine(EngineSpec(profile=task, temperature=T, acceptance="auto"))
costs.CostCurve.latency = orig
engines["static"] = build_engine(EngineSpec(profile=task, temperature=T, acceptance="auto", policy="static"))
print(describe(hardware(engines["A"].model)), task, "extra", extra)
tot = {k: [0, 0.0, 0] for k in engines}
for _ in range(2):
    for i, p in enumerate(load_prompts(task, "test", n)):
        for k, e in engines.items():
            r = e.generate(p, max_new_tokens=96, temperature=T, seed=i)
            tot[k][0] += len(r.token_ids)
            tot[k][1] += r.seconds
            tot[k][2] += r.num_steps
for k, (t, s, st) in tot.items():
    print(
        f"{k:8} {t / s:7.1f} tok/s  {t / st:5.2f} tok/step  vs static {t / s / (tot['static'][0] / tot['static'][1]):.3f}"
    )
