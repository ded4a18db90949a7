"""How good are trained heads? Teacher-forced accuracy and realised tokens per step, per benchmark task, and
the same numbers for the heads they would replace (``baseline``: by default the shipped heads), in one table.

Metrics (on the test split of each task by default, or its calibration split; never trained on):

* ``top1`` / ``top5`` / ``top10`` of head k: at every position t of the base model's greedy continuation
  (from the last prompt position on), is x_{t+k+1} among head k's top-1/5/10? Hydra heads are teacher-forced:
  they read the true tokens x_{t+1..t+k}.
* ``chain`` at depth k: heads 1..k are all top-1 right at t (what a chain of k drafts would accept).
* ``tokens_per_step`` per tree: realised mean tokens per verification step of greedy speculative decoding
  (accepted drafts + 1 bonus token), i.e. generated tokens / steps over all prompts of the task.
* ``sampling``: with sampling rules asked for (``sample``: lossless rejection sampling, ``typical``, ``gumbel``),
  the same per tree at temperature T (0.7), each prompt seeded alike for the heads and the baseline.
* ``tokens_per_second`` per tree: the steps' tokens (the prefill's first token left out) over the whole
  generations' wall time (see metrics.py). The heads and the baseline decode each prompt back to back, so
  machine load hits both alike; ratios between them are what to read.

How tokens per step is measured (``method``):

* ``decode``: every prompt is decoded with every (heads, tree), greedy and with each sampling rule; this also
  gives tokens/s.
* ``replay``: every prompt is generated once by plain decoding (greedy, and a plain sample at T per prompt
  seeded by its index), and each heads are teacher-forced over it (`calibration.traces`); a tree's steps are
  then walked on the trace (`calibration.search.simulate`). For greedy output that is exactly what decoding
  gives; with lossless ``sample`` acceptance, exactly what decoding gives for that sampled outcome, and all
  heads and trees are scored on the same outcomes. No tokens/s (nothing decodes with the heads). Not for
  ``typical``, whose output depends on the tree, nor ``gumbel``, whose drafts depend on the decode's noise.
  Much faster on a CPU: one plain generation a prompt and mode instead of one speculative decode a prompt,
  mode, heads and tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from .. import metrics
from ..accept import SAMPLED, Sampling
from ..build import fixed, given
from ..calibration.search import simulate
from ..calibration.traces import generate_traces
from ..heads.config import heads_input
from ..model import encode_prompt
from ..prompts import FOUR_TASKS, SPECBENCH, TASKS, load_prompts
from ..tree import load_tree
from .shards import generate_responses

TOPS = (1, 5, 10)
# The published default tree, and the static tree `entmtp generate` uses for heads without a profile.
DEFAULT_TREES = ("mc_sim_7b_63", "tree_8")
SAMPLING_RULES = SAMPLED  # acceptance rules the evaluation can decode with at T > 0
EVAL_TASKS = FOUR_TASKS + tuple(SPECBENCH)  # the paper's four tasks, then the dev benchmark's categories
METHODS = ("decode", "replay")  # how tokens per step is measured (module docstring)
REPLAYED_RULES = ("sample",)  # sampling rules a replay scores exactly


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
        hidden = heads_input(decoder, out, offset, heads.config.hidden_state_norm)  # [1, L, H]
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


def speculative_runs(
    model,
    tokenizer,
    heads: dict[str, object],
    prompts: list[list[int]],
    trees: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    acceptance: str = "auto",
) -> dict[str, dict[str, dict]]:
    """Speculative decoding of every prompt with every (heads, tree), the heads interleaved prompt by prompt:
    {heads name: {tree: tokens_per_step, steps, tokens, seconds, tokens_per_second}}. Greedy at temperature 0;
    else sampled by ``acceptance``, prompt i seeded with i for every heads and tree."""
    engines = {(n, t): fixed(given(model, tokenizer, h), t) for n, h in heads.items() for t in trees}
    sums = {key: [0, 0, 0.0] for key in engines}  # tokens after the first, steps, seconds
    sampling = {} if temperature == 0 else {"acceptance": acceptance}
    for i, ids in enumerate(prompts):
        for key, engine in engines.items():
            result = engine.generate(
                ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=i, **sampling
            )
            acc = sums[key]
            acc[0] += sum(result.tokens_per_step)
            acc[1] += result.num_steps
            acc[2] += result.seconds
    out: dict[str, dict[str, dict]] = {n: {} for n in heads}
    for (n, t), (tokens, steps, seconds) in sums.items():
        out[n][t] = {
            "tokens_per_step": metrics.mean_tokens_per_step(tokens, steps),
            "steps": steps,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": metrics.tokens_per_second(tokens, seconds),
        }
    return out


@torch.inference_mode()
def replayed_runs(
    model,
    tokenizer,
    heads: dict[str, object],
    prompts: list[list[int]],
    trees: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
) -> dict[str, dict[str, dict]]:
    """`speculative_runs`' tokens per step by trace replay (module docstring): {heads name: {tree:
    tokens_per_step, steps, tokens}}. Greedy at temperature 0; else lossless sampling, prompt i's plain sample
    seeded with i."""
    plain = fixed(given(model, tokenizer))
    outputs = [
        plain.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=i).token_ids
        for i, ids in enumerate(prompts)
    ]
    sampling = Sampling(temperature, "sample") if temperature > 0 else None
    out: dict[str, dict[str, dict]] = {}
    for name, h in heads.items():  # each heads' engine: its base model reads the layer the heads read
        engine = fixed(given(model, tokenizer, h), trees[-1])
        traces, _ = generate_traces(engine, h, prompts, max_new_tokens, outputs=outputs, sampling=sampling)
        out[name] = {}
        for t in trees:
            sim = simulate(load_tree(t), traces)
            out[name][t] = {"tokens_per_step": sim.tokens_per_step, "steps": sim.steps, "tokens": sim.tokens}
    return out


def _check_method(method: str, sampling: tuple[str, ...]) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown evaluation method {method!r}: use {' or '.join(METHODS)}")
    for rule in sampling:
        if rule not in SAMPLING_RULES:
            raise ValueError(f"unknown sampling rule {rule!r}: use some of {', '.join(SAMPLING_RULES)}")
        if method == "replay" and rule not in REPLAYED_RULES:
            raise ValueError(
                f"sampling rule {rule!r} cannot be replayed (typical's output depends on the tree, gumbel's "
                f"drafts on the decode's noise): use method decode, or only {', '.join(REPLAYED_RULES)}"
            )


def evaluate_heads(
    model,
    tokenizer,
    heads,
    *,
    tasks: tuple[str, ...] = FOUR_TASKS,
    split: str = "calib",
    num_prompts: int = 10,
    max_new_tokens: int = 128,
    trees: tuple[str, ...] = DEFAULT_TREES,
    baseline=None,
    baseline_name: str = "baseline",
    batch_size: int = 8,
    progress: bool = True,
    sampling: tuple[str, ...] = (),
    temperature: float = 0.7,
    method: str = "decode",
) -> dict:
    """The evaluation report as a dict (see the module docstring). ``baseline``: other heads for the same
    model, measured the same way on the same prompts (report["baseline"] and each task's "baseline").
    ``sampling``: also decode at ``temperature`` with these acceptance rules (`SAMPLING_RULES`). ``method``:
    how tokens per step is measured (`METHODS`). Each task's result line (`task_line`) prints when the task is
    done; ``progress``: a progress bar over the tasks too."""
    _check_method(method, sampling)
    named = {"heads": heads} | ({"baseline": baseline} if baseline is not None else {})
    for h in named.values():
        h.bind(model)
        h.to(device=model.device, dtype=model.dtype).eval()
    depth = min(h.config.num_heads for h in named.values())
    usable = [t for t in trees if load_tree(t).depth <= depth]
    report: dict = {
        "heads": dataclasses.asdict(heads.config),
        "settings": {
            "num_prompts": num_prompts,
            "max_new_tokens": max_new_tokens,
            "split": split,
            "sampling": list(sampling),
            "temperature": temperature,
            "method": method,
        },
        "trees": usable,
        "skipped_trees": {t: f"depth {load_tree(t).depth} > {depth} heads" for t in trees if t not in usable},
        "tasks": {},
    }
    if baseline is not None:
        report["baseline"] = {"name": baseline_name, "heads": dataclasses.asdict(baseline.config)}
    with _TaskProgress(progress, len(tasks)) as bar:
        for task in tasks:
            report["tasks"][task] = _evaluate_task(
                model, tokenizer, named, task, split, num_prompts, max_new_tokens, usable, batch_size,
                sampling, temperature, method,
            )  # fmt: skip
            bar.done(task_line(task, report["tasks"][task]))
    return report


def _evaluate_task(
    model, tokenizer, named: dict, task: str, split: str, num_prompts: int, max_new_tokens: int,
    trees: list[str], batch_size: int, sampling: tuple[str, ...], temperature: float, method: str = "decode",
) -> dict:  # fmt: skip
    """One task's entry of the report: teacher-forced accuracy and tokens per step of `named`'s heads
    ("heads", and "baseline" when given) on the task's prompts."""
    t0 = time.perf_counter()
    heads, baseline = named["heads"], named.get("baseline")
    prompts = [encode_prompt(tokenizer, p) for p in load_prompts(task, split, num_prompts)]
    responses = generate_responses(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    pairs = list(zip(prompts, responses, strict=True))
    measure = replayed_runs if method == "replay" else speculative_runs
    runs = measure(model, tokenizer, named, prompts, trees, max_new_tokens)
    entry = {"label": TASKS[task][1], "prompts": len(prompts)}
    entry.update(teacher_forced_accuracy(model, heads, pairs))
    entry["speculative"] = runs["heads"]
    if baseline is not None:
        entry["baseline"] = teacher_forced_accuracy(model, baseline, pairs)
        entry["baseline"]["speculative"] = runs["baseline"]
    for rule in sampling:
        how = {} if method == "replay" else {"acceptance": rule}  # a replay's one rule: sample
        sampled = measure(model, tokenizer, named, prompts, trees, max_new_tokens, temperature, **how)
        entry.setdefault("sampling", {})[rule] = sampled["heads"]
        if baseline is not None:
            entry["baseline"].setdefault("sampling", {})[rule] = sampled["baseline"]
    entry["seconds"] = time.perf_counter() - t0
    return entry


def task_line(task: str, entry: dict) -> str:
    """One task's result as a line: the heads' top-1 accuracy and tokens per step per tree (the baseline's
    beside them)."""
    tps = ", ".join(f"{t} {v['tokens_per_step']:.2f}" for t, v in entry["speculative"].items())
    if "baseline" in entry:
        old = ", ".join(f"{v['tokens_per_step']:.2f}" for v in entry["baseline"]["speculative"].values())
        tps += f" (baseline {old})"
    return f"eval {task}: head top-1 {_fmt(entry['top1'])}; tokens/step {tps}"


class _TaskProgress:
    """A rich progress bar over the tasks, each task's result line logged above it; without it (`enabled`
    False, or off a terminal) the result lines alone. The lines are results, so they always print."""

    def __init__(self, enabled: bool, tasks: int):
        self.enabled, self.tasks = enabled and tasks > 0, tasks

    def __enter__(self) -> _TaskProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn("eval tasks"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.enabled = bar.console.is_terminal
            if self.enabled:
                self.bar = bar
                bar.__enter__()
                self.task = bar.add_task("eval", total=self.tasks)
        return self

    def done(self, line: str) -> None:
        if not self.enabled:
            print(line, flush=True)
            return
        self.bar.console.log(line)
        self.bar.advance(self.task)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def report_markdown(report: dict) -> str:
    tasks = report["tasks"]
    K = report["heads"]["num_heads"]
    lines = [
        f"# Heads evaluation: {report['heads']['kind']}, {K} heads, base {report['heads'].get('base_model') or '?'}",
        "",
        f"{report['settings'].get('split', 'calib').capitalize()}-split prompts per task: "
        f"{report['settings']['num_prompts']}; greedy continuations of up to "
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
            "## Mean tokens per step (greedy speculative decoding; accepted drafts + 1 bonus token)"
            + (" by trace replay" if _replayed(report) else ""),
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
    if "baseline" in report and report["trees"]:
        lines += comparison_table(report)
    for rule in report["settings"].get("sampling", []):
        lines += sampling_table(report, rule)
    for tree, why in report["skipped_trees"].items():
        lines.append(f"Tree {tree} skipped: {why}.")
    return "\n".join(lines) + "\n"


def _groups(tasks: dict) -> list[tuple[str, list[str]]]:
    """Summary rows: the paper's four tasks and the dev categories, where the report has them; a group the report
    has only part of is named by its tasks (a mean of two tasks is not labelled "four tasks")."""
    four = [t for t in FOUR_TASKS if t in tasks]
    dev = [t for t in SPECBENCH if t in tasks]
    groups = (("four tasks", four, FOUR_TASKS), ("dev categories", dev, tuple(SPECBENCH)))
    return [(name if len(ts) == len(every) else " + ".join(ts), ts) for name, ts, every in groups if ts]


def _replayed(report: dict) -> bool:
    return report["settings"].get("method", "decode") == "replay"


def comparison_table(report: dict) -> list[str]:
    """One table: tokens/step of the heads and the baseline per tree and task, and (decoded, not replayed) the
    tokens/s ratio with the last tree (the default one), with means (and the dev categories' minimum) below."""
    trees, tasks, name = report["trees"], report["tasks"], report["baseline"]["name"]
    default, timed = trees[-1], not _replayed(report)
    head = ["task"] + [f"{t} {who}" for t in trees for who in ("new", name)]
    head += [f"{default} tokens/s new / {name}"] if timed else []
    title = f"tokens/s ratio with {default}" if timed else "by trace replay: no tokens/s"
    lines = [
        f"## Against {name} (greedy tokens per step; {title})",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---|" * (len(head) - 1),
    ]

    def tps(e: dict, side: str, tree: str) -> float:  # tokens/step of the new heads or the baseline
        return (e if side == "new" else e["baseline"])["speculative"][tree]["tokens_per_step"]

    def cells(values: list[dict]) -> list[str]:  # values: the tasks' entries to average
        out = []
        for t in trees:
            for side in ("new", "baseline"):
                xs = [tps(e, side, t) for e in values]
                out.append(f"{sum(xs) / len(xs):.2f}")
        if not timed:
            return out
        ratios = [
            metrics.speedup(
                e["speculative"][default]["tokens_per_second"],
                e["baseline"]["speculative"][default]["tokens_per_second"],
            )
            for e in values
        ]
        out.append(f"{sum(ratios) / len(ratios):.2f}x")
        return out

    for e in tasks.values():
        lines.append("| " + " | ".join([e["label"], *cells([e])]) + " |")
    for group, ts in _groups(tasks):
        lines.append("| " + " | ".join([f"**mean, {group}**", *cells([tasks[t] for t in ts])]) + " |")
        if ts[0] in SPECBENCH:  # the dev categories (all or some): their worst too
            worst = [
                f"{min(tps(tasks[t], side, tr) for t in ts):.2f}"
                for tr in trees
                for side in ("new", "baseline")
            ]
            lines.append("| " + " | ".join([f"**min, {group}**", *worst] + [""] * timed) + " |")
    lines.append("")
    return lines


def sampling_table(report: dict, rule: str) -> list[str]:
    """Tokens/step at the report's temperature with acceptance ``rule``, per tree and task (the baseline's
    beside the heads' when there is one), with the means of the task groups."""
    trees, tasks = report["trees"], report["tasks"]
    name = report["baseline"]["name"] if "baseline" in report else None
    sides = ["new", name] if name else ["new"]
    T = report["settings"]["temperature"]

    def tps(e: dict, side: str, tree: str) -> float:
        return (e if side == "new" else e["baseline"])["sampling"][rule][tree]["tokens_per_step"]

    head = ["task"] + [f"{t} {side}" for t in trees for side in sides]
    lines = [
        f"## Mean tokens per step at T={T:g}, {rule} acceptance"
        + (" (trace replay)" if _replayed(report) else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---|" * (len(head) - 1),
    ]
    for e in tasks.values():
        lines.append(
            "| " + " | ".join([e["label"]] + [f"{tps(e, s, t):.2f}" for t in trees for s in sides]) + " |"
        )
    for group, ts in _groups(tasks):
        means = [f"{sum(tps(tasks[x], s, t) for x in ts) / len(ts):.2f}" for t in trees for s in sides]
        lines.append("| " + " | ".join([f"**mean, {group}**", *means]) + " |")
    lines.append("")
    return lines


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
