"""The layer-27 experiment's results in one table, JSON and plot: validation top-1 of both arms per head at every
evaluation (their copied ``train_log.jsonl``), and eval-heads' tokens per step (``eval/eval.json``: layer 27's
heads, with layer 30's as the baseline), greedy and at T=0.7, per task and as the four tasks' mean.

    python docs/results/heads-v3-cpu/layer27/compare.py      # after run.sh; writes layer27.{json,md,png} here
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


def tokens_per_step(report: dict) -> dict:
    """{mode: {tree: {task: (layer 27, layer 30)}}}, mode greedy or a sampling rule."""
    out: dict = {}
    for task, t in report["tasks"].items():
        modes = {"greedy": (t["speculative"], t["baseline"]["speculative"])}
        for rule, ours in t.get("sampling", {}).items():
            modes[f"T=0.7 {rule}"] = (ours, t["baseline"]["sampling"][rule])
        for mode, (ours, theirs) in modes.items():
            for tree in report["trees"]:
                out.setdefault(mode, {}).setdefault(tree, {})[task] = (
                    ours[tree]["tokens_per_step"],
                    theirs[tree]["tokens_per_step"],
                )
    return out


def main() -> None:
    c = curves()
    evaluated = (HERE / "eval" / "eval.json").is_file()  # run.sh eval (not yet run: the curves alone)
    report = json.loads((HERE / "eval" / "eval.json").read_text()) if evaluated else {"tasks": {}}
    tps = tokens_per_step(report) if evaluated else {}
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
    lines += ["", "## Tokens per step, layer 27 vs layer 30 (eval-heads, test split)", ""]
    if not evaluated:
        lines.append("Not measured yet: `run.sh eval`, then this script again.")
    tasks = list(report["tasks"])
    if evaluated:
        lines += [
            "| mode | tree | " + " | ".join(tasks) + " | mean |",
            "|---|---|" + "---|" * (len(tasks) + 1),
        ]
    summary = {}
    for mode, trees in tps.items():
        for tree, per_task in trees.items():
            ours = sum(v[0] for v in per_task.values()) / len(per_task)
            theirs = sum(v[1] for v in per_task.values()) / len(per_task)
            summary[f"{mode} {tree}"] = {"layer27": ours, "layer30": theirs, "gain": ours / theirs - 1}
            cells = [f"{per_task[t][0]:.2f} vs {per_task[t][1]:.2f}" for t in tasks]
            lines.append(
                f"| {mode} | {tree} | "
                + " | ".join(cells)
                + f" | **{ours:.2f} vs {theirs:.2f} ({ours / theirs - 1:+.1%})** |"
            )
    (HERE / "layer27.md").write_text("\n".join(lines) + "\n")
    (HERE / "layer27.json").write_text(
        json.dumps({"curves": c, "tokens_per_step": tps, "means": summary}, indent=1) + "\n"
    )
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
