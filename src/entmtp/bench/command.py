"""`entmtp bench`: plan, load, measure, summarise, print and write."""

from __future__ import annotations

from .engines import load
from .plan import make_plan
from .report import print_mismatches, print_tables, write
from .run import measure
from .summary import summarise_tasks


def run_bench(args) -> int:
    """Run the benchmark the command line describes; every name and size is checked before a model loads."""
    plan = make_plan(args)
    methods = load(plan)
    measured = measure(plan, methods)
    summary = summarise_tasks(
        measured.runs, measured.mismatches, seed=args.seed, greedy=args.temperature == 0
    )
    print_tables(summary, measured.replays, args)
    print_mismatches(measured, methods)
    write(plan.out, methods, measured, summary)
    return 0
