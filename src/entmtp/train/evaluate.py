"""How good are trained heads? Teacher-forced accuracy and realised tokens per step, per benchmark task.

Metrics (all on the calibration prompts of each task, never trained on):

* ``top1`` / ``top5`` / ``top10`` of head k: at every position t of the base model's greedy continuation
  (from the last prompt position on), is x_{t+k+1} among head k's top-1/5/10? Hydra heads are teacher-forced:
  they read the true tokens x_{t+1..t+k}.
* ``chain`` at depth k: heads 1..k are all top-1 right at t (what a chain of k drafts would accept).
* ``tokens_per_step`` per tree: realised mean tokens per verification step of greedy speculative decoding
  (accepted drafts + 1 bonus token), i.e. generated tokens / steps over all prompts of the task.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from ..engine import Engine
from ..model import encode_prompt
from ..prompts import FOUR_TASKS, TASKS, load_prompts
from ..tree import load_tree
from .data import generate_responses

TOPS = (1, 5, 10)
DEFAULT_TREES = ("mc_sim_7b_63", "tree_16")


@torch.inference_mode()
def teacher_forced_accuracy(model, heads, sequences: list[tuple[list[int], list[int]]]) -> dict:
    """Per-head top-1/5/10 and chain acceptance over (prompt ids, greedy response ids) pairs."""
    K = heads.config.num_heads
    hits = {n: [0] * K for n in TOPS}
    counts = [0] * K
    chain_hits, chain_counts = [0] * K, [0] * K
    decoder = model.get_decoder()
    offset = heads.config.hidden_state_offset
    for prompt, response in sequences:
        seq = torch.tensor(prompt + response, device=model.device)[None]  # [1, L]
        out = decoder(input_ids=seq, output_hidden_states=offset > 0)
        hidden = out.hidden_states[-1 - offset] if offset > 0 else out.last_hidden_state  # [1, L, H]
        feats = heads.features(hidden.to(heads.dtype), seq)  # K x [1, L, H]
        L, first = seq.shape[1], len(prompt) - 1
        right = []  # per head: [n_k] top-1 correct at anchors first .. L-k-2
        for k in range(1, K + 1):
            stop = L - k - 1  # anchors t < stop have x_{t+k+1}
            if stop <= first:
                right.append(torch.zeros(0, dtype=torch.bool, device=seq.device))
                continue
            logits = heads.project(k - 1, feats[k - 1][0, first:stop])  # [n, V]
            top = logits.topk(max(TOPS), dim=-1).indices  # [n, 10]
            truth = seq[0, first + k + 1 : stop + k + 1]  # [n]
            match = top == truth[:, None]  # [n, 10]
            for n in TOPS:
                hits[n][k - 1] += int(match[:, :n].any(-1).sum())
            counts[k - 1] += truth.numel()
            right.append(match[:, 0])
        for k in range(1, K + 1):
            n = right[k - 1].numel()
            if n == 0:
                continue
            all_right = torch.stack([r[:n] for r in right[:k]]).all(0)  # anchors valid for head k
            chain_hits[k - 1] += int(all_right.sum())
            chain_counts[k - 1] += n
    report = {f"top{n}": [h / max(1, c) for h, c in zip(hits[n], counts, strict=True)] for n in TOPS}
    report["chain"] = [h / max(1, c) for h, c in zip(chain_hits, chain_counts, strict=True)]
    report["positions"] = counts
    return report


def speculative_tokens_per_step(
    model, tokenizer, heads, prompts: list[list[int]], tree: str, max_new_tokens: int
) -> dict:
    engine = Engine(model, tokenizer, heads, tree=tree)
    tokens = steps = 0
    t0 = time.perf_counter()
    for ids in prompts:
        result = engine.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
        tokens += sum(result.tokens_per_step)
        steps += result.num_steps
    seconds = time.perf_counter() - t0
    return {
        "tokens_per_step": tokens / max(1, steps),
        "steps": steps,
        "tokens": tokens,
        "tokens_per_second": tokens / max(1e-9, seconds),
    }


def evaluate_heads(
    model,
    tokenizer,
    heads,
    *,
    tasks: tuple[str, ...] = FOUR_TASKS,
    num_prompts: int = 10,
    max_new_tokens: int = 128,
    trees: tuple[str, ...] = DEFAULT_TREES,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """The evaluation report as a dict (see the module docstring); ``heads`` are bound to ``model``."""
    heads.bind(model)
    heads.to(device=model.device, dtype=model.dtype).eval()
    usable = [t for t in trees if load_tree(t).depth <= heads.config.num_heads]
    report: dict = {
        "heads": dataclasses.asdict(heads.config),
        "settings": {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "split": "calib"},
        "trees": usable,
        "skipped_trees": {
            t: f"depth {load_tree(t).depth} > {heads.config.num_heads} heads"
            for t in trees
            if t not in usable
        },
        "tasks": {},
    }
    for task in tasks:
        t0 = time.perf_counter()
        prompts = [encode_prompt(tokenizer, p) for p in load_prompts(task, "calib", num_prompts)]
        responses = generate_responses(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
        )
        entry = {"label": TASKS[task][1], "prompts": len(prompts)}
        entry.update(teacher_forced_accuracy(model, heads, list(zip(prompts, responses, strict=True))))
        entry["speculative"] = {
            tree: speculative_tokens_per_step(model, tokenizer, heads, prompts, tree, max_new_tokens)
            for tree in usable
        }
        entry["seconds"] = time.perf_counter() - t0
        report["tasks"][task] = entry
        if progress:
            tps = ", ".join(f"{t} {v['tokens_per_step']:.2f}" for t, v in entry["speculative"].items())
            print(f"eval {task}: head top-1 {_fmt(entry['top1'])}; tokens/step {tps}", flush=True)
    return report


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def report_markdown(report: dict) -> str:
    tasks = report["tasks"]
    K = report["heads"]["num_heads"]
    lines = [
        f"# Heads evaluation: {report['heads']['kind']}, {K} heads, base {report['heads'].get('base_model') or '?'}",
        "",
        f"Calibration prompts per task: {report['settings']['num_prompts']}; greedy continuations of up to "
        f"{report['settings']['max_new_tokens']} tokens. Accuracy is teacher-forced against the base model's "
        "own greedy continuation; head k predicts the token k+1 ahead.",
        "",
    ]
    titles = {
        "top1": "Top-1 accuracy per head",
        "top5": "Top-5 accuracy per head",
        "top10": "Top-10 accuracy per head",
        "chain": "Chain acceptance (heads 1..k all top-1 right)",
    }
    for metric, title in titles.items():
        lines += [f"## {title}", "", "| task | " + " | ".join(f"k={k}" for k in range(1, K + 1)) + " |"]
        lines.append("|---|" + "---|" * K)
        for e in tasks.values():
            lines.append(f"| {e['label']} | " + " | ".join(f"{v:.3f}" for v in e[metric]) + " |")
        lines.append("")
    if report["trees"]:
        lines += [
            "## Mean tokens per step (greedy speculative decoding; accepted drafts + 1 bonus token)",
            "",
            "| task | " + " | ".join(report["trees"]) + " |",
            "|---|" + "---|" * len(report["trees"]),
        ]
        for e in tasks.values():
            lines.append(
                f"| {e['label']} | "
                + " | ".join(f"{e['speculative'][t]['tokens_per_step']:.2f}" for t in report["trees"])
                + " |"
            )
        lines.append("")
    for tree, why in report["skipped_trees"].items():
        lines.append(f"Tree {tree} skipped: {why}.")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    js, md = d / "eval.json", d / "eval.md"
    js.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    md.write_text(report_markdown(report), encoding="utf-8")
    return js, md


def plot_learning_curve(log_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path | None:
    """Training loss and validation top-1 per head against positions seen (None when the log is empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(log_path)
    rows = (
        [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if path.is_file()
        else []
    )
    if not rows:
        return None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    train = [r for r in rows if r.get("loss") is not None]
    ax_loss.plot([r["positions"] for r in train], [r["loss"] for r in train])
    ax_loss.set_xlabel("positions seen")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("training loss")
    val = [r for r in rows if "val_top1" in r]
    if val:
        for k in range(len(val[0]["val_top1"])):
            ax_acc.plot(
                [r["positions"] for r in val],
                [r["val_top1"][k] for r in val],
                marker="o",
                label=f"head {k + 1}",
            )
        ax_acc.legend()
    ax_acc.set_xlabel("positions seen")
    ax_acc.set_ylabel("top-1 vs base argmax")
    ax_acc.set_title("validation top-1 per head")
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
