"""Per-step cost breakdown: where a speculative step spends its time, per tree, against plain decoding.

`entmtp profile` prints a table (median milliseconds per phase over the measured steps, warm-up dropped)
and writes it as JSON. Non-model overhead = draft + accept + commit + bookkeeping (everything but the
verification forward).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

PHASES = ("draft", "verify", "accept", "commit")
WARMUP = 3  # steps dropped per run: first calls allocate and warm caches
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def profile_engine(engine, steps: int, prompt: str = PROMPT) -> dict:
    """Run one generation long enough for `steps` measured steps; return median ms per phase."""
    result = engine.generate(prompt, max_new_tokens=(steps + WARMUP) * 8)  # EOS or length may end it earlier
    measured = result.steps[WARMUP : WARMUP + steps]
    if not measured:
        raise RuntimeError("generation ended before any step could be measured: use a longer prompt")
    row = {p: 1000 * statistics.median(s.seconds[p] for s in measured) for p in PHASES}
    row["total"] = 1000 * statistics.median(s.seconds["total"] for s in measured)
    row["bookkeeping"] = max(0.0, row["total"] - sum(row[p] for p in PHASES))
    row["overhead"] = row["total"] - row["verify"]
    row["tokens_per_step"] = statistics.mean(s.tokens for s in measured)
    row["steps"] = len(measured)
    return row


def run_profile(args) -> int:
    import torch

    from .engine import Engine
    from .heads import HeadsConfig, random_heads
    from .model import load_model
    from .shipped import default_heads, resolve_heads
    from .tree import load_tree

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    spec = args.heads or default_heads()
    if spec == "none":  # nothing shipped: random heads still measure drafting cost (acceptance will be low)
        cfg = model.config
        heads = random_heads(
            HeadsConfig(kind="medusa", num_heads=4, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
        )
        spec = "random medusa"
    else:
        heads = resolve_heads(spec, model)
    rows = {}
    runs = [("plain", None, None)] + [(n, heads, load_tree(n)) for n in args.trees.split(",")]
    for name, h, tree in track(runs, description="profiling"):
        engine = Engine(model, tokenizer, heads=h, tree=tree) if h is not None else Engine(model, tokenizer)
        rows[name] = {"nodes": 0 if tree is None else tree.num_nodes, **profile_engine(engine, args.steps)}
    table = Table(
        title=f"per-step cost, ms (median of {args.steps} steps; heads: {spec}; {args.dtype}, "
        f"{torch.get_num_threads()} threads)"
    )
    for col in ("run", "nodes", *PHASES, "bookkeeping", "overhead", "total", "tokens/step"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        cells = [f"{r[p]:.2f}" for p in (*PHASES, "bookkeeping", "overhead", "total")]
        table.add_row(name, str(r["nodes"]), *cells, f"{r['tokens_per_step']:.2f}")
    _console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"heads": spec, "dtype": args.dtype, "threads": torch.get_num_threads(), "steps": args.steps}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


def _console() -> Console:
    """Full-width tables in logs too (rich would cut columns to 80 characters when not on a terminal)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)
