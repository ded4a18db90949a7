"""`entmtp calibrate`: its parser and the run."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from ..accept import Rule
from ..console import wide_console
from ..engine_args import setup_torch
from ..errors import EntMTPError
from ..prompts import CALIB, FOUR_TASKS, TASKS, load_prompt_file, load_prompts
from ..scheduler.profiles import PROFILE_TASKS, ModeProfile, Profile, load_profile
from ..settings import add_arguments, from_args
from .calibrate import CalibrationSettings


def register(sub) -> None:
    """`calibrate` on the subcommand parsers `sub`."""
    from ..engine_args import add_model_arguments

    c = sub.add_parser(
        "calibrate", help="build a task's scheduler profile (tree bank, frontiers, thresholds)"
    )
    add_calibrate_arguments(c)
    add_model_arguments(c)
    c.set_defaults(func=run_calibrate)


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", default="hydra", help="medusa | hydra (shipped) | a heads directory")
    p.add_argument(
        "--task",
        default="mixed",
        help=f"{' | '.join(PROFILE_TASKS)} (calibration split: the first {CALIB} prompts of each) "
        "| a JSONL file with a 'prompt' or 'turns' field",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=CALIB,
        help=f"calibration prompts (default {CALIB}; mixed takes an equal share of the four tasks)",
    )
    p.add_argument(
        "--out", default=None, help="profile JSON to write (default runs/profiles/HEADS-TASK.json)"
    )
    p.add_argument(
        "--latency-only",
        action="store_true",
        help="re-measure only the hardware side of --profile here, keeping its calibration traces",
    )
    p.add_argument(
        "--profile", default=None, help="with --latency-only, --retune or --retrace: the profile to update"
    )
    p.add_argument(
        "--retune",
        action="store_true",
        help="re-derive --profile from its stored traces and latencies (after an entmtp upgrade; no decoding)",
    )
    p.add_argument(
        "--retrace",
        action="store_true",
        help="re-derive --profile for changed heads of the same kind and depth (another draft vocabulary, "
        "retrained weights): its stored generations teacher-forced through them, then retuned (no decoding)",
    )
    add_arguments(p, CalibrationSettings)  # max tokens, latency prompts, tokens, repeats, seconds per tree
    p.add_argument(
        "--greedy-only",
        action="store_true",
        help="skip the T=0.7 sections, lossless sampling and typical acceptance (their sampled generations "
        "triple the decoding time)",
    )
    p.add_argument("--no-progress", action="store_true")


def calibration_prompts(task: str, n: int) -> list[str]:
    if task == "mixed":
        share = max(1, n // len(FOUR_TASKS))
        return [p for t in FOUR_TASKS for p in load_prompts(t, "calib", n=share)]
    if task in TASKS:
        if n > CALIB:
            raise EntMTPError(
                f"--num-prompts {n}: a task's calibration split holds {CALIB} prompts (the rest is "
                f"the test split, never calibrated on); use <= {CALIB} or a prompt file"
            )
        return load_prompts(task, "calib", n=n)
    if Path(task).suffix == ".jsonl" or Path(task).exists():
        return load_prompt_file(task)[:n]
    raise EntMTPError(f"unknown task {task!r}: use {', '.join(PROFILE_TASKS)} or a .jsonl prompt file")


def run_calibrate(args) -> int:
    from ..model import load_model
    from ..shipped import resolve_heads
    from .calibrate import retrace, retune
    from .traces import save_traces

    _check_arguments(args)
    setup_torch(args)
    old = load_profile(args.profile) if args.latency_only or args.retune or args.retrace else None
    texts = None if old else calibration_prompts(args.task, args.num_prompts)  # bad tasks fail before loading
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, pack=not args.no_pack)
    heads = resolve_heads(args.heads, model)  # bound, moved and packed as the engine runs them
    if heads is None:
        raise EntMTPError("calibration needs heads: pass --heads medusa, hydra or a heads directory")
    settings = _settings(args)
    if args.retune:
        old.check(model, heads, warn_hardware=False)
        _write(retune(old, heads, settings).save(old.path))
        return 0
    if args.retrace:
        old.check_model(model)
        with Progress(disable=args.no_progress) as progress:
            prompts = _traced_prompts(old, tokenizer)
            profile, greedy, sampled = retrace(old, model, tokenizer, heads, prompts, progress)
        profile = save_traces(profile, old.path, greedy, sampled)  # the sidecar first, then the JSON
        _write(retune(profile, heads, settings).save(old.path), traces=True)
        return 0
    with Progress(disable=args.no_progress) as progress:
        profile, greedy, sampled = _calibrate(args, model, tokenizer, heads, settings, old, texts, progress)
    out = Path(
        args.out or (old.path if old else f"runs/profiles/{Path(args.heads).name}-{profile.task}.json")
    )
    _write(save_traces(profile, out, greedy, sampled).save(out), traces=True)
    return 0


def _traced_prompts(profile: Profile, tokenizer) -> list[list[int]] | None:
    """The token ids of the calibration prompts `profile` was made from, when its task is a shipped one (what
    a retrace decodes again where the traces hold no generations); None for a prompt file's task."""
    from ..model import encode_prompt

    if profile.task not in PROFILE_TASKS:
        return None
    return [
        encode_prompt(tokenizer, t) for t in calibration_prompts(profile.task, profile.calibration.prompts)
    ]


