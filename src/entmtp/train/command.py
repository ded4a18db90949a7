"""`entmtp train-heads` and `entmtp eval-heads`: their parsers (with the default training data directory) and
the runs.

    entmtp train-heads --kind medusa|hydra --out DIR [--stages gen,train,eval] ...
    entmtp eval-heads HEADS [--against shipped|none|DIR] [--out DIR] ...

The settings classes' fields are the flags (settings.py): a new setting is a field declared with `setting`
in its class (GenSettings, TrainSettings, HeadsSettings, EvalSettings), and nothing else.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..engine_args import add_model_arguments, setup_torch
from ..heads import load_heads
from ..machine import auto_dtype
from ..model import DTYPES, load_model
from ..prompts import TASKS
from ..settings import add_arguments, from_args
from ..shipped import HEAD_KINDS, heads_path, shipped_heads_dir
from .evaluate import EVAL_TASKS, evaluate_heads, plot_learning_curve, write_report
from .pipeline import EvalSettings, HeadsSettings, TrainJob, train_heads
from .prompt_sources import default_data_dirs
from .shards import GenSettings
from .trainer import LOG, TrainSettings

# ---- arguments ---------------------------------------------------------------------------------------

# train-heads' base model: batched generation and teacher-forced passes, where emulated bf16 is slow
TRAIN_DTYPE = dict(
    default="auto",
    choices=["auto", *DTYPES],
    help="base model dtype for generation and the teacher-forced pass: auto (default) = bfloat16 on CUDA and "
    "on a CPU with native bf16 (avx512_bf16, AMX), float32 on other CPUs",
)


# eval-heads' base model: tokens per step barely depends on it, the run's length does (emulated bf16 ran the
# teacher-forced pass ~6x slower than float32 on a 2-core AVX2-only EPYC)
EVAL_DTYPE = dict(
    default="auto",
    choices=["auto", *DTYPES],
    help="base model dtype: auto (default) = bfloat16 on CUDA and on a CPU with native bf16 (avx512_bf16, "
    "AMX), float32 on other CPUs",
)


def register(sub) -> None:
    """`train-heads` and `eval-heads` on the subcommand parsers `sub`."""
    tr = sub.add_parser("train-heads", help="train Medusa or Hydra heads by self-distillation")
    add_train_arguments(tr)
    # --data-dir's default: the training prompts shipped in the package (assets/training), plus the project's
    # own prompts where scripts/build_training_prompts.py has built data/train/ in the working directory
    tr.set_defaults(func=run_train, data_dir=",".join(default_data_dirs()))
    ev = sub.add_parser(
        "eval-heads",
        help="evaluate heads per task and dev category against the shipped ones (accuracy, tokens per step, tokens/s)",
    )
    add_eval_arguments(ev)
    ev.set_defaults(func=run_eval)


def _model_args(p: argparse.ArgumentParser, **changes) -> None:
    add_model_arguments(
        p,
        ("model", "dtype", "device", "threads"),
        model=dict(help="Hugging Face model id or local path (default: embedded SmolLM2)"),
        **changes,
    )


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", required=True, choices=list(HEAD_KINDS))
    p.add_argument("--out", required=True, help="output directory: heads, checkpoints, log, eval report")
    _model_args(p, dtype=TRAIN_DTYPE)
    p.add_argument("--stages", default="gen,train,eval", help="comma list of gen, train, eval (default: all)")
    _prompt_arguments(p)
    add_arguments(p, GenSettings)
    p.add_argument(
        "--gen-batch-size", type=int, default=None, help="generation batch (default 32 CPU, 128 CUDA)"
    )
    add_arguments(p, HeadsSettings)
    add_arguments(p, TrainSettings, skip=("seed",))  # one --seed: GenSettings' (data, windows, new heads)
    p.add_argument("--overwrite", action="store_true", help="replace heads / checkpoints already in --out")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--init",
        default=None,
        help="start from these heads instead of random ones: medusa | hydra (shipped) | a heads directory "
        "(they read the layer the data stores: heads of another layer start from their weights there)",
    )
    add_arguments(p, EvalSettings, prefix="eval-")
    p.add_argument(
        "--gen-time-limit", type=float, default=None, help="seconds: start no new data shard after"
    )
    p.add_argument(
        "--time-limit", type=float, default=None, help="seconds of training: fewer steps if needed"
    )
    p.add_argument("--no-progress", action="store_true")


def _prompt_arguments(p: argparse.ArgumentParser) -> None:
    """Where the training prompts come from, and where the generated data goes."""
    p.add_argument(
        "--data-dir",
        default=None,
        help="training prompt directories (holding train/ and gsm8k/), comma-separated; `shipped` = the 24,735 "
        "prompts shipped with entmtp (assets/training, never the benchmark sets) (default %(default)s)",
    )
    p.add_argument("--prompts", default=None, help="JSONL/JSON prompt file instead of --data-dir")
    p.add_argument(
        "--distill-dir",
        default=None,
        help="generated data directory (default OUT/distill); reused. --stages train also takes several, "
        "comma-separated, made apart (say instruction prompts' and GSM8K's) and trained on as one",
    )
    p.add_argument(
        "--answers-dir",
        default=None,
        help="keep the base model's answers here (2 bytes a token; a directory that outlives the machine): "
        "shards whose answers are stored there are only teacher-forced from them, not generated again",
    )


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "heads_dir", help="trained heads: a directory (config.json + weights), or medusa | hydra (shipped)"
    )
    p.add_argument(
        "--against",
        default="shipped",
        help="heads to compare with, measured on the same prompts in the same run: shipped (the shipped heads "
        "of the same kind; default), none, or a heads directory",
    )
    p.add_argument("--split", default="test", choices=["calib", "test"], help="prompt split (default test)")
    p.add_argument("--out", default=None, help="report directory (default HEADS_DIR/eval)")
    _model_args(p, dtype=EVAL_DTYPE)
    tasks = f"comma list of {', '.join(TASKS)} (default {','.join(EVAL_TASKS)})"
    add_arguments(  # train-heads' --eval-* settings, unprefixed here
        p,
        EvalSettings,
        prefix="eval-",
        changes={
            "prompts": dict(flag="--num-prompts"),
            "max_new_tokens": dict(flag="--max-new-tokens"),
            "trees": dict(flag="--trees"),
            "tasks": dict(flag="--tasks", default=EVAL_TASKS, help=tasks),
            "sampling": dict(flag="--sampling"),
            "method": dict(flag="--method"),
        },
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the per-task results still print)"
    )


# ---- settings from arguments -------------------------------------------------------------------------


def eval_settings_from_args(args) -> EvalSettings:
    return from_args(EvalSettings, args, prefix="eval-")


def train_settings_from_args(args) -> dict:
    """The settings objects of a `TrainJob` from train-heads' arguments."""
    return {
        "gen_settings": from_args(GenSettings, args),
        "train_settings": from_args(TrainSettings, args),
        "heads_settings": from_args(HeadsSettings, args),
        "eval_settings": eval_settings_from_args(args),
    }


