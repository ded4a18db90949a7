"""Train draft heads on self-distillation data; the base model stays frozen.

Loss. Head k (1-based) at position t predicts x_{t+k+1}; its target is the base model's distribution at
position t+k (the one that predicts x_{t+k+1}), stored as top-k ids and log-probs:

* ``kl``: KL(q || p_head) with q the stored top-k renormalised (the base's other tokens carry little mass);
* ``ce``: cross-entropy to the base's argmax (rank 0), what greedy acceptance checks;
* ``mix``: their mean.

Heads are weighted ``head_decay ** (k - 1)`` (Medusa's 0.8^k): early heads decide most acceptances.

Vocabulary (``vocab``). ``full``: the heads' softmax runs over the whole vocabulary. ``draft``: only over the
draft vocabulary they draft from (`Heads.set_draft_vocab`), which is all they are ever asked for: a target
outside it is a draft they cannot make, so it drops out of the loss (and counts as a miss in top-1). With
SmolLM2's 49,152 tokens and an 8k draft vocabulary, the projection, the softmax and their backward, which
are nearly all of a step's work, shrink about sixfold. Heads with vocab projections of their own then train
only those projections' draft rows (`DraftRows`): the rest get no gradient, and AdamW need not step them.

Batches are windows of one sequence: ``window`` anchor positions (the positions that get a loss) plus the
K positions after them, which Hydra's heads read as tokens and which hold the targets. Windows are visited
in a seeded random order, epoch after epoch, so the data position is a pure function of the step and a
resumed run sees exactly the batches an uninterrupted one would.

Memory: the vocabulary projection of M positions is [M, V]. It is computed ``chunk`` rows at a time; each
chunk's loss is back-propagated to a detached copy of the features at once (freeing its [chunk, V]
activations), and the accumulated feature gradients then go through the heads in one backward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import DataError, HeadsError
from ..files import write_text_atomic
from ..heads import HEADS_FILES, Heads, HeadsConfig
from ..machine import auto_dtype
from ..settings import setting
from .shards import DistillData, SplitData, load_split

CHECKPOINTS = "checkpoints"
LOG = "train_log.jsonl"
LOSSES = ("kl", "ce", "mix")
VOCABS = ("full", "draft")
PRECISIONS = ("auto", "bfloat16", "float32")  # bfloat16: autocast (CPU: avx512_bf16 / AMX matrix units)
TIME_PROBE_STEPS = 20  # steps timed before a time limit re-plans the run


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings. A resumed run must use the same ones (the checkpoint records them)."""

    # optimiser steps; ~8 epochs of the default 1000-prompt data at 1024 positions a step
    steps: int = setting(1000)
    batch_size: int = setting(8, help="windows per step")
    # anchor positions per window: batch_size * window ~ positions per step
    window: int = setting(128, help="positions per window")
    lr: float = setting(1e-3)  # Medusa's head learning rate
    weight_decay: float = 0.0  # the heads are tiny next to the data; no need
    warmup: float = setting(0.05, help="fraction of steps of linear warm-up")
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    loss: str = setting("kl", choices=LOSSES)
    vocab: str = setting(
        "full",
        choices=VOCABS,
        help="the loss's softmax over the full vocabulary, or only the draft vocabulary (~6x less work a "
        "position with 8k of 49k tokens; the heads' draft vocabulary is then chosen before training)",
    )
    head_decay: float = 0.8  # loss weight of head k: head_decay ** (k - 1)
    grad_clip: float = 1.0
    chunk: int = 0  # positions per vocab-projection chunk; 0: ~32M logits per chunk on CPU, ~256M on CUDA
    eval_every: int = setting(100, help="steps between validation runs")  # 0: only at the end
    checkpoint_every: int = setting(100)  # steps between checkpoints (0: only at the end)
    log_every: int = 10  # steps between learning-curve lines
    keep_checkpoints: int = 2  # older checkpoints are deleted
    seed: int = setting(0, help="seed of the data, the windows and the new heads")  # window order
    precision: str = setting(
        "auto",
        choices=PRECISIONS,
        help="the heads' matmuls in training: auto (bfloat16 on CUDA and on a CPU with native bf16, "
        "float32 on other CPUs), bfloat16, float32",
    )  # weights and optimiser stay fp32

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise DataError(f"loss {self.loss!r} is unknown: use one of {', '.join(LOSSES)}")
        if self.vocab not in VOCABS:
            raise DataError(f"vocab {self.vocab!r} is unknown: use one of {', '.join(VOCABS)}")
        if self.precision not in PRECISIONS:
            raise DataError(f"precision {self.precision!r} is unknown: use one of {', '.join(PRECISIONS)}")
        for name in ("steps", "batch_size", "window", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise DataError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and 0 <= self.warmup < 1 and 0 <= self.min_lr_ratio <= 1):
            raise DataError(
                f"need lr > 0, 0 <= warmup < 1, 0 <= min_lr_ratio <= 1; got {self.lr}, {self.warmup}, "
                f"{self.min_lr_ratio}"
            )


