"""Tokens per step of two sets of heads on the same generations, by trace replay instead of decoding.

    PYTHONPATH=src .venv/bin/python docs/results/heads-v3-cpu/layer27/replay.py \
        heads-v3/runs/hydra-scratch-l27 --against heads-v3/runs/hydra-scratch-l30 \
        [--tasks humaneval,sharegpt,gsm8k,writing] [--num-prompts 20] [--max-new-tokens 96] \
        [--trees mc_sim_7b_63,tree_8] [--sampling sample] [--threads 2] [--out DIR]

Why: `eval-heads` decodes every prompt with every (heads, tree), greedy and at T=0.7; in float32 on the 2-core
AVX2 EPYC that took 37 minutes for one task's 10 prompts. The library's calibration traces
(`entmtp.calibration.traces`) give the same number far faster: one generation per prompt, shared by both heads,
then one teacher-forced pass of each heads over it records, at every position, the rank of the base model's
own next tokens among each head's drafts. A tree's accepted length at a step is then a lookup, and
`entmtp.calibration.search.simulate` walks the steps a decode with that tree takes: exactly for greedy output
(tests/test_replay.py checks replays against the engine step for step) and, for lossless sampling (`sample`),
exactly for the sampled outcome, whatever the tree (traces.py's docstring). Here the T=0.7 outcomes are plain
samples of the base model (prompt i seeded with i), so both heads are scored on the very same texts: a paired
comparison, with less noise than two sampled decodes.

Tokens per step: generated tokens after the prefill's first over steps (metrics.mean_tokens_per_step), per task
over its prompts. The relative difference of the four tasks' mean gets a 95% interval from a bootstrap over
prompts (resampled within each task, the same draws for both heads). Writes replay.json, replay.md (the table,
also printed) and replay.png to --out (default: here).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch

from entmtp.accept import Sampling
from entmtp.calibration.search import step_tokens
from entmtp.calibration.traces import generate_traces
from entmtp.engine import Engine
from entmtp.heads import load_heads
from entmtp.machine import auto_dtype
from entmtp.model import encode_prompt, load_model
from entmtp.policy import static
from entmtp.prompts import FOUR_TASKS, load_prompts
from entmtp.tree import load_tree

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
TEMPERATURE = 0.7  # eval-heads' and the issue's
BOOTSTRAP = 2000


def generations(engine: Engine, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list:
    """The base model's output for each prompt: greedy, or a plain sample at `temperature` seeded by index."""
    return [
        engine.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=i).token_ids
        for i, ids in enumerate(prompts)
    ]


def per_prompt(engine: Engine, heads, prompts, outputs, trees, sampling) -> dict[str, list[list[int]]]:
    """{tree: per prompt [tokens, steps]} for `heads` (bound in `engine`) on the given outputs."""
    traces, _ = generate_traces(engine, heads, prompts, 0, outputs=outputs, sampling=sampling)
    if len(traces) != len(prompts):
        raise SystemExit("a generation had fewer than two tokens: its trace cannot be replayed")
    out = {}
    for name in trees:
        tree = load_tree(name)
        out[name] = [[sum(s), len(s)] for s in (step_tokens(tree, tr) for tr in traces)]
    return out


def ratio(counts: np.ndarray) -> float:  # [prompts, 2] tokens, steps
    return float(counts[:, 0].sum() / counts[:, 1].sum())


def four_task_mean(side: dict, tasks: list[str], tree: str, draws: list[np.ndarray] | None = None) -> float:
    """Mean over tasks of tokens/step; `draws`: per task the prompt indices to use (a bootstrap resample)."""
    vals = []
    for i, task in enumerate(tasks):
        c = np.asarray(side[task][tree])
        vals.append(ratio(c if draws is None else c[draws[i]]))
    return float(np.mean(vals))


def summarise(result: dict, tasks: list[str], trees: list[str], rng: np.random.Generator) -> dict:
    """Per mode and tree: each task's tokens/step for both heads, the four-task means, the relative
    difference and its bootstrap interval."""
    out = {}
    for mode, sides in result.items():
        new, old = sides["heads"], sides["against"]
        sizes = [len(new[t][trees[0]]) for t in tasks]
        resamples = [[rng.integers(0, n, n) for n in sizes] for _ in range(BOOTSTRAP)]
        out[mode] = {}
        for tree in trees:
            a, b = four_task_mean(new, tasks, tree), four_task_mean(old, tasks, tree)
            rel = [
                four_task_mean(new, tasks, tree, d) / four_task_mean(old, tasks, tree, d) - 1
                for d in resamples
            ]
            out[mode][tree] = {
                "tasks": {
                    t: [ratio(np.asarray(new[t][tree])), ratio(np.asarray(old[t][tree]))] for t in tasks
                },
                "mean": [a, b],
                "relative": a / b - 1,
                "relative_95": [float(np.percentile(rel, 2.5)), float(np.percentile(rel, 97.5))],
            }
    return out