# ---- the runs ----------------------------------------------------------------------------------------


def _setup(args) -> None:
    setup_torch(args)


def run_train(args) -> int:
    settings = train_settings_from_args(args)  # bad settings fail before torch is touched
    _setup(args)
    job = TrainJob(
        model=args.model,
        stages=args.stages,
        data_dir=args.data_dir,
        prompts_file=args.prompts,
        distill_dir=args.distill_dir,
        answers_dir=args.answers_dir,
        **settings,
        gen_batch_size=args.gen_batch_size,
        device=args.device,
        dtype=args.dtype,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        gen_time_limit=args.gen_time_limit,
        train_time_limit=args.time_limit,
        init=args.init,
    )
    summary = train_heads(args.kind, args.out, job)
    brief = {k: v for k, v in summary.items() if k != "eval"}
    print(json.dumps(brief, indent=2))
    if "eval" in summary:
        print(f"evaluation written to {Path(args.out) / 'eval'}")
    return 0


def run_eval(args) -> int:
    settings = eval_settings_from_args(args)  # an unknown task fails before any heads or model load
    _setup(args)
    path = heads_path(args.heads_dir)
    heads = load_heads(path)
    against = None
    if args.against == "shipped":
        same_kind = shipped_heads_dir(heads.config.kind)
        if (same_kind / "config.json").exists() and same_kind.resolve() != path.resolve():
            against = same_kind
    elif args.against != "none":
        against = heads_path(args.against)
    baseline = load_heads(against) if against is not None else None
    dtype = auto_dtype(args.device) if args.dtype == "auto" else args.dtype
    model, tokenizer = load_model(
        args.model or heads.config.base_model or None, dtype=dtype, device=args.device
    )
    report = evaluate_heads(
        model,
        tokenizer,
        heads,
        tasks=settings.tasks,
        split=args.split,
        num_prompts=settings.prompts,
        max_new_tokens=settings.max_new_tokens,
        trees=settings.trees,
        baseline=baseline,
        baseline_name=f"shipped {heads.config.kind}" if args.against == "shipped" else str(args.against),
        progress=not args.no_progress,
        sampling=settings.sampling,
        method=settings.method,
    )
    report["settings"]["dtype"] = dtype  # the base model's and the heads' (evaluate_heads casts them to it)
    shipped = args.heads_dir in HEAD_KINDS  # the package's own folder: write the report elsewhere
    out = (
        Path(args.out)
        if args.out
        else (Path("runs") / f"eval-{args.heads_dir}" if shipped else path / "eval")
    )
    js, md = write_report(report, out)
    log = path / LOG
    if log.is_file() and not shipped:
        plot_learning_curve(log, path / "learning_curve.png")
    print(md.read_text(encoding="utf-8"))
    print(f"written: {js}, {md}")
    return 0
