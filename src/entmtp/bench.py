"""End-to-end speed benchmark: tokens/s and tokens/step of speculative decoding against plain decoding, per task.

`entmtp bench` runs, for every prompt, plain decoding and every (heads, tree) configuration back to back in
the same process (so machine load hits all of them alike), checks that greedy outputs are identical, prints a
table per task and writes everything as JSON. One warm-up generation per configuration is dropped.
Convention: tokens per step = accepted drafts + 1 bonus token; tokens/s counts every generated token over the
whole generation's wall time (prefill included).
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .engine import Engine
from .prompts import TASKS, load_prompts
from .shipped import resolve_heads


def run_bench(args) -> int:
    from .model import load_model

    tasks = args.tasks.split(",")
    prompts = {t: load_prompts(t, args.split, n=args.num_prompts) for t in tasks}  # bad names fail first
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    engines = {"plain": Engine(model, tokenizer)}
    for kind in args.heads.split(","):
        heads = resolve_heads(kind, model)
        if heads is None:
            continue
        for tree in args.trees.split(","):
            engines[f"{kind}/{tree}"] = Engine(model, tokenizer, heads=heads, tree=tree)
    gen = dict(max_new_tokens=args.max_new_tokens)
    for engine in engines.values():  # warm-up (dropped)
        engine.generate("Hello!", max_new_tokens=8)

    runs: dict[str, dict[str, list[dict]]] = {t: {name: [] for name in engines} for t in tasks}
    mismatches = []
    total = sum(len(p) for p in prompts.values()) * len(engines)
    with Progress(disable=args.no_progress) as bar:
        job = bar.add_task("bench", total=total)
        for task in tasks:
            for i, prompt in enumerate(prompts[task]):
                ref = None
                for name, engine in engines.items():
                    r = engine.generate(prompt, **gen)
                    runs[task][name].append(
                        {
                            "prompt": i,
                            "tokens": len(r.token_ids),
                            "steps": r.num_steps,
                            "seconds": r.seconds,
                            "tokens_per_step": r.mean_tokens_per_step,
                        }
                    )
                    ref = r.token_ids if ref is None else ref
                    if r.token_ids != ref:
                        mismatches.append({"task": task, "prompt": i, "config": name})
                    bar.advance(job)

    summary = {t: {name: _summarise(rs) for name, rs in runs[t].items()} for t in tasks}
    for t in tasks:
        base = summary[t]["plain"]["tokens_per_second"]
        for row in summary[t].values():
            row["speedup"] = row["tokens_per_second"] / base if base else 0.0
    _print(summary, args)
    if mismatches:  # bf16 rounds one-token and many-token forwards differently: rare divergences are expected
        n_spec = sum(len(p) for p in prompts.values()) * (len(engines) - 1)
        print(
            f"{len(mismatches)} of {n_spec} speculative runs differ from plain decoding ({args.dtype}: "
            "one-token and many-token forwards round differently; float32 runs are bit-exact)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": args.num_prompts,
        "split": args.split,
        "torch": torch.__version__,
    }
    out.write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs, "mismatches": mismatches}, indent=1)
    )
    print(f"wrote {out}")
    return 0


def _summarise(rs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rs)
    seconds = sum(r["seconds"] for r in rs)
    steps = sum(r["steps"] for r in rs)
    return {
        "prompts": len(rs),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "tokens_per_step": (tokens - len(rs)) / steps if steps else 1.0,  # the prefill's token has no step
        "median_prompt_tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in rs),
    }


def _print(summary: dict, args) -> None:
    console = _console()
    for task, rows in summary.items():
        table = Table(
            title=f"{TASKS[task][1]}: {args.num_prompts} {args.split} prompts, {args.max_new_tokens} "
            f"new tokens, {args.dtype}, {torch.get_num_threads()} threads"
        )
        for col in ("config", "tokens/step", "tokens/s", "speedup"):
            table.add_column(col, justify="right")
        for name, r in rows.items():
            table.add_row(
                name, f"{r['tokens_per_step']:.2f}", f"{r['tokens_per_second']:.1f}", f"{r['speedup']:.2f}x"
            )
        console.print(table)


def _console() -> Console:
    """Full-width tables in logs too (rich would cut columns to 80 characters when not on a terminal)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)