@dataclass
class TrainResult:
    step: int
    positions: int  # anchor positions seen (each trains every head that has a target there)
    loss: float  # mean training loss of the last log interval
    val_top1: list[float]  # per head, from the last validation run (empty without a val split)
    seconds: float  # wall time of this call (training only)
    positions_per_second: float
    stopped_early: bool  # True when `stop_after` cut the run short


# ---- windows and batches -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Windows:
    start: torch.Tensor  # [W] global index of each window's first position
    length: torch.Tensor  # [W] positions in the window (anchors + lookahead, cut at the sequence end)
    lo: torch.Tensor  # [W] first anchor (offset within the window)
    hi: torch.Tensor  # [W] one past the last anchor

    def __len__(self) -> int:
        return self.start.numel()


def make_windows(data: SplitData, window: int, num_heads: int, whole_sequences: bool = False) -> Windows:
    """Windows over every sequence's anchors (positions prompt_len-1 .. L-2: each has a next token).
    ``whole_sequences``: one window per sequence from position 0 (heads with a prefix layer read all
    earlier positions)."""
    rows = []
    for s in range(data.num_sequences):
        g0, n = int(data.offsets[s]), int(data.offsets[s + 1] - data.offsets[s])
        first = max(0, int(data.prompt_lens[s]) - 1)
        last = n - 1  # anchors first .. last-1 have head 1's target inside the sequence
        if last <= first:
            continue
        if whole_sequences:
            rows.append((g0, n, first, last))
            continue
        for a in range(first, last, window):
            hi = min(window, last - a)
            rows.append((g0 + a, min(hi + num_heads, n - a), 0, hi))
    if not rows:
        raise DataError("the distillation data has no response positions to train on: generate more data")
    t = torch.tensor(rows, dtype=torch.int64)
    return Windows(start=t[:, 0], length=t[:, 1], lo=t[:, 2], hi=t[:, 3])


@dataclass
class Batch:
    hidden: torch.Tensor  # [B, T, H]
    tokens: torch.Tensor  # [B, T]
    anchor: torch.Tensor  # [B, T] bool
    length: torch.Tensor  # [B] window lengths
    index: torch.Tensor  # [B, T] global position index (targets of head k at j: index + k)

    @property
    def positions(self) -> int:
        return int(self.anchor.sum())


def make_batch(data: SplitData, windows: Windows, which: torch.Tensor) -> Batch:
    length = windows.length[which]  # [B]
    t_max = int(length.max())
    j = torch.arange(t_max)  # [T]
    inside = j[None] < length[:, None]  # [B, T]
    index = torch.where(inside, windows.start[which, None] + j[None], windows.start[which, None])  # [B, T]
    anchor = (j[None] >= windows.lo[which, None]) & (j[None] < windows.hi[which, None])  # [B, T]
    return Batch(data.hidden[index], data.tokens[index], anchor, length, index)


def window_order(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=g)


def batch_windows(num_windows: int, seed: int, step: int, batch_size: int) -> torch.Tensor:
    """Window ids of batch ``step`` (0-based): consecutive slices of per-epoch seeded permutations."""
    out, p, end = [], step * batch_size, (step + 1) * batch_size
    while p < end:
        epoch, i = divmod(p, num_windows)
        take = min(end - p, num_windows - i)
        out.append(window_order(num_windows, seed, epoch)[i : i + take])
        p += take
    return torch.cat(out)


