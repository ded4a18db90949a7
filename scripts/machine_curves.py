"""How each shipped profile's choice moves with the machine: EntMTP* and the default schedule under several
measured cost curves, replayed on the profile's own calibration traces (no timing noise).

    python scripts/machine_curves.py --out docs/results/hardware-aware/machine-curves.json [--this-machine]
        [--cached-only]

Curves: two 2-core CPUs of the pool, AVX2-only and AVX-512 with native bf16 (tests/data/machines, bf16 and
float32 each), the AVX-512/bf16 2-core CPU whose latencies the shipped profiles store, one H200 with CUDA
graphs (docs/results/gpu-check), and with --this-machine the curves measured here (`costs_for`, bf16 and
float32: measured once, then cached; with --cached-only it refuses to measure: the curves must be in the cost
cache, so the replays can run on a busy machine). The JSON names the machine that ran it (`machine`) and each
curve's (`curves`).
Per (profile, curve): EntMTP*'s nodes, and the replayed tokens/s of the default schedule (scheduler.factory.scheduled_policy)
and of EntMTP*, over plain decoding on that curve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from entmtp.calibration.replay import replay, step_ms
from entmtp.calibration.traces import load_traces
from entmtp.costs import CostCurve, cached_curve, costs_for
from entmtp.machine import describe_record, record
from entmtp.policy import StaticPolicy
from entmtp.scheduler.factory import scheduled_policy
from entmtp.scheduler.profiles import PROFILE_TASKS, resolve_profile
from entmtp.tree import Tree

ROOT = Path(__file__).resolve().parents[1]


def shared_curves() -> dict[str, CostCurve]:
    rows = json.loads((ROOT / "docs/results/gpu-check/profile-smollm2-135m.json").read_text())["rows"]
    graphs = sorted((r for r in rows.values() if r["mode"] == "graphs"), key=lambda r: r["nodes"])
    machines = ROOT / "tests/data/machines"
    h200 = {"gpu": "NVIDIA H200", "note": H200_NOTE}
    return {
        "avx2 bf16": CostCurve.from_step_costs(machines / "avx2-bfloat16.json"),
        "avx2 fp32": CostCurve.from_step_costs(machines / "avx2-float32.json"),
        "avx512 bf16": CostCurve.from_step_costs(machines / "avx512bf16-bfloat16.json"),
        "avx512 fp32": CostCurve.from_step_costs(machines / "avx512bf16-float32.json"),
        "h200 graphs": CostCurve(  # its drafting measured with it (the rows' "draft" phase)
            tuple(r["nodes"] for r in graphs),
            tuple(r["total"] for r in graphs),
            tuple(r["draft"] for r in graphs),
            source="h200",
            machine=h200,
        ),
    }


# docs/results/gpu-check/profile-smollm2-135m.json kept no machine record; what its README says
H200_NOTE = (
    "recorded afterwards (issue 40): one NVIDIA H200 (docs/results/gpu-check); driver and CUDA not recorded"
)


def here_curves(kind: str, cached_only: bool = False) -> dict[str, CostCurve]:
    """This machine's curves with `kind`'s heads, bf16 and float32: cached, else measured now (`cached_only`:
    refuse, naming the command that measures them)."""
    from entmtp.model import load_model
    from entmtp.shipped import resolve_heads

    out = {}
    for dtype in ("bfloat16", "float32"):
        model, _ = load_model(dtype=dtype)
        heads = resolve_heads(kind, model)
        curve = cached_curve(model, heads) if cached_only else costs_for(model, heads)
        if curve is None:
            raise SystemExit(
                f"--cached-only: this machine's {dtype} cost curve with the {kind} heads is not in the cost "
                "cache: run `python scripts/machine_curves.py --this-machine --out FILE` once on a quiet "
                "machine (it measures what is missing, then reads the cache), then run this again"
            )
        out[f"here {dtype[:4]}"] = curve
    return out


def replayed(profile, traces, curve: CostCurve) -> dict:
    """EntMTP* and the default schedule on `curve`, replayed on `traces`: each step charged by the curve, its
    drafting share too where the curve measured it (`step_ms(curve)`; another machine's constant only where it
    did not, which `charges` says)."""
    lat, ms_of = curve.latency(), step_ms(curve)
    plain = 1000.0 / float(lat(0))
    chosen, why, _ = scheduled_policy(profile, "greedy", lat)
    policy = StaticPolicy(chosen) if isinstance(chosen, Tree) else chosen
    best = profile.best_tree("greedy", lat)
    return {
        "entmtp_star": best.name,
        "entmtp_star_nodes": best.num_nodes,
        "default_over_plain": replay(policy, traces, ms_of).tokens_per_second / plain,
        "entmtp_star_over_plain": replay(StaticPolicy(best), traces, ms_of).tokens_per_second / plain,
        "default": why,
        "plain_ms": float(lat(0)),
        "charges": ms_of.charges,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--this-machine", action="store_true", help="add this machine's measured curves")
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="with --this-machine: never measure (the curves are cached)",
    )
    args = ap.parse_args()
    console = Console()
    result: dict = {"machine": record(), "curves": {}}  # who ran it; each curve's machine
    for kind in ("hydra", "medusa"):
        curves = dict(shared_curves())
        if args.this_machine:
            curves |= here_curves(kind, args.cached_only)
        result["curves"] |= {name: describe_record(c.machine) for name, c in curves.items()}
        table = Table(title=f"{kind}: EntMTP* nodes / default and EntMTP* over plain, replayed")
        table.add_column("profile")
        for name in ("stored", *curves):
            table.add_column(name, justify="right")
        for task in PROFILE_TASKS:
            profile = resolve_profile(task, kind)
            traces = load_traces(profile)
            lat0 = profile.latency.model()
            cs = {"stored": CostCurve.from_latency(list(lat0.nodes), list(lat0.ms), "stored"), **curves}
            result["curves"][f"stored ({kind}/{task})"] = profile.machine_description
            cells = []
            for name, curve in cs.items():
                r = result.setdefault(kind, {}).setdefault(task, {})[name] = replayed(profile, traces, curve)
                cells.append(
                    f"{r['entmtp_star_nodes']} / {r['default_over_plain']:.2f}x / {r['entmtp_star_over_plain']:.2f}x"
                )
            table.add_row(task, *cells)
        console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
