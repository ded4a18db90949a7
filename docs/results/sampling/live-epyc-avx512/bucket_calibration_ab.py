"""A/B, tried and not kept (#25): the dynamic policy's online calibration with one scale (shipped) against one
scale per context bucket, interleaved per prompt, twice over. Run from the repository root:
    .venv/bin/python docs/results/sampling/live-epyc-avx512/bucket_calibration_ab.py 0.7 sample writing,humaneval,sharegpt 8
"""

import copy
import sys

import torch

from entmtp.accept import Sampling
from entmtp.build import EngineSpec, build_engine
from entmtp.prompts import load_prompts
from entmtp.scheduler.policies import DynamicPolicy, OnlineCalibration


class BucketCalibration(OnlineCalibration):
    edges = None

    def reset(self):
        super().reset()
        n = len(self.edges) + 1
        self.h = [0.0] * n
        self.p = [0.0] * n
        self._c = 0

    @property
    def scale(self):
        c = self._c
        return (self.h[c] + self.weight) / (self.p[c] + self.weight)

    def predict(self, rates, probe):
        if probe is not None and probe.logprobs.numel():
            self._c = int(torch.bucketize(probe.logprobs[0, 0].float().exp(), self.edges))
        return super().predict(rates, probe)

    def observe(self, step):
        if self._pending is None or not step.token_ids:
            return
        predicted, cands = self._pending
        first = step.token_ids[0]
        hit = first in cands and cands.index(first) in self.ranks
        c = self._c
        self.h[c] = self.decay * self.h[c] + float(hit)
        self.p[c] = self.decay * self.p[c] + predicted
        self._pending = None


T, acc = float(sys.argv[1]), sys.argv[2]
tasks = sys.argv[3].split(",")
n = int(sys.argv[4])
base = build_engine(EngineSpec(dtype="bfloat16", threads=2))
pol = base.policy_for(Sampling(temperature=T, acceptance=acc))
assert isinstance(pol, DynamicPolicy), type(pol)
var = copy.copy(pol)
cal = BucketCalibration.__new__(BucketCalibration)
cal.__dict__.update(pol.calibration.__dict__)
BucketCalibration.edges = pol.paths.ctx_edges
cal.reset()
var.calibration = cal
engines = {"one scale": base}
alt = copy.copy(base)
alt.policies = dict(base.policies)
alt.policy = base.policy
rule = Sampling(temperature=T, acceptance=acc).rule
if rule in alt.policies:
    alt.policies[rule] = var
else:
    alt.policy = var
engines["per bucket"] = alt
for e in engines.values():
    e.generate("Hi", max_new_tokens=8, temperature=T, acceptance=acc, seed=0)
for task in tasks:
    tally = {k: [0, 0.0, 0] for k in engines}
    for rep in range(2):
        for i, p in enumerate(load_prompts(task, "test", n)):
            order = list(engines) if (i + rep) % 2 == 0 else list(engines)[::-1]
            for k in order:
                r = engines[k].generate(
                    p, max_new_tokens=96, temperature=T, acceptance=acc, seed=i + 100 * rep
                )
                tally[k][0] += sum(s.tokens for s in r.steps)
                tally[k][1] += sum(s.seconds["total"] for s in r.steps)
                tally[k][2] += len(r.steps)
    a = tally["one scale"]
    b = tally["per bucket"]
    print(
        f"{task} T={T} {acc}: one scale {a[0] / a[1]:.1f} tok/s ({a[0] / a[2]:.2f}/step), per bucket {b[0] / b[1]:.1f} ({b[0] / b[2]:.2f}/step): {b[0] / b[1] / (a[0] / a[1]):.3f}x",
        flush=True,
    )
