"""Issue 42's capacity question: at equal data, do heads that grow (`--init hydra` with `--num-layers 2`, or
`--own-lm-head`) learn more than the shipped Hydra heads continued as they are? Nothing is run or timed: this reads
the committed training logs of the runs `train_runs.sh` made (runs/<name>/train_log.jsonl and config.json).
It compares any runs on equal data: the same heads at other learning rates too (capacity/lr/).

    python docs/results/heads-v3-cpu/capacity/capacity.py [--runs CONTROL,ARM,...] [--out DIR]

The first run is the control. Every run must have trained on the same data (the same distinct training
positions, in its log's first line) for the same number of steps, or the comparison is refused. For each run:
validation top-1 per head (the fraction of validation positions where head k's top draft is the base model's
token k+1 ahead) at step 0 (the grown heads compute exactly the shipped heads' function there) and at every
validation after, and the gain over the control at the end. Writes capacity.json and capacity.png to --out,
and the table to stdout (capacity.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from entmtp.heads import HeadsConfig, random_heads  # noqa: E402

HERE = Path(__file__).resolve().parent.parent  # docs/results/heads-v3-cpu
# the twelfth session's runs and the thirteenth's own projections (README "Twelfth session", "Thirteenth session")
RUNS = ("hydra-small-ctl", "hydra-small-l2", "hydra-small-own")


def read_run(name: str) -> dict:
    run = HERE / "runs" / name
    rows = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if x.strip()]
    config = {
        k: v
        for k, v in json.loads((run / "config.json").read_text()).items()
        if k not in ("format", "version")
    }
    heads = random_heads(HeadsConfig(**config))
    parameters = sum(p.numel() for p in heads.parameters())
    # logged since the thirteenth session; before it, every parameter of heads sharing the base layer trained
    trained = rows[0].get("trained_parameters", None if not config["share_lm_head"] else parameters)
    if trained is None:
        raise SystemExit(f"{name}'s log does not say which parameters it trained: rerun it with this trainer")
    val = [r for r in rows if "val_top1" in r]
    rates = [r["positions_per_second"] for r in rows if "positions_per_second" in r]
    return {
        "name": name,
        "num_layers": config["num_layers"],
        "hidden_state_offset": config.get("hidden_state_offset", 0),  # the layer read: 0 the last, 3 layer 27
        "own_lm_head": not config["share_lm_head"],
        "parameters": parameters,
        "trained_parameters": trained,
        "precision": rows[0].get("precision"),
        "peak_lr": max(r["lr"] for r in rows if "lr" in r),
        "train_positions": rows[0].get("train_positions"),
        "steps": rows[-1]["step"],
        "positions_seen": rows[-1]["positions"],
        "curve": [{"step": r["step"], "positions": r["positions"], "val_top1": r["val_top1"]} for r in val],
        "positions_per_second_median": statistics.median(rates) if rates else None,
    }


def check_comparable(runs: list[dict]) -> None:
    control = runs[0]
    for r in runs[1:]:
        for field in ("train_positions", "steps"):
            if r[field] != control[field]:
                raise SystemExit(
                    f"{r['name']} and {control['name']} differ in {field} ({r[field]} vs {control[field]}): "
                    "train the arms on the same shards for the same steps (train_runs.sh with the same STEPS)"
                )


def _reads(offset: int) -> str:
    return "last layer" if offset == 0 else f"last layer - {offset}"


def table(runs: list[dict]) -> str:
    control_end = runs[0]["curve"][-1]["val_top1"]
    k = len(control_end)
    lines = [
        "| run | reads | blocks a head | own projection | head parameters (trained) | peak lr | distinct training positions | steps "
        "| positions seen | "
        + " | ".join(f"val top-1 head {i + 1}: start -> end" for i in range(k))
        + " | head 1 vs control | positions/s (median) |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * k + "---|---|",
    ]
    for r in runs:
        start, end = r["curve"][0]["val_top1"], r["curve"][-1]["val_top1"]
        rate = r["positions_per_second_median"]
        lines.append(
            f"| {r['name']} | {_reads(r['hidden_state_offset'])} | {r['num_layers']} | {'yes' if r['own_lm_head'] else 'no'} | {r['parameters'] / 1e6:.1f}M ({r['trained_parameters'] / 1e6:.1f}M) | {r['peak_lr']:.0e} "
            f"| {r['train_positions'] if r['train_positions'] is None else format(r['train_positions'], ',')} | {r['steps']} | {r['positions_seen']:,} | "
            + " | ".join(f"{a:.4f} -> {b:.4f} ({b - a:+.4f})" for a, b in zip(start, end, strict=True))
            + f" | {end[0] - control_end[0]:+.4f} | {rate:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(runs[0]["curve"][0]["val_top1"]), figsize=(14, 3.6), sharex=True)
    for i, ax in enumerate(axes):
        for r in runs:
            ax.plot(
                [p["positions"] for p in r["curve"]],
                [p["val_top1"][i] for p in r["curve"]],
                marker="o",
                label=r["name"],
            )
        ax.set_title(f"head {i + 1}")
        ax.set_xlabel("positions seen")
    axes[0].set_ylabel("validation top-1")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Hydra from the shipped heads, on equal data (validation top-1): "
        + ", ".join(r["name"] for r in runs)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--runs", default=",".join(RUNS), help="comma list of runs/<name>; the first is the control"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    runs = [read_run(n) for n in args.runs.split(",")]
    check_comparable(runs)
    print(table(runs))
    (args.out / "capacity.json").write_text(json.dumps(runs, indent=1) + "\n")
    plot(runs, args.out / "capacity.png")


if __name__ == "__main__":
    main()
