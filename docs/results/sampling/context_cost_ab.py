"""Replay A/B: `dynamic` choosing by the cost curve averaged over its two measured contexts (what the policies
use) or by the curve at each step's own context (interpolated linearly between the 128- and 768-token rows,
extrapolated above), every step charged its own context's cost. Shipped Hydra profiles' greedy and `sample`
traces, the dense curve of docs/results/probe-sizes (the AVX-512/bf16 EPYC). Prints `dynamic` over EntMTP*
per rule and task, both ways.

    .venv/bin/python docs/results/sampling/context_cost_ab.py    # context-cost-ab.txt
"""

import json
from pathlib import Path

import numpy as np
import torch

from entmtp.calibration.replay import TraceRow
from entmtp.calibration.traces import load_traces
from entmtp.costs import CostCurve
from entmtp.policy import StaticPolicy
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.profiles import resolve_profile

CURVE = Path(__file__).parents[1] / "probe-sizes" / "probe-sizes.json"
curve = CostCurve.from_json(json.loads(CURVE.read_text())["curve"])
nodes, rows, contexts = np.array(curve.nodes), np.array(curve.by_context), np.array(curve.contexts)


def ms_at(n: int, position: int) -> float:
    w = max((position - contexts[0]) / (contexts[1] - contexts[0]), 0.0)
    return float(np.interp(n, nodes, (1 - w) * rows[0] + w * rows[1]))


def run(policy, traces, by_context: bool) -> float:
    tokens = ms = 0.0
    for tr in traces:
        row = TraceRow(policy, tr)
        pol = row.policy
        while not row.done:
            ctx = row.context()
            if by_context and pol.master is not None:
                pol.inv_ms = torch.tensor(
                    [1.0 / ms_at(n, ctx.position) for n in range(pol.master.size)], dtype=torch.float32
                )
            choice = pol.choose(ctx)
            step = row.take(choice.tree, choice.signals)
            tokens, ms = tokens + step.tokens, ms + ms_at(row.last_tree.num_nodes, ctx.position)
    return tokens / ms


latency = curve.latency()
for rule in ("greedy", "sample"):
    for task in ("humaneval", "sharegpt", "gsm8k", "writing"):
        profile = resolve_profile(task, "hydra")
        mode = profile.mode_for_rule(rule)
        traces = load_traces(profile, mode)
        static = run(StaticPolicy(profile.best_tree(mode, latency)), traces, False)
        avg = run(profile_policy(profile, "dynamic", mode, latency=latency), traces, False) / static
        own = run(profile_policy(profile, "dynamic", mode, latency=latency), traces, True) / static
        print(
            f"{rule:7} {task:10} dynamic / EntMTP*: averaged curve {avg:.3f}, each step's context {own:.3f}"
        )
