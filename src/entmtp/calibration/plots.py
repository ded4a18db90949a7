"""The picture of a profile: its acceptance frontier and its throughput frontier, default tree marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_profile(profile, path: str | Path, mode: str = "greedy") -> Path:
    m = profile.mode(mode)
    data = profile.data
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    af = m["acceptance_frontier"]
    ax1.plot(
        [e["nodes"] for e in af],
        [1 + e["mean_accepted_all_positions"] for e in af],
        ".-",
        color="tab:gray",
        label="1 + mean accepted (all positions)",
    )
    ax1.plot(
        [e["nodes"] for e in af],
        [e["tokens_per_step_simulated"] for e in af],
        ".-",
        color="tab:blue",
        label="tokens/step (own-tree decodes)",
    )
    ref = m.get("reference", {})
    for name, r in ref.items():
        ax1.plot(
            [r["nodes"]], [r["tokens_per_step_simulated"]], "s", color="tab:red", label=f"{name} (default)"
        )
    ax1.set_xlabel("tree nodes")
    ax1.set_ylabel("tokens per step")
    ax1.set_title("acceptance frontier")
    ax1.legend(fontsize=8)
    trees = data["latency"]["trees"]
    measured = [(v["nodes"], n) for n, v in trees.items() if n != "none" and n not in ref]
    by_name = {e["name"]: e for e in af}
    xs, ys = [], []
    for nodes, name in sorted(measured):
        e = by_name.get(name)
        if e is None:
            continue
        xs.append(nodes)
        ys.append(e["tokens_per_step_simulated"] * 1000 / trees[name]["ms_per_step"])
    ax2.plot(xs, ys, ".-", color="tab:gray", label="measured frontier trees")
    bank = m["throughput_frontier"]
    ax2.plot(
        [e["nodes"] for e in bank],
        [e["tokens_per_second"] for e in bank],
        "o",
        color="tab:blue",
        label="throughput frontier",
    )
    best = next(e for e in bank if e["name"] == m["best"])
    ax2.plot(
        [best["nodes"]],
        [best["tokens_per_second"]],
        "*",
        ms=16,
        color="tab:green",
        label=f"EntMTP* {best['name']}",
    )
    for name, r in ref.items():
        ax2.plot([r["nodes"]], [r["tokens_per_second"]], "s", color="tab:red", label=f"{name} (default)")
    ax2.axhline(m["plain_tokens_per_second"], color="k", lw=0.8, ls="--", label="plain decoding")
    ax2.set_xlabel("tree nodes")
    ax2.set_ylabel("tokens/s (sim. tokens/step / measured ms/step)")
    ax2.set_title(
        f"throughput frontier ({data['hardware']['name'][:40]}, {data['hardware']['threads']} threads)"
    )
    ax2.legend(fontsize=8)
    fig.suptitle(f"{data['heads']['name']} heads, task {data['task']}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
