"""A/B, tried and not kept (#25): the dynamic policy's online calibration with one scale (shipped) against a
variant, interleaved per prompt, twice over. Variants: `bucket`, one scale per context bucket; `linear`, a
decayed linear fit of head 1's hits on their predicted probability (hit ~ a + b p, ridge towards a = 0, b = 1).
Run from the repository root:
    .venv/bin/python docs/results/sampling/live-epyc-avx512/calibration_ab.py bucket 0.7 sample writing,humaneval,sharegpt 8
    .venv/bin/python docs/results/sampling/live-epyc-avx512/calibration_ab.py linear 0.7 sample writing,humaneval,sharegpt 8
"""

import copy
import sys

import torch

from entmtp.accept import Sampling
from entmtp.build import EngineSpec, build_engine
from entmtp.prompts import load_prompts
from entmtp.scheduler.policies import DynamicPolicy, OnlineCalibration

RIDGE = 2.0


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


class LinearCalibration(OnlineCalibration):
    def reset(self):
        super().reset()
        self.s = [0.0] * 5  # n, sum p, sum h, sum pp, sum ph

    def _fit(self):
        n, sp, sh, spp, sph = self.s
        lam = RIDGE
        # minimise sum (h - a - b p)^2 + lam (a^2 + (b - 1)^2)
        A = [[n + lam, sp], [sp, spp + lam]]
        y = [sh, sph + lam]
        det = A[0][0] * A[1][1] - A[0][1] * A[1][0]
        a = (y[0] * A[1][1] - A[0][1] * y[1]) / det
        b = (A[0][0] * y[1] - A[1][0] * y[0]) / det
        return a, b

    def predict(self, rates, probe):
        total = float(rates[self.first].sum())
        self._pending = None
        if probe is not None and probe.tokens.numel():
            self._pending = (min(total, 1.0), probe.tokens[0].tolist())
        out = rates.clone()
        if total > 0:
            a, b = self._fit()
            target = min(max(a + b * min(total, 1.0), 0.02), 1.0)
            out[self.first] *= target / total
        return out

    def observe(self, step):
        if self._pending is None or not step.token_ids:
            return
        p, cands = self._pending
        first = step.token_ids[0]
        h = float(first in cands and cands.index(first) in self.ranks)
        d = self.decay
        n, sp, sh, spp, sph = self.s
        self.s = [d * n + 1, d * sp + p, d * sh + h, d * spp + p * p, d * sph + p * h]
        self._pending = None


variant, T, acc = sys.argv[1], float(sys.argv[2]), sys.argv[3]
tasks, n = sys.argv[4].split(","), int(sys.argv[5])
base = build_engine(EngineSpec(dtype="bfloat16", threads=2))
pol = base.policy_for(Sampling(temperature=T, acceptance=acc))
assert isinstance(pol, DynamicPolicy), type(pol)
kind = {"bucket": BucketCalibration, "linear": LinearCalibration}[variant]
BucketCalibration.edges = pol.paths.ctx_edges
var = copy.copy(pol)
cal = kind.__new__(kind)
cal.__dict__.update(pol.calibration.__dict__)
cal.reset()
var.calibration = cal
alt = copy.copy(base)
alt.policies = dict(base.policies)
rule = Sampling(temperature=T, acceptance=acc).rule
if rule in alt.policies:
    alt.policies[rule] = var
else:
    alt.policy = var
engines = {"one scale": base, variant: alt}
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
                t = tally[k]
                t[0] += sum(s.tokens for s in r.steps)
                t[1] += sum(s.seconds["total"] for s in r.steps)
                t[2] += len(r.steps)
    a, b = tally["one scale"], tally[variant]
    print(
        f"{task} T={T} {acc}: one scale {a[0] / a[1]:.1f} tok/s ({a[0] / a[2]:.2f}/step), {variant} "
        f"{b[0] / b[1]:.1f} ({b[0] / b[2]:.2f}/step): {b[0] / b[1] / (a[0] / a[1]):.3f}x",
        flush=True,
    )
