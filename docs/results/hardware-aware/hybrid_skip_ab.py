"""The hybrid's skips of the heads' probe, measured (#21, goal 3): the default engine's policy with both (on a
step with a match where no heads' tree can pay; on a step without one while such probed steps have not paid),
with the first only, with neither, and prompt lookup alone, interleaved per prompt in one process on the same
model.

In float32 every method writes plain greedy decoding's text, so tokens/s differ by the policies' choices and
per-step work only (in bf16 each tree shape rounds differently and the texts drift apart, which swamps a few
percent). Each prompt runs every method in turn, the order reversed on alternate prompts, twice over.

    .venv/bin/python docs/results/hardware-aware/hybrid_skip_ab.py --tasks specbench-translation,specbench-qa --num-prompts 10 \
        --out docs/results/hardware-aware/skip-ab.json
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from interleave import finish, interleaved, lookup_alone
from rich.table import Table

from entmtp.build import EngineSpec, build_engine
from entmtp.engine import Engine
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts
from entmtp.scheduler.hybrid import HybridPolicy, _Rate


class ProbeWithoutAMatch(HybridPolicy):
    """The hybrid before its skip on steps without a match (2026-12-02): the heads probed on every such step."""

    def reset(self) -> None:
        super().reset()
        self.probe_yield = _Rate(float("inf"))


class ProbeEveryStep(ProbeWithoutAMatch):
    """The hybrid before either skip: the inner policy asked (and the heads probed) on every step."""

    def _heads_lose(self, *args) -> bool:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="specbench-translation,specbench-qa,specbench-rag,humaneval,gsm8k")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    default = build_engine(EngineSpec(lookup=Lookup(), dtype=args.dtype, threads=args.threads))
    if not isinstance(default.policy, HybridPolicy):
        raise SystemExit(
            f"the default engine here runs {type(default.policy).__name__}, not the hybrid: nothing to compare"
        )
    policies = {}
    for name, kind in (("probe every step", ProbeEveryStep), ("skip with a match", ProbeWithoutAMatch)):
        policies[name] = copy.copy(default.policy)
        policies[name].__class__ = kind
    policies["both skips (default)"] = default.policy
    engines = {
        name: Engine(default.model, default.tokenizer, heads=default.heads, policy=p, costs=default.costs)
        for name, p in policies.items()
    }
    engines["lookup alone"] = lookup_alone(default)
    machine = describe(hardware(default.model))
    results: dict = {"machine": machine, "dtype": args.dtype, "threads": torch.get_num_threads(), "tasks": {}}
    table = Table(
        title=f"{machine}, {args.dtype}, {args.num_prompts} prompts x 2, {args.max_new_tokens} new tokens"
    )
    for col in (
        "task",
        "method",
        "tokens/s",
        "vs probe every step",
        "tokens/step",
        "ms/step",
        "steps skipped",
    ):
        table.add_column(col, justify="left" if col in ("task", "method") else "right")
    for task in args.tasks.split(","):
        prompts = load_prompts(task, "test", args.num_prompts)
        tally, same = interleaved(engines, prompts, args.max_new_tokens)
        base = tally["probe every step"]["tokens"] / tally["probe every step"]["seconds"]
        for t in tally.values():
            t["tokens_per_second"] = t["tokens"] / t["seconds"]  # decode steps only (no prefill)
            t["tokens_per_step"] = t["tokens"] / t["steps"]
            t["ms_per_step"] = 1000 * t["seconds"] / t["steps"]
            t["vs_probe_every_step"] = t["tokens_per_second"] / base
        results["tasks"][task] = {"identical_outputs": same, "methods": tally}
        for name, t in tally.items():
            table.add_row(
                task,
                name,
                f"{t['tokens_per_second']:.1f}",
                f"{t['vs_probe_every_step']:.3f}x",
                f"{t['tokens_per_step']:.2f}",
                f"{t['ms_per_step']:.1f}",
                f"{t['skipped']} of {t['steps']}",
            )
        table.add_row(
            task, "identical outputs" if same else "OUTPUTS DIFFER", "", "", "", "", "", end_section=True
        )
        print(f"{task}: done", flush=True)
    finish(table, results, args.out)


if __name__ == "__main__":
    main()
