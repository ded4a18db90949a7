"""Per-task, per-method figures from a bench's records. Every rate is computed by metrics.py: tokens/s pools a
method's prompts (all tokens over all seconds, prefill included); tokens/step = accepted drafts + 1 bonus token,
the prefill's first token belonging to no step; speedup is tokens/s over plain decoding's on the same prompts."""

from __future__ import annotations

import math
import statistics

import numpy as np

from .. import metrics
from .peers import LLAMA_PEERS

BOOTSTRAP = 2000  # resamples of the prompts for the 95% interval


def summarise_tasks(runs: dict, mismatches: list[dict], *, seed: int, greedy: bool) -> dict:
    """task -> method -> `summarise` of its records, with its speedup over plain decoding, the per-prompt
    speedup interval and, when `greedy`, the share of outputs identical to plain decoding's. Tasks without
    records (Ctrl-C came first) are left out."""
    summary = {}
    for task, methods in ((t, m) for t, m in runs.items() if m):
        rows = summary[task] = {name: summarise(rs) for name, rs in methods.items()}
        base = rows["plain"]["tokens_per_second"]
        for name, row in rows.items():
            row["speedup"] = metrics.speedup(row["tokens_per_second"], base)
            row.update(speedup_interval(methods[name], methods["plain"], seed=seed))
            if greedy and name not in ("plain", *LLAMA_PEERS):  # llama.cpp decodes its own weights
                diffs = [
                    m["first_difference"] for m in mismatches if m["task"] == task and m["config"] == name
                ]
                row["identical_to_plain"] = 1.0 - len(diffs) / max(1, row["prompts"])
                row["first_differences"] = diffs
    return summary


# each built default against the plain decodings of the backend it runs on (issue #62): "never slower" is
# checked against the faster of them (transformers: either CPU dtype; llama.cpp: entmtp's own plain steps)
PLAIN_OF = {"transformers": ("plain", "plain@float32", "plain@bfloat16"), "llama-cpp": ("plain@llama-cpp",)}


def default_over_plain(summary: dict, plans: dict[str, str]) -> dict[str, dict[str, float]]:
    """task -> built default (`default`, `default@transformers`, `default@llama-cpp`) -> its tokens/s over the
    fastest plain decoding of the backend it runs on (its plan's `backend:` line; a routed default's first
    lane), where the run has both."""
    out: dict[str, dict[str, float]] = {}
    for task, rows in summary.items():
        for name, plan in plans.items():
            backend = next((x.split()[1] for x in plan.splitlines() if x.startswith("backend: ")), None)
            plain = [rows[p]["tokens_per_second"] for p in PLAIN_OF.get(backend, ()) if p in rows]
            if name in rows and plain:
                out.setdefault(task, {})[name] = rows[name]["tokens_per_second"] / max(plain)
    return out


def summarise(records: list[dict]) -> dict:
    """One method's records on one task (see run.record): pooled rates, per-step costs, the trees' usage and,
    for sampled runs, the continuations' perplexity. A peer records no steps: its tokens/step is NaN and its
    decode rate is over the whole wall time."""
    tokens = sum(r["tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    steps = sum(r["steps"] for r in records)
    step_seconds = sum(r["step_seconds"] for r in records) if steps else seconds
    decode = metrics.step_tokens(tokens, len(records))  # each prompt's first token comes from its prefill
    usage: dict[str, int] = {}
    for r in records:
        for k, v in r["trees"].items():
            usage[k] = usage.get(k, 0) + v
    return {
        "prompts": len(records),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": metrics.tokens_per_second(tokens, seconds),
        "decode_tokens_per_second": metrics.tokens_per_second(decode, step_seconds),
        "tokens_per_step": metrics.mean_tokens_per_step(decode, steps) if steps else float("nan"),
        "lookup_share": sum(r["lookup_tokens"] for r in records) / max(1, tokens),
        "median_prompt_tokens_per_second": statistics.median(_rate(r) for r in records),
        "choose_ms_per_step": 1000 * sum(r["choose_seconds"] for r in records) / max(1, steps),
        "probe_ms_per_step": 1000 * sum(r["probe_seconds"] for r in records) / max(1, steps),
        "ms_per_step": 1000 * step_seconds / max(1, steps),
        "tree_usage": usage,
        "drafts": _drafts(records),
        **_perplexity(records),
    }


def _drafts(records: list[dict]) -> dict[str, dict[str, int]]:
    """Drafted and accepted nodes by source (drafts.py), pooled over the records (a peer's: none)."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        for source, n in r.get("drafts", {}).items():
            pooled = out.setdefault(source, {"drafted": 0, "accepted": 0})
            pooled["drafted"] += n["drafted"]
            pooled["accepted"] += n["accepted"]
    return out


def speedup_interval(runs: list[dict], plain: list[dict], seed: int = 0) -> dict:
    """Per-prompt speedups (tokens/s over plain decoding's on the same prompt): their mean and a 95% bootstrap
    interval of that mean (percentile method; one prompt gives a zero-width interval)."""
    ratios = np.array([metrics.speedup(_rate(r), _rate(p)) for r, p in zip(runs, plain, strict=True)])
    if len(ratios) == 0:
        return {"speedup_mean_of_ratios": float("nan"), "speedup_ci95": [float("nan"), float("nan")]}
    rng = np.random.default_rng(seed)
    means = ratios[rng.integers(0, len(ratios), size=(BOOTSTRAP, len(ratios)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"speedup_mean_of_ratios": float(ratios.mean()), "speedup_ci95": [float(lo), float(hi)]}


def _rate(record: dict) -> float:
    """One generation's tokens/s."""
    return metrics.tokens_per_second(record["tokens"], record["seconds"])


def _perplexity(records: list[dict]) -> dict:
    """exp(mean NLL per token) of the continuations under the base model (T > 0 runs only)."""
    n = sum(r.get("nll_tokens", 0) for r in records)
    return {"perplexity": math.exp(sum(r["nll"] for r in records) / n)} if n else {}
