"""``train_heads``: data generation, training and evaluation in one call; and the two CLI commands.

    entmtp train-heads --kind medusa|hydra --out DIR [--stages gen,train,eval] ...
    entmtp eval-heads HEADS [--against shipped|none|DIR] [--out DIR] ...

Directory layout of ``--out``: ``config.json`` + ``heads.safetensors`` (the final heads, via ``save_heads``),
``checkpoints/`` (resumable state), ``train_log.jsonl`` (the learning curve), ``learning_curve.png``,
``eval/eval.json`` + ``eval/eval.md``; the distillation data goes to ``--distill-dir`` (default ``OUT/distill``;
point several runs at one directory to train Medusa and Hydra heads on the same data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from ..errors import DataError, HeadsError
from ..heads import (
    CONFIG_FILE,
    Heads,
    HeadsConfig,
    frequent_tokens,
    load_heads,
    random_heads,
    save_heads,
)
from ..heads.hydra import heads_class
from ..model import DTYPES, EMBEDDED, load_model
from ..prompts import FOUR_TASKS, TASKS
from ..shipped import HEAD_KINDS, heads_path, shipped_heads_dir
from .data import DEFAULT_DATA_DIR, GenSettings, Manifest, generate_data, load_split, load_training_prompts
from .evaluate import DEFAULT_TREES, EVAL_TASKS, evaluate_heads, plot_learning_curve, write_report
from .trainer import LOG, LOSSES, TrainSettings, check_output_dir, train

STAGES = ("gen", "train", "eval")


def _stages(stages) -> tuple[str, ...]:
    items = tuple(s.strip() for s in (stages.split(",") if isinstance(stages, str) else stages) if s.strip())
    if items in ((), ("all",)):
        return STAGES
    bad = [s for s in items if s not in STAGES]
    if bad:
        raise DataError(f"unknown stage(s) {', '.join(bad)}: use some of {', '.join(STAGES)} (or all)")
    return tuple(s for s in STAGES if s in items)


def train_heads(
    kind: str,
    out_dir: str | os.PathLike[str],
    *,
    model: str | None = None,  # HF id or path; None: the embedded SmolLM2-135M-Instruct
    base: tuple | None = None,  # an already loaded (model, tokenizer), instead of `model`
    stages: str | tuple[str, ...] = STAGES,  # any of gen, train, eval, in that order
    data_dir: str | os.PathLike[str] | None = None,  # training prompt sources (default: ../shared/data)
    prompts_file: str | os.PathLike[str] | None = None,  # JSONL/JSON prompts instead of data_dir
    distill_dir: str | os.PathLike[str] | None = None,  # generated data (default: OUT/distill)
    num_prompts: int = GenSettings.num_prompts,
    max_new_tokens: int = GenSettings.max_new_tokens,
    max_prompt_tokens: int = GenSettings.max_prompt_tokens,
    sample_fraction: float = GenSettings.sample_fraction,
    top_k: int = GenSettings.top_k,
    val_fraction: float = GenSettings.val_fraction,
    shard_size: int = GenSettings.shard_size,
    gen_batch_size: int | None = None,  # None: 32 on CPU (~150 tok/s here), 128 on CUDA
    num_heads: int = 4,  # mc_sim_7b_63, the default tree, is 4 deep
    num_layers: int = 1,  # residual blocks per head; both papers find one enough
    head_arch: str = "mlp",  # hydra: "mlp" or "prefix-mlp" (Hydra++)
    share_lm_head: bool = True,  # a 135M model cannot afford a V x H projection per head
    steps: int = TrainSettings.steps,
    batch_size: int = TrainSettings.batch_size,
    window: int = TrainSettings.window,
    lr: float = TrainSettings.lr,
    loss: str = TrainSettings.loss,
    warmup: float = TrainSettings.warmup,
    eval_every: int = TrainSettings.eval_every,
    checkpoint_every: int = TrainSettings.checkpoint_every,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",  # the frozen base model's dtype; the heads train in float32
    save_dtype: str = "float32",  # dtype of the saved heads
    resume: bool = False,
    overwrite: bool = False,
    eval_prompts: int = 10,  # calibration prompts per benchmark task
    eval_max_new_tokens: int = 128,
    eval_trees: tuple[str, ...] = DEFAULT_TREES,
    eval_tasks: tuple[str, ...] = FOUR_TASKS,
    progress: bool = True,
    stop_after: int | None = None,  # stop training at this step (a resumable checkpoint), as if interrupted
    draft_vocab: int = 16384,  # heads draft from this many most frequent tokens (0: all); see set_draft_vocab
    max_draft_vocab: int = 0,  # with init: cap the merged vocabulary at this many tokens (0: no cap)
    gen_time_limit: float | None = None,  # seconds: start no new data shard after this (train on what exists)
    train_time_limit: float | None = None,  # seconds: plan fewer steps (shorter lr schedule) if needed
    init: str | os.PathLike[str] | None = None,  # start from these heads' weights (same kind and shape)
) -> dict:
    """Generate self-distillation data, train Medusa/Hydra heads on it, save and evaluate them.

    Returns a summary dict: {"distill": manifest summary, "train": TrainResult fields, "eval": report}.
    """
    stages = _stages(stages)
    if draft_vocab < 0:
        raise DataError(f"draft_vocab must be >= 0 (0: draft from the whole vocabulary), got {draft_vocab}")
    if max_draft_vocab < 0:
        raise DataError(f"max_draft_vocab must be >= 0 (0: no cap), got {max_draft_vocab}")
    for name, limit in (("gen_time_limit", gen_time_limit), ("train_time_limit", train_time_limit)):
        if limit is not None and not limit > 0:
            raise DataError(f"{name} must be a positive number of seconds, got {limit}")
    out = Path(out_dir)
    distill = Path(distill_dir) if distill_dir is not None else out / "distill"
    if save_dtype not in DTYPES:
        raise HeadsError(f"save_dtype {save_dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    gen_settings = GenSettings(
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        sample_fraction=sample_fraction,
        top_k=top_k,
        val_fraction=val_fraction,
        shard_size=shard_size,
        seed=seed,
    )
    train_settings = TrainSettings(
        steps=steps,
        batch_size=batch_size,
        window=window,
        lr=lr,
        loss=loss,
        warmup=warmup,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        seed=seed,
    )
    # Fail before any slow work: output directory, prompt sources, stage inputs.
    if "train" in stages:
        check_output_dir(out, overwrite=overwrite, resume=resume)
    elif "eval" in stages and not (out / CONFIG_FILE).exists():
        raise HeadsError(
            f"no heads in {out} to evaluate: run the train stage first (or give the heads directory)"
        )
    prompts, sources = (
        load_training_prompts(data_dir, prompts_file, with_sources=True) if "gen" in stages else (None, None)
    )
    if "train" in stages and "gen" not in stages:
        Manifest.read(distill)  # raises a clear DataError when the data is missing

    if base is None:
        model_obj, tokenizer = load_model(model, dtype=dtype, device=device)
    else:
        model_obj, tokenizer = base
    base_name = model or (EMBEDDED if base is None else _name(model_obj))
    summary: dict = {}

    if "gen" in stages:
        batch = gen_batch_size or (128 if torch.device(device).type == "cuda" else 32)
        t0 = time.perf_counter()
        manifest = generate_data(
            model_obj,
            tokenizer,
            distill,
            prompts=prompts,
            sources=sources,
            settings=gen_settings,
            batch_size=batch,
            base_model=base_name,
            progress=progress,
            time_limit=gen_time_limit,
        )
        summary["distill"] = {
            "dir": str(distill),
            "train_positions": manifest.positions("train"),
            "val_positions": manifest.positions("val"),
            "shards": len(manifest.shards),
            "seconds": time.perf_counter() - t0,
        }

    heads = None
    if "train" in stages:
        manifest = Manifest.read(distill)
        if manifest.base_model != base_name:
            raise DataError(
                f"distillation data in {distill} was made by {manifest.base_model!r}, not {base_name!r}: "
                f"use another --distill-dir for this model"
            )
        config = HeadsConfig.for_model(
            model_obj,
            kind,
            num_heads,
            num_layers=num_layers,
            head_arch=head_arch,
            share_lm_head=share_lm_head,
            base_model=base_name,
        )
        init_vocab = None
        if init is not None:  # continue from trained heads (e.g. the shipped ones, on new data)
            heads = _init_heads(init, config, distill, seed)
            init_vocab = heads.draft_vocab  # the new data's draft vocabulary extends it (below)
            heads.set_draft_vocab(None)
        else:
            heads = random_heads(config, seed=seed)
            if not share_lm_head:
                heads.bind(model_obj).init_projections_from_base()
        result = train(
            model_obj,
            heads,
            distill,
            out,
            settings=train_settings,
            device=device,
            resume=resume,
            overwrite=overwrite,
            progress=progress,
            stop_after=stop_after,
            time_limit=train_time_limit,
        )
        summary["train"] = dataclasses.asdict(result)
        plot_learning_curve(out / LOG, out / "learning_curve.png")
        if result.stopped_early:
            return summary
        if draft_vocab:  # the tokens the base model itself writes most often (its distillation data)
            tokens = load_split(distill, "train", manifest).tokens
            counts = torch.bincount(tokens, minlength=model_obj.config.vocab_size)
            ids = frequent_tokens(counts, draft_vocab, keep=tokenizer.all_special_ids)
            if init_vocab is not None:  # what the --init heads could draft stays draftable (up to the cap)
                ids = torch.cat([ids, init_vocab.to(ids.device)]).unique()
            if max_draft_vocab and ids.numel() > max_draft_vocab:
                ids = cap_vocab(
                    ids, counts, max_draft_vocab, keep=tokenizer.all_special_ids, prefer=init_vocab
                )
            heads.set_draft_vocab(ids)
        heads.to(dtype=DTYPES[save_dtype])
        save_heads(heads, out, overwrite=overwrite)

    if "eval" in stages:
        if heads is None:
            heads = load_heads(out)
        heads.to(device=model_obj.device, dtype=model_obj.dtype)
        report = evaluate_heads(
            model_obj,
            tokenizer,
            heads,
            tasks=tuple(eval_tasks),
            num_prompts=eval_prompts,
            max_new_tokens=eval_max_new_tokens,
            trees=tuple(eval_trees),
            progress=progress,
        )
        write_report(report, out / "eval")
        summary["eval"] = report
    return summary


def cap_vocab(
    ids: torch.Tensor, counts: torch.Tensor, size: int, keep=(), prefer: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``size`` ids of ``ids`` [N] most frequent by ``counts`` [V], sorted. The ids of ``keep`` (special
    tokens) among them always stay; on ties (unseen tokens too) the ids in ``prefer`` come first, e.g. the
    vocabulary the heads already drafted from."""
    special = torch.isin(ids, torch.as_tensor(list(keep), dtype=torch.long))
    score = counts[ids].double()
    if prefer is not None:
        score += 0.5 * torch.isin(ids, prefer.to(ids.device)).double()
    score[special] = float("inf")
    return ids[score.topk(max(size, int(special.sum()))).indices].sort().values


