"""End-to-end speed benchmark: tokens/s and tokens/step of speculative decoding against plain decoding, per task.

`entmtp bench` runs, for every prompt, plain decoding and every configuration (heads with a static tree, heads
with a scheduling policy from a profile) back to back in the same process (so machine load hits all of them
alike), checks that greedy outputs are identical, prints a table per task and writes everything as JSON. One
warm-up generation per configuration is dropped. With `--replay`, the plain greedy outputs are also traced
through the heads and every policy (lookup hybrids included) and the hindsight oracle are replayed on them
with the profile's measured latencies (decode steps only): the oracle is a measurement, not a method one can run.
Convention (metrics.py): tokens per step = accepted drafts + 1 bonus token; tokens/s counts every generated token
over the whole generation's wall time (prefill included).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import metrics
from .costs import costs_for, probing_disabled
from .engine import Engine
from .errors import EntMTPError, TreeError
from .files import write_text_atomic
from .lookup import Lookup
from .prompts import TASKS, load_prompt_file, load_prompts
from .report import markdown, speedup_interval, speedup_plot, trace_plot
from .scheduler.plots import plot_profile
from .scheduler.profiles import POLICY_NAMES
from .shipped import HEAD_KINDS, heads_path, resolve_heads
from .tree import load_tree


def run_bench(args) -> int:
    from .model import encode_prompt, load_model
    from .scheduler.profiles import PROFILE_TASKS, resolve_profile

    _resolve_sizes(args)
    out = _out_dir(args.out)  # an unwritable --out fails before any model loads
    if args.prompts is not None:  # a user's own prompt file: one task named after it
        tasks = [Path(args.prompts).stem]
        prompts = {tasks[0]: load_prompt_file(args.prompts)[: args.num_prompts]}
    else:
        tasks = args.tasks.split(",")
        prompts = {t: load_prompts(t, args.split, n=args.num_prompts) for t in tasks}  # bad names fail first
    kinds = [k for k in args.heads.split(",") if k and k != "none"]
    policies = {kind: _for_heads(args.policies, kind) for kind in kinds}
    for item in (x for items in policies.values() for x in items):
        if _split_lookup(item, args)[0] not in POLICY_NAMES:
            raise EntMTPError(
                f"unknown policy {item!r} in --policies: use {', '.join(POLICY_NAMES)} (+lookup)"
            )
    _check_heads_and_trees(kinds, args)
    peers = _check_peers(args.peers)
    lookup_only = [x for x in args.lookup_only.split(",") if x]
    for x in lookup_only:
        if x not in LOOKUP_VARIANTS:
            raise EntMTPError(f"unknown --lookup-only variant {x!r}: use {' or '.join(LOOKUP_VARIANTS)}")
    _lookup("adaptive", args)  # bad lookup settings fail before any model loads
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, pack=not args.no_pack)
    heads = {kind: h for kind in kinds if (h := resolve_heads(kind, model)) is not None}
    label = _heads_labels(list(heads))
    # this machine's step costs (costs.py; measured once, cached): what policies and lookup branches are sized
    # by, unless --no-probe or ENTMTP_NO_PROBE=1 (then the profiles' stored latencies, and the lookup-only rule's CPU_COST)
    measured = not (args.no_probe or probing_disabled())
    costs = {k: costs_for(model, h) if measured else None for k, h in [("none", None), *heads.items()]}
    static = {"plain": Engine(model, tokenizer)}
    static |= _peers(peers, model, tokenizer, embedded=args.model is None)
    for x in lookup_only:
        static[LOOKUP_VARIANTS[x]] = Engine(model, tokenizer, lookup=_lookup(x, args), costs=costs["none"])
    for kind, h in heads.items():
        for item in _for_heads(args.trees, kind):
            tree, lookup = _split_lookup(item, args)
            static[f"{label[kind]}/{item}"] = Engine(
                model, tokenizer, heads=h, tree=tree, lookup=lookup, costs=costs[kind]
            )
    plans = _defaults(args, model, tokenizer, static) if args.defaults else {}

    def profile_for(kind: str, task: str):
        spec = args.profile if args.profile != "auto" else (task if task in PROFILE_TASKS else "mixed")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if args.dtype != "bfloat16" else "default")
            p = resolve_profile(spec, kind)
            p.check(model, heads[kind])
        return p

    profiles = {(k, t): profile_for(k, t) for k in heads for t in tasks if policies[k]}
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, acceptance=args.acceptance)
    peer_gen = {k: v for k, v in gen.items() if k != "acceptance"}  # peers sample plainly
    hello = encode_prompt(tokenizer, "Hello!")
    for engine in static.values():  # warm-up (dropped)
        engine.generate(hello, max_new_tokens=8)

    runs: dict[str, dict[str, list[dict]]] = {t: {} for t in tasks}
    rate: dict[str, list[float]] = {}  # config -> [tokens, seconds] so far: the progress line's tokens/s
    trace: dict = {}  # one generation's steps (the first prompt of the first scheduled config), for trace.png
    traced = next((f"{label[k]}/{p}" for k in heads for p in policies[k]), None) or next(
        (n for n in static if "/" in n), None
    )
    replays: dict[str, dict] = {}
    mismatches = []
    n_configs = len(static) + sum(len(policies[k]) for k in heads)
    total = sum(len(p) for p in prompts.values()) * n_configs
    interrupted = False
    try:
        with Progress(disable=args.no_progress) as bar:
            job = bar.add_task("bench", total=total)
            for task in tasks:
                engines = dict(static)
                for kind in heads:
                    for item in policies[kind]:
                        pol, lookup = _split_lookup(item, args)
                        engines[f"{label[kind]}/{item}"] = Engine(
                            model,
                            tokenizer,
                            heads=heads[kind],
                            tree=_policy(profiles[(kind, task)], pol, args, costs[kind]),
                            lookup=lookup,
                            costs=costs[kind],
                        )
                outputs = []
                for i, prompt in enumerate(prompts[task]):
                    ref = None
                    ids = encode_prompt(tokenizer, prompt)
                    for name, engine in engines.items():
                        kw = gen if isinstance(engine, Engine) else peer_gen
                        r = engine.generate(ids, seed=args.seed + i, **kw)
                        record = _record(i, r)
                        if args.temperature > 0:  # how likely the base model finds the sampled continuation
                            record.update(_nll(model, ids, r.token_ids))
                        runs[task].setdefault(name, []).append(record)
                        if name == traced and not trace and r.steps:
                            trace = _trace(task, i, name, r)
                        tokens_seconds = rate.setdefault(name, [0, 0.0])
                        tokens_seconds[0] += len(r.token_ids)
                        tokens_seconds[1] += r.seconds
                        if ref is None:
                            ref = r.token_ids
                            outputs.append((ids, r.token_ids))
                        elif (
                            args.temperature == 0 and name != "llama-cpp" and r.token_ids != ref
                        ):  # its own weights
                            diff = (
                                k for k, (a, b) in enumerate(zip(r.token_ids, ref, strict=False)) if a != b
                            )
                            first = next(diff, min(len(r.token_ids), len(ref)))
                            mismatches.append(
                                {"task": task, "prompt": i, "config": name, "first_difference": first}
                            )
                        bar.advance(job)
                        tps = metrics.tokens_per_second(*tokens_seconds)
                        bar.update(job, description=f"{task} {name}: {tps:.1f} tok/s")
                if args.replay and args.temperature == 0:
                    replays[task] = {
                        label[k]: _replays(
                            profiles[(k, task)],
                            heads[k],
                            Engine(model, tokenizer, heads=heads[k]),
                            outputs,
                            policies[k],
                            args,
                            costs[k],
                        )
                        for k in heads
                        if policies[k]
                    }
    except KeyboardInterrupt:  # Ctrl-C: keep the prompts that every configuration finished
        interrupted = True
        for t in tasks:
            done = min((len(rs) for rs in runs[t].values()), default=0)
            runs[t] = {name: rs[:done] for name, rs in runs[t].items()} if done else {}
            mismatches[:] = [m for m in mismatches if m["task"] != t or m["prompt"] < done]
        tasks = [t for t in tasks if runs[t]]
        done_prompts = sum(len(r.get("plain", [])) for r in runs.values())
        print(
            f"entmtp: interrupted: writing the {done_prompts} prompts every configuration finished",
            flush=True,
        )

    summary = {t: {name: _summarise(rs) for name, rs in runs[t].items()} for t in tasks}
    for t in tasks:
        base = summary[t]["plain"]["tokens_per_second"]
        for name, row in summary[t].items():
            row["speedup"] = metrics.speedup(row["tokens_per_second"], base)
            row.update(speedup_interval(runs[t][name], runs[t]["plain"], seed=args.seed))
            if args.temperature == 0 and name not in ("plain", "llama-cpp"):  # which outputs equal plain's
                diffs = [m["first_difference"] for m in mismatches if m["task"] == t and m["config"] == name]
                row["identical_to_plain"] = 1.0 - len(diffs) / max(1, row["prompts"])
                row["first_differences"] = diffs
    _print(summary, replays, args)
    if mismatches:  # bf16 rounds one-token and many-token forwards differently: rare divergences are expected
        n_spec = sum(len(p) for p in prompts.values()) * (n_configs - 1)
        print(
            f"{len(mismatches)} of {n_spec} speculative runs differ from plain decoding ({args.dtype}: "
            "one-token and many-token forwards round differently; float32 runs are bit-exact)"
        )
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "entmtp " + " ".join(getattr(args, "argv", sys.argv[1:])),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "commit": _commit(),
        "versions": _versions(),
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": args.num_prompts,
        "split": args.split,
        "temperature": args.temperature,
        "acceptance": args.acceptance,
        "profiles": {f"{k}/{t}": str(p.path) for (k, t), p in profiles.items()},
        "step_costs": {k: c.to_json() if c is not None else "profile latencies" for k, c in costs.items()},
        "plans": plans,
        "torch": torch.__version__,
        "prompts_file": args.prompts,
        "quick": args.quick,
        "interrupted": interrupted,
    }
    data = {
        "meta": meta,
        "summary": summary,
        "replays": replays,
        "runs": runs,
        "mismatches": mismatches,
        "trace": trace,
    }
    results = out / "results.json"
    write_text_atomic(results, json.dumps(data, indent=1))
    labels = {t: _label(t) for t in tasks}
    images = []
    if tasks:
        speedup_plot(summary, labels, out / "speedup.png")
        images.append(("speedup over plain decoding per task and method", "speedup.png"))
    used = {(kind, p.path): p for (kind, _), p in profiles.items()}  # each heads' profile, once
    for (kind, path), profile in used.items():
        name = f"frontier-{Path(kind).name}-{Path(path).stem}.png"
        plot_profile(profile, out / name, profile.mode_for(args.temperature))
        images.append((f"acceptance and throughput frontiers of {path}", name))
    if trace:
        trace_plot(trace, out / "trace.png")
        images.append((f"one generation, step by step: {trace['config']} on {trace['task']}", "trace.png"))
    report = markdown(json.loads(results.read_text()), labels, meta["command"], images)
    write_text_atomic(out / "report.md", report)
    print(f"wrote {results}, {out / 'report.md'} and {len(images)} plots in {out}")
    return 0


# What a run compares unless told otherwise. The full run: every peer that needs no training, entmtp's prompt
# lookup, both heads with the published default tree and Hydra with its best small static tree, every policy
# for Hydra (the better heads here) and EntMTP* for Medusa. --quick (about 7 minutes on a 2-core CPU for all
# 11 tasks): the strongest peer, lookup, the published default, EntMTP* and the two best policies, shorter.
FULL = {
    "num_prompts": 10,
    "max_new_tokens": 128,
    "trees": "mc_sim_7b_63,hydra:tree_8",
    "policies": "hydra:static,hydra:binary,hydra:ladder,hydra:cost,hydra:dynamic,hydra:dynamic+lookup,medusa:static",
    "peers": "hf-generate,hf-prompt-lookup",
    "lookup_only": "adaptive",
}
QUICK = {
    "num_prompts": 2,
    "max_new_tokens": 48,
    "trees": "hydra:mc_sim_7b_63",
    "policies": "hydra:static,hydra:dynamic,hydra:dynamic+lookup",
    "peers": "hf-prompt-lookup",
    "lookup_only": "adaptive",
}


def _resolve_sizes(args) -> None:
    """Sizes and methods default to --quick's or the full run's; what the command line sets wins."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise EntMTPError("--num-prompts and --max-new-tokens must be >= 1")


