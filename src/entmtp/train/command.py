"""`entmtp train-heads` and `entmtp eval-heads`: arguments and the runs (the CLI registers them and names
the default training data directory).

    entmtp train-heads --kind medusa|hydra --out DIR [--stages gen,train,eval] ...
    entmtp eval-heads HEADS [--against shipped|none|DIR] [--out DIR] ...

`train_settings_from_args` is the one place that turns the arguments into `train_heads`' settings objects: a
new setting is a field of its settings class, its argument here, and one line there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..heads import load_heads
from ..model import DTYPES, load_model
from ..prompts import FOUR_TASKS, TASKS
from ..shipped import HEAD_KINDS, heads_path, shipped_heads_dir
from .evaluate import DEFAULT_TREES, EVAL_TASKS, evaluate_heads, plot_learning_curve, write_report
from .pipeline import EvalSettings, HeadsSettings, train_heads
from .shards import GenSettings
from .trainer import LOG, LOSSES, PRECISIONS, TrainSettings

# ---- arguments ---------------------------------------------------------------------------------------


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="Hugging Face model id or local path (default: embedded SmolLM2)"
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=list(DTYPES), help="base model dtype (default bfloat16)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", required=True, choices=list(HEAD_KINDS))
    p.add_argument("--out", required=True, help="output directory: heads, checkpoints, log, eval report")
    _model_args(p)
    p.add_argument("--stages", default="gen,train,eval", help="comma list of gen, train, eval (default: all)")
    _gen_arguments(p)
    _heads_arguments(p)
    _optimiser_arguments(p)
    p.add_argument("--overwrite", action="store_true", help="replace heads / checkpoints already in --out")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--init",
        default=None,
        help="start from these heads instead of random ones: medusa | hydra (shipped) | a heads directory",
    )
    _eval_options(p, prefix="eval-")
    p.add_argument(
        "--gen-time-limit", type=float, default=None, help="seconds: start no new data shard after"
    )
    p.add_argument(
        "--time-limit", type=float, default=None, help="seconds of training: fewer steps if needed"
    )
    p.add_argument("--no-progress", action="store_true")


def _gen_arguments(p: argparse.ArgumentParser) -> None:
    """Prompt sources and `GenSettings`."""
    g = GenSettings
    p.add_argument(
        "--data-dir",
        default=None,
        help="training prompt directories (holding train/ and gsm8k/), comma-separated (default %(default)s)",
    )
    p.add_argument("--prompts", default=None, help="JSONL/JSON prompt file instead of --data-dir")
    p.add_argument(
        "--distill-dir", default=None, help="generated data directory (default OUT/distill); reused"
    )
    p.add_argument(
        "--num-prompts", type=int, default=g.num_prompts, help=f"training prompts (default {g.num_prompts})"
    )
    p.add_argument("--max-new-tokens", type=int, default=g.max_new_tokens, help="response length cap")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=g.max_prompt_tokens, help="longer prompts are skipped"
    )
    p.add_argument(
        "--sample-fraction", type=float, default=g.sample_fraction, help="responses sampled at T=0.7"
    )
    p.add_argument("--top-k", type=int, default=g.top_k, help="soft targets stored per position")
    p.add_argument(
        "--val-fraction", type=float, default=g.val_fraction, help="prompts held out for validation"
    )
    p.add_argument(
        "--both-answers",
        action="store_true",
        help="answer every prompt twice, greedy and sampled at T=0.7 (instead of --sample-fraction)",
    )
    p.add_argument(
        "--shard-size", type=int, default=g.shard_size, help="sequences (prompts, or answers) per data shard"
    )
    p.add_argument(
        "--gen-batch-size", type=int, default=None, help="generation batch (default 32 CPU, 128 CUDA)"
    )


def _heads_arguments(p: argparse.ArgumentParser) -> None:
    """`HeadsSettings`."""
    h = HeadsSettings
    p.add_argument("--num-heads", type=int, default=h.num_heads)
    p.add_argument("--num-layers", type=int, default=h.num_layers)
    p.add_argument("--head-arch", default=h.head_arch, choices=["mlp", "prefix-mlp"], help="hydra only")
    p.add_argument(
        "--own-lm-head", action="store_true", help="a vocab projection per head instead of sharing"
    )
    p.add_argument("--save-dtype", default=h.save_dtype, choices=list(DTYPES))
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=h.draft_vocab,
        help="draft from the N most frequent tokens (0: all)",
    )
    p.add_argument(
        "--max-draft-vocab",
        type=int,
        default=h.max_draft_vocab,
        help="with --init, the draft vocabulary is the old one plus the new data's --draft-vocab most frequent "
        "tokens; cap it at M, keeping the tokens most frequent in the new data (0: no cap)",
    )


def _optimiser_arguments(p: argparse.ArgumentParser) -> None:
    """`TrainSettings`, and the seed of the data, the windows and the new heads."""
    t = TrainSettings
    p.add_argument("--steps", type=int, default=t.steps)
    p.add_argument("--batch-size", type=int, default=t.batch_size, help="windows per step")
    p.add_argument("--window", type=int, default=t.window, help="positions per window")
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--loss", default=t.loss, choices=list(LOSSES))
    p.add_argument("--warmup", type=float, default=t.warmup, help="fraction of steps of linear warm-up")
    p.add_argument("--eval-every", type=int, default=t.eval_every, help="steps between validation runs")
    p.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every)
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument(
        "--precision",
        default=t.precision,
        choices=list(PRECISIONS),
        help="the heads' matmuls in training: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32",
    )


def _eval_options(p: argparse.ArgumentParser, prefix: str = "", tasks: tuple[str, ...] = FOUR_TASKS) -> None:
    """`EvalSettings`: ``--eval-*`` for train-heads, unprefixed for eval-heads."""
    e = EvalSettings
    p.add_argument(
        f"--{prefix}prompts" if prefix else "--num-prompts",
        dest="eval_prompts",
        type=int,
        default=e.prompts,
        help=f"prompts per task (default {e.prompts})",
    )
    p.add_argument(
        f"--{prefix}max-new-tokens", dest="eval_max_new_tokens", type=int, default=e.max_new_tokens
    )
    p.add_argument(
        f"--{prefix}trees",
        dest="eval_trees",
        default=",".join(DEFAULT_TREES),
        help="the last one's tokens/s is compared with the baseline's (default: the published mc_sim_7b_63 "
        "and tree_8, what generate uses for heads without a profile)",
    )
    p.add_argument(
        f"--{prefix}tasks",
        dest="eval_tasks",
        default=",".join(tasks),
        help=f"comma list of {', '.join(TASKS)} (default {','.join(tasks)})",
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
    _model_args(p)
    _eval_options(p, tasks=EVAL_TASKS)
    p.add_argument("--no-progress", action="store_true")


# ---- settings from arguments -------------------------------------------------------------------------


def _csv(value: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in value.split(",") if s.strip())


def eval_settings_from_args(args) -> EvalSettings:
    return EvalSettings(
        prompts=args.eval_prompts,
        max_new_tokens=args.eval_max_new_tokens,
        trees=_csv(args.eval_trees),
        tasks=_csv(args.eval_tasks),
    )


def train_settings_from_args(args) -> dict:
    """The settings objects of `train_heads` (its keyword arguments) from train-heads' arguments."""
    gen = GenSettings(
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        sample_fraction=args.sample_fraction,
        both_answers=args.both_answers,
        top_k=args.top_k,
        val_fraction=args.val_fraction,
        shard_size=args.shard_size,
        seed=args.seed,
    )
    training = TrainSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        window=args.window,
        lr=args.lr,
        loss=args.loss,
        warmup=args.warmup,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        precision=args.precision,
    )
    heads = HeadsSettings(
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        head_arch=args.head_arch,
        share_lm_head=not args.own_lm_head,
        draft_vocab=args.draft_vocab,
        max_draft_vocab=args.max_draft_vocab,
        save_dtype=args.save_dtype,
    )
    return {
        "gen_settings": gen,
        "train_settings": training,
        "heads_settings": heads,
        "eval_settings": eval_settings_from_args(args),
    }


# ---- the runs ----------------------------------------------------------------------------------------


def _setup(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def run_train(args) -> int:
    settings = train_settings_from_args(args)  # bad settings fail before torch is touched
    _setup(args)
    summary = train_heads(
        args.kind,
        args.out,
        model=args.model,
        stages=args.stages,
        data_dir=args.data_dir,
        prompts_file=args.prompts,
        distill_dir=args.distill_dir,
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
    model, tokenizer = load_model(
        args.model or heads.config.base_model or None, dtype=args.dtype, device=args.device
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
    )
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