def _check_arguments(args) -> None:
    """Refuse impossible settings before anything loads."""
    flags = [f for f in ("latency_only", "retune", "retrace") if getattr(args, f)]
    if len(flags) > 1:
        named = " and ".join("--" + f.replace("_", "-") for f in flags)
        raise EntMTPError(f"{named} are separate runs: pass one of them")
    if flags and not args.profile:
        flag = "--" + flags[0].replace("_", "-")
        raise EntMTPError(f"{flag} updates an existing profile: pass it with --profile FILE")
    if args.tree_seconds <= 0:
        raise EntMTPError(f"--tree-seconds must be > 0, got {args.tree_seconds}")
    if (
        min(args.num_prompts, args.latency_prompts, args.latency_repeats) < 1
        or min(args.max_new_tokens, args.latency_tokens) < 4
    ):
        raise EntMTPError(
            "--num-prompts, --latency-prompts and --latency-repeats must be >= 1, --max-new-tokens and "
            "--latency-tokens >= 4"
        )


def _settings(args):
    return from_args(CalibrationSettings, args)


def _calibrate(args, model, tokenizer, heads, settings, old, texts, progress):
    """(profile, greedy traces, {rule: sampled traces}): a new calibration of `texts`, or with `old` (for
    --latency-only) its traces re-measured on this machine."""
    from ..model import encode_prompt
    from .calibrate import add_sampled, build_profile, generation_engine, typical_union
    from .traces import SAMPLED, generate_traces, load_traces

    log = progress.console.print
    settings_of = {s.rule: s for s in SAMPLED}
    if old is not None:
        old.check(model, heads, warn_hardware=False)
        ids, task, name = old.calibration.latency_prompt_ids, old.task, old.heads.name
        greedy = load_traces(old)
        sampled = {m: load_traces(old, m) for m in old.modes if Rule(m).sampled}
        settings_of.update({m: old.mode(m).sampling for m in sampled})
    else:
        task = args.task if args.task in PROFILE_TASKS else Path(args.task).stem
        ids, name = [encode_prompt(tokenizer, t) for t in texts], Path(args.heads).name
        greedy, sampled = None, {}
    profile, greedy = build_profile(
        model,
        tokenizer,
        heads,
        heads_name=name,
        task=task,
        prompts=ids,
        settings=settings,
        progress=progress,
        traces=greedy,
        log=log,
    )
    if old is not None:  # what the traces were made from stays as it was
        run = replace(
            profile.calibration,
            prompts=old.calibration.prompts,
            max_new_tokens=old.calibration.max_new_tokens,
        )
        profile = replace(profile, calibration=run)
    elif not args.greedy_only:
        engine = generation_engine(model, tokenizer, heads)
        union = typical_union(profile, heads)
        for sampling in SAMPLED:
            sampled[sampling.rule], _ = generate_traces(
                engine, heads, ids, settings.max_new_tokens, progress, sampling=sampling, union=union
            )
    for rule, traces in sampled.items():
        profile = add_sampled(profile, heads, traces, settings_of[rule], settings, log=log)
    return profile, greedy, sampled


