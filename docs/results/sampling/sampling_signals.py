"""Does `dynamic` at T > 0 lack a signal? Two candidate refinements of its acceptance model, replayed.

Under lossless sampling `dynamic` runs at 0.97-1.03x of EntMTP* (docs/results/sampling/). This script asks
whether a richer per-step model would choose better, on the shipped Hydra profiles' own `sample` traces,
two folds (fit on the even-numbered generations, replay on the odd ones, and the reverse):

  shipped  the acceptance model as calibrated (per depth, head 1's top-1 probability as step context, the
           head's probability of a depth-1 node's token, ranks below)
  parent   deeper rank rates also conditioned on whether the node's parent is its depth's top candidate
           (the steps where the heads' first guesses keep being right)
  entropy  depth-1 rates rescaled per quintile of the base model's entropy at the root, the one signal of the
           step the heads do not see (fitted as measured / predicted depth-1 acceptance on the fit fold)

For each: the predicted minus measured P(accepted >= depth k) of the master tree on the held-out fold, and
`dynamic`'s replayed tokens/s over EntMTP*'s (the profile's stored latencies: the calibration machine).

    .venv/bin/python docs/results/sampling/sampling_signals.py --out docs/results/sampling/signals.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from entmtp.calibration.calibrate import CTX_EDGES, SHRINK, _observations, fit_acceptance
from entmtp.calibration.replay import replay, step_ms
from entmtp.calibration.search import TraceAcceptance
from entmtp.calibration.traces import TOPK, load_traces
from entmtp.policy import StaticPolicy
from entmtp.scheduler.policies import DynamicPolicy, ExpectedAccepted, PathProbabilities
from entmtp.scheduler.profiles import resolve_profile

TASKS = ("humaneval", "sharegpt", "gsm8k", "writing")
VARIANTS = ("shipped", "parent", "entropy")
ENTROPY_BINS = 5


def parent_rank_rates(traces, num_heads: int) -> torch.Tensor:
    """[D, C, 2, K] P(right | parent path right) by depth, step context, parent top-ranked (1) or not, rank;
    each (context, parent) cell shrunk toward its context's rate as fit_acceptance shrinks toward all."""
    probe = torch.cat([t.probe for t in traces])
    ctx_all = torch.bucketize(probe[:, 0, 0].exp(), torch.tensor(CTX_EDGES[1:-1]))
    ranks_all = torch.cat([t.ranks for t in traces])
    out = []
    for d, (right, rank, pos) in enumerate(_observations(traces, num_heads)):
        c = ctx_all[pos]
        top = torch.ones_like(rank) if d == 0 else (ranks_all[pos, d - 1] == 0).long()
        overall = (torch.bincount(rank, weights=right, minlength=TOPK) + 0.5) / (
            torch.bincount(rank, minlength=TOPK) + 1.0
        )
        per_ctx = []
        for k in range(len(CTX_EDGES) - 1):
            sc = c == k
            ctx_rate = (torch.bincount(rank[sc], weights=right[sc], minlength=TOPK) + SHRINK * overall) / (
                torch.bincount(rank[sc], minlength=TOPK) + SHRINK
            )
            cells = []
            for p in (0, 1):
                sub = sc & (top == p)
                hits = torch.bincount(rank[sub], weights=right[sub], minlength=TOPK)
                r = (hits + SHRINK * ctx_rate) / (torch.bincount(rank[sub], minlength=TOPK) + SHRINK)
                cells.append(np.minimum.accumulate(r.numpy()))
            per_ctx.append(cells)
        out.append(per_ctx)
    return torch.tensor(np.array(out), dtype=torch.float32)


class ParentPaths(PathProbabilities):
    """PathProbabilities whose rank rates also depend on the parent being top-ranked."""

    def __init__(self, master, acceptance, parent_rates: torch.Tensor):
        super().__init__(master, acceptance)
        parents = master.parents[1:]
        top = torch.where(parents == 0, torch.ones_like(parents), (master.ranks[parents] == 0).long())
        self.by_rank = parent_rates[self.depth, :, top, self.rank]  # [M, C]


class EntropyScaled(PathProbabilities):
    """PathProbabilities whose depth-1 rates are scaled by the root entropy's bin (`rates_at`)."""

    def __init__(self, master, acceptance, edges: np.ndarray, scales: torch.Tensor):
        super().__init__(master, acceptance)
        self.entropy_edges, self.scales = edges, scales
        self.depth1 = (master.depths == 1).nonzero().flatten()

    def rates_at(self, probe_logprobs, root_entropy: float) -> torch.Tensor:
        f = self.rates(probe_logprobs).clone()
        b = int(np.searchsorted(self.entropy_edges, root_entropy))
        f[self.depth1] = (f[self.depth1] * self.scales[b]).clamp(max=1.0)
        return f