# ---- loss --------------------------------------------------------------------------------------------


def distill_loss(
    logits: torch.Tensor,  # [M, V] head logits
    target_ids: torch.Tensor,  # [M, K] base top-k ids (rank 0 = argmax) as indices into the logits; -1: none
    target_logp: torch.Tensor,  # [M, K] their base log-probs
    loss: str,
) -> torch.Tensor:  # [M]
    """Per position. A target id of -1 is a token the logits do not cover (outside the draft vocabulary): it
    drops out, the top-k renormalised over the rest; a position with none left has loss 0."""
    logp = F.log_softmax(logits.float(), dim=-1)  # [M, V]
    inside = target_ids >= 0  # [M, K]
    picked = logp.gather(1, target_ids.clamp(min=0))  # [M, K]
    ce = torch.where(inside[:, 0], -picked[:, 0], 0.0)
    if loss == "ce":
        return ce
    # renormalised over the top-k (inside the logits); -1e4, not -inf: a row with none inside stays finite
    lq = F.log_softmax(target_logp.float().masked_fill(~inside, -1e4), dim=-1)  # [M, K]
    kl = torch.where(inside, lq.exp() * (lq - picked), 0.0).sum(-1)
    return kl if loss == "kl" else 0.5 * (kl + ce)


def _draft_vocab(heads: Heads) -> torch.Tensor:
    """The heads' draft vocabulary [Vd], which training over the draft vocabulary needs."""
    if heads.draft_vocab is None:
        raise HeadsError(
            "training over the draft vocabulary needs heads with one: set it first (train-heads does, "
            "from --draft-vocab), or train with --vocab full"
        )
    return heads.draft_vocab


class _Projection:
    """What a head's features are scored against: the whole vocabulary, or only the draft vocabulary (see the
    module docstring), with the map from token ids to logit columns (-1: not a column). Heads with vocab
    projections of their own are scored over the draft vocabulary through `DraftRows`' copy of those rows."""

    def __init__(self, heads: Heads, vocab: str, rows: DraftRows | None = None):
        self.heads, self.rows = heads, rows
        self.width = heads.config.vocab_size  # the logits' columns
        self.columns: torch.Tensor | None = None  # [V] token id -> column, or None: the identity
        if vocab == "draft":
            ids = _draft_vocab(heads)
            self.columns = torch.full((heads.config.vocab_size,), -1, dtype=torch.long)
            self.columns[ids.cpu()] = torch.arange(ids.numel())
            self.width = ids.numel()

    def logits(self, k: int, feats: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V or Vd]
        if self.columns is None:
            return self.heads.project(k, feats)
        if self.rows is not None:
            return self.rows.logits(k, feats)
        return self.heads.project_draft(k, feats)

    def targets(self, ids: torch.Tensor) -> torch.Tensor:  # token ids [M, K] -> columns [M, K]
        return ids if self.columns is None else self.columns.to(ids.device)[ids]


class DraftRows:
    """The draft vocabulary's rows of each head's own vocab projection, as parameters of their own.

    Scored over the draft vocabulary (``vocab="draft"``), a head's own projection [V, H] gets gradient only in
    its draft rows, but AdamW would still step and decay all V rows: on SmolLM2, 49,152 rows for the 8,192 a
    draft reads, most of a step's time. The run trains these [Vd, H] copies instead (the heads' projections
    are not stepped meanwhile) and writes them back into the projections after every optimiser step, so what is
    validated, checkpointed and saved is always the heads themselves; the other rows keep their values."""

    def __init__(self, heads: Heads):
        if heads.config.share_lm_head:
            raise HeadsError("DraftRows needs heads with vocab projections of their own (--own-lm-head)")
        self.heads = heads
        self.ids = _draft_vocab(heads).to(heads.device)
        self.replaced = {id(p) for head in heads.heads for p in head.proj.parameters()}  # not stepped
        self.weights, self.biases = [], []
        for head in heads.heads:
            self.weights.append(torch.nn.Parameter(head.proj.weight.detach()[self.ids].clone()))  # [Vd, H]
            bias = head.proj.bias
            self.biases.append(None if bias is None else torch.nn.Parameter(bias.detach()[self.ids].clone()))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in zip(self.weights, self.biases, strict=True) for p in pair if p is not None]

    def logits(self, k: int, feats: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, Vd]
        return F.linear(feats, self.weights[k], self.biases[k])

    @torch.no_grad()
    def write_back(self) -> None:
        for head, weight, bias in zip(self.heads.heads, self.weights, self.biases, strict=True):
            head.proj.weight.index_copy_(0, self.ids, weight)
            if bias is not None:
                head.proj.bias.index_copy_(0, self.ids, bias)


