"""What `entmtp bench` prints and writes: a table per task on the console; results.json (the run's setup,
the summary, the replays, every record, the mismatches, one generation's step log); report.md with the plots."""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

import torch
from rich.table import Table

from .. import metrics
from ..console import wide_console
from ..drafts import SourceCounts
from ..errors import EntMTPError
from ..files import portable, write_text_atomic
from ..machine import describe, describe_record, hardware, record, versions
from ..prompts import TASKS
from .engines import Methods
from .peers import LLAMA_PEERS
from .plots import speedup_plot, step_log_plot
from .run import Measurements
from .summary import default_over_plain


def task_label(task: str) -> str:
    """A task's name in reports ("GSM8K (math)"); a prompt file's task is its file name."""
    return TASKS[task][1] if task in TASKS else task


def meta(methods: Methods, interrupted: bool) -> dict:
    """The run's setup, for results.json: the command, machine, versions, sizes, profiles and step costs."""
    args = methods.plan.args
    return {
        "command": "entmtp " + " ".join(getattr(args, "argv", sys.argv[1:])),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": describe(hardware(methods.model)),
        "hardware": hardware(methods.model),
        "machine_record": record(methods.model.device),
        "commit": _commit(),
        "versions": versions(),
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": args.num_prompts,
        "split": args.split,
        "temperature": args.temperature,
        "acceptance": args.acceptance,
        "profiles": {f"{k}/{t}": portable(p.path) for (k, t), p in methods.profiles.items()},
        "step_costs": {
            k: c.to_json() if c is not None else "profile latencies" for k, c in methods.costs.items()
        },
        "plans": methods.plans,
        "peers": {name: p.settings for name, p in methods.static.items() if hasattr(p, "settings")},
        "torch": torch.__version__,
        "prompts_file": args.prompts,
        "quick": args.quick,
        "interrupted": interrupted,
    }


def write(out: Path, methods: Methods, measured: Measurements, summary: dict) -> None:
    """results.json, the plots and report.md (which shows them) into `out`, created if needed."""
    from ..calibration.plots import plot_profile

    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta(methods, measured.interrupted), "summary": summary, "replays": measured.replays}
    data |= {"runs": measured.runs, "mismatches": measured.mismatches, "step_log": measured.step_log}
    greedy = methods.plan.args.temperature == 0
    data["compared_runs"] = compared_runs(measured.runs) if greedy else 0  # what `mismatches` is out of
    results = out / "results.json"
    write_text_atomic(results, json.dumps(data, indent=1))
    labels = {t: task_label(t) for t in summary}
    images = []
    if summary:
        speedup_plot(summary, labels, out / "speedup.png")
        images.append(("speedup over plain decoding per task and method", "speedup.png"))
    used = {(kind, p.path): p for (kind, _), p in methods.profiles.items()}  # each heads' profile, once
    for (kind, path), profile in used.items():
        name = f"frontier-{Path(kind).name}-{Path(path).stem}.png"
        plot_profile(
            profile, out / name, profile.mode_for(methods.plan.args.temperature, methods.plan.args.acceptance)
        )
        images.append((f"acceptance and throughput frontiers of {portable(path)}", name))
    if log := measured.step_log:
        step_log_plot(log, out / "steps.png")
        images.append((f"one generation, step by step: {log['config']} on {log['task']}", "steps.png"))
    report = markdown(json.loads(results.read_text()), labels, data["meta"]["command"], images)
    write_text_atomic(out / "report.md", report)
    print(f"wrote {results}, {out / 'report.md'} and {len(images)} plots in {out}")


