"""``train_heads``: data generation, training and evaluation in one call, with the settings of each stage.

Directory layout of ``out_dir``: ``config.json`` + ``heads.safetensors`` (the final heads, via ``save_heads``),
``checkpoints/`` (resumable state), ``train_log.jsonl`` (the learning curve), ``learning_curve.png``,
``eval/eval.json`` + ``eval/eval.md``; the distillation data goes to ``distill_dir`` (default ``OUT/distill``;
point several runs at one directory to train Medusa and Hydra heads on the same data).
The command line (``entmtp train-heads``, ``entmtp eval-heads``) is in ``command``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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
from ..machine import auto_dtype
from ..model import DTYPES, EMBEDDED, load_model
from ..prompts import FOUR_TASKS, TASKS
from ..settings import csv, setting
from ..shipped import heads_path
from .evaluate import (
    DEFAULT_TREES,
    METHODS,
    REPLAYED_RULES,
    SAMPLING_RULES,
    evaluate_heads,
    plot_learning_curve,
    write_report,
)
from .prompt_sources import load_training_prompts
from .shards import (
    DistillData,
    GenSettings,
    Manifest,
    distill_dirs,
    generate_data,
    mean_feature_rms,
    model_name,
    token_counts,
)
from .trainer import LOG, TrainSettings, check_output_dir, train

STAGES = ("gen", "train", "eval")


def _stages(stages) -> tuple[str, ...]:
    items = tuple(s.strip() for s in (stages.split(",") if isinstance(stages, str) else stages) if s.strip())
    if items in ((), ("all",)):
        return STAGES
    bad = [s for s in items if s not in STAGES]
    if bad:
        raise DataError(f"unknown stage(s) {', '.join(bad)}: use some of {', '.join(STAGES)} (or all)")
    return tuple(s for s in STAGES if s in items)


@dataclass(frozen=True)
class HeadsSettings:
    """The heads to train (their sizes come from the base model), their draft vocabulary and saved dtype."""

    num_heads: int = setting(4)  # mc_sim_7b_63, the default tree, is 4 deep
    num_layers: int = setting(1)  # residual blocks per head; both papers find one enough
    head_arch: str = setting("mlp", choices=("mlp", "prefix-mlp"), help="hydra only")  # prefix-mlp: Hydra++
    # a 135M model cannot afford a V x H projection per head
    share_lm_head: bool = setting(
        True, flag="--own-lm-head", help="a vocab projection per head instead of sharing"
    )
    # ~3x cheaper on SmolLM2's 49k than the whole vocabulary
    draft_vocab: int = setting(16384, help="draft from the N most frequent tokens (0: all)")
    max_draft_vocab: int = setting(
        0,
        help="with --init, the draft vocabulary is the old one plus the new data's --draft-vocab most frequent "
        "tokens; cap it at M, keeping the tokens most frequent in the new data (0: no cap)",
    )
    # the heads train in float32; saving them so loses nothing
    save_dtype: str = setting("float32", choices=DTYPES)

    def __post_init__(self) -> None:
        if self.draft_vocab < 0:
            raise DataError(
                f"draft_vocab must be >= 0 (0: draft from the whole vocabulary), got {self.draft_vocab}"
            )
        if self.max_draft_vocab < 0:
            raise DataError(f"max_draft_vocab must be >= 0 (0: no cap), got {self.max_draft_vocab}")
        if self.save_dtype not in DTYPES:
            raise HeadsError(f"save_dtype {self.save_dtype!r} is unknown: use one of {', '.join(DTYPES)}")

    def config(self, model, kind: str, base_model: str, data: DistillData | None = None) -> HeadsConfig:
        """The config of such heads of ``kind`` for ``model`` (sizes from its config), reading the layer state
        that ``data`` stores (None: the last layer's)."""
        return HeadsConfig.for_model(
            model,
            kind,
            self.num_heads,
            num_layers=self.num_layers,
            head_arch=self.head_arch,
            share_lm_head=self.share_lm_head,
            base_model=base_model,
            hidden_state_offset=data.hidden_state_offset if data is not None else 0,
            hidden_state_norm=data.hidden_state_norm if data is not None else True,
        )


@dataclass(frozen=True)
class EvalSettings:
    """What the eval stage (and ``entmtp eval-heads``) measures: see `evaluate_heads`."""

    # enough to rank heads in minutes on a CPU
    prompts: int = setting(10, help="prompts per task (default %(default)s)")
    max_new_tokens: int = setting(128)  # what ``entmtp bench`` decodes per prompt
    trees: tuple[str, ...] = setting(
        DEFAULT_TREES,
        type=csv,
        help="the last one's tokens/s is compared with the baseline's (default: the published mc_sim_7b_63 "
        "and tree_8, what generate uses for heads without a profile)",
    )
    tasks: tuple[str, ...] = setting(  # the paper's four tasks
        FOUR_TASKS, type=csv, help=f"comma list of {', '.join(TASKS)} (default {','.join(FOUR_TASKS)})"
    )
    sampling: tuple[str, ...] = setting(
        (),
        type=csv,
        help="also decode at T=0.7 with these acceptance rules and report their tokens/step: comma list of "
        f"{', '.join(SAMPLING_RULES)} (default: greedy only)",
    )
    method: str = setting(
        "decode",
        choices=METHODS,
        help="how tokens/step is measured: decode (every prompt with every heads and tree; also tokens/s) or "
        "replay (one plain generation a prompt, the heads teacher-forced over it: the same tokens/step, "
        "much faster on a CPU; greedy and sample acceptance only, no tokens/s)",
    )

    def __post_init__(self) -> None:
        for t in self.tasks:
            if t not in TASKS:
                raise DataError(f"unknown task {t!r} in the evaluation tasks: use some of {', '.join(TASKS)}")
        for rule in self.sampling:
            if rule not in SAMPLING_RULES:
                raise DataError(
                    f"unknown sampling rule {rule!r} in the evaluation: use some of {', '.join(SAMPLING_RULES)}"
                )
        unreplayable = sorted(set(self.sampling) - set(REPLAYED_RULES)) if self.method == "replay" else []
        if unreplayable:
            raise DataError(
                f"the evaluation cannot replay sampling rules {', '.join(unreplayable)} (typical's output "
                "depends on the tree, gumbel's drafts on the decode's noise): measure them with method decode "
                f"(eval-heads --method, train-heads --eval-method), or replay only {', '.join(REPLAYED_RULES)}"
            )
        if self.prompts < 1 or self.max_new_tokens < 1:
            raise DataError(
                f"evaluation needs prompts >= 1 and max_new_tokens >= 1, got {self.prompts} and "
                f"{self.max_new_tokens}"
            )


@dataclass(frozen=True)
class TrainJob:
    """One `train_heads` run: its inputs and outputs, the stages it runs and how (`entmtp train-heads`'s flags
    make one, train/command.py). The four settings objects say how each stage works (None: their defaults)."""

    model: str | None = None  # HF id or path; None: the embedded SmolLM2-135M-Instruct
    stages: str | tuple[str, ...] = STAGES  # any of gen, train, eval, in that order
    data_dir: str | os.PathLike[str] | list | None = None  # training prompt directories (see prompt_sources)
    prompts_file: str | os.PathLike[str] | None = None  # JSONL/JSON prompts instead of data_dir
    # generated data (default: OUT/distill); train reads several directories as one (a comma-separated string
    # or a list), gen writes one
    distill_dir: str | os.PathLike[str] | list | None = None
    answers_dir: str | os.PathLike[str] | None = None  # the base model's answers, kept apart (AnswerStore)
    gen_settings: GenSettings | None = None
    train_settings: TrainSettings | None = None  # its seed also seeds the new heads
    heads_settings: HeadsSettings | None = None
    eval_settings: EvalSettings | None = None
    gen_batch_size: int | None = None  # None: 32 on CPU (~150 tok/s here), 128 on CUDA
    device: str = "cpu"
    dtype: str = (
        "auto"  # the frozen base model's dtype (auto: `machine.auto_dtype`); the heads' weights are fp32
    )
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    stop_after: int | None = None  # stop training at this step (a resumable checkpoint), as if interrupted
    gen_time_limit: float | None = None  # seconds: start no new data shard after this (train on what exists)
    train_time_limit: float | None = None  # seconds: plan fewer steps (shorter lr schedule) if needed
    init: str | os.PathLike[str] | None = None  # start from these heads' weights (same kind and shape)


def train_heads(
    kind: str,
    out_dir: str | os.PathLike[str],
    job: TrainJob | None = None,
    *,
    base: tuple | None = None,
    **fields,
) -> dict:
    """Generate self-distillation data, train Medusa/Hydra heads on it, save and evaluate them, as `job` says
    (`fields`: `TrainJob` fields on top of it). `base`: an already loaded (model, tokenizer), instead of the
    job's `model`. Returns a summary dict: {"distill": manifest summary, "train": TrainResult fields, "eval":
    report}."""
    job = replace(job or TrainJob(), **fields)
    stages = _stages(job.stages)
    out = Path(out_dir)
    distill = job.distill_dir if job.distill_dir is not None else out / "distill"
    _check_inputs(stages, out, distill, job.resume, job.overwrite, job.gen_time_limit, job.train_time_limit)
    prompts, sources = (
        load_training_prompts(job.data_dir, job.prompts_file, with_sources=True)
        if "gen" in stages
        else (None, None)
    )
    b = _load_base(job.model, base, job.dtype, job.device)
    summary: dict = {}
    if "gen" in stages:
        batch_size = job.gen_batch_size or (128 if torch.device(job.device).type == "cuda" else 32)
        summary["distill"] = _gen_stage(
            b, distill_dirs(distill)[0], prompts, sources, job.gen_settings, batch_size, job.progress,
            job.gen_time_limit, job.answers_dir,
        )  # fmt: skip
    heads = None
    if "train" in stages:
        run = dict(device=job.device, resume=job.resume, overwrite=job.overwrite, progress=job.progress,
                   stop_after=job.stop_after)  # fmt: skip
        heads, summary["train"] = _train_stage(
            b, kind, distill, out, job.train_settings, job.heads_settings, job.init,
            time_limit=job.train_time_limit, **run,
        )  # fmt: skip
        if summary["train"]["stopped_early"]:
            return summary
    if "eval" in stages:
        heads = heads if heads is not None else load_heads(out)
        settings = job.eval_settings or EvalSettings()
        summary["eval"] = _evaluate(b.model, b.tokenizer, heads, out, settings, job.progress)
    return summary


@dataclass(frozen=True)
class _Base:
    """The frozen base model, its tokenizer, and the name its distillation data and heads record."""

    model: Any
    tokenizer: Any
    name: str


def _load_base(model: str | None, base: tuple | None, dtype: str, device: str) -> _Base:
    if base is None:
        dtype = auto_dtype(device) if dtype == "auto" else dtype
        model_obj, tokenizer = load_model(model, dtype=dtype, device=device)
    else:
        model_obj, tokenizer = base
    return _Base(model_obj, tokenizer, model or (EMBEDDED if base is None else model_name(model_obj)))


def _gen_stage(
    b: _Base,
    distill: Path,
    prompts,
    sources,
    settings: GenSettings | None,
    batch_size: int,
    progress,
    time_limit,
    answers_dir,
) -> dict:
    """Generate the self-distillation data in ``distill``; returns its summary."""
    t0 = time.perf_counter()
    manifest = generate_data(
        b.model,
        b.tokenizer,
        distill,
        prompts=prompts,
        sources=sources,
        settings=settings or GenSettings(),
        batch_size=batch_size,
        base_model=b.name,
        progress=progress,
        time_limit=time_limit,
        answers_dir=answers_dir,
    )
    return _distill_summary(distill, manifest, time.perf_counter() - t0)


def _check_inputs(stages, out: Path, distill, resume, overwrite, gen_time_limit, train_time_limit) -> None:
    """Fail before any slow work: time limits, output directory, the inputs of the stages asked for."""
    for name, limit in (("gen_time_limit", gen_time_limit), ("train_time_limit", train_time_limit)):
        if limit is not None and not limit > 0:
            raise DataError(f"{name} must be a positive number of seconds, got {limit}")
    if "train" in stages:
        check_output_dir(out, overwrite=overwrite, resume=resume)
    elif "eval" in stages and not (out / CONFIG_FILE).exists():
        raise HeadsError(
            f"no heads in {out} to evaluate: run the train stage first (or give the heads directory)"
        )
    if "gen" in stages and len(distill_dirs(distill)) > 1:
        raise DataError(
            f"the gen stage writes one distillation directory, not {distill}: give several --distill-dir "
            "directories only to --stages train"
        )
    if "train" in stages and "gen" not in stages:
        DistillData.read(distill)  # raises a clear DataError when the data is missing


def _distill_summary(distill: Path, manifest: Manifest, seconds: float) -> dict:
    return {
        "dir": str(distill),
        "train_positions": manifest.positions("train"),
        "val_positions": manifest.positions("val"),
        "shards": len(manifest.shards),
        "seconds": seconds,
    }


def _data_of(distill, base_name: str) -> DistillData:
    """The distillation data, which must come from the base model being trained for."""
    data = DistillData.read(distill)
    if data.base_model != base_name:
        raise DataError(
            f"distillation data in {data.name} was made by {data.base_model!r}, not {base_name!r}: "
            f"use another --distill-dir for this model"
        )
    return data


def _train_stage(
    b: _Base,
    kind: str,
    distill,
    out: Path,
    settings: TrainSettings | None,
    heads_settings: HeadsSettings | None,
    init,
    **run,
) -> tuple[Heads, dict]:
    """Train ``kind`` heads on the data in ``distill`` (``run``: the keyword options of `train`), then give
    them their draft vocabulary and save them in ``out`` unless training stopped early. Returns the heads and
    the `TrainResult` fields."""
    settings, heads_settings = settings or TrainSettings(), heads_settings or HeadsSettings()
    data = _data_of(distill, b.name)
    config = heads_settings.config(b.model, kind, b.name, data)
    if init is not None:  # continue from trained heads (e.g. the shipped ones, on new data)
        heads = _init_heads(init, config, data, b.model, settings.seed)
        init_vocab = heads.draft_vocab  # the new data's draft vocabulary extends it (_set_draft_vocab)
        heads.set_draft_vocab(None)
    else:
        heads, init_vocab = random_heads(config, seed=settings.seed), None
        if not config.share_lm_head:
            heads.bind(b.model).init_projections_from_base()
    # the draft vocabulary: chosen first when the loss runs over it (a resumed run takes its checkpoint's)
    if settings.vocab == "draft":
        _set_draft_vocab(heads, b.tokenizer, data, heads_settings, init_vocab)
    result = train(b.model, heads, data, out, settings=settings, **run)
    plot_learning_curve(out / LOG, out / "learning_curve.png")
    if not result.stopped_early:
        if settings.vocab != "draft":
            _set_draft_vocab(heads, b.tokenizer, data, heads_settings, init_vocab)
        heads.to(dtype=DTYPES[heads_settings.save_dtype])
        save_heads(heads, out, overwrite=run["overwrite"])
    return heads, dataclasses.asdict(result)


def _set_draft_vocab(heads: Heads, tokenizer, data: DistillData, s: HeadsSettings, init_vocab) -> None:
    """Draft from the tokens the base model itself writes most often (its distillation data); what the
    ``init`` heads could draft stays draftable (up to ``max_draft_vocab``). Nothing when ``draft_vocab`` is 0."""
    if not s.draft_vocab:
        return
    counts = token_counts(data, "train")  # [V]; the data's vocab_size is the model's
    ids = frequent_tokens(counts, s.draft_vocab, keep=tokenizer.all_special_ids)
    if init_vocab is not None:
        ids = torch.cat([ids, init_vocab.to(ids.device)]).unique()
    if s.max_draft_vocab and ids.numel() > s.max_draft_vocab:
        ids = cap_vocab(ids, counts, s.max_draft_vocab, keep=tokenizer.all_special_ids, prefer=init_vocab)
    heads.set_draft_vocab(ids)


def _evaluate(model, tokenizer, heads: Heads, out: Path, s: EvalSettings, progress: bool) -> dict:
    """The eval stage: the report of `evaluate_heads`, also written to ``out/eval``."""
    heads.to(device=model.device, dtype=model.dtype)
    report = evaluate_heads(
        model,
        tokenizer,
        heads,
        tasks=tuple(s.tasks),
        num_prompts=s.prompts,
        max_new_tokens=s.max_new_tokens,
        trees=tuple(s.trees),
        progress=progress,
        sampling=tuple(s.sampling),
        method=s.method,
    )
    write_report(report, out / "eval")
    return report


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


def _init_heads(path, config: HeadsConfig, data: DistillData, model, seed: int = 0) -> Heads:
    """Heads loaded from ``path`` to train further. Their architecture must be the one asked for, except that
    they may grow, each growth starting as the function the old heads computed (see `_grow`): Hydra ``mlp``
    heads into Hydra++ (``prefix-mlp``), more residual blocks a head (``num_layers``), and a projection of
    each head's own instead of the shared base output layer (``share_lm_head`` off).

    They read the layer state the data stores (``config``'s offset and norm), as new heads do: heads trained on
    another layer start from their weights there, a warm start whose inputs have changed (their accuracy at
    step 0 is what the first validation shows)."""
    heads = load_heads(heads_path(path), dtype=torch.float32)
    have, want = heads.config, config
    grows = {
        "head_arch": have.head_arch == "mlp" and want.head_arch == "prefix-mlp",
        "num_layers": have.num_layers < want.num_layers,
        "share_lm_head": have.share_lm_head and not want.share_lm_head,
    }
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
        if getattr(have, f) != getattr(want, f) and not grows.get(f)
    ]
    if diff:
        raise HeadsError(
            f"--init heads in {path} differ from the heads to train: {', '.join(diff)}; pass matching "
            "--kind/--num-heads/--num-layers/--head-arch (heads may also grow: Hydra mlp heads into Hydra++ "
            "with --head-arch prefix-mlp, more --num-layers, --own-lm-head), or drop --init to train from scratch"
        )
    if any(grows.values()):
        scale = mean_feature_rms(data, "train") if grows["head_arch"] else 1.0
        heads = _grow(heads, config, model, scale, seed)  # built from `config`: reads the data's layer
    elif _reads(have) != _reads(want):
        heads.config = dataclasses.replace(
            have, hidden_state_offset=want.hidden_state_offset, hidden_state_norm=want.hidden_state_norm
        )
    return heads