def _out_dir(spec: str | None) -> Path:
    """The output directory (default: a new dated folder under runs/), checked writable; created when the
    results are written, so a run that fails early leaves nothing behind."""
    out = Path(spec) if spec else Path("runs") / f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if out.suffix == ".json":
        raise EntMTPError(
            f"--out {out}: give a directory (results.json, report.md and the plots are written into it)"
        )
    if out.exists() and not out.is_dir():
        raise EntMTPError(f"--out {out} is a file: give a directory")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise EntMTPError(f"--out {out} cannot be written ({parent} is not a writable directory)")
    return out


def _nll(model, ids: list[int], out: list[int]) -> dict:
    """Negative log-likelihood of the continuation `out` under the base model (T=1), summed over its tokens."""
    if not out:
        return {"nll": 0.0, "nll_tokens": 0}
    seq = torch.tensor([ids + out], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[0, len(ids) - 1 : -1].float()  # [len(out), V]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, seq[0, len(ids) :, None]).sum()
    return {"nll": float(nll), "nll_tokens": len(out)}


def _trace(task: str, prompt: int, config: str, result) -> dict:
    steps = [
        {"tree": s.tree, "nodes": s.tree_nodes, "accepted": s.accepted, "signals": s.signals}
        for s in result.steps
    ]
    return {"task": task, "prompt": prompt, "config": config, "steps": steps}


def _commit() -> str | None:
    import subprocess

    try:
        here = Path(__file__).parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    import importlib.metadata

    out = {}
    for dist in ("entmtp", "torch", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


LOOKUP_VARIANTS = {"adaptive": "lookup", "fixed": "lookup-fixed"}  # --lookup-only item -> config name
PEERS = ("hf-generate", "hf-prompt-lookup", "llama-cpp")


def _lookup(variant: str, args) -> Lookup:
    return Lookup(
        max_ngram=args.lookup_ngram,
        tokens=args.lookup_tokens,
        adaptive=variant == "adaptive",
        node_cost=args.lookup_node_cost,
    )


def _split_lookup(item: str, args) -> tuple[str, Lookup | None]:
    """`tree_8+lookup` -> ("tree_8", adaptive lookup); `tree_8+lookup-fixed` -> fixed-length lookup."""
    for suffix, variant in (("+lookup-fixed", "fixed"), ("+lookup", "adaptive")):
        if item.endswith(suffix):
            return item[: -len(suffix)], _lookup(variant, args)
    return item, None


def _heads_labels(specs: list[str]) -> dict[str, str]:
    """Config names' heads part: medusa, hydra, or a heads directory's name (its path if two share it)."""
    names = [Path(s).name for s in specs]
    return {s: n if names.count(n) == 1 else s for s, n in zip(specs, names, strict=True)}


def _check_heads_and_trees(kinds: list[str], args) -> None:
    """Unknown heads, a HEADS: prefix naming no heads, and unknown trees are named before any model loads."""
    for spec in kinds:
        if not heads_path(spec).is_dir():
            raise EntMTPError(
                f"unknown heads {spec!r} in --heads: use medusa, hydra, none or a heads directory"
            )
    for flag, spec in (("--trees", args.trees), ("--policies", args.policies)):
        for item in (x for x in spec.split(",") if x):
            only, sep, _ = item.partition(":")
            if sep and only not in kinds and only not in HEAD_KINDS:
                raise EntMTPError(
                    f"{flag} item {item!r} is for heads {only!r}, which --heads does not name: "
                    f"use {' or '.join(f'{k}:' for k in kinds or HEAD_KINDS)} or no prefix"
                )
    for kind in kinds:
        for item in _for_heads(args.trees, kind):
            try:
                load_tree(_split_lookup(item, args)[0])
            except TreeError as e:
                raise EntMTPError(f"--trees: {e}") from e


def _check_peers(spec: str) -> list[str]:
    peers = [p for p in spec.split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise EntMTPError(f"unknown peer {p!r}: use {', '.join(PEERS)}")
    return peers


def _peers(names: list[str], model, tokenizer, embedded: bool = True) -> dict:
    """Peer decoders by config name; an optional one that is not installed is skipped with its install hint,
    and llama-cpp, which plays the embedded model's GGUF, is skipped when another model is benchmarked."""
    from .peers import HFGenerate, LlamaCppPlain, PeerUnavailable

    out: dict = {}
    for name in names:
        if name == "hf-generate":
            out[name] = HFGenerate(model, tokenizer)
        elif name == "hf-prompt-lookup":
            out[name] = HFGenerate(model, tokenizer, prompt_lookup_tokens=10)
        elif not embedded:
            print(f"entmtp: skipping peer {name}: it decodes the embedded model's GGUF, not --model")
        else:
            try:
                out[name] = LlamaCppPlain(n_threads=torch.get_num_threads())
            except PeerUnavailable as e:
                print(f"entmtp: skipping peer {name}: {e}")
    return out


def _for_heads(spec: str, kind: str) -> list[str]:
    """Items of a comma list for heads `kind`: plain items apply to every heads, `kind:item` to one."""
    out = []
    for item in (x for x in spec.split(",") if x):
        only, sep, rest = item.partition(":")
        if not sep:
            out.append(item)
        elif only == kind:
            out.append(rest)
    return out


def _policy(profile, name: str, args, costs):
    latency = costs.latency() if costs is not None else None
    return profile.policy(name, profile.mode_for(args.temperature), latency=latency)


def _defaults(args, model, tokenizer, engines: dict) -> dict[str, str]:
    """--defaults: add plain decoding in the other CPU dtype, `default` (what `entmtp generate` builds: auto
    dtype, this machine's step costs, lookup drafts) and `previous-default` (until this version's: bfloat16,
    the shipped `mixed` profile's recommended policy on its stored latencies, no lookup). Returns each built
    engine's plan, for the results' meta."""
    from .build import EngineSpec, build
    from .model import load_model
    from .scheduler.profiles import resolve_profile

    other = "float32" if args.dtype == "bfloat16" else "bfloat16"
    m2, t2 = load_model(args.model, dtype=other, device=args.device, pack=not args.no_pack)
    engines[f"plain@{other}"] = Engine(m2, t2)
    spec = EngineSpec(model=args.model, device=args.device, threads=args.threads, lookup=Lookup())
    built = build(spec)
    engines["default"] = built.engine
    old_model, old_tok = (model, tokenizer) if args.dtype == "bfloat16" else (m2, t2)
    hydra = resolve_heads("hydra", old_model)
    profile = resolve_profile("mixed", "hydra")
    engines["previous-default"] = Engine(
        old_model, old_tok, heads=hydra, tree=profile.policy(profile.recommended_policy())
    )
    return {"default": built.plan.describe()}


def _record(i: int, r) -> dict:
    sched = [s.seconds.get("choose", 0.0) for s in r.steps]
    probe = [s.seconds.get("probe", 0.0) for s in r.steps]
    step = [s.seconds["total"] for s in r.steps]
    usage: dict[str, int] = {}
    for s in r.steps:
        usage[s.tree] = usage.get(s.tree, 0) + 1
    return {
        "lookup_tokens": sum(s.lookup_accepted for s in r.steps),
        "prompt": i,
        "tokens": len(r.token_ids),
        "steps": r.num_steps,
        "seconds": r.seconds,
        "prefill_seconds": r.prefill_seconds,
        "tokens_per_step": r.mean_tokens_per_step,
        "choose_seconds": sum(sched),
        "probe_seconds": sum(probe),
        "step_seconds": sum(step),
        "trees": usage,
    }


def _replays(profile, heads, engine, outputs, policies, args, costs) -> dict:
    """Trace the plain greedy outputs through the heads; replay each policy (lookup hybrids included) and the
    oracle on them."""
    from .scheduler.hybrid import HybridPolicy
    from .scheduler.replay import oracle, replay, step_ms
    from .scheduler.traces import trace_generation

    traces = [
        trace_generation(engine.base, heads, ids + out, len(ids)) for ids, out in outputs if len(out) >= 2
    ]
    latency = costs.latency() if costs is not None else profile.latency()
    ms_of = step_ms(latency)
    out = {}
    for p in policies:
        name, lookup = _split_lookup(p, args)
        policy = profile.policy(name, latency=latency)
        if lookup is not None:  # as the engine wraps it
            share = costs.draft_share if costs is not None else None
            policy = HybridPolicy(policy, lookup, latency, draft_cost=share)
        out[p] = replay(policy, traces, ms_of).to_json()
    out["oracle"] = oracle(profile.bank(), traces, ms_of).to_json()
    return out


def _summarise(rs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rs)
    seconds = sum(r["seconds"] for r in rs)
    steps = sum(r["steps"] for r in rs)
    step_seconds = sum(r["step_seconds"] for r in rs)
    if not steps:  # a peer: no per-step records
        step_seconds = seconds
    decode = metrics.step_tokens(tokens, len(rs))  # each prompt's first token comes from its prefill
    usage: dict[str, int] = {}
    for r in rs:
        for k, v in r["trees"].items():
            usage[k] = usage.get(k, 0) + v
    return {
        "prompts": len(rs),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": metrics.tokens_per_second(tokens, seconds),
        "decode_tokens_per_second": metrics.tokens_per_second(decode, step_seconds),
        "tokens_per_step": metrics.mean_tokens_per_step(decode, steps) if steps else float("nan"),
        "lookup_share": sum(r["lookup_tokens"] for r in rs) / max(1, tokens),
        "median_prompt_tokens_per_second": statistics.median(
            metrics.tokens_per_second(r["tokens"], r["seconds"]) for r in rs
        ),
        "choose_ms_per_step": 1000 * sum(r["choose_seconds"] for r in rs) / max(1, steps),
        "probe_ms_per_step": 1000 * sum(r["probe_seconds"] for r in rs) / max(1, steps),
        "ms_per_step": 1000 * step_seconds / max(1, steps),
        "tree_usage": usage,
        **_perplexity(rs),
    }


def _perplexity(rs: list[dict]) -> dict:
    """exp(mean NLL per token) of the continuations under the base model (T > 0 runs only)."""
    n = sum(r.get("nll_tokens", 0) for r in rs)
    return {"perplexity": math.exp(sum(r["nll"] for r in rs) / n)} if n else {}


def _print(summary: dict, replays: dict, args) -> None:
    console = _console()
    for task, rows in summary.items():
        table = Table(
            title=f"{_label(task)}: {args.num_prompts} {args.split if args.prompts is None else ''} prompts, {args.max_new_tokens} new tokens, "
            f"T={args.temperature} {args.acceptance}, {args.dtype}, {torch.get_num_threads()} threads"
        )
        cols = ["config", "tokens/step", "tokens/s", "speedup", "ms/step", "choose ms/step", "lookup share"]
        sampled = any("perplexity" in r for r in rows.values())
        for col in cols + (["perplexity"] if sampled else []):
            table.add_column(col, justify="right")
        for name, r in rows.items():
            peer = r["tokens_per_step"] != r["tokens_per_step"]  # NaN: no per-step records
            table.add_row(
                name,
                "" if peer else f"{r['tokens_per_step']:.2f}",
                f"{r['tokens_per_second']:.1f}",
                f"{r['speedup']:.2f}x",
                "" if peer else f"{r['ms_per_step']:.1f}",
                "" if peer else f"{r['choose_ms_per_step']:.3f}",
                f"{r['lookup_share']:.0%}" if r["lookup_share"] else "",
                *([f"{r['perplexity']:.2f}" if "perplexity" in r else ""] if sampled else []),
            )
        console.print(table)
        for kind, rep in replays.get(task, {}).items():
            rt = Table(
                title=f"{_label(task)}, {kind}: policies replayed on the plain outputs (decode steps, "
                "the profile's latencies)"
            )
            for col in ("policy", "tokens/s", "tokens/step", "vs static"):
                rt.add_column(col, justify="right")
            base = rep.get("static", {}).get("tokens_per_second")
            for name, r in rep.items():
                ratio = f"{metrics.speedup(r['tokens_per_second'], base):.3f}x" if base else ""
                rt.add_row(name, f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_step']:.2f}", ratio)
            console.print(rt)


def _label(task: str) -> str:
    return TASKS[task][1] if task in TASKS else task


def _console() -> Console:
    """Full-width tables in logs too (rich would cut columns to 80 characters when not on a terminal)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)