def render_again(path: Path) -> Path:
    """report.md written again from results.json by today's `markdown` (its legend and columns), showing the
    plots the report showed before: `path` is a bench folder or one of its results files (X-results.json is
    rendered into X-report.md). Nothing is measured; returns the report's path."""
    results = path / "results.json" if path.is_dir() else path
    if not results.is_file() or not results.name.endswith("results.json"):
        raise EntMTPError(f"{path}: give a folder `entmtp bench --out` wrote, or its results.json")
    try:
        data = json.loads(results.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EntMTPError(f"{results}: not a bench results.json ({e})") from e
    if not {"meta", "summary"} <= set(data):
        raise EntMTPError(f"{results}: not a bench results.json (no meta or summary)")
    report = results.with_name(results.name.removesuffix("results.json") + "report.md")
    images = _images(report.read_text(encoding="utf-8")) if report.is_file() else []
    labels = {t: task_label(t) for t in data["summary"]}
    write_text_atomic(report, markdown(data, labels, data["meta"]["command"], images))
    return report


def _images(report: str) -> list[tuple[str, str]]:
    """The (caption, file) of each plot a report.md shows."""
    return re.findall(r"^!\[(.*)\]\((.*)\)$", report, flags=re.MULTILINE)


def print_tables(summary: dict, replays: dict, args) -> None:
    """A table per task (every method against plain decoding), then its replayed policies per heads."""
    console = wide_console()
    for task, rows in summary.items():
        console.print(_task_table(task, rows, args))
        for kind, rep in replays.get(task, {}).items():
            console.print(_replay_table(task, kind, rep))


NOT_COMPARED = ("plain", *LLAMA_PEERS)  # plain decoding is the reference; llama.cpp decodes its own weights


def compared_runs(runs: dict) -> int:
    """How many runs a greedy bench compares with plain decoding's output: every method's but NOT_COMPARED."""
    return sum(len(recs) for rows in runs.values() for name, recs in rows.items() if name not in NOT_COMPARED)


def print_mismatches(measured: Measurements, methods: Methods) -> None:
    """How many of the compared runs' greedy outputs differ from plain decoding's (plain decoding's own runs
    are not counted), and why some may."""
    args = methods.plan.args
    if args.temperature > 0:
        return
    differ, n = len(measured.mismatches), compared_runs(measured.runs)
    # bf16 rounds one-token and many-token forwards differently: rare divergences are expected
    why = f" ({args.dtype}: one-token and many-token forwards round differently; float32 runs are bit-exact)"
    print(f"{differ} of {n} runs of the other methods differ from plain decoding" + (why if differ else ""))


def _task_table(task: str, rows: dict, args) -> Table:
    prompts = args.split if args.prompts is None else ""
    table = Table(
        title=f"{task_label(task)}: {args.num_prompts} {prompts} prompts, {args.max_new_tokens} new tokens, "
        f"T={args.temperature} {args.acceptance}, {args.dtype}, {torch.get_num_threads()} threads"
    )
    cols = ["config", "tokens/step", "tokens/s", "speedup", "ms/step", "choose ms/step", "lookup share"]
    sampled = any("perplexity" in r for r in rows.values())
    for col in cols + (["perplexity"] if sampled else []):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        peer = r["tokens_per_step"] != r["tokens_per_step"]  # NaN: no per-step records
        table.add_row(
            name,
            "" if peer else f"{r['tokens_per_step']:.2f}",
            f"{r['tokens_per_second']:.1f}",
            f"{r['speedup']:.2f}x",
            "" if peer else f"{r['ms_per_step']:.1f}",
            "" if peer else f"{r['choose_ms_per_step']:.3f}",
            f"{r['lookup_share']:.0%}" if r["lookup_share"] else "",
            *([f"{r['perplexity']:.2f}" if "perplexity" in r else ""] if sampled else []),
        )
    return table


def _replay_table(task: str, kind: str, rep: dict) -> Table:
    """A task's replayed policies; the title says what the steps were charged by, each row its choice's ms
    (measured here, or "-": not charged)."""
    steps = next((r["charges"]["step"]["note"] for r in rep.values() if "charges" in r), "stored latencies")
    table = Table(
        title=f"{task_label(task)}, {kind}: policies replayed on the plain outputs (decode steps, {steps})"
    )
    for col in ("policy", "tokens/s", "tokens/step", "vs static", "choice ms"):
        table.add_column(col, justify="right")
    base = rep.get("static", {}).get("tokens_per_second")
    for name, r in rep.items():
        ratio = f"{metrics.speedup(r['tokens_per_second'], base):.3f}x" if base else ""
        choice = r.get("charges", {}).get("choice", {"source": "none"})
        charged = f"{choice['ms']:.3f}" if choice["source"] != "none" else "-"
        table.add_row(name, f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_step']:.2f}", ratio, charged)
    return table


def markdown(data: dict, labels: dict[str, str], command: str, images=()) -> str:
    """The report: the command and setup, one table per task, then the plots ((caption, file) pairs)."""
    meta = data["meta"]
    sampled = meta["temperature"] > 0
    lines = [
        "# entmtp bench",
        "",
        f"`{command}`",
        "",
        f"{_machine(meta)}, {meta['threads']} threads, {meta['dtype']}, torch {meta['torch']}; "
        f"{meta['max_new_tokens']} new tokens, T={meta['temperature']} ({meta['acceptance']})"
        + (" — interrupted: partial results" if meta.get("interrupted") else ""),
        "",
        "Speedup = tokens/s over plain decoding (ratio of sums; prefill included); the interval is a 95% "
        "bootstrap interval of the mean per-prompt speedup. Decode tokens/s leaves the prefill out. Probe ms = "
        "the heads' probe a scheduling policy reads before it chooses (the drafts reuse it), choose ms = the "
        "choice itself, per step. Trees: each tree's share of the steps (the three most "
        "used). Drafts: accepted of drafted nodes by source (heads, the text's lookup, a prediction, the suffix "
        "cache, a grammar's forced tokens). Identical = outputs equal to plain decoding's (T=0), with the "
        "first differing token of each that is not."
        + (" Perplexity: of the sampled continuations under the base model (T=1)." if sampled else ""),
    ]
    if meta.get("date") or meta.get("commit"):
        lines += [
            "",
            f"Run {meta.get('date', '')}, commit {meta.get('commit') or 'unknown'}, versions {meta.get('versions', {})}.",
        ]
    if data.get("replays"):
        lines += ["", replay_pricing(data["replays"], command)]
    lines += weights_lines(meta.get("plans") or {})
    if meta.get("peers"):
        lines += ["", "Peers' builds and settings:", ""]
        lines += [f"- `{name}`: {settings}" for name, settings in meta["peers"].items()]
    lines += never_slower_lines(data["summary"], meta.get("plans") or {})
    head = ["method", "tokens/s", "speedup", "per-prompt speedup (95% CI)", "tokens/step", "decode tokens/s"]
    head += ["probe ms", "choose ms", "trees", "drafts", "perplexity" if sampled else "identical"]
    for task, rows in data["summary"].items():
        lines += ["", f"## {labels.get(task, task)} ({next(iter(rows.values()))['prompts']} prompts)", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(_markdown_cells(name, r, sampled)) + " |" for name, r in rows.items()]
    for caption, file in images:
        lines += ["", f"![{caption}]({file})"]
    return "\n".join(lines) + "\n"


def never_slower_lines(summary: dict, plans: dict[str, str]) -> list[str]:
    """A table of each built default over the same backend's fastest plain decoding per task, and whether it
    is >= 1.00x on every row (the README's promise: never slower than plain)."""
    ratios = default_over_plain(summary, plans)
    names = sorted({n for row in ratios.values() for n in row})
    if not names:
        return []
    lines = ["", "Each built default over the fastest plain decoding of the backend it runs on:", ""]
    lines += ["| task | " + " | ".join(f"`{n}`" for n in names) + " |", "|" + "---|" * (len(names) + 1)]
    for task, row in ratios.items():
        lines.append(f"| {task} | " + " | ".join(f"{row[n]:.2f}x" if n in row else "" for n in names) + " |")
    below = sorted({(n, t) for t, row in ratios.items() for n, r in row.items() if r < 1.0})
    said = "yes" if not below else "no: " + ", ".join(f"`{n}` on {t}" for n, t in below)
    return [*lines, "", f"Never slower than its backend's plain decoding on every row (>= 1.00x): {said}."]


def weights_lines(plans: dict[str, str]) -> list[str]:
    """What weights each built default decoded, and its route, from its plan (`build.Plan.describe`); plans
    from before the plan named weights say nothing here."""
    out = []
    for name, plan in plans.items():
        said = [line for line in plan.splitlines() if line.startswith(("weights:", "llama.cpp:", "route:"))]
        if any(line.startswith("weights:") for line in said):
            out.append(f"- `{name}`: " + "; ".join(said))
    return ["", "Weights each built default decoded (its plan):", "", *out] if out else []


# what a run's replays were priced with before each replay recorded its `charges` (2026-12-03)
UNRECORDED_PRICES = (
    "each profile's stored latencies (its calibration machine's), the heads' drafting on "
    "lookup-only steps at the constant HEADS_DRAFT_COST (another machine's), the hybrid's probe and the "
    "policies' choice not charged"
)


def replay_pricing(replays: dict, command: str) -> str:
    """One paragraph on what the replays in results.json (`replays`: task -> heads -> policy -> replay) were
    priced with: each charge's source as the replays recorded it, or, for a run from before they recorded it,
    another machine's figures, with the command that prices them on this machine (the run again)."""
    rows = [r for by_heads in replays.values() for by_policy in by_heads.values() for r in by_policy.values()]
    charges = next((r["charges"] for r in rows if "charges" in r), None)
    if charges is None:
        return (
            f"Replays (results.json `replays`, not in the tables below): priced with {UNRECORDED_PRICES}. "
            "The run kept the replays' results, not their traces, so they cannot be priced again from this "
            f"file: `{command}` on the machine in question prices them on its measured costs."
        )
    said = "; ".join(f"{what}: {c['source']} ({c.get('note', '')})" for what, c in charges.items())
    return f"Replays (results.json `replays`, not in the tables below), charged per step by: {said}."


def _machine(meta: dict) -> str:
    """The machine a run's report names: its machine record (CPU model, cores and flags, or GPU and driver),
    else its hardware record's name; runs from before either recorded only the architecture: unknown."""
    if "machine_record" in meta:
        return describe_record(meta["machine_record"])
    if "hardware" in meta:
        return meta["machine"]
    return f"machine unknown (the run recorded only {meta.get('machine')!r}: no CPU model or flags)"


def _markdown_cells(name: str, r: dict, sampled: bool) -> list[str]:
    """One method's row of a task's table; a peer (no per-step records) leaves the per-step cells empty."""
    lo, hi = r.get("speedup_ci95", [float("nan")] * 2)
    tps = r["tokens_per_step"]
    same = r.get("identical_to_plain")
    if sampled:
        tail = f"{r['perplexity']:.2f}" if "perplexity" in r else ""
    else:
        tail = "" if same is None else f"{same:.0%}"
        if r.get("first_differences"):
            tail += " (at " + ", ".join(str(i) for i in r["first_differences"]) + ")"
    steps = tps == tps  # NaN for a peer
    return [
        name,
        f"{r['tokens_per_second']:.1f}",
        f"{r['speedup']:.2f}x",
        f"{r.get('speedup_mean_of_ratios', float('nan')):.2f}x ({lo:.2f}-{hi:.2f})",
        f"{tps:.2f}" if steps else "",
        f"{r['decode_tokens_per_second']:.1f}" if steps else "",
        f"{r.get('probe_ms_per_step', float('nan')):.2f}" if steps else "",
        f"{r['choose_ms_per_step']:.2f}" if steps else "",
        _usage(r.get("tree_usage", {})) if steps and name != "plain" else "",
        _drafts(r.get("drafts") or {}),
        tail,
    ]


def _drafts(counts: dict[str, dict[str, int]]) -> str:
    """Accepted of drafted nodes by source (drafts.py), e.g. "heads 12/40, lookup 38/45"; none: empty."""
    return SourceCounts(
        {s: c["drafted"] for s, c in counts.items()}, {s: c["accepted"] for s, c in counts.items()}
    ).describe()


def _usage(usage: dict[str, int], most: int = 3) -> str:
    """The most used trees with their share of the steps, e.g. "n3d2 61%, none 30%, n8d4 9%"."""
    total = sum(usage.values())
    top = sorted(usage.items(), key=lambda kv: -kv[1])[:most]
    return ", ".join(f"{tree} {n / total:.0%}" for tree, n in top) if total else ""


def _commit() -> str | None:
    import subprocess

    try:
        here = Path(__file__).parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