class EntropyDynamic(DynamicPolicy):
    def _rates(self, ctx):
        f = self.paths.rates_at(None if ctx.probe is None else ctx.probe.logprobs, ctx.raw_signals[0])
        return f if self.calibration is None else self.calibration.predict(f, ctx.probe)


def entropy_paths(master, model, rule, traces) -> EntropyScaled:
    plain = PathProbabilities(master, model)
    expected, whole = ExpectedAccepted(master, rule), torch.ones(1, master.size)
    raw0 = torch.cat([t.raw[:, 0] for t in traces]).numpy()
    edges = np.quantile(raw0, np.linspace(0, 1, ENTROPY_BINS + 1)[1:-1])
    predicted, measured = np.zeros(ENTROPY_BINS), np.zeros(ENTROPY_BINS)
    for tr in traces:
        accepted = TraceAcceptance(tr)
        for j in range(len(tr.ranks)):
            b = int(np.searchsorted(edges, float(tr.raw[j, 0])))
            predicted[b] += float(expected.reach(plain.rates(tr.probe[j]), whole)[0, 0])
            measured[b] += accepted(j, master.path_set) >= 1
    scales = torch.tensor(measured / np.maximum(predicted, 1e-9), dtype=torch.float32)
    return EntropyScaled(master, model, edges, scales)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", default="sample", choices=["greedy", "sample"])
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    console, rows = Console(width=160), {}
    for task in TASKS:
        profile = resolve_profile(task, "hydra")
        mode = profile.mode_for_rule(args.rule)
        traces = load_traces(profile, mode)
        master = profile.trees(mode)[profile.mode(mode).master.name]
        latency = profile.latency.model()
        ms_of, best = step_ms(latency), profile.best_tree(mode, latency)
        depth, whole = master.depth, torch.ones(1, master.size)
        err = {v: np.zeros(depth) for v in VARIANTS}
        speed = {v: 0.0 for v in (*VARIANTS, "EntMTP*")}
        n = 0
        for fit_on, held in ((traces[0::2], traces[1::2]), (traces[1::2], traces[0::2])):
            model = fit_acceptance(fit_on, 1, master.depth, args.rule)
            paths = {
                "shipped": PathProbabilities(master, model),
                "parent": ParentPaths(master, model, parent_rank_rates(fit_on, master.depth)),
                "entropy": entropy_paths(master, model, args.rule, fit_on),
            }
            expected = ExpectedAccepted(master, args.rule)
            for tr in held:
                accepted = TraceAcceptance(tr)
                for j in range(len(tr.ranks)):
                    measured = np.zeros(depth)
                    measured[: accepted(j, master.path_set)] = 1
                    for v, p in paths.items():
                        f = (
                            p.rates_at(tr.probe[j], float(tr.raw[j, 0]))
                            if v == "entropy"
                            else p.rates(tr.probe[j])
                        )
                        err[v] += expected.reach(f, whole)[0].numpy() - measured
                    n += 1
            for v, p in paths.items():
                policy = (EntropyDynamic if v == "entropy" else DynamicPolicy)(master, model, latency)
                policy.paths = p
                speed[v] += replay(policy, held, ms_of).to_json()["tokens_per_second"]
            speed["EntMTP*"] += replay(StaticPolicy(best), held, ms_of).to_json()["tokens_per_second"]
        rows[task] = {
            v: {
                "error_by_depth": [round(float(e) / n, 4) for e in err[v]],
                "dynamic_over_entmtp_star": round(speed[v] / speed["EntMTP*"], 4),
            }
            for v in VARIANTS
        }
    table = Table(
        title=f"Hydra, {args.rule} traces, two folds: dynamic / EntMTP* (predicted - measured P(>= k))"
    )
    for col in ("task", *VARIANTS):
        table.add_column(col, justify="left" if col == "task" else "right")
    for task, r in rows.items():
        cells = [
            f"{r[v]['dynamic_over_entmtp_star']:.3f}x ({' '.join(f'{e:+.3f}' for e in r[v]['error_by_depth'])})"
            for v in VARIANTS
        ]
        table.add_row(task, *cells)
    console.print(table)
    if args.out is not None:
        command = (
            "python docs/results/sampling/sampling_signals.py --rule " + args.rule + f" --out {args.out}"
        )
        args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
