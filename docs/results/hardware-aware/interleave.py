"""Shared by the in-process A/B scripts (hybrid_skip_ab.py, draft_vocab_ab.py): several engines on the same
prompts, interleaved so that a slow stretch of the machine hits every engine alike."""

from __future__ import annotations

import json


def interleaved(
    engines: dict, prompts: list[str], max_new_tokens: int, reps: int = 2, **options
) -> tuple[dict, bool]:
    """Every engine on every prompt in turn (the order reversed on alternate prompts), `reps` times over, after
    one short warm-up each. `options`: the generation's own (temperature, acceptance); with a temperature,
    prompt i is seeded with i for every engine. Returns, per engine, the decode steps' totals (tokens, steps, seconds, probe
    seconds, steps chosen without probing the heads; prefill left out), and whether all engines wrote the same
    tokens on every prompt."""
    for engine in engines.values():
        engine.generate(prompts[0], max_new_tokens=8)
    tally = {name: {"tokens": 0, "steps": 0, "seconds": 0.0, "probe": 0.0, "skipped": 0} for name in engines}
    same = True
    for rep in range(reps):
        for i, prompt in enumerate(prompts):
            order = list(engines) if (i + rep) % 2 == 0 else list(engines)[::-1]
            outs = set()
            for name in order:
                seed = {"seed": i} if options.get("temperature") else {}
                result = engines[name].generate(prompt, max_new_tokens=max_new_tokens, **options, **seed)
                outs.add(tuple(result.token_ids))
                steps = result.steps
                t = tally[name]
                t["tokens"] += sum(s.tokens for s in steps)
                t["steps"] += len(steps)
                t["seconds"] += sum(s.seconds["total"] for s in steps)
                t["probe"] += sum(s.seconds.get("probe", 0.0) for s in steps)
                t["skipped"] += sum(s.signals.get("probed") == 0.0 for s in steps)
            same &= len(outs) == 1
    return tally, same


def add_rates(tally: dict, base: str) -> None:
    """Adds each engine's tokens/s and its ratio to engine `base`'s (`vs_shipped`) to its `interleaved` totals."""
    for t in tally.values():
        t["tokens_per_second"] = t["tokens"] / t["seconds"]
    for t in tally.values():
        t["vs_shipped"] = t["tokens_per_second"] / tally[base]["tokens_per_second"]


def rate_cells(t: dict) -> list[str]:
    """An engine's `add_rates`d totals as table cells: tokens/s, its ratio to the base engine, tokens/step,
    ms/step."""
    return [
        f"{t['tokens_per_second']:.1f}",
        f"{t['vs_shipped']:.3f}x",
        f"{t['tokens'] / t['steps']:.2f}",
        f"{1000 * t['seconds'] / t['steps']:.1f}",
    ]


def per_task(engines: dict, base: str, table, results: dict, args) -> None:
    """Every engine on each of `args.tasks`' test prompts at each of `args.temperatures` (`interleaved`, with
    `args.num_prompts`, `args.max_new_tokens`, `args.reps`): a section of `table` (columns T, task, engine,
    then `rate_cells`, against engine `base`) and an entry of results["runs"] per (temperature, task)."""
    from entmtp.prompts import load_prompts

    for temperature in (float(t) for t in args.temperatures.split(",")):
        options = {"temperature": temperature} if temperature > 0 else {}
        for task in args.tasks.split(","):
            prompts = load_prompts(task, "test", args.num_prompts)
            tally, same = interleaved(engines, prompts, args.max_new_tokens, args.reps, **options)
            add_rates(tally, base)
            for name, t in tally.items():
                table.add_row(f"{temperature:g}", task, name, *rate_cells(t))
            table.add_row("", "", "same text" if same else "texts differ", end_section=True)
            results["runs"][f"{temperature:g}/{task}"] = {"identical_outputs": same, "methods": tally}
            print(f"T={temperature:g} {task}: done", flush=True)


def lookup_alone(default):
    """entmtp's prompt lookup without heads on the default engine's model and cost curve (the method the
    default is held to on copy-heavy text)."""
    from entmtp.engine import Engine
    from entmtp.lookup import Lookup
    from entmtp.scheduler.hybrid import hybrid

    policy = hybrid(None, Lookup(), default.costs)
    return Engine(default.model, default.tokenizer, policy=policy, costs=default.costs)


def finish(table, results: dict, out) -> None:
    """Prints the run's table (wide enough for its columns off a terminal) and writes its JSON atomically."""
    from rich.console import Console

    from entmtp.files import write_text_atomic

    Console(width=160).print(table)
    write_text_atomic(out, json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
