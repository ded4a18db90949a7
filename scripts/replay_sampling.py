"""The scheduler at T > 0: every method replayed on sampled generations of the test prompts, per acceptance
rule, on several machines' measured cost curves, and the base model's perplexity of the continuations.

    python scripts/replay_sampling.py [--rules sample,typical] [--heads hydra,medusa,DIR] [--tasks T,...]
        [--num-prompts 10] [--max-new-tokens 96] [--temperature 0.7] [--dtype bfloat16] [--out DIR]

1. Sampled generations of each task's first test prompts (seed = prompt index), per rule, with Hydra heads
   and tree_8 (kept in OUT/outputs-RULE.json; a rerun with the same settings reuses them), and plain
   sampling's generations of the same prompts (seeds 1000 + index) for the perplexity comparison.
2. Traces of them through each heads (traces.py): rank vectors for the lossless rule, which replay any tree
   exactly for the sampled outcome; typical: each profile's union tree verified at every root, exact per
   step, but a tree other than tree_8 would have emitted other tokens (acceptance is not lossless there).
3. Replays (calibration/replay.py) of plain decoding, the published default tree mc_sim_7b_63, EntMTP* (the
   section's fastest static bank tree on that curve), binary, cost, dynamic, dynamic+lookup (lossless only:
   a lookup draft is a draft like any other) and the hindsight oracle over the bank, each on the cost curves
   of the calibration machine (the shipped profiles' stored latencies), the AVX2 CPU (bf16, float32) and one
   H200 with CUDA graphs (machine_curves.shared_curves). Speed-up = replayed tokens/s over plain decoding's on
   the same curve. Prints one table per (rule, heads, curve) and writes OUT/replay-sampling.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch
from machine_curves import shared_curves
from replay_policies import _commit
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from entmtp.accept import Sampling
from entmtp.calibration.replay import oracle, replay, step_ms
from entmtp.calibration.traces import trace_generation
from entmtp.costs import CostCurve
from entmtp.engine import Engine
from entmtp.lookup import Lookup
from entmtp.machine import describe_record, record
from entmtp.model import encode_prompt, load_model
from entmtp.policy import StaticPolicy, static
from entmtp.prompts import FOUR_TASKS, TASKS, load_prompts
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.hybrid import HybridPolicy
from entmtp.scheduler.profiles import PROFILE_TASKS, resolve_profile
from entmtp.shipped import HEAD_KINDS, resolve_heads
from entmtp.tree import load_tree

METHODS = ("mc_sim_7b_63", "EntMTP*", "binary", "cost", "dynamic", "dynamic+lookup", "oracle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", default="sample,typical")
    ap.add_argument(
        "--heads",
        default="hydra,medusa",
        help="shipped heads (hydra, medusa) or trained heads directories, comma list; a directory's heads are "
        "replayed with the shipped profiles of their kind (banks and signals calibrated on the shipped heads)",
    )
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/results/sampling"))
    ap.add_argument(
        "--perplexity-only",
        action="store_true",
        help="only the perplexities (OUT/perplexity.json), no replays",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks, rules = _checked(args)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(dtype=args.dtype)
    console = Console(width=200)
    curves = shared_curves()
    result = _header(args, model, curves)
    plain = _outputs(model, tokenizer, tasks, args, None)
    for rule in rules:
        sampling = Sampling(args.temperature, rule)
        outputs = _outputs(model, tokenizer, tasks, args, sampling)
        result["perplexity"][rule] = {t: _perplexity(model, outputs[t], plain[t]) for t in tasks}
        result["replays"][rule] = {}
        for label in [k for k in args.heads.split(",") if k and not args.perplexity_only]:
            heads = resolve_heads(label, model)  # shipped (hydra, medusa) or a heads directory
            kind = heads.config.kind  # the profiles (banks, signals) are the shipped heads' of this kind
            engine = Engine(model, tokenizer, heads=heads)
            rows: dict[str, dict] = {}
            with Progress(console=console, transient=True) as bar:
                job = bar.add_task(f"{rule}/{label}: traces and replays", total=len(tasks))
                for task in tasks:
                    profile = resolve_profile(task if task in PROFILE_TASKS else "mixed", kind)
                    mode = profile.mode_for(args.temperature, rule)
                    union = profile.mode(mode).trace_tree
                    traces = [
                        trace_generation(
                            engine.base, heads, ids + out, len(ids), sampling, union and union.tree(), seed=i
                        )
                        for i, (ids, out) in enumerate(outputs[task])
                        if len(out) >= 2
                    ]
                    stored = profile.latency.model()
                    task_curves = {
                        "calibration": CostCurve.from_latency(list(stored.nodes), list(stored.ms), "stored"),
                        **curves,
                    }
                    rows[task] = {
                        name: _replay_methods(profile, mode, traces, curve, rule)
                        for name, curve in task_curves.items()
                    }
                    bar.advance(job)
            result["replays"][rule][label] = rows
            for curve in rows[tasks[0]] if rows else ():
                table = Table(
                    title=f"T={args.temperature} {rule}, {label} heads, {curve} costs: replayed speed-up over "
                    "plain (tokens/step)"
                )
                for col in ("task", *METHODS):
                    table.add_column(col, justify="left" if col == "task" else "right")
                for task in tasks:
                    r = rows[task][curve]
                    cells = [
                        f"{r[m]['speedup']:.2f}x ({r[m]['tokens_per_step']:.2f})" if m in r else "-"
                        for m in METHODS
                    ]
                    table.add_row(task, *cells)
                console.print(table)
        ppl = Table(title=f"T={args.temperature} {rule}: base model's perplexity of the continuations")
        for col in ("task", f"{rule} (tree_8)", "plain sampling", "NLL/token (+- s.e.)", "tokens"):
            ppl.add_column(col, justify="left" if col == "task" else "right")
        for task, p in result["perplexity"][rule].items():
            se = f"{p['nll']:.3f} +- {p['nll_se']:.3f} vs {p['plain_nll']:.3f} +- {p['plain_nll_se']:.3f}"
            ppl.add_row(task, f"{p['speculative']:.2f}", f"{p['plain']:.2f}", se, f"{p['tokens']}")
        console.print(ppl)
    path = args.out / ("perplexity.json" if args.perplexity_only else "replay-sampling.json")
    path.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {path}")


def _checked(args) -> tuple[list[str], list[str]]:
    """(tasks, rules) of the command line, each bad setting named before anything is loaded or written."""
    tasks = [t for t in args.tasks.split(",") if t]
    rules = [r for r in args.rules.split(",") if r]
    if not rules or any(r not in ("sample", "typical", "gumbel") for r in rules):
        raise SystemExit(f"--rules {args.rules}: use some of sample, typical, gumbel (comma list)")
    missing = [
        h
        for h in args.heads.split(",")
        if h and h not in HEAD_KINDS and not (Path(h) / "config.json").exists()
    ]
    if missing:
        raise SystemExit(
            f"--heads {', '.join(missing)}: no heads there (a directory with config.json), or hydra, medusa"
        )
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task(s) {', '.join(unknown)}: use some of {', '.join(TASKS)}")
    return tasks, rules


def _replay_methods(profile, mode: str, traces, curve: CostCurve, rule: str) -> dict:
    """Every method replayed on `traces`, each step charged by `curve`, the heads' drafting and probe at the
    curve's own measured share where it has one (else another machine's constant; `charges` says which)."""
    latency = curve.latency()
    plain_ms, ms_of = float(latency(0)), step_ms(curve)
    policies = {
        "mc_sim_7b_63": StaticPolicy(load_tree("mc_sim_7b_63")),
        "EntMTP*": StaticPolicy(profile.best_tree(mode, latency)),
        "binary": profile_policy(profile, "binary", mode),
        "cost": profile_policy(profile, "cost", mode, latency=latency),
        "dynamic": profile_policy(profile, "dynamic", mode, latency=latency),
    }
    if rule != "typical":  # a typical replay's accepted paths leave the recorded tokens: no lookup replay
        policies["dynamic+lookup"] = HybridPolicy(
            profile_policy(profile, "dynamic", mode, latency=latency),
            Lookup(),
            latency,
            draft_cost=curve.draft_share,
        )
    out = {name: replay(p, traces, ms_of).to_json() for name, p in policies.items()}
    out["oracle"] = oracle(profile.bank(mode), traces, ms_of).to_json()
    for r in out.values():
        r["speedup"] = r["tokens_per_second"] * plain_ms / 1000.0
    return out


@torch.inference_mode()
def continuation_nll(model, pairs) -> tuple[float, float, int]:
    """(mean negative log-likelihood per continuation token under the base model at temperature 1, its
    standard error over generations (whole generations are the independent samples), tokens) of the
    (prompt ids, continuation ids) `pairs`."""
    per, n = [], 0
    for ids, out in pairs:
        if not out:
            continue
        x = torch.tensor([ids + out])
        logits = model(input_ids=x).logits[0, len(ids) - 1 : -1].float()  # [len(out), V]
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out)[:, None])
        per.append((-float(lp.sum()), len(out)))
        n += len(out)
    mean = sum(a for a, _ in per) / max(1, n)
    rates = [a / b for a, b in per]
    var = sum((r - sum(rates) / len(rates)) ** 2 for r in rates) / max(1, len(rates) - 1)
    return mean, math.sqrt(var / max(1, len(rates))), n


def _perplexity(model, pairs, plain_pairs) -> dict:
    """exp(mean NLL per continuation token) of the speculative generations and of plain sampling's, with
    the NLLs and their standard errors (`continuation_nll`)."""
    spec, spec_se, n = continuation_nll(model, pairs)
    base, base_se, _ = continuation_nll(model, plain_pairs)
    return {
        "speculative": math.exp(spec),
        "plain": math.exp(base),
        "nll": spec,
        "nll_se": spec_se,
        "plain_nll": base,
        "plain_nll_se": base_se,
        "tokens": n,
    }


def _outputs(model, tokenizer, tasks, args, sampling: Sampling | None) -> dict[str, list]:
    """Sampled generations of each task's first test prompts: with `sampling`'s rule, Hydra heads and tree_8
    (seed = prompt index), or (None) plain sampling at the same temperature (seed = 1000 + index). Reused from
    OUT/outputs-NAME.json when made with the same settings; saved after every task."""
    name = "plain" if sampling is None else sampling.rule
    path = args.out / f"outputs-{name}.json"
    key = {
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "temperature": args.temperature,
    }
    saved = json.loads(path.read_text()) if path.exists() else {}
    if saved.get("settings") != key:
        saved = {"settings": key, "tasks": {}}
    todo = [t for t in tasks if t not in saved["tasks"]]
    if sampling is None:
        engine, rule, offset = Engine(model, tokenizer), "sample", 1000
    else:
        engine = Engine(model, tokenizer, heads=resolve_heads("hydra", model), policy=static("tree_8"))
        rule, offset = sampling.rule, 0
    with Progress(transient=True) as bar:
        job = bar.add_task(f"{name} outputs", total=len(todo) * args.num_prompts)
        for task in todo:
            pairs = []
            for i, prompt in enumerate(load_prompts(task, "test", args.num_prompts)):
                ids = encode_prompt(tokenizer, prompt)
                r = engine.generate(
                    ids,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    acceptance=rule,
                    seed=offset + i,
                )
                pairs.append((ids, r.token_ids))
                bar.advance(job)
            saved["tasks"][task] = pairs
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(saved))
            tmp.replace(path)
    return {t: [(list(a), list(b)) for a, b in saved["tasks"][t]] for t in tasks}


def _header(args, model, curves: dict) -> dict:
    """replay-sampling.json's head: the command, date and commit, the machine that ran it (machine.record) and
    each curve's (the stored profiles' latencies: their calibration machine, named per profile in the tables)."""
    return {
        "command": "python scripts/replay_sampling.py " + " ".join(_argv(args)),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": record(model.device),
        "curves": {name: describe_record(c.machine) for name, c in curves.items()},
        "replays": {},
        "perplexity": {},
    }


def _argv(args) -> list[str]:
    return [
        f"--rules {args.rules}",
        f"--heads {args.heads}",
        f"--tasks {args.tasks}",
        f"--num-prompts {args.num_prompts}",
        f"--max-new-tokens {args.max_new_tokens}",
        f"--temperature {args.temperature}",
        f"--dtype {args.dtype}",
        f"--threads {args.threads}",
        f"--out {args.out}",
    ]


if __name__ == "__main__":
    main()