def _chunk_rows(settings: TrainSettings, vocab: int, device: torch.device) -> int:
    """Rows per vocab-projection chunk: ~32M logits on CPU (cache-friendly), ~256M on a GPU (fewer kernels)."""
    budget = (256 << 20) if device.type == "cuda" else (32 << 20)
    return settings.chunk or max(64, budget // vocab)


def _autocast(device: torch.device, precision: str = "auto"):
    """The heads' forward in bfloat16 (autocast: fp32 weights, optimiser and loss) or float32."""
    device = torch.device(device)
    bf16 = (auto_dtype(device) if precision == "auto" else precision) == "bfloat16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    move = (
        (lambda t: t.pin_memory().to(device, non_blocking=True))
        if device.type == "cuda"
        else (lambda t: t.to(device))
    )
    return Batch(*(move(t) for t in dataclasses.astuple(batch)))


def head_weights(num_heads: int, decay: float) -> list[float]:
    w = [decay**k for k in range(num_heads)]
    return [x / sum(w) for x in w]


def train_step(
    heads: Heads,
    data: SplitData,
    batch: Batch,
    settings: TrainSettings,
    device,
    rows: DraftRows | None = None,
) -> tuple[float, list[int], list[int]]:
    """Forward + backward of one batch (gradients accumulate in the heads, and in ``rows`` when the heads'
    own projections train through them). Returns (loss, correct top-1 per head, counted positions per head)."""
    K = heads.config.num_heads
    weights = head_weights(K, settings.head_decay)
    proj = _Projection(heads, settings.vocab, rows)
    chunk = _chunk_rows(settings, proj.width, torch.device(device))
    j = torch.arange(batch.anchor.shape[1], device=device)
    with _autocast(device, settings.precision):
        feats = heads.features(batch.hidden, batch.tokens)  # K x [B, T, H]
    selected, grads, total, correct, counts = [], [], 0.0, [], []
    for k in range(1, K + 1):
        valid = batch.anchor & (j[None] + k < batch.length[:, None])  # [B, T]
        f = feats[k - 1][valid]  # [M, H]
        m = f.shape[0]
        counts.append(m)
        if m == 0:
            correct.append(0)
            continue
        tgt = (batch.index[valid] + k).cpu()  # [M] global index of the target distribution
        ids = proj.targets(data.topk_ids[tgt]).to(device)  # [M, Kt] logit columns
        logp = data.topk_logp[tgt].to(device)
        leaf = f.detach().requires_grad_(True)
        hits = 0
        for c in range(0, m, chunk):
            with _autocast(device, settings.precision):
                logits = proj.logits(k - 1, leaf[c : c + chunk])  # [c, V]
            per_pos = distill_loss(logits, ids[c : c + chunk], logp[c : c + chunk], settings.loss)
            part = per_pos.sum() * (weights[k - 1] / m)
            part.backward()
            total += float(part.detach())
            hits += int((logits.argmax(-1) == ids[c : c + chunk, 0]).sum())
        correct.append(hits)
        selected.append(f)
        grads.append(leaf.grad)
    if selected:
        torch.autograd.backward(selected, grads)
    return total, correct, counts


