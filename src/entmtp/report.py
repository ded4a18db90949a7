"""What `entmtp bench` writes beside its JSON: per-prompt speedup intervals, a Markdown report, a speedup plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .metrics import speedup, tokens_per_second

BOOTSTRAP = 2000  # resamples of the prompts for the 95% interval


def speedup_interval(runs: list[dict], plain: list[dict], seed: int = 0) -> dict:
    """Per-prompt speedups (tokens/s over plain decoding's on the same prompt): their mean and a 95% bootstrap
    interval of that mean (percentile method; one prompt gives a zero-width interval)."""

    def rate(run: dict) -> float:
        return tokens_per_second(run["tokens"], run["seconds"])

    ratios = np.array([speedup(rate(r), rate(p)) for r, p in zip(runs, plain, strict=True)])
    if len(ratios) == 0:
        return {"speedup_mean_of_ratios": float("nan"), "speedup_ci95": [float("nan"), float("nan")]}
    rng = np.random.default_rng(seed)
    means = ratios[rng.integers(0, len(ratios), size=(BOOTSTRAP, len(ratios)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"speedup_mean_of_ratios": float(ratios.mean()), "speedup_ci95": [float(lo), float(hi)]}


def markdown(data: dict, labels: dict[str, str], command: str, images=()) -> str:
    """The report: the command and setup, one table per task, then the plots ((caption, file) pairs)."""
    meta = data["meta"]
    sampled = meta["temperature"] > 0
    lines = [
        "# entmtp bench",
        "",
        f"`{command}`",
        "",
        f"{meta['machine']}, {meta['threads']} threads, {meta['dtype']}, torch {meta['torch']}; "
        f"{meta['max_new_tokens']} new tokens, T={meta['temperature']} ({meta['acceptance']})"
        + (" — interrupted: partial results" if meta.get("interrupted") else ""),
        "",
        "Speedup = tokens/s over plain decoding (ratio of sums; prefill included); the interval is a 95% "
        "bootstrap interval of the mean per-prompt speedup. Decode tokens/s leaves the prefill out. Choose ms = "
        "the scheduler's time per step (probe included). Trees: each tree's share of the steps (the three most "
        "used). Identical = outputs equal to plain decoding's (T=0), with the first differing token of each "
        "that is not."
        + (" Perplexity: of the sampled continuations under the base model (T=1)." if sampled else ""),
    ]
    if meta.get("date") or meta.get("commit"):
        lines += [
            "",
            f"Run {meta.get('date', '')}, commit {meta.get('commit') or 'unknown'}, versions {meta.get('versions', {})}.",
        ]
    for task, rows in data["summary"].items():
        lines += ["", f"## {labels.get(task, task)} ({next(iter(rows.values()))['prompts']} prompts)", ""]
        last = "perplexity" if sampled else "identical"
        head = [
            "method",
            "tokens/s",
            "speedup",
            "per-prompt speedup (95% CI)",
            "tokens/step",
            "decode tokens/s",
        ]
        head += ["choose ms", "trees", last]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, r in rows.items():
            lo, hi = r.get("speedup_ci95", [float("nan")] * 2)
            tps = r["tokens_per_step"]
            same = r.get("identical_to_plain")
            if sampled:
                tail = f"{r['perplexity']:.2f}" if "perplexity" in r else ""
            else:
                tail = "" if same is None else f"{same:.0%}"
                if r.get("first_differences"):
                    tail += " (at " + ", ".join(str(i) for i in r["first_differences"]) + ")"
            steps = tps == tps  # a peer has no per-step records
            cells = [
                name,
                f"{r['tokens_per_second']:.1f}",
                f"{r['speedup']:.2f}x",
                f"{r.get('speedup_mean_of_ratios', float('nan')):.2f}x ({lo:.2f}-{hi:.2f})",
                f"{tps:.2f}" if steps else "",
                f"{r['decode_tokens_per_second']:.1f}" if steps else "",
                f"{r['choose_ms_per_step']:.2f}" if steps else "",
                _usage(r.get("tree_usage", {})) if steps and name != "plain" else "",
                tail,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    for caption, file in images:
        lines += ["", f"![{caption}]({file})"]
    return "\n".join(lines) + "\n"


def _usage(usage: dict[str, int], most: int = 3) -> str:
    """The most used trees with their share of the steps, e.g. "n3d2 61%, none 30%, n8d4 9%"."""
    total = sum(usage.values())
    top = sorted(usage.items(), key=lambda kv: -kv[1])[:most]
    return ", ".join(f"{tree} {n / total:.0%}" for tree, n in top) if total else ""


def speedup_plot(summary: dict, labels: dict[str, str], path: Path) -> None:
    """Grouped bars: speedup over plain decoding per task and method, with the per-prompt 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary)
    methods = [m for m in dict.fromkeys(m for rows in summary.values() for m in rows) if m != "plain"]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(tasks) * max(1, len(methods)) ** 0.5 + 3), 4.2))
    x = np.arange(len(tasks))
    for i, m in enumerate(methods):
        rows = [summary[t].get(m) for t in tasks]
        ys = [r["speedup"] if r else np.nan for r in rows]
        mean = [r.get("speedup_mean_of_ratios", np.nan) if r else np.nan for r in rows]
        lo = [
            mu - r["speedup_ci95"][0] if r and "speedup_ci95" in r else 0
            for r, mu in zip(rows, mean, strict=True)
        ]
        hi = [
            r["speedup_ci95"][1] - mu if r and "speedup_ci95" in r else 0
            for r, mu in zip(rows, mean, strict=True)
        ]
        xs = x + (i - (len(methods) - 1) / 2) * width
        ax.bar(xs, ys, width, label=m)
        ax.errorbar(xs, mean, yerr=[lo, hi], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, [labels.get(t, t) for t in tasks], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def trace_plot(trace: dict, path: Path) -> None:
    """One generation step by step: the signals the policy read, the tree it chose (nodes) and how many of
    the tree's drafts the base model accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = trace["steps"]
    x = np.arange(len(steps))
    names = list(dict.fromkeys(k for s in steps for k in s["signals"]))[:4]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for name in names:
        ax1.plot(x, [s["signals"].get(name, np.nan) for s in steps], lw=1, label=name)
    ax1.set_ylabel("signal")
    ax1.set_title(f"{trace['config']}, {trace['task']} prompt {trace['prompt']}: what the policy read")
    if names:
        ax1.legend(fontsize=7, ncol=len(names))
    ax2.bar(x, [s["nodes"] for s in steps], color="tab:gray", alpha=0.5, label="tree nodes chosen")
    ax2.plot(x, [s["accepted"] for s in steps], ".", color="tab:blue", label="drafts accepted")
    ax2.set_yscale("symlog")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
