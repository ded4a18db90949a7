"""End-to-end speed benchmark: tokens/s and tokens/step of speculative decoding against plain decoding, per task.

`entmtp bench` runs, for every prompt, plain decoding and every method (heads with a static tree, heads with a
scheduling policy from a profile, prompt lookup, peer decoders) back to back in the same process (so machine
load hits all of them alike), checks that greedy outputs are identical, prints a table per task and writes
everything as JSON, a Markdown report and plots. One warm-up generation per method is dropped. With `--replay`,
the plain greedy outputs are also traced through the heads and every policy (lookup hybrids included) and the
hindsight oracle are replayed on them with the measured step latencies (decode steps only): the oracle is a
measurement, not a method one can run. Convention (metrics.py): tokens per step = accepted drafts + 1 bonus
token; tokens/s counts every generated token over the whole generation's wall time (prefill included).

The room: `plan` (what to run, checked before any model loads), `engines` (loading it; the one place an
`Engine` is built), `run` (the interleaved measurements), `summary` (per task and method, by metrics.py),
`report` and `plots` (console tables, results.json, report.md), `peers` (transformers and llama.cpp decoders),
`command` (`entmtp bench`).
"""

from .command import run_bench
from .engines import Methods, engine, load
from .plan import FULL, QUICK, Plan, for_heads, make_plan
from .run import Measurements, measure, nll, record
from .summary import speedup_interval, summarise, summarise_tasks

__all__ = [
    "FULL",
    "QUICK",
    "Measurements",
    "Methods",
    "Plan",
    "engine",
    "for_heads",
    "load",
    "measure",
    "nll",
    "make_plan",
    "record",
    "run_bench",
    "speedup_interval",
    "summarise",
    "summarise_tasks",
]