@torch.no_grad()
def evaluate_split(heads: Heads, data: SplitData, windows: Windows, settings: TrainSettings, device) -> dict:
    """Teacher-forced top-1 accuracy (against the base argmax) and loss per head over the whole split."""
    K = heads.config.num_heads
    hits, counts, losses = [0] * K, [0] * K, [0.0] * K
    proj = _Projection(heads, settings.vocab)  # the heads' own weights (a run writes its draft rows back)
    chunk = _chunk_rows(settings, proj.width, torch.device(device))
    for b in range(0, len(windows), settings.batch_size):
        batch = _to(
            make_batch(data, windows, torch.arange(b, min(b + settings.batch_size, len(windows)))), device
        )
        j = torch.arange(batch.anchor.shape[1], device=device)
        with _autocast(device, settings.precision):
            feats = heads.features(batch.hidden, batch.tokens)
        for k in range(1, K + 1):
            valid = batch.anchor & (j[None] + k < batch.length[:, None])
            f = feats[k - 1][valid]
            tgt = (batch.index[valid] + k).cpu()
            ids, logp = proj.targets(data.topk_ids[tgt]).to(device), data.topk_logp[tgt].to(device)
            for c in range(0, f.shape[0], chunk):
                with _autocast(device, settings.precision):
                    logits = proj.logits(k - 1, f[c : c + chunk])
                losses[k - 1] += float(
                    distill_loss(logits, ids[c : c + chunk], logp[c : c + chunk], settings.loss).sum()
                )
                hits[k - 1] += int((logits.argmax(-1) == ids[c : c + chunk, 0]).sum())
            counts[k - 1] += f.shape[0]
    return {
        "val_top1": [h / max(1, n) for h, n in zip(hits, counts, strict=True)],
        "val_loss": [s / max(1, n) for s, n in zip(losses, counts, strict=True)],
        "val_positions": counts[0],
    }


# ---- schedule and checkpoints ------------------------------------------------------------------------


class WarmupCosine:
    """lr multiplier: linear warm-up over ``warmup`` steps, then cosine from 1 to ``floor`` at ``total``."""

    def __init__(self, total: int, warmup: int, floor: float):
        self.total, self.warmup, self.floor = total, warmup, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    d = Path(out_dir) / CHECKPOINTS
    found = sorted(d.glob("step-*.pt")) if d.is_dir() else []
    return found[-1] if found else None


