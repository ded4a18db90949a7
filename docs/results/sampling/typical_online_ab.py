"""Replay A/B: typical acceptance's `dynamic` with and without an online scale of its depth-1 rates, the scale
fed by exact per-candidate passes (whether each of the master's depth-1 drafts passes the typical test at the
root, which a trace's union passes record), as `OnlineCalibration` does for the exclusive rules from the
emitted token. Shipped Hydra profiles' typical traces, two folds (fit the acceptance model on one half,
replay the other), steps charged the dense curve of docs/results/probe-sizes (the AVX-512/bf16 EPYC).
Prints `dynamic` over EntMTP* per task, without and with the online scale.

    .venv/bin/python docs/results/sampling/typical_online_ab.py    # typical-online-ab.txt
"""

import json
from pathlib import Path

import numpy as np

from entmtp.calibration.calibrate import fit_acceptance
from entmtp.calibration.replay import TraceRow, step_ms
from entmtp.calibration.traces import load_traces
from entmtp.costs import CostCurve
from entmtp.policy import StaticPolicy
from entmtp.scheduler.policies import CALIBRATION_PRIOR, CALIBRATION_WINDOW, DynamicPolicy
from entmtp.scheduler.profiles import resolve_profile

CURVE = Path(__file__).parents[1] / "probe-sizes" / "probe-sizes.json"
curve = CostCurve.from_json(json.loads(CURVE.read_text())["curve"])
latency = curve.latency()
ms_of = step_ms(latency)


def run(policy, traces, online: bool) -> float:
    """Replayed tokens/s; `online`: the depth-1 rates scaled by (passes + w) / (predicted + w), decayed."""
    tokens = ms = 0.0
    for tr in traces:
        row = TraceRow(policy, tr)
        pol, master = row.policy, row.policy.master
        firsts = [] if master is None else [int(i) for i in (master.depths == 1).nonzero().flatten()]
        col = {p: i for i, p in enumerate(tr.union.paths)}
        cols = [col[master.paths[i]] for i in firsts]
        hits = predicted = 0.0
        while not row.done:
            j, ctx = row.j, row.context()
            if firsts:
                base = pol.paths.rates(ctx.probe.logprobs)
                scaled = base.clone()
                if online:
                    scale = (hits + CALIBRATION_PRIOR) / (predicted + CALIBRATION_PRIOR)
                    scaled[firsts] = (base[firsts] * scale).clamp(max=0.999)
                pol._rates = lambda _ctx, f=scaled: f
            choice = pol.choose(ctx)
            step = row.take(choice.tree, choice.signals)
            if firsts:
                decay = 1.0 - 1.0 / CALIBRATION_WINDOW
                hits = decay * hits + float(tr.passes[j, cols].float().sum())
                predicted = decay * predicted + float(base[firsts].sum())
            tokens, ms = tokens + step.tokens, ms + ms_of(row.last_tree)
    return tokens / ms


for task in ("humaneval", "sharegpt", "gsm8k", "writing"):
    profile = resolve_profile(task, "hydra")
    mode = profile.mode_for_rule("typical")
    traces = load_traces(profile, mode)
    master = profile.trees(mode)[profile.mode(mode).master.name]
    ratios = {False: [], True: []}
    for fit, held in ((traces[0::2], traces[1::2]), (traces[1::2], traces[0::2])):
        model = fit_acceptance(fit, 1, master.depth, "typical")
        static = run(StaticPolicy(profile.best_tree(mode, latency)), held, False)
        for online in ratios:
            ratios[online].append(run(DynamicPolicy(master, model, latency), held, online) / static)
    print(
        f"{task:10} dynamic / EntMTP*: fixed {np.mean(ratios[False]):.3f}, online depth-1 scale {np.mean(ratios[True]):.3f}"
    )