def _init_heads(path, config: HeadsConfig, distill: Path, seed: int = 0) -> Heads:
    """Heads loaded from ``path`` to train further. Their architecture must be the one asked for, except
    that Hydra ``mlp`` heads may grow into Hydra++ (``prefix-mlp``): see `_add_prefix_layer`."""
    heads = load_heads(heads_path(path), dtype=torch.float32)
    have, want = heads.config, config
    upgrade = have.head_arch == "mlp" and want.head_arch == "prefix-mlp"
    fields = (
        "kind",
        "num_heads",
        "num_layers",
        "hidden_size",
        "vocab_size",
        "share_lm_head",
        "head_arch",
        "grounded",
    )
    diff = [
        f"{f}={getattr(have, f)!r} (asked {getattr(want, f)!r})"
        for f in fields
        if getattr(have, f) != getattr(want, f) and not (f == "head_arch" and upgrade)
    ]
    if diff:
        raise HeadsError(
            f"--init heads in {path} differ from the heads to train: {', '.join(diff)}; pass matching "
            "--kind/--num-heads/--num-layers/--head-arch (Hydra mlp heads may also start Hydra++ with "
            "--head-arch prefix-mlp), or drop --init to train from scratch"
        )
    if upgrade:
        scale = float(load_split(distill, "train").hidden.float().pow(2).mean(-1).sqrt().mean())
        heads = _add_prefix_layer(heads, config, scale, seed)
    return heads


