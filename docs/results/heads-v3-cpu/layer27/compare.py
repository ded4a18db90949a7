"""The layer-27 experiment's results in one table, JSON and plot: validation top-1 of both arms per head at every
evaluation (their copied ``train_log.jsonl``), and their tokens per step (``replay/replay.json``, written by
replay.py: layer 27's heads against layer 30's on the same generations), greedy and at T=0.7, per task and as
the four tasks' mean with its bootstrap interval.

    python docs/results/heads-v3-cpu/layer27/compare.py   # after run.sh l27 l30 and replay.py; writes layer27.{json,md,png}
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ARMS = {"layer 27": "hydra-scratch-l27", "layer 30 (last)": "hydra-scratch-l30"}


def curves() -> dict[str, list[dict]]:
    """Per arm: [{step, positions, val_top1, val_loss}] at every validation."""
    out = {}
    for arm, run in ARMS.items():
        rows = [
            json.loads(line) for line in (HERE / "runs" / run / "train_log.jsonl").read_text().splitlines()
        ]
        out[arm] = [
            {k: r.get(k) for k in ("step", "positions", "val_top1", "val_loss")}
            for r in rows
            if "val_top1" in r
        ]
    return out


def main() -> None:
    c = curves()
    replayed = (HERE / "replay" / "replay.json").is_file()  # replay.py (not yet run: the curves alone)
    summary = json.loads((HERE / "replay" / "replay.json").read_text())["summary"] if replayed else {}
    lines = ["## Validation top-1 at the end (380 steps, 299,771 positions seen)", ""]
    lines += ["| heads read | k=1 | k=2 | k=3 | k=4 | val loss k=1 |", "|---|---|---|---|---|---|"]
    for arm, rows in c.items():
        last = rows[-1]
        lines.append(
            f"| {arm} | "
            + " | ".join(f"{x:.4f}" for x in last["val_top1"])
            + f" | {last['val_loss'][0]:.3f} |"
        )
    a, b = (rows[-1]["val_top1"] for rows in c.values())
    lines.append("| difference | " + " | ".join(f"{x - y:+.4f}" for x, y in zip(a, b, strict=True)) + " | |")
    lines += ["", "## Tokens per step, layer 27 vs layer 30 (replay.py, test split)", ""]
    if not replayed:
        lines.append("Not measured yet: replay.py, then this script again.")
    else:
        tasks = list(next(iter(next(iter(summary.values())).values()))["tasks"])
        lines += [
            "| mode | tree | " + " | ".join(tasks) + " | mean (95% interval of the difference) |",
            "|---|---|" + "---|" * (len(tasks) + 1),
        ]
    for mode, trees in summary.items():
        for tree, r in trees.items():
            cells = [f"{x:.2f} vs {y:.2f}" for x, y in (r["tasks"][t] for t in tasks)]
            lo, hi = r["relative_95"]
            lines.append(
                f"| {mode} | {tree} | "
                + " | ".join(cells)
                + f" | **{r['mean'][0]:.2f} vs {r['mean'][1]:.2f} ({r['relative']:+.1%})** ({lo:+.1%} .. {hi:+.1%}) |"
            )
    (HERE / "layer27.md").write_text("\n".join(lines) + "\n")
    (HERE / "layer27.json").write_text(json.dumps({"curves": c, "tokens_per_step": summary}, indent=1) + "\n")
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), sharey=True)
    for k, ax in enumerate(axes):
        for arm, rows in c.items():
            ax.plot([r["positions"] for r in rows], [r["val_top1"][k] for r in rows], marker="o", label=arm)
        ax.set_title(f"head {k + 1} (token {k + 2} ahead)")
        ax.set_xlabel("training positions seen")
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation top-1")
    axes[0].legend()
    fig.suptitle("Hydra from scratch: layer 27 vs the last layer, equal data (2-core AVX2 EPYC, float32)")
    fig.tight_layout()
    fig.savefig(HERE / "layer27.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