def _write(profile: Profile, traces: bool = False) -> None:
    """Draw the saved profile's frontiers beside it and print its tables and what was written."""
    from .plots import plot_profile
    from .traces import sidecar_path

    png = plot_profile(profile, profile.path.with_suffix(".png"))
    print_profile(profile)
    side = f", {sidecar_path(profile.path)}" if traces else ""
    print(f"wrote {profile.path}{side} and {png}")


FRONTIER_COLUMNS = (
    "tree",
    "nodes",
    "depth",
    "1+accepted (all pos.)",
    "tokens/step (own)",
    "ms/step",
    "tokens/s",
    "measured tok/s",
    "bank",
)


def print_profile(profile: Profile) -> None:
    console = wide_console()
    console.print(_frontier_table(profile))
    for mode, section in profile.modes.items():
        console.print(_replay_table(mode, section))
        if section.acceptance_check:
            check = ", ".join(
                f"{c.depth}: {c.predicted:.3f} vs {c.measured:.3f}" for c in section.acceptance_check
            )
            console.print(
                f"{mode}: P(accepted >= depth) on held-out positions, predicted vs measured: {check}"
            )
        console.print(f"{mode}: recommended policy {section.measured_on.recommended_policy}")


def _frontier_table(profile: Profile) -> Table:
    """The greedy section's measured frontier trees, the published default and plain decoding."""
    m, lat = profile.mode("greedy"), profile.latency.trees
    table = Table(
        title=f"{profile.heads.name} / {profile.task}: frontier trees measured here "
        f"(tokens/s = simulated tokens/step / measured ms per step)"
    )
    for col in FRONTIER_COLUMNS:
        table.add_column(col, justify="right")
    bank = {e.name for e in m.measured_on.throughput_frontier}
    for e in m.acceptance_frontier:
        if e.name not in lat:
            continue
        ms, tps = lat[e.name].ms_per_step, e.tokens_per_step_simulated
        mark = "EntMTP*" if e.name == m.measured_on.best else ("yes" if e.name in bank else "")
        table.add_row(
            e.name,
            str(e.nodes),
            str(e.depth),
            f"{1 + e.mean_accepted_all_positions:.2f}",
            f"{tps:.2f}",
            f"{ms:.1f}",
            f"{tps * 1000 / ms:.1f}",
            f"{lat[e.name].measured_tokens_per_second:.1f}",
            mark,
        )
    for name, r in m.measured_on.reference.items():
        table.add_row(
            name,
            str(r.nodes),
            "",
            "",
            f"{r.tokens_per_step_simulated:.2f}",
            f"{r.ms_per_step:.1f}",
            f"{r.tokens_per_second:.1f}",
            f"{lat[name].measured_tokens_per_second:.1f}",
            "default",
        )
    plain = (f"{profile.latency.plain_ms_per_step:.1f}", f"{m.measured_on.plain_tokens_per_second:.1f}")
    table.add_row("plain", "0", "", "", "1.00", *plain, f"{lat['none'].measured_tokens_per_second:.1f}", "")
    return table


def _replay_table(mode: str, section: ModeProfile) -> Table:
    """Every policy replayed on the section's traces, against EntMTP*, with its tuned settings."""
    rt = Table(
        title=f"{mode}: policies replayed on the calibration traces (decode steps, measured latencies)"
    )
    for col in ("policy", "tokens/s", "tokens/step", "vs EntMTP*", "settings"):
        rt.add_column(col, justify="right")
    base = section.measured_on.replay["static"].tokens_per_second
    for name, r in section.measured_on.replay.items():
        th = getattr(section.measured_on.thresholds, name, None)
        setting = ", ".join(f"{k}={v}" for k, v in th.to_json().items() if k != "window") if th else ""
        if name == "static":
            setting = f"EntMTP* = {section.measured_on.best}"
        rt.add_row(
            name,
            f"{r.tokens_per_second:.1f}",
            f"{r.tokens_per_step:.2f}",
            f"{r.tokens_per_second / base:.3f}x",
            setting[:80],
        )
    return rt
