"""How far the heads v3 runs are from issue 42's goals, and what more data would buy (nothing is run or timed:
this reads the committed training logs and evaluations).

    python docs/results/heads-v3-cpu/scaling/scaling.py [--out docs/results/heads-v3-cpu/scaling]

Two measured relations, then one extrapolation:

1. Validation top-1 against data. Each run's `runs/<run>/train_log.jsonl` gives head 1's validation top-1 at
   step 0 (the shipped heads) and at the end. With the distinct positions the run saw (its data, from the
   README's sections, or fewer when it ran less than one pass) added to the shipped heads' 540k, that is a gain
   per doubling of the data.
2. Tokens/step against validation top-1. Every `eval/<run>/eval.json` holds, per task, the tree_8 tokens/step
   of the new heads and of the shipped ones on the same test prompts. The mean over the four tasks of new minus
   shipped, pooled over a kind's runs and divided by their top-1 gains (1), is how far tree_8 moves per point of
   head-1 top-1. The teacher-forced chain (chain[d]: the fraction of positions where heads 1..d all draft the
   base model's next tokens; 1 + sum(chain) is what a one-path tree of depth 4 accepts) is reported beside it.
3. The extrapolation: the tree_8 goal as a top-1 gain (2), and as doublings of the data at the best rate any run
   of the kind reached (1). That assumes top-1 keeps growing log-linearly in the data, the optimistic case: the
   rate fell from run to run.

Writes scaling.json and scaling.png (the top-1 gains against data, and the extrapolation) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent.parent  # docs/results/heads-v3-cpu
FOUR = ("humaneval", "sharegpt", "gsm8k", "writing")
SHIPPED_POSITIONS = 540_000  # the shipped heads' training data (issue 42)
# unique training positions each run read (README sections "The first v3 run", "Hydra v2", "Hydra++ v3",
# "Tenth session"); the logs hold only the positions seen
RUNS = {
    "hydra": ("hydra", 961_000, "first v3 run, 1 pass, val split of the instruction prompts only"),
    "hydra-v2": ("hydra", 1_781_382, "2 passes"),
    "hydra-pp-v3": ("hydra", 3_523_251, "Hydra++ (prefix layer), half a pass"),
    "medusa-v2": ("medusa", 1_781_382, "1.2 passes"),
    "medusa-v3": ("medusa", 4_419_656, "1.25 passes"),
}
# each run's evaluation against the shipped heads over the four tasks (directories of eval/)
EVALS = {
    "hydra-v2": ("hydra-v2-a", "hydra-v2-b"),
    "hydra-pp-v3": ("hydra-pp-v3-a", "hydra-pp-v3-b"),
    "medusa-v2": ("medusa-v2",),
    "medusa-v3": ("medusa-v3-a", "medusa-v3-b"),
}
GOALS = {"hydra": 2.3, "medusa": 1.9}  # greedy tree_8 tokens/step on the four tasks


def chain_tokens(chain: list[float]) -> float:
    return 1.0 + sum(chain)


def eval_means(dirs: tuple[str, ...]) -> dict:
    """Means over the four tasks of (new, shipped): chain tokens/step, head-1 top-1, tree_8 and mc_sim tokens/step."""
    tasks = {}
    for d in dirs:
        report = json.loads((HERE / "eval" / d / "eval.json").read_text())
        tasks.update(report["tasks"])
    if set(tasks) != set(FOUR):
        raise SystemExit(f"{dirs}: tasks {sorted(tasks)}, not the four")
    out = {}
    for side in ("new", "shipped"):
        rows = [t if side == "new" else t["baseline"] for t in tasks.values()]
        out[side] = {
            "chain_tokens": sum(chain_tokens(r["chain"]) for r in rows) / 4,
            "top1_head1": sum(r["top1"][0] for r in rows) / 4,
            **{
                tree: sum(r["speculative"][tree]["tokens_per_step"] for r in rows) / 4
                for tree in ("tree_8", "mc_sim_7b_63")
            },
        }
    out["prompts"] = sorted({t["prompts"] for t in tasks.values()})
    return out


def run_curve(name: str) -> tuple[list[int], list[float]]:
    rows = [
        json.loads(line)
        for line in (HERE / "runs" / name / "train_log.jsonl").read_text().splitlines()
        if line
    ]
    val = [r for r in rows if "val_top1" in r]
    return [r["positions"] for r in val], [r["val_top1"][0] for r in val]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()

    runs = {}
    for name, (kind, unique, what) in RUNS.items():
        seen, top1 = run_curve(name)
        distinct = min(unique, seen[-1])  # a run of less than one pass saw only part of its data
        doublings = math.log2((SHIPPED_POSITIONS + distinct) / SHIPPED_POSITIONS)  # from the shipped heads
        gain = top1[-1] - top1[0]
        runs[name] = {
            "kind": kind,
            "what": what,
            "unique_positions": unique,
            "positions_seen": seen[-1],
            "distinct_positions_seen": distinct,
            "val_top1_head1": [top1[0], top1[-1]],
            "gain": gain,
            "gain_per_doubling": gain / doublings,
        }
        if name in EVALS:
            runs[name]["eval"] = eval_means(EVALS[name])

    kinds = {}
    for kind, goal in GOALS.items():
        evaluated = [r for r in runs.values() if r["kind"] == kind and "eval" in r]
        d_tree = sum(r["eval"]["new"]["tree_8"] - r["eval"]["shipped"]["tree_8"] for r in evaluated)
        d_chain = sum(
            r["eval"]["new"]["chain_tokens"] - r["eval"]["shipped"]["chain_tokens"] for r in evaluated
        )
        tree_per_top1 = d_tree / sum(r["gain"] for r in evaluated)  # pooled over the runs
        shipped_tree = sum(r["eval"]["shipped"]["tree_8"] for r in evaluated) / len(evaluated)
        need_top1 = (goal - shipped_tree) / tree_per_top1
        own = [r for r in runs.values() if r["kind"] == kind]
        rate = max(r["gain_per_doubling"] for r in own)  # the most favourable run's rate
        doublings = need_top1 / rate
        kinds[kind] = {
            "goal_tree_8": goal,
            "shipped_tree_8": shipped_tree,
            "best_tree_8": max(r["eval"]["new"]["tree_8"] for r in evaluated),
            "tree_8_per_chain_token": d_tree / d_chain,
            "tree_8_per_top1": tree_per_top1,
            "need_top1_gain": need_top1,
            "best_top1_gain": max(r["gain"] for r in own),
            "best_gain_per_doubling": rate,
            "doublings_needed": doublings,
            "positions_needed": SHIPPED_POSITIONS * 2**doublings,
        }

    print(
        "| run | kind | unique positions | seen | val top-1 head 1 (shipped -> new) | gain / doubling |"
        " chain (new vs shipped) | tree_8 (new vs shipped) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        e = r.get("eval")
        chain = f"{e['new']['chain_tokens']:.3f} vs {e['shipped']['chain_tokens']:.3f}" if e else ""
        tree = f"{e['new']['tree_8']:.2f} vs {e['shipped']['tree_8']:.2f}" if e else ""
        print(
            f"| {name} | {r['kind']} | {r['unique_positions'] / 1e6:.2f}M | {r['positions_seen'] / 1e6:.2f}M |"
            f" {r['val_top1_head1'][0]:.3f} -> {r['val_top1_head1'][1]:.3f} | {r['gain_per_doubling']:+.4f} |"
            f" {chain} | {tree} |"
        )
    print()
    print(
        "| heads | goal tree_8 | shipped | best | tree_8 per chain token | tree_8 per point of val top-1 |"
        " val top-1 gain needed (best so far) | best gain per doubling | doublings | positions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, k in kinds.items():
        print(
            f"| {kind} | {k['goal_tree_8']} | {k['shipped_tree_8']:.2f} | {k['best_tree_8']:.2f} |"
            f" {k['tree_8_per_chain_token']:.2f} | {k['tree_8_per_top1'] / 100:.3f} |"
            f" {k['need_top1_gain']:+.3f} ({k['best_top1_gain']:+.3f}) | {k['best_gain_per_doubling']:+.4f} |"
            f" {k['doublings_needed']:.1f} | {k['positions_needed'] / 1e6:,.0f}M |"
        )

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps({"runs": runs, "goals": kinds}, indent=2) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, (kind, k) in zip(axes, kinds.items(), strict=True):
        own = {n: r for n, r in runs.items() if r["kind"] == kind}
        xs = [(SHIPPED_POSITIONS + r["distinct_positions_seen"]) / 1e6 for r in own.values()]
        ax.plot([SHIPPED_POSITIONS / 1e6], [0], "ko")
        ax.annotate(
            "shipped", (SHIPPED_POSITIONS / 1e6, 0), textcoords="offset points", xytext=(4, -10), fontsize=8
        )
        for x, (name, r) in zip(xs, own.items(), strict=True):
            ax.plot([x], [r["gain"]], "o")
            ax.annotate(
                name,
                (x, r["gain"]),
                textcoords="offset points",
                xytext=(5, 4 if "-pp" not in name else -11),
                fontsize=8,
            )
        far = k["positions_needed"] / 1e6
        ax.plot([SHIPPED_POSITIONS / 1e6, far], [0, k["need_top1_gain"]], "--", color="grey", lw=1)
        ax.axhline(k["need_top1_gain"], color="tab:red", lw=1)
        ax.text(
            SHIPPED_POSITIONS / 1e6,
            k["need_top1_gain"] + 0.003,
            f"needed for tree_8 {k['goal_tree_8']}",
            fontsize=8,
            color="tab:red",
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training positions, shipped + distinct seen (millions, log2)")
        ax.set_title(f"{kind}: best rate {k['best_gain_per_doubling']:+.4f} a doubling (dashed)", fontsize=10)
    axes[0].set_ylabel("validation top-1 gain, head 1")
    fig.suptitle(
        "Heads v3 (issue 42): head-1 top-1 against data, and what the tree_8 goals need", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(args.out / "scaling.png", dpi=120)
    print(f"\nwrote {args.out / 'scaling.json'} and {args.out / 'scaling.png'}")


if __name__ == "__main__":
    main()
