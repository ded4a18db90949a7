"""The picture of a profile: its acceptance frontier and its throughput frontier, default tree marked."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..scheduler.profiles import MeasuredTree, ModeProfile, Profile  # noqa: E402


def plot_profile(profile: Profile, path: str | Path, mode: str = "greedy") -> Path:
    m = profile.mode(mode)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    _acceptance_panel(ax1, m)
    _throughput_panel(ax2, m, profile.latency.trees)
    hw = profile.hardware
    ax2.set_title(f"throughput frontier ({hw.name[:40]}, {hw.threads} threads)")
    fig.suptitle(f"{profile.heads.name} heads, task {profile.task}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _acceptance_panel(ax, m: ModeProfile) -> None:
    """Tokens per step against nodes: the search's all-position score and the trees' own simulated decodes."""
    af = m.acceptance_frontier
    nodes = [e.nodes for e in af]
    ax.plot(
        nodes,
        [1 + e.mean_accepted_all_positions for e in af],
        ".-",
        color="tab:gray",
        label="1 + mean accepted (all positions)",
    )
    ax.plot(
        nodes,
        [e.tokens_per_step_simulated for e in af],
        ".-",
        color="tab:blue",
        label="tokens/step (own-tree decodes)",
    )
    for name, r in m.measured_on.reference.items():
        ax.plot([r.nodes], [r.tokens_per_step_simulated], "s", color="tab:red", label=f"{name} (default)")
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("tokens per step")
    ax.set_title("acceptance frontier")
    ax.legend(fontsize=8)


def _throughput_panel(ax, m: ModeProfile, trees: Mapping[str, MeasuredTree]) -> None:
    """Tokens/s against nodes of every measured frontier tree, the throughput frontier, EntMTP*, the default
    tree and plain decoding."""
    by_name = {e.name: e for e in m.acceptance_frontier}
    measured = sorted((v.nodes, n) for n, v in trees.items() if n in by_name)
    xs = [nodes for nodes, _ in measured]
    ys = [by_name[n].tokens_per_step_simulated * 1000 / trees[n].ms_per_step for _, n in measured]
    ax.plot(xs, ys, ".-", color="tab:gray", label="measured frontier trees")
    bank = m.measured_on.throughput_frontier
    ax.plot(
        [e.nodes for e in bank],
        [e.tokens_per_second for e in bank],
        "o",
        color="tab:blue",
        label="throughput frontier",
    )
    best = next(e for e in bank if e.name == m.measured_on.best)
    ax.plot(
        [best.nodes], [best.tokens_per_second], "*", ms=16, color="tab:green", label=f"EntMTP* {best.name}"
    )
    for name, r in m.measured_on.reference.items():
        ax.plot([r.nodes], [r.tokens_per_second], "s", color="tab:red", label=f"{name} (default)")
    ax.axhline(m.measured_on.plain_tokens_per_second, color="k", lw=0.8, ls="--", label="plain decoding")
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("tokens/s (sim. tokens/step / measured ms/step)")
    ax.legend(fontsize=8)