def _save_checkpoint(out: Path, state: dict, keep: int) -> Path:
    d = out / CHECKPOINTS
    d.mkdir(parents=True, exist_ok=True)
    path = _checkpoint_path(d, state["step"])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for old in sorted(d.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _signature(heads: Heads, data: DistillData, settings: TrainSettings) -> dict:
    """What must not change between a run and its resumption."""
    keep = {
        k: v
        for k, v in asdict(settings).items()
        if k not in ("eval_every", "checkpoint_every", "log_every", "keep_checkpoints", "precision")
    }
    rows = {"trained_rows": "draft"} if own_projection_rows(heads, settings) else {}  # the optimiser's shapes
    return {"heads": asdict(heads.config), "data": data.prompts_sha, **keep, **rows}


def own_projection_rows(heads: Heads, settings: TrainSettings) -> bool:
    """Whether the heads' own vocab projections train through their draft rows (`DraftRows`)."""
    return settings.vocab == "draft" and not heads.config.share_lm_head


def _read_log(path: Path, up_to: int) -> list[str]:
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= up_to:
                lines.append(line)
        except (json.JSONDecodeError, KeyError):
            continue
    return lines


# ---- the loop ----------------------------------------------------------------------------------------


def check_output_dir(out_dir: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse a directory that already holds heads (unless overwrite) or a run's checkpoints (unless
    resume or overwrite)."""
    held = [n for n in HEADS_FILES if (out_dir / n).exists()]
    if held and not overwrite:
        raise HeadsError(
            f"{out_dir} already holds heads ({', '.join(held)}): pass --overwrite to replace them, or choose "
            f"another --out"
        )
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None and not (resume or overwrite):
        raise HeadsError(
            f"{out_dir} holds an unfinished training run ({ckpt.name}): pass --resume to continue it or "
            f"--overwrite to start over"
        )


def check_data_fits(data: DistillData, config: HeadsConfig) -> None:
    if (data.hidden_size, data.vocab_size) != (config.hidden_size, config.vocab_size):
        raise DataError(
            f"distillation data in {data.name} is for {data.base_model} (hidden {data.hidden_size}, "
            f"vocab {data.vocab_size}) but the heads have hidden {config.hidden_size}, vocab "
            f"{config.vocab_size}: generate data with the heads' base model (another --distill-dir)"
        )
    offset, want = data.hidden_state_offset, config.hidden_state_offset
    if offset != want:
        raise DataError(
            f"distillation data in {data.name} stores hidden states at offset {offset} but the heads read "
            f"offset {want}: generate data with --hidden-state-offset {want} (another --distill-dir)"
        )
    if offset and data.hidden_state_norm != config.hidden_state_norm:
        said = {True: "through the final norm", False: "raw"}
        raise DataError(
            f"distillation data in {data.name} stores layer states {said[data.hidden_state_norm]} but the "
            f"heads read them {said[config.hidden_state_norm]}: generate data "
            f"{'without' if config.hidden_state_norm else 'with'} --no-hidden-state-norm (another --distill-dir)"
        )


def train(
    model,
    heads: Heads,
    distill_dir: str | os.PathLike[str] | list | DistillData,
    out_dir: str | os.PathLike[str],
    *,
    settings: TrainSettings = TrainSettings(),
    device: str | torch.device = "cpu",
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    time_limit: float | None = None,
) -> TrainResult:
    """Train ``heads`` (bound to the frozen ``model``) on the data in ``distill_dir`` (one directory, several as
    a comma-separated string or list, or a `DistillData`); checkpoints and the
    learning-curve log go to ``out_dir``. The final heads are NOT saved here (see ``train_heads``).

    ``resume``: continue from the latest checkpoint in ``out_dir`` (same settings required).
    ``stop_after``: stop (with a checkpoint) once this step is reached, as if interrupted.
    ``time_limit``: seconds this call may train. After a few steps the pace is measured; if the remaining
    steps would not fit, fewer are planned and the lr schedule is shortened to end with them (a complete,
    shorter run, not an interrupted one).
    """
    out = Path(out_dir)
    if settings.precision == "auto":  # decided once a run (not part of its identity: a resume may differ)
        settings = dataclasses.replace(settings, precision=auto_dtype(device))
    data = DistillData.read(distill_dir)
    check_data_fits(data, heads.config)
    heads.bind(model)
    check_output_dir(out, overwrite=overwrite, resume=resume)
    splits = _load_splits(data, heads.config, settings)
    run = _TrainingRun(heads, splits, _signature(heads, data, settings), out, settings, torch.device(device))
    run.resume_or_start(resume=resume, overwrite=overwrite)
    if (
        run.step == 0
    ):  # what the run trains on and in, and the untrained heads: the learning curve's first point
        anchors = int((splits.windows.hi - splits.windows.lo).sum())  # distinct positions a pass trains on
        trained = sum(p.numel() for p in run.params)  # own projections: their draft rows only
        start = {"train_positions": anchors, "precision": settings.precision, "trained_parameters": trained}
        run.log(
            {
                "step": 0,
                "positions": 0,
                "loss": None,
                **start,
                **(run.validate() if splits.val is not None else {}),
            }
        )
    return run.loop(progress=progress, stop_after=stop_after, time_limit=time_limit)


@dataclass(frozen=True)
class _Splits:
    """The distillation data's train split and optional val split, each cut into windows."""

    train: SplitData
    windows: Windows
    val: SplitData | None
    val_windows: Windows | None


def _load_splits(data: DistillData, config: HeadsConfig, settings: TrainSettings) -> _Splits:
    train_data = load_split(data, "train")
    val_data = load_split(data, "val") if data.has("val") else None
    K = config.num_heads
    whole = config.head_arch == "prefix-mlp"
    windows = make_windows(train_data, settings.window, K, whole)
    val_windows = make_windows(val_data, settings.window, K, whole) if val_data is not None else None
    return _Splits(train_data, windows, val_data, val_windows)


class _TrainingRun:
    """One call of `train`: the heads with their optimiser and lr schedule, the step and positions reached
    (what a checkpoint holds), and the learning-curve log."""

    def __init__(
        self, heads: Heads, splits: _Splits, signature: dict, out: Path, settings: TrainSettings, device
    ):
        self.heads, self.splits, self.signature = heads, splits, signature
        self.out, self.log_path, self.settings, self.device = out, out / LOG, settings, device
        heads.to(device=device, dtype=torch.float32).train()
        warmup = max(1, int(settings.warmup * settings.steps)) if settings.warmup > 0 else 0
        self.schedule = WarmupCosine(
            settings.steps, warmup, settings.min_lr_ratio
        )  # a time limit shortens it
        self._build_optimizer()
        self.step, self.positions = 0, 0
        self.val_top1: list[float] = []  # per head, from the last validation run

    def _build_optimizer(self) -> None:
        """AdamW and its lr schedule over what trains: the heads' parameters, except that own vocab projections
        scored over the draft vocabulary train through their draft rows (`DraftRows`). Rebuilt when a resumed
        run's draft vocabulary replaces the one the heads came with."""
        s, heads = self.settings, self.heads
        self.rows = DraftRows(heads) if own_projection_rows(heads, s) else None
        self.params = [p for p in heads.parameters() if p.requires_grad]
        if self.rows is not None:
            self.params = [p for p in self.params if id(p) not in self.rows.replaced] + self.rows.parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=s.lr, weight_decay=s.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)

    # ---- start, checkpoints, log -------------------------------------------------------------------------

    def resume_or_start(self, *, resume: bool, overwrite: bool) -> None:
        """Continue from the latest checkpoint (``resume``), keeping the log up to its step; or start afresh,
        deleting old checkpoints (``overwrite``) and the old log."""
        ckpt = latest_checkpoint(self.out) if resume else None
        if ckpt is not None:
            self._load_checkpoint(ckpt)
            kept = _read_log(self.log_path, self.step)
            write_text_atomic(self.log_path, "".join(line + "\n" for line in kept))
            return
        if overwrite:
            shutil.rmtree(self.out / CHECKPOINTS, ignore_errors=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path.unlink(missing_ok=True)

    def _load_checkpoint(self, ckpt: Path) -> None:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if state["signature"] != self.signature:
            diff = sorted(k for k in self.signature if state["signature"].get(k) != self.signature[k])
            raise HeadsError(
                f"checkpoint {ckpt} was made with other settings ({', '.join(diff)} differ): resume with the "
                f"same settings, or pass --overwrite to start over"
            )
        self.heads.load_state_dict(state["heads"])
        if self.settings.vocab == "draft":  # the columns trained so far, whatever the data holds now
            self.heads.set_draft_vocab(state["draft_vocab"])
            self._build_optimizer()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self.step, self.positions = state["step"], state["positions"]

    def checkpoint(self) -> None:
        state = {
            "step": self.step,
            "positions": self.positions,
            "signature": self.signature,
            "heads": self.heads.state_dict(),
            "draft_vocab": self.heads.draft_vocab,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
            "windows_consumed": self.step * self.settings.batch_size,
        }
        _save_checkpoint(self.out, state, self.settings.keep_checkpoints)

    def log(self, entry: dict) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    # ---- one optimiser step, validation ----------------------------------------------------------------

    def optimise(self) -> tuple[float, list[int], list[int]]:
        """Train on batch ``step``; returns `train_step`'s (loss, correct top-1 per head, positions per head)."""
        s, data, windows = self.settings, self.splits.train, self.splits.windows
        which = batch_windows(len(windows), s.seed, self.step, s.batch_size)
        batch = _to(make_batch(data, windows, which), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss, hits, counts = train_step(self.heads, data, batch, s, self.device, self.rows)
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, s.grad_clip)
        self.optimizer.step()
        if self.rows is not None:
            self.rows.write_back()
        self.heads.weights_changed()  # written in place: drafts slice them afresh
        self.scheduler.step()
        self.step += 1
        self.positions += counts[0]
        return loss, hits, counts

    def validate(self) -> dict:
        self.heads.eval()
        ev = evaluate_split(self.heads, self.splits.val, self.splits.val_windows, self.settings, self.device)
        self.heads.train()
        self.val_top1 = ev["val_top1"]
        return ev

    def _fit_time_limit(self, time_limit: float, t_start: float, start_step: int, planned: int, bar) -> int:
        """The steps planned once the first TIME_PROBE_STEPS of this call have measured the pace: fewer when
        the rest would not fit in ``time_limit``, and the lr schedule then ends with them."""
        pace = (time.perf_counter() - t_start) / TIME_PROBE_STEPS  # seconds per step
        fit = start_step + int(0.9 * time_limit / pace)  # 10% for evals and checkpoints
        if fit >= planned:
            return planned
        planned = self.schedule.total = max(self.step, fit)
        bar.note(f"time limit {time_limit:.0f}s: training {planned} steps instead of {self.settings.steps}")
        return planned

    # ---- the loop ----------------------------------------------------------------------------------------

    def loop(self, *, progress: bool, stop_after: int | None, time_limit: float | None) -> TrainResult:
        s = self.settings
        planned = s.steps  # may shrink to fit time_limit
        end = planned if stop_after is None else min(planned, stop_after)
        t_start, start_positions, start_step = time.perf_counter(), self.positions, self.step
        interval = _Interval(self.heads.config.num_heads)
        last_loss = float("nan")
        bar = _TrainProgress(progress, s.steps, self.step)
        try:
            with bar:
                while self.step < end:
                    loss, hits, counts = self.optimise()
                    if time_limit and self.step - start_step == TIME_PROBE_STEPS:
                        planned = self._fit_time_limit(time_limit, t_start, start_step, planned, bar)
                        end = min(end, planned)
                    interval.add(loss, hits, counts)
                    rate = (self.positions - start_positions) / max(1e-9, time.perf_counter() - t_start)
                    bar.update(self.step, loss, rate)
                    entry = None
                    if self.step % s.log_every == 0 or self.step == planned:
                        entry = interval.entry(
                            self.step, self.positions, self.scheduler.get_last_lr()[0], rate
                        )
                        last_loss = entry["loss"]
                    if self.splits.val is not None and (
                        self.step == planned or (s.eval_every and self.step % s.eval_every == 0)
                    ):
                        entry = {
                            **(entry or {"step": self.step, "positions": self.positions}),
                            **self.validate(),
                        }
                        bar.note(
                            f"step {self.step}: val top-1 " + " ".join(f"{x:.3f}" for x in self.val_top1)
                        )
                    if entry is not None:
                        self.log(entry)
                    if self.step == end or (s.checkpoint_every and self.step % s.checkpoint_every == 0):
                        self.checkpoint()
        except KeyboardInterrupt:
            self.checkpoint()  # the completed steps are kept: --resume continues from here
            raise
        self.heads.eval()
        seconds = time.perf_counter() - t_start
        return TrainResult(
            step=self.step,
            positions=self.positions,
            loss=last_loss,
            val_top1=self.val_top1,
            seconds=seconds,
            positions_per_second=(self.positions - start_positions) / max(1e-9, seconds),
            stopped_early=self.step < planned,
        )


class _Interval:
    """Training loss and top-1 hits per head since the last learning-curve line."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self._reset()

    def _reset(self) -> None:
        self.loss, self.steps = 0.0, 0
        self.hits, self.counts = [0] * self.num_heads, [0] * self.num_heads

    def add(self, loss: float, hits: list[int], counts: list[int]) -> None:
        self.loss += loss
        self.steps += 1
        self.hits = [a + b for a, b in zip(self.hits, hits, strict=True)]
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]

    def entry(self, step: int, positions: int, lr: float, rate: float) -> dict:
        """The learning-curve line of this interval (mean loss, top-1 per head); the next interval starts."""
        entry = {
            "step": step,
            "positions": positions,
            "loss": self.loss / self.steps,
            "lr": lr,
            "train_top1": [h / max(1, n) for h, n in zip(self.hits, self.counts, strict=True)],
            "positions_per_second": rate,
        }
        self._reset()
        return entry


class _TrainProgress:
    """Rich progress bar: step, loss, positions per second (or silence)."""

    def __init__(self, enabled: bool, total: int, start: int):
        self.enabled, self.total, self.start = enabled, total, start

    def __enter__(self) -> _TrainProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} pos/s"),
                TimeRemainingColumn(),
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, completed=self.start, loss="-", rate="-")
        return self

    def update(self, step: int, loss: float, rate: float) -> None:
        if self.enabled:
            self.bar.update(self.task, completed=step, loss=f"{loss:.4f}", rate=f"{rate:.0f}")

    def note(self, text: str) -> None:
        if self.enabled:
            self.bar.console.log(text)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)
