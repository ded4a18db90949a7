"""Running a bench: every prompt through every method back to back (so machine load hits all of them alike),
each generation kept as a record; with --replay, the policies and the oracle replayed on plain decoding's
greedy outputs. Ctrl-C keeps the prompts that every method finished."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rich.progress import Progress

from .. import metrics
from ..engine import Engine
from ..routing import Router
from .engines import Methods
from .peers import LLAMA_PEERS
from .plan import Plan


@dataclass
class Measurements:
    """What a bench measured. A record is one generation (`record`); a mismatch names a method whose greedy
    output differs from plain decoding's, and its first differing token."""

    runs: dict[str, dict[str, list[dict]]]  # task -> method -> one record per prompt
    mismatches: list[dict] = field(default_factory=list)
    step_log: dict = field(default_factory=dict)  # one generation step by step (`step_log`), for steps.png
    replays: dict[str, dict] = field(default_factory=dict)  # task -> heads label -> policy -> replay
    interrupted: bool = False

    @property
    def tasks(self) -> list[str]:
        """The tasks with results (all of them, unless Ctrl-C came before a task's first prompt finished)."""
        return [t for t, methods in self.runs.items() if methods]

    def keep_finished(self) -> None:
        """After Ctrl-C: keep, per task, the prompts that every method finished."""
        self.interrupted = True
        for task, methods in self.runs.items():
            done = min((len(rs) for rs in methods.values()), default=0)
            self.runs[task] = {name: rs[:done] for name, rs in methods.items()} if done else {}
            self.mismatches[:] = [m for m in self.mismatches if m["task"] != task or m["prompt"] < done]


def measure(plan: Plan, methods: Methods) -> Measurements:
    """Warm every static method up (one dropped generation), then run each task's prompts through every
    method in turn."""
    from ..model import encode_prompt

    warm_up(methods)
    measured = Measurements(runs={t: {} for t in plan.tasks})
    total = sum(len(p) for p in plan.prompts.values()) * methods.count
    try:
        with Progress(disable=plan.args.no_progress) as bar:
            progress = _ProgressLine(bar, bar.add_task("bench", total=total))
            for task in plan.tasks:
                engines = methods.for_task(task)
                outputs = []
                for i, prompt in enumerate(plan.prompts[task]):
                    ids = encode_prompt(methods.tokenizer, prompt)
                    predicted = getattr(prompt, "prediction", None)  # prompts.PredictedPrompt
                    plain = _one_prompt(methods, engines, task, i, ids, measured, progress, predicted)
                    outputs.append((ids, plain))
                if plan.args.replay and plan.args.temperature == 0:
                    measured.replays[task] = replays(methods, task, outputs)
    except KeyboardInterrupt:
        measured.keep_finished()
        done = sum(len(r.get("plain", [])) for r in measured.runs.values())
        print(f"entmtp: interrupted: writing the {done} prompts every configuration finished", flush=True)
    return measured


def warm_up(methods: Methods) -> None:
    """One short generation per static method, dropped: first calls pay for allocation and kernel selection."""
    from ..model import encode_prompt

    hello = encode_prompt(methods.tokenizer, "Hello!")
    for engine in methods.static.values():
        engine.generate(hello, max_new_tokens=8)


def _one_prompt(
    methods: Methods,
    engines: dict,
    task: str,
    i: int,
    ids: list[int],
    measured: Measurements,
    progress,
    prediction: str | None = None,
) -> list[int]:
    """Prompt `i` through every method (plain decoding first); returns plain decoding's output. `prediction`:
    the prompt's expected output, given to every speculative method of ours (`predicted`)."""
    args = methods.plan.args
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    plain = None
    for name, engine in engines.items():
        ours = isinstance(engine, (Engine, Router))
        rule = {"acceptance": args.acceptance} if ours else {}  # a peer samples plainly
        if prediction is not None and predicted(name, ours):
            rule["prediction"] = prediction
        r = engine.generate(ids, seed=args.seed + i, **sampling, **rule)
        rec = record(i, r)
        if args.temperature > 0:  # how likely the base model finds the sampled continuation
            rec.update(nll(methods.model, ids, r.token_ids))
        measured.runs[task].setdefault(name, []).append(rec)
        if name == methods.logged and not measured.step_log and r.steps:
            measured.step_log = step_log(task, i, name, r)
        # greedy outputs should equal plain decoding's (llama-cpp decodes its own weights)
        if plain is None:
            plain = r.token_ids
        elif args.temperature == 0 and name not in LLAMA_PEERS and r.token_ids != plain:
            first = first_difference(r.token_ids, plain)
            measured.mismatches.append({"task": task, "prompt": i, "config": name, "first_difference": first})
        progress.advance(task, name, r)
    return plain