def _reads(config: HeadsConfig) -> tuple[int, bool]:
    """The layer state heads read: (offset, through the final norm); the last layer's is normed either way."""
    return config.hidden_state_offset, config.hidden_state_norm or not config.hidden_state_offset


def _grow(heads: Heads, config: HeadsConfig, model, scale: float, seed: int) -> Heads:
    """Trained heads in a larger architecture that starts as (nearly) the function they computed, so training
    begins from their accuracy instead of from noise. What is new:

    * Hydra++'s prefix layer (``prefix-mlp`` from ``mlp``): its attention and MLP outputs start at zero (as
      fresh residual blocks do), which leaves its final RMSNorm: x -> scale * x / rms(x). With ``scale`` the
      mean RMS of the features the heads read (the base model's normed hidden states, whose RMS varies ~10%
      from token to token on SmolLM2), the heads see their old inputs up to that spread.
    * residual blocks beyond the old ``num_layers``: x + SiLU(0 x + 0) = x, exactly the identity.
    * each head's own vocab projection instead of the shared base output layer: a copy of it (bias zero),
      exactly the old logits. On SmolLM2 that is 49,152 x 576 weights a head; drafting and ``--vocab draft``
      training read only the draft vocabulary's rows."""
    if config.head_arch == "prefix-mlp" and config.head_dim == 0:
        raise HeadsError("Hydra++ from mlp heads needs the base model's attention geometry in the config")
    old_layers = heads.config.num_layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        new = heads_class(config)(config)  # the geometry is known: a prefix layer is built here

    def is_new(key: str) -> bool:
        block = re.match(r"heads\.\d+\.blocks\.(\d+)\.", key)
        return (
            key.startswith("prefix.")
            or ".proj." in key
            or (block is not None and int(block[1]) >= old_layers)
        )

    missing, unexpected = new.load_state_dict(heads.state_dict(), strict=False)
    if unexpected or not all(is_new(k) for k in missing):
        raise HeadsError(
            f"cannot carry the --init heads into the new ones: missing {missing}, extra {unexpected}"
        )
    with torch.no_grad():
        for head in new.heads:
            for block in list(head.blocks)[old_layers:]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
        if heads.config.head_arch == "mlp" and config.head_arch == "prefix-mlp":
            new.prefix.self_attn.o_proj.weight.zero_()
            new.prefix.mlp.down_proj.weight.zero_()
            new.prefix.norm.weight.fill_(scale)
    if heads.config.share_lm_head and not config.share_lm_head:
        new.bind(model).init_projections_from_base()
    new.set_draft_vocab(heads.draft_vocab)
    return new