def table(summary: dict, tasks: list[str], names: tuple[str, str]) -> str:
    lines = [
        f"tokens/step, {names[0]} vs {names[1]} (trace replay on the same generations)",
        "",
        "| mode | tree | " + " | ".join(tasks) + " | mean of tasks | difference (95% bootstrap) |",
        "|---|---|" + "---|" * len(tasks) + "---|---|",
    ]
    for mode, trees in summary.items():
        for tree, s in trees.items():
            cells = [f"{a:.3f} vs {b:.3f}" for a, b in (s["tasks"][t] for t in tasks)]
            lo, hi = s["relative_95"]
            lines.append(
                f"| {mode} | {tree} | " + " | ".join(cells) + f" | {s['mean'][0]:.3f} vs {s['mean'][1]:.3f} "
                f"| {100 * s['relative']:+.1f}% ({100 * lo:+.1f}% .. {100 * hi:+.1f}%) |"
            )
    return "\n".join(lines)


def plot(summary: dict, tasks: list[str], names: tuple[str, str], path: Path) -> None:
    panels = [(m, t) for m, trees in summary.items() for t in trees]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    x = np.arange(len(tasks) + 1)
    for ax, (mode, tree) in zip(axes[0], panels, strict=True):
        s = summary[mode][tree]
        for k, (name, shift) in enumerate(zip(names, (-0.2, 0.2), strict=True)):
            ax.bar(x + shift, [s["tasks"][t][k] for t in tasks] + [s["mean"][k]], 0.4, label=name)
        ax.set_xticks(x, [*tasks, "mean"], rotation=30, fontsize=8)
        ax.set_ylim(1.0, None)
        ax.set_title(f"{mode}, {tree}: {100 * s['relative']:+.1f}%", fontsize=9)
    axes[0][0].set_ylabel("tokens per step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("heads", type=Path)
    ap.add_argument("--against", type=Path, required=True)
    ap.add_argument("--tasks", default=",".join(FOUR_TASKS))
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--trees", default="mc_sim_7b_63,tree_8")
    ap.add_argument("--sampling", default="sample", help="'sample' (lossless, T=0.7) or empty: greedy only")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    if args.sampling not in ("", "sample"):
        raise SystemExit("--sampling: 'sample' or empty (typical and gumbel traces are not replayed here)")
    torch.set_num_threads(args.threads)
    tasks, trees = args.tasks.split(","), args.trees.split(",")
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    model, tok = load_model(None, dtype=dtype)
    heads = {
        side: load_heads(p, dtype=model.dtype)
        for side, p in (("heads", args.heads), ("against", args.against))
    }
    engines = {side: Engine(model, tok, h, static(trees[-1])) for side, h in heads.items()}
    plain = Engine(model, tok)
    modes = {"greedy": None} | ({"T=0.7 sample": Sampling(TEMPERATURE, "sample")} if args.sampling else {})
    result: dict = {m: {"heads": {}, "against": {}} for m in modes}
    t0 = time.perf_counter()
    for task in tasks:
        prompts = [encode_prompt(tok, p) for p in load_prompts(task, "test", args.num_prompts)]
        for mode, sampling in modes.items():
            outputs = generations(
                plain, prompts, args.max_new_tokens, sampling.temperature if sampling else 0.0
            )
            for side, engine in engines.items():
                result[mode][side][task] = per_prompt(engine, heads[side], prompts, outputs, trees, sampling)
        print(f"{task}: {len(prompts)} prompts, {time.perf_counter() - t0:.0f} s", flush=True)
    names = (args.heads.name, args.against.name)
    summary = summarise(result, tasks, trees, np.random.default_rng(args.seed))
    md = table(summary, tasks, names)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"dtype": dtype}
    report = {"settings": settings, "summary": summary, "per_prompt": result}
    (args.out / "replay.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "replay.md").write_text(md + "\n")
    plot(summary, tasks, names, args.out / "replay.png")
    print(f"written: {args.out / 'replay.json'}, replay.md, replay.png")


if __name__ == "__main__":
    main()
