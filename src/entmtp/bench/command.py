"""`entmtp bench`: its parser, then plan, load, measure, summarise, print and write."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..accept import GenerationOptions
from ..build import EngineSpec
from ..engine_args import add_model_arguments, setup_torch
from ..lookup import Lookup
from ..prompts import TASKS
from ..scheduler.policies import POLICIES
from ..settings import add_arguments
from ..shipped import HEAD_KINDS
from .engines import load
from .plan import make_plan
from .report import print_mismatches, print_tables, write
from .run import measure
from .summary import summarise_tasks


def register(sub) -> None:
    """`bench` on the subcommand parsers `sub`."""
    b = sub.add_parser(
        "bench", help="tokens/s and tokens/step against plain decoding, per task (table + JSON)"
    )
    add_bench_arguments(b)
    b.set_defaults(func=run_bench_command)


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    _add_methods_arguments(b)
    add_arguments(b, Lookup, skip=("adaptive",))  # fixed or adaptive: a method of its own (--lookup-only)
    b.add_argument("--replay", action="store_true", help="also replay the policies and the oracle (greedy)")
    add_arguments(
        b,
        EngineSpec,
        only=("probe",),
        changes={
            "probe": dict(
                help="size policies and lookup branches by the profiles' stored latencies, not this machine's "
                "measured step costs"
            )
        },
    )
    b.add_argument(
        "--defaults",
        action="store_true",
        help="also run plain decoding in the other CPU dtype, `default` (what `entmtp generate` builds: auto "
        "dtype, this machine's costs, lookup) and `previous-default` (bf16, mixed profile, stored latencies)",
    )
    add_arguments(
        b,
        GenerationOptions,
        only=("temperature", "acceptance", "seed"),
        changes={"seed": dict(default=0, help="sampling seed of prompt i is seed + i")},
    )
    _add_workload_arguments(b)
    b.add_argument(
        "--out",
        default=None,
        help="directory for results.json, report.md and the plots (default: runs/bench-DATE-TIME)",
    )
    b.add_argument("--no-progress", action="store_true")
    b.add_argument(
        "--render",
        metavar="RUN",
        default=None,
        help="run nothing: write RUN/report.md again from RUN/results.json (today's legend and columns, the "
        "same plots); RUN may also name a results file (X-results.json -> X-report.md)",
    )
    add_model_arguments(b)


def _add_methods_arguments(b: argparse.ArgumentParser) -> None:
    """What `bench` runs: heads, static trees, policies, peers and lookup-only decoding."""
    b.add_argument(
        "--heads", default="hydra,medusa", help=f"comma list: {', '.join(HEAD_KINDS)} or heads directories"
    )
    b.add_argument(
        "--trees",
        default=None,
        help="static trees (comma list; HEADS:TREE for one heads only; default: mc_sim_7b_63 (the published "
        "default) for each heads and hydra:tree_8; --quick: hydra:mc_sim_7b_63; '' for none)",
    )
    b.add_argument(
        "--policies",
        default=None,
        help=f"scheduling policies (comma list of {','.join(POLICIES)}, each optionally +lookup; "
        "HEADS:POLICY for one heads only; default: every policy for hydra and dynamic+lookup, EntMTP* (static) "
        "for medusa; --quick: hydra's static, dynamic and dynamic+lookup; '' for none)",
    )
    b.add_argument(
        "--profile", default="auto", help="auto (each task's shipped profile, else mixed) | TASK | FILE"
    )
    b.add_argument(
        "--peers",
        default=None,
        help="peer decoders on the same prompt ids (comma list): hf-generate (transformers' generate), "
        "hf-prompt-lookup (its prompt lookup decoding, 10 tokens), llama-cpp (plain decoding of the GGUF as "
        "pip's llama-cpp-python runs it; needs llama-cpp-python), llama-cpp-amx (the patched build's, on a CPU "
        "with AMX; added beside llama-cpp there); default: the first two (--quick: hf-prompt-lookup)",
    )
    b.add_argument(
        "--lookup-only",
        default=None,
        help="entmtp prompt lookup without heads (comma list; default adaptive): adaptive (branch sized per step), fixed; "
        "TREE+lookup in --trees and POLICY+lookup in --policies add a lookup branch to heads configs",
    )


def _add_workload_arguments(b: argparse.ArgumentParser) -> None:
    """What `bench` decodes: tasks or a prompt file, how many prompts and tokens."""
    b.add_argument("--tasks", default=",".join(TASKS), help="comma list (default: all of them)")
    b.add_argument(
        "--prompts",
        default=None,
        help="benchmark your own prompts instead of --tasks: a JSONL file with a 'prompt' or 'turns' field per line",
    )
    b.add_argument("--split", default="test", choices=["calib", "test"])
    b.add_argument("--num-prompts", type=int, default=None, help="prompts per task (default 10; --quick 2)")
    add_arguments(
        b,
        GenerationOptions,
        only=("max_new_tokens",),
        changes={"max_new_tokens": dict(default=None, help="default 128; --quick 48")},
    )
    b.add_argument(
        "--quick",
        action="store_true",
        help="2 prompts per task, 48 tokens, the main methods (peer prompt lookup, lookup, Hydra mc_sim_7b_63, "
        "EntMTP*, dynamic, dynamic+lookup): about 7 minutes for all 11 tasks on a 2-core CPU",
    )


def run_bench_command(args) -> int:
    """`entmtp bench`: --render writes a report again; otherwise the benchmark runs."""
    if args.render is not None:
        from .report import render_again

        print(f"wrote {render_again(Path(args.render))}")
        return 0
    setup_torch(args)
    return run_bench(args)


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
