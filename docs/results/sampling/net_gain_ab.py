"""Tried and not kept: `dynamic` choosing each step's subtree by net gain, expected tokens - lam x ms, lam the
rate achieved so far in the generation (tokens over modeled ms, decayed, from plain decoding's rate; the
Dinkelbach rule for a ratio of sums), instead of by expected tokens per ms. Exact replays of the test
generations (greedy: docs/results/replay-policies/outputs.json; lossless sampling:
docs/results/sampling/outputs-sample.json), Hydra heads, each task's shipped profile, the shared cost curves;
prints each method's speed-up over plain and the two ratios (net gain / ratio rule, alone and with lookup).

    .venv/bin/python docs/results/sampling/net_gain_ab.py sample > docs/results/sampling/net-gain-ab.txt
    .venv/bin/python docs/results/sampling/net_gain_ab.py greedy >> docs/results/sampling/net-gain-ab.txt
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, "scripts")
from machine_curves import shared_curves

from entmtp.accept import Sampling
from entmtp.calibration.replay import replay, step_ms
from entmtp.calibration.traces import trace_generation
from entmtp.costs import CostCurve
from entmtp.engine import Engine
from entmtp.lookup import Lookup
from entmtp.model import load_model
from entmtp.policy import Choice, StaticPolicy
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.hybrid import HybridPolicy
from entmtp.scheduler.policies import DynamicPolicy
from entmtp.scheduler.profiles import resolve_profile
from entmtp.shipped import resolve_heads

torch.set_num_threads(2)


class LamDynamic(DynamicPolicy):
    W = float(os.environ.get("LAMW", "32"))

    def reset(self):
        super().reset()
        self.tok = 0.0
        self.ms = 0.0

    def lam(self):
        ms0 = 1.0 / float(self.inv_ms[0])
        w = 4.0
        return (self.tok + w) / (self.ms + w * ms0)

    def observe(self, step):
        super().observe(step)
        d = 1 - 1 / self.W
        self.tok = d * self.tok + step.tokens
        self.ms = d * self.ms + 1.0 / float(self.inv_ms[min(step.tree_nodes, len(self.inv_ms) - 1)])

    def choose(self, ctx):
        rates = self._rates(ctx)
        p = self.paths.along_paths(rates)[1:]
        order = torch.sort(p, descending=True, stable=True).indices
        if self.expected.rule != "typical":
            expected = torch.cat([torch.ones(1), 1.0 + p[order].cumsum(0)])
        else:
            member = torch.zeros(self.master.size, self.master.size)
            member[:, 1 + order] = self.prefixes[:, 1:]
            expected = 1.0 + self.expected(rates, member)
        ms = 1.0 / self.inv_ms
        n = (expected - self.lam() * ms).argmax()
        picked = torch.cat([n.reshape(1), order]).tolist()
        n, ids = picked[0], tuple(sorted(picked[1 : 1 + picked[0]]))
        signals = {"expected_tokens": float(expected[n]), "nodes": float(n), **self._scale()}
        return Choice(self._subtree(ids), signals, None)


def lam_policy(profile, mode, latency):
    p = profile_policy(profile, "dynamic", mode, latency=latency)
    p.__class__ = LamDynamic
    p.tok = p.ms = 0.0
    return p


model, tok = load_model(dtype="bfloat16")
heads = resolve_heads("hydra", model)
engine = Engine(model, tok, heads=heads)
curves = shared_curves()
rules = sys.argv[1].split(",") if len(sys.argv) > 1 else ["sample", "greedy"]
cache = Path("runs/lam_traces")
cache.mkdir(parents=True, exist_ok=True)
res = {}
for rule in rules:
    if rule == "greedy":
        outs = json.load(open("docs/results/replay-policies/outputs.json"))["tasks"]
        sampling = None
        T = 0.0
    else:
        outs = json.load(open(f"docs/results/sampling/outputs-{rule}.json"))["tasks"]
        sampling = Sampling(0.7, rule)
        T = 0.7
    tasks = ["humaneval", "sharegpt", "gsm8k", "writing"]
    for task in tasks:
        profile = resolve_profile(task, "hydra")
        mode = profile.mode_for(T, "auto" if rule == "greedy" else rule)
        f = cache / f"{rule}-{task}.pt"
        if f.exists():
            traces = torch.load(f, weights_only=False)
        else:
            union = profile.mode(mode).trace_tree
            traces = [
                trace_generation(engine.base, heads, ids + out, len(ids), sampling, union and union.tree())
                for ids, out in outs[task]
                if len(out) >= 2
            ]
            torch.save(traces, f)
        stored = profile.latency.model()
        cs = {"calibration": CostCurve.from_latency(list(stored.nodes), list(stored.ms), "stored"), **curves}
        for cname, curve in cs.items():
            latency = curve.latency()
            plain_ms, ms_of = float(latency(0)), step_ms(latency)
            pols = {
                "EntMTP*": StaticPolicy(profile.best_tree(mode, latency)),
                "dynamic": profile_policy(profile, "dynamic", mode, latency=latency),
                "lam": lam_policy(profile, mode, latency),
            }
            if rule != "typical":
                pols["dyn+lookup"] = HybridPolicy(
                    profile_policy(profile, "dynamic", mode, latency=latency), Lookup(), latency
                )
                pols["lam+lookup"] = HybridPolicy(lam_policy(profile, mode, latency), Lookup(), latency)
            r = {k: replay(p, traces, ms_of).to_json() for k, p in pols.items()}
            sp = {k: v["tokens_per_second"] * plain_ms / 1000 for k, v in r.items()}
            res[f"{rule}/{task}/{cname}"] = sp
            print(
                f"{rule:8}{task:10}{cname:12}",
                "  ".join(f"{k} {v:.3f}" for k, v in sp.items()),
                f" lam/dyn {sp['lam'] / sp['dynamic']:.3f}",
                f" lamL/dynL {sp.get('lam+lookup', 1) / sp.get('dyn+lookup', 1):.3f}",
                flush=True,
            )
