"""Replay the scheduling policies, lookup hybrids included, on many test prompts per task: tokens per second
from the shipped profiles' measured step latencies, without timing noise (calibration/replay.py).

    python scripts/replay_policies.py [--heads hydra,medusa] [--tasks T,...] [--num-prompts 10]
        [--split test|calib] [--max-new-tokens 96] [--dtype bfloat16] [--threads 2] [--out DIR]
        [--this-machine [--cached-only]]

Step 1 generates plain greedy outputs of the test prompts (kept in OUT/outputs.json: a rerun with the same
settings reuses them); step 2 traces them through each heads; step 3 replays every method and prints one
table per heads (replayed decode tokens/s over plain decoding's, whose step costs the profile's plain-step
latency) and writes OUT/replay.json. Methods: `static` (EntMTP*), `dynamic` with its acceptance model fixed
(`dynamic-fixed`, the policy before online recalibration) and recalibrated online (`dynamic`), prompt lookup
without heads (`lookup`), the lookup hybrid over each (`dynamic-fixed+lookup` without the heads' probe
evidence, `dynamic+lookup` with it), and the hindsight oracle over the bank (a ceiling, not a method).
A step whose tree has no head node is charged the profile's latency less the heads' drafting
(calibration.replay.step_ms), as the hybrid policy itself assumes.

By default every figure is priced on the shipped profile's stored latencies, another machine's, with the heads'
drafting at the constant HEADS_DRAFT_COST and no choice charged (each replay's `charges` says so). With
--this-machine the policies are sized on this machine's measured cost curve (`costs_for`: measured once, then
cached) and every step is charged by it, the drafting at its measured share and each policy's choice as
measured here for that policy (costs/choice.py). With --cached-only those measurements must be in the cost
cache already (the script refuses, naming what is missing, rather than time anything): the replays themselves
are computations, fine on a busy machine; the curve and the choices are not. replay.json names the machine
that ran it (`machine`, machine.record).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from entmtp.calibration.replay import oracle, replay, step_ms
from entmtp.calibration.traces import trace_generation
from entmtp.costs import CostCurve, cached_choice, cached_curve, choice_for, costs_for
from entmtp.engine import Engine
from entmtp.lookup import Lookup
from entmtp.machine import record
from entmtp.model import encode_prompt, load_model
from entmtp.policy import StaticPolicy
from entmtp.prompts import TASKS, load_prompts
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.hybrid import HybridPolicy
from entmtp.scheduler.profiles import PROFILE_TASKS, resolve_profile
from entmtp.shipped import resolve_heads
from entmtp.tree import Tree

METHODS = (
    "static",
    "dynamic-fixed",
    "dynamic",
    "lookup",
    "dynamic-fixed+lookup",
    "dynamic+lookup",
    "oracle",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="hydra,medusa")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument(
        "--split", default="test", choices=("test", "calib"), help="calib: to tune on, not to report"
    )
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/results/replay-policies"))
    ap.add_argument(
        "--this-machine",
        action="store_true",
        help="price on this machine's measured cost curve and each policy's measured choice (see above)",
    )
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="with --this-machine: never measure; refuse when a curve or a choice cost is not cached",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task(s) {', '.join(unknown)}: use some of {', '.join(TASKS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(dtype=args.dtype)
    outputs = _outputs(model, tokenizer, tasks, args)
    console = Console(width=200)
    result = {
        "command": "python scripts/replay_policies.py " + " ".join(_argv(args)),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": record(model.device),
        "replays": {},
    }
    for kind in [k for k in args.heads.split(",") if k]:
        heads = resolve_heads(kind, model)
        engine = Engine(model, tokenizer, heads=heads)
        curve, choices = _here(model, heads, kind, args) if args.this_machine else (None, None)
        table = Table(title=f"{kind}: replayed decode tokens/s over plain decoding (tokens/step)")
        for col in ("task", *METHODS):
            table.add_column(col, justify="right" if col != "task" else "left")
        result["replays"][kind] = {}
        with Progress(console=console, transient=True) as bar:
            job = bar.add_task(f"{kind}: traces and replays", total=len(tasks))
            for task in tasks:
                traces = [
                    trace_generation(engine.base, heads, ids + out, len(ids))
                    for ids, out in outputs[task]
                    if len(out) >= 2
                ]
                profile = resolve_profile(task if task in PROFILE_TASKS else "mixed", kind)
                row = _replay_task(profile, traces, curve, choices)
                result["replays"][kind][task] = row
                table.add_row(
                    task,
                    *(f"{row[m]['speedup']:.2f}x ({row[m]['tokens_per_step']:.2f})" for m in METHODS),
                )
                bar.advance(job)
        console.print(table)
    path = args.out / "replay.json"
    path.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {path}")


def _here(model, heads, kind: str, args):
    """(this machine's curve with `heads`, each policy's choice cost): cached, else measured now; with
    --cached-only never measured (a missing one ends the script, naming it and what measures it)."""
    if not args.cached_only:
        return costs_for(model, heads), lambda p: choice_for(model, heads, p)
    fix = "run this command without --cached-only once on a quiet machine (it measures what is missing)"

    def choices(policy):
        found = cached_choice(model, heads, policy)
        if found is None:
            raise SystemExit(
                f"--cached-only: the {type(policy).__name__} choice with {kind} is not cached: {fix}"
            )
        return found

    curve = cached_curve(model, heads)
    if curve is None:
        raise SystemExit(f"--cached-only: this machine's cost curve with {kind} is not cached: {fix}")
    return curve, choices


def _replay_task(profile, traces, curve: CostCurve | None = None, choices=None) -> dict:
    """Every method replayed on `traces`: priced on `curve` (this machine's, --this-machine: the policies are
    sized on it too, and each step pays `choices(policy)`, that policy's measured choice), else on the
    profile's stored latencies (another machine's: the drafting at HEADS_DRAFT_COST, no choice charged)."""
    latency = curve.latency() if curve is not None else profile.latency.model()
    share = curve.draft_share if curve is not None else None
    plain_ms, ms_of = float(latency(0)), step_ms(curve if curve is not None else latency)
    lookup, on = Lookup(), {"latency": latency} if curve is not None else {}
    policies = {
        "static": profile_policy(profile, "static", **on),
        "dynamic-fixed": profile_policy(profile, "dynamic", online=False, **on),
        "dynamic": profile_policy(profile, "dynamic", **on),
        "lookup": HybridPolicy(StaticPolicy(Tree.root_only()), lookup, latency, draft_cost=share),
        "dynamic-fixed+lookup": HybridPolicy(
            profile_policy(profile, "dynamic", online=False, **on),
            lookup,
            latency,
            counterfactual=False,
            draft_cost=share,
        ),
        "dynamic+lookup": HybridPolicy(
            profile_policy(profile, "dynamic", **on), lookup, latency, draft_cost=share
        ),
    }
    out = {
        name: replay(p, traces, ms_of.with_choice(choices(p) if choices else None)).to_json()
        for name, p in policies.items()
    }
    out["oracle"] = oracle(profile.bank(), traces, ms_of).to_json()
    for r in out.values():
        r["speedup"] = r["tokens_per_second"] * plain_ms / 1000.0
    return out


def _outputs(model, tokenizer, tasks: list[str], args) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Plain greedy outputs of each task's first test prompts, reused from OUT/outputs.json when it was made
    with the same settings; saved after every task, so an interrupted run resumes."""
    path = args.out / "outputs.json"
    key = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype}
    if args.split != "test":
        key["split"] = args.split
    saved = json.loads(path.read_text()) if path.exists() else {}
    if saved.get("settings") != key:
        saved = {"settings": key, "tasks": {}}
    todo = [t for t in tasks if t not in saved["tasks"]]
    engine = Engine(model, tokenizer)
    with Progress(transient=True) as bar:
        job = bar.add_task("plain greedy outputs", total=len(todo) * args.num_prompts)
        for task in todo:
            pairs = []
            for prompt in load_prompts(task, args.split, args.num_prompts):
                ids = encode_prompt(tokenizer, prompt)
                pairs.append((ids, engine.generate(ids, max_new_tokens=args.max_new_tokens).token_ids))
                bar.advance(job)
            saved["tasks"][task] = pairs
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(saved))
            tmp.replace(path)
    return {t: [(list(a), list(b)) for a, b in saved["tasks"][t]] for t in tasks}


def _argv(args) -> list[str]:
    return [
        f"--heads {args.heads}",
        f"--tasks {args.tasks}",
        f"--num-prompts {args.num_prompts}",
        f"--split {args.split}",
        f"--max-new-tokens {args.max_new_tokens}",
        f"--dtype {args.dtype}",
        f"--threads {args.threads}",
        f"--out {args.out}",
        *(["--this-machine"] if args.this_machine else []),
        *(["--cached-only"] if args.cached_only else []),
    ]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
