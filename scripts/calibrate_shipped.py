"""Make the scheduler profiles shipped in src/entmtp/assets/profiles/{hydra,medusa}/ on this machine.

The same as `entmtp calibrate --heads H --task T` for the four tasks and `mixed`, with both shipped head sets,
except that each task's greedy generations are made once and traced through both head sets (greedy output
does not depend on the heads), and `mixed` reuses the first 5 traces of each task (its prompts are exactly
those). Resumable: a profile that exists is skipped. Usage:

    .venv/bin/python scripts/calibrate_shipped.py [--threads 2] [--only hydra/gsm8k ...]   # greedy + latency
    .venv/bin/python scripts/calibrate_shipped.py --sampled     # then the T=0.7 sections (sample, typical)
    .venv/bin/python scripts/calibrate_shipped.py --retune      # re-derive all from stored traces
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.progress import Progress

from entmtp.calibration.calibrate import (
    CalibrationSettings,
    add_sampled,
    build_profile,
    retune,
    typical_union,
)
from entmtp.calibration.command import calibration_prompts, print_profile
from entmtp.calibration.plots import plot_profile
from entmtp.calibration.traces import SAMPLED, generate_traces, load_traces, save_traces
from entmtp.engine import Engine
from entmtp.model import encode_prompt, load_model
from entmtp.policy import static
from entmtp.prompts import CALIB, FOUR_TASKS
from entmtp.scheduler.profiles import Profile, load_profile, shipped_profiles_dir
from entmtp.shipped import HEAD_KINDS, resolve_heads

OUTPUTS = Path("runs/calibration_outputs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--only", nargs="*", default=None, help="HEADS/TASK pairs to make (default: all)")
    ap.add_argument(
        "--outputs-only",
        action="store_true",
        help="only make (and cache) the greedy generations; no timing, so it may share the machine",
    )
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="add the T=0.7 sections (lossless sampling, typical acceptance) the existing profiles lack "
        "(sampled generations, no timing)",
    )
    ap.add_argument("--sampled-prompts", type=int, default=12, help="sampled calibration prompts per task")
    ap.add_argument(
        "--retune", action="store_true", help="re-derive existing profiles from their traces (no decoding)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    heads = {k: resolve_heads(k, model) for k in HEAD_KINDS}
    settings = CalibrationSettings(max_new_tokens=args.max_new_tokens)
    share = CALIB // len(FOUR_TASKS)
    outputs: dict[str, list[list[int]]] = {}
    traces: dict[tuple[str, str], list] = {}
    wanted = [(k, t) for t in (*FOUR_TASKS, "mixed") for k in HEAD_KINDS]
    if args.only:
        wanted = [w for w in wanted if f"{w[0]}/{w[1]}" in args.only]
    with Progress() as progress:
        if args.retune:
            for kind, task in wanted:
                path = shipped_profiles_dir(kind) / f"{task}.json"
                # read without validation: a profile of an older format is exactly what a retune renews
                profile = Profile.from_json(json.loads(path.read_text()), path)
                profile = retune(profile, heads[kind], settings, log=progress.console.print).save(path)
                plot_profile(profile, path.with_suffix(".png"))
            return
        if args.sampled:
            _add_sampled(args, model, tokenizer, heads, settings, wanted, progress)
            return
        if args.outputs_only:
            for task in FOUR_TASKS:
                _trace_task("hydra", task, model, tokenizer, heads, settings, outputs, traces, progress)
            return
        for kind, task in wanted:
            out = shipped_profiles_dir(kind) / f"{task}.json"
            if out.exists():
                progress.console.print(f"{out} exists: skipped")
                continue
            t0 = time.perf_counter()
            ids = [encode_prompt(tokenizer, p) for p in calibration_prompts(task, CALIB)]
            if task == "mixed":
                need = [t for t in FOUR_TASKS]
                for t in need:
                    _trace_task(kind, t, model, tokenizer, heads, settings, outputs, traces, progress)
                tr = [x for t in FOUR_TASKS for x in traces[(kind, t)][:share]]
            else:
                tr = _trace_task(kind, task, model, tokenizer, heads, settings, outputs, traces, progress)
            profile, tr = build_profile(
                model,
                tokenizer,
                heads[kind],
                heads_name=kind,
                task=task,
                prompts=ids,
                settings=settings,
                progress=progress,
                traces=tr,
                log=progress.console.print,
            )
            run = replace(
                profile.calibration, trace_seconds=None
            )  # traces were shared; see the log for timings
            profile = replace(profile, calibration=run)
            out.parent.mkdir(parents=True, exist_ok=True)
            save_traces(profile, out, tr).save(out)
            plot_profile(profile, out.with_suffix(".png"))
            print_profile(profile)
            progress.console.print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")


def _add_sampled(args, model, tokenizer, heads, settings, wanted, progress) -> None:
    """Sampled (T=0.7, one generation per rule: lossless and typical) generations of the first
    --sampled-prompts calibration prompts of each task, made once per rule with Hydra heads and tree_8 and
    traced through both head sets (typical: verified on each profile's union tree); `mixed` takes an equal
    share of each task's. A typical section of an older entmtp (no union tree) is made again."""
    n = args.sampled_prompts
    share = max(1, n // len(FOUR_TASKS))
    gen = Engine(model, tokenizer, heads=heads["hydra"], policy=static("tree_8"))
    outs: dict[tuple[str, str], list[list[int]]] = {}
    for kind, task in wanted:
        path = shipped_profiles_dir(kind) / f"{task}.json"
        profile = load_profile(path)
        current = {m for m in profile.modes if m != "greedy"}
        if "typical" in current and profile.mode("typical").trace_tree is None:
            current.discard("typical")
            profile = replace(profile, modes={m: s for m, s in profile.modes.items() if m != "typical"})
        sampled = {m: load_traces(load_profile(path), m) for m in current}
        for sampling in SAMPLED:
            rule = sampling.rule
            if rule in current:
                progress.console.print(f"{path} has a {rule} section: kept")
                continue
            t0 = time.perf_counter()
            union = typical_union(profile, heads[kind]) if rule == "typical" else None
            traces = []
            for t in FOUR_TASKS if task == "mixed" else (task,):
                k = share if task == "mixed" else n  # mixed: the first prompts of each task (seeds 0..)
                ids = [encode_prompt(tokenizer, p) for p in calibration_prompts(t, CALIB)][:k]
                cached = outs.get((rule, t))
                tr, made = generate_traces(
                    gen,
                    heads[kind],
                    ids,
                    settings.max_new_tokens,
                    progress,
                    None if cached is None or len(cached) < k else cached[:k],
                    sampling,
                    union,
                )
                if cached is None or len(cached) < k:
                    outs[(rule, t)] = made
                traces += tr
            profile = add_sampled(
                profile, heads[kind], traces, sampling, settings, log=progress.console.print
            )
            sampled[rule] = traces
            progress.console.print(f"{rule} section of {path} ({time.perf_counter() - t0:.0f} s)")
        save_traces(profile, path, load_traces(load_profile(path)), sampled).save(path)


def _trace_task(kind, task, model, tokenizer, heads, settings, outputs, traces, progress):
    if (kind, task) in traces:
        return traces[(kind, task)]
    ids = [encode_prompt(tokenizer, p) for p in calibration_prompts(task, CALIB)]
    t0 = time.perf_counter()
    gen = Engine(model, tokenizer, heads=heads["hydra"], policy=static("tree_8"))
    cached = OUTPUTS / f"{task}-{settings.max_new_tokens}.json"  # greedy outputs, reused across runs
    if task not in outputs and cached.exists():
        outputs[task] = json.loads(cached.read_text())
    tr, outs = generate_traces(gen, heads[kind], ids, settings.max_new_tokens, progress, outputs.get(task))
    if task not in outputs:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(outs))
    outputs[task] = outs
    traces[(kind, task)] = tr
    progress.console.print(f"traces {kind}/{task}: {len(tr)} prompts in {time.perf_counter() - t0:.0f} s")
    return tr


if __name__ == "__main__":
    main()
