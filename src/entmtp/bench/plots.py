"""The bench's plots: speedup per task and method, and one generation step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np


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


def step_log_plot(log: dict, path: Path) -> None:
    """One generation step by step: the signals the policy read, the tree it chose (nodes) and how many of
    the tree's drafts the base model accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log["steps"]
    x = np.arange(len(steps))
    names = list(dict.fromkeys(k for s in steps for k in s["signals"]))[:4]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for name in names:
        ax1.plot(x, [s["signals"].get(name, np.nan) for s in steps], lw=1, label=name)
    ax1.set_ylabel("signal")
    ax1.set_title(f"{log['config']}, {log['task']} prompt {log['prompt']}: what the policy read")
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