def predicted(name: str, ours: bool) -> bool:
    """Whether method `name` decodes with a prompt's prediction: every method of entmtp's but its plain
    baselines (`plain`, `plain@...`, the speedups' denominators); peers take none (llama-cpp-python's
    decoding has no such input)."""
    return ours and not name.startswith("plain")


class _ProgressLine:
    """The progress bar, described by the running method's tokens/s so far."""

    def __init__(self, bar: Progress, job):
        self.bar, self.job = bar, job
        self.done: dict[str, list[float]] = {}  # method -> [tokens, seconds]

    def advance(self, task: str, name: str, result) -> None:
        tokens_seconds = self.done.setdefault(name, [0, 0.0])
        tokens_seconds[0] += len(result.token_ids)
        tokens_seconds[1] += result.seconds
        self.bar.advance(self.job)
        tps = metrics.tokens_per_second(*tokens_seconds)
        self.bar.update(self.job, description=f"{task} {name}: {tps:.1f} tok/s")


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two outputs differ (the shorter's length if one is a prefix of the other)."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def record(i: int, r) -> dict:
    """One generation of prompt `i` (a `Result`) as the JSON keeps it: counts, times, and each tree's steps."""
    usage: dict[str, int] = {}
    for s in r.steps:
        usage[s.tree] = usage.get(s.tree, 0) + 1
    used = getattr(r, "prediction", None)  # with a prediction: its tokens found in the output and the rest
    predicted = {} if used is None else {"prediction": {"accepted": used.accepted, "rejected": used.rejected}}
    return predicted | {
        "lookup_tokens": sum(s.lookup_accepted for s in r.steps),
        "drafts": r.drafts.to_json() if hasattr(r, "drafts") else {},  # by source (drafts.py); peers: none
        "prompt": i,
        "tokens": len(r.token_ids),
        "steps": r.num_steps,
        "seconds": r.seconds,
        "prefill_seconds": r.prefill_seconds,
        "tokens_per_step": r.mean_tokens_per_step,
        "choose_seconds": sum(s.seconds.get("choose", 0.0) for s in r.steps),
        "probe_seconds": sum(s.seconds.get("probe", 0.0) for s in r.steps),
        "step_seconds": sum(s.seconds["total"] for s in r.steps),
        "trees": usage,
    }


def nll(model, ids: list[int], out: list[int]) -> dict:
    """Negative log-likelihood of the continuation `out` under the base model (T=1), summed over its tokens."""
    if not out:
        return {"nll": 0.0, "nll_tokens": 0}
    seq = torch.tensor([ids + out], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[0, len(ids) - 1 : -1].float()  # [len(out), V]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, seq[0, len(ids) :, None]).sum()
    return {"nll": float(nll), "nll_tokens": len(out)}


def step_log(task: str, prompt: int, config: str, result) -> dict:
    """One generation step by step: each step's tree, its size, the drafts accepted and the policy's signals."""
    steps = [
        {"tree": s.tree, "nodes": s.tree_nodes, "accepted": s.accepted, "signals": s.signals}
        for s in result.steps
    ]
    return {"task": task, "prompt": prompt, "config": config, "steps": steps}


def replays(methods: Methods, task: str, outputs: list[tuple[list[int], list[int]]]) -> dict[str, dict]:
    """Per heads label with policies: each policy and the oracle replayed on plain decoding's (prompt, output)
    pairs (decode steps only, charged by this machine's step costs, else the profile's latencies)."""
    return {
        methods.labels[k]: _replay_heads(methods, k, task, outputs)
        for k in methods.heads
        if methods.policies(k)
    }


def _replay_heads(methods: Methods, kind: str, task: str, outputs) -> dict:
    """Trace the plain greedy outputs through the heads; replay each policy (lookup hybrids included) and the
    oracle on them. Where this machine's step costs were measured, each policy's steps are also charged its
    choice, measured here for that policy (costs/choice.py, cached); else the replays say it is not charged."""
    from ..calibration.replay import oracle, replay, step_ms
    from ..calibration.traces import trace_generation
    from ..costs.choice import choice_for

    heads, profile, costs = methods.heads[kind], methods.profiles[(kind, task)], methods.costs[kind]
    base = methods.engine(kind, "tree_8").base
    traces = [trace_generation(base, heads, ids + out, len(ids)) for ids, out in outputs if len(out) >= 2]
    latency = costs.latency() if costs is not None else profile.latency.model()
    ms_of = step_ms(costs if costs is not None else latency)  # the measured drafting share, when measured
    out = {}
    for p in methods.policies(kind):
        policy = methods.policy(kind, p, task)  # as the engine composes it
        choice = choice_for(methods.loaded[kind].model, heads, policy) if costs is not None else None
        out[p] = replay(policy, traces, ms_of.with_choice(choice)).to_json()
    out["oracle"] = oracle(profile.bank(), traces, ms_of).to_json()
    return out