def _add_prefix_layer(heads: Heads, config: HeadsConfig, scale: float, seed: int) -> Heads:
    """Hydra++ from trained Hydra ``mlp`` heads: the same heads behind a new prefix layer that starts as
    (nearly) the identity, so training begins from the old heads' accuracy instead of from noise.

    The layer's attention and MLP outputs start at zero (as fresh residual blocks do), which leaves its final
    RMSNorm: x -> scale * x / rms(x). With ``scale`` the mean RMS of the features the heads read (the base
    model's normed hidden states, whose RMS varies ~10% from token to token on SmolLM2), the heads see their
    old inputs up to that spread."""
    if config.head_dim == 0:
        raise HeadsError("Hydra++ from mlp heads needs the base model's attention geometry in the config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        new = heads_class(config)(config)  # the geometry is known: the prefix layer is built here
    missing, unexpected = new.load_state_dict(heads.state_dict(), strict=False)
    if unexpected or any(not k.startswith("prefix.") for k in missing):
        raise HeadsError(
            f"cannot carry mlp heads into prefix-mlp heads: missing {missing}, extra {unexpected}"
        )
    with torch.no_grad():
        new.prefix.self_attn.o_proj.weight.zero_()
        new.prefix.mlp.down_proj.weight.zero_()
        new.prefix.norm.weight.fill_(scale)
    new.set_draft_vocab(heads.draft_vocab)
    return new


def _name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


# ---- CLI ---------------------------------------------------------------------------------------------


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
    g, d, t = GenSettings, train_heads.__kwdefaults__, TrainSettings
    p.add_argument("--kind", required=True, choices=list(HEAD_KINDS))
    p.add_argument("--out", required=True, help="output directory: heads, checkpoints, log, eval report")
    _model_args(p)
    p.add_argument("--stages", default="gen,train,eval", help="comma list of gen, train, eval (default: all)")
    p.add_argument(
        "--data-dir",
        default=None,
        help=f"training prompt directories, comma-separated (default {DEFAULT_DATA_DIR} and, in a source "
        f"checkout, the project's data/)",
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
    p.add_argument("--shard-size", type=int, default=g.shard_size, help="prompts per data shard")
    p.add_argument(
        "--gen-batch-size", type=int, default=None, help="generation batch (default 32 CPU, 128 CUDA)"
    )
    p.add_argument("--num-heads", type=int, default=d["num_heads"])
    p.add_argument("--num-layers", type=int, default=d["num_layers"])
    p.add_argument("--head-arch", default="mlp", choices=["mlp", "prefix-mlp"], help="hydra only")
    p.add_argument(
        "--own-lm-head", action="store_true", help="a vocab projection per head instead of sharing"
    )
    p.add_argument("--steps", type=int, default=t.steps)
    p.add_argument("--batch-size", type=int, default=t.batch_size, help="windows per step")
    p.add_argument("--window", type=int, default=t.window, help="positions per window")
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--loss", default=t.loss, choices=list(LOSSES))
    p.add_argument("--warmup", type=float, default=t.warmup, help="fraction of steps of linear warm-up")
    p.add_argument("--eval-every", type=int, default=t.eval_every, help="steps between validation runs")
    p.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--overwrite", action="store_true", help="replace heads / checkpoints already in --out")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--init",
        default=None,
        help="start from these heads instead of random ones: medusa | hydra (shipped) | a heads directory",
    )
    _eval_options(p, prefix="eval-")
    p.add_argument(
        "--draft-vocab", type=int, default=16384, help="draft from the N most frequent tokens (0: all)"
    )
    p.add_argument(
        "--max-draft-vocab",
        type=int,
        default=0,
        help="with --init, the draft vocabulary is the old one plus the new data's --draft-vocab most frequent "
        "tokens; cap it at M, keeping the tokens most frequent in the new data (0: no cap)",
    )
    p.add_argument(
        "--gen-time-limit", type=float, default=None, help="seconds: start no new data shard after"
    )
    p.add_argument(
        "--time-limit", type=float, default=None, help="seconds of training: fewer steps if needed"
    )
    p.add_argument("--no-progress", action="store_true")


def _eval_options(p: argparse.ArgumentParser, prefix: str = "", tasks: tuple[str, ...] = FOUR_TASKS) -> None:
    p.add_argument(
        f"--{prefix}prompts" if prefix else "--num-prompts",
        dest="eval_prompts",
        type=int,
        default=10,
        help="prompts per task (default 10)",
    )
    p.add_argument(f"--{prefix}max-new-tokens", dest="eval_max_new_tokens", type=int, default=128)
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


def _setup(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in value.split(",") if s.strip())


def run_train(args) -> int:
    _setup(args)
    summary = train_heads(
        args.kind,
        args.out,
        model=args.model,
        stages=args.stages,
        data_dir=args.data_dir,
        prompts_file=args.prompts,
        distill_dir=args.distill_dir,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        sample_fraction=args.sample_fraction,
        top_k=args.top_k,
        val_fraction=args.val_fraction,
        shard_size=args.shard_size,
        gen_batch_size=args.gen_batch_size,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        head_arch=args.head_arch,
        share_lm_head=not args.own_lm_head,
        steps=args.steps,
        batch_size=args.batch_size,
        window=args.window,
        lr=args.lr,
        loss=args.loss,
        warmup=args.warmup,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        save_dtype=args.save_dtype,
        resume=args.resume,
        overwrite=args.overwrite,
        eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        eval_trees=_csv(args.eval_trees),
        eval_tasks=_csv(args.eval_tasks),
        progress=not args.no_progress,
        draft_vocab=args.draft_vocab,
        max_draft_vocab=args.max_draft_vocab,
        gen_time_limit=args.gen_time_limit,
        train_time_limit=args.time_limit,
        init=args.init,
    )
    brief = {k: v for k, v in summary.items() if k != "eval"}
    print(json.dumps(brief, indent=2))
    if "eval" in summary:
        print(f"evaluation written to {Path(args.out) / 'eval'}")
    return 0


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


def run_eval(args) -> int:
    _setup(args)
    tasks = _csv(args.eval_tasks)
    for t in tasks:
        if t not in TASKS:
            raise DataError(f"unknown task {t!r} in --tasks: use {', '.join(TASKS)}")
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
        tasks=tasks,
        split=args.split,
        num_prompts=args.eval_prompts,
        max_new_tokens=args.eval_max_new_tokens,
        trees=_csv(args.eval_trees),
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
