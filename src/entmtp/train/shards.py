"""Self-distillation shards: the base model answers the training prompts (see `prompt_sources`) itself, and
we write what the heads learn from; `load_split` reads it back for training.

Layout of a distillation directory (written once, reused by every training run on the same base model):

* ``prompts.jsonl``: the selected prompts in order, each with its split ("val" first, then "train") and
  whether its response is sampled. Written first; a resumed run reads it back, so shards line up.
* ``val-00000.safetensors``, ``train-00000.safetensors``, ...: one shard per ``shard_size`` prompts.
  Each holds whole sequences (prompt + response) concatenated along positions:

  - ``hidden``     [N, H]  bf16: hidden[t], the base hidden state after token x_t (predicts x_{t+1})
  - ``tokens``     [N]     int32: x_t
  - ``topk_ids``   [N, K]  int32: the base model's top-k next-token ids at t (rank 0 = its greedy choice)
  - ``topk_logp``  [N, K]  fp16: their log-probabilities (not renormalised)
  - ``offsets``    [S+1]   int64: sequence s is positions offsets[s] .. offsets[s+1]-1
  - ``prompt_lens``[S]     int32: prompt tokens of sequence s; its positions >= prompt_len - 1 are the ones
    the heads train on (the last prompt position predicts the first response token)
  - ``sampled``    [S]     uint8: 1 if the response was sampled (T = ``temperature``), 0 if greedy

  A sequence of L tokens (prompt + response) stores positions 0..L-2: every position whose next token
  exists. The prompt positions are kept as context for heads that read earlier positions (Hydra++'s
  prefix layer); the loss ignores them.
* ``manifest.json``: base model, sizes, settings, the shards written so far (each with its two phases'
  record: response tokens and seconds of generation, positions and seconds of the teacher-forced pass,
  wall and CPU), ``complete``. Updated after every shard; shards and manifest are written to a temp file
  and renamed, so a killed run leaves no half-written shard (a rerun deletes its temp file), and a rerun
  skips the shards already listed. ``.lock`` holds the process id of the run writing the directory.

The responses come from the batched engine (``batch.generate_batch``: continuous batching, plain decoding),
greedy or sampled at T by the gumbel rule; then one teacher-forced forward per sequence batch stores what
the heads read and learn from. Pausing the process (SIGSTOP / SIGCONT) changes nothing but the wall
seconds recorded: no token depends on time (only the optional time limit reads the clock).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from ..batch import BatchOptions, generate_batch
from ..engine import Engine
from ..errors import DataError, PromptError
from ..files import save_tensors_atomic, write_text_atomic
from ..heads.config import heads_input, saved_norm
from ..model import encode_prompt, eos_token_ids
from ..settings import setting
from .answers import IDENTITY, AnswerStore

FORMAT = "entmtp-distill"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROMPTS = "prompts.jsonl"
LOCK = ".lock"
HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- settings and manifest ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GenSettings:
    """How the distillation data is made. Stored in the manifest; a rerun must use the same settings."""

    # ~200 response tokens each: ~200k positions, well past where small heads saturate
    num_prompts: int = setting(1000, help="training prompts (default %(default)s)")
    # long enough for GSM8K-style reasoning and short code
    max_new_tokens: int = setting(256, help="response length cap")
    # truncating a chat template would break it
    max_prompt_tokens: int = setting(256, help="longer prompts are skipped")
    # some sampled responses: the heads see off-greedy contexts too
    sample_fraction: float = setting(0.25, help="responses sampled at T=0.7")
    both_answers: bool = setting(
        False, help="answer every prompt twice, greedy and sampled at T=0.7 (instead of --sample-fraction)"
    )
    temperature: float = 0.7  # for the sampled fraction
    # the KL loss renormalises over them
    top_k: int = setting(10, help="soft targets stored per position")
    val_fraction: float = setting(0.02, help="prompts held out for validation")  # at least one
    shard_size: int = setting(
        64, help="sequences (prompts, or answers) per data shard"
    )  # the unit of resumption
    seed: int = setting(0, help="seed of the data, the windows and the new heads")  # TrainSettings' too
    hidden_dtype: str = "bfloat16"  # storage dtype of hidden states
    # what the heads read (heads.config.heads_input); the new heads are made to read the same
    hidden_state_offset: int = setting(
        0, help="store the output of the layer this many before the last (default 0: the last layer's)"
    )
    hidden_state_norm: bool = setting(
        True, help="store that layer's output raw, not through the base model's final norm (with an offset)"
    )

    def __post_init__(self) -> None:
        checks = [
            (self.num_prompts >= 1, f"num_prompts must be >= 1, got {self.num_prompts}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.max_prompt_tokens >= 1, f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"),
            (
                0.0 <= self.sample_fraction <= 1.0,
                f"sample_fraction must be in [0, 1], got {self.sample_fraction}",
            ),
            (self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}"),
            (0.0 <= self.val_fraction < 1.0, f"val_fraction must be in [0, 1), got {self.val_fraction}"),
            (self.shard_size >= 1, f"shard_size must be >= 1, got {self.shard_size}"),
            (self.hidden_dtype in HIDDEN_DTYPES, f"hidden_dtype must be one of {list(HIDDEN_DTYPES)}"),
            (
                self.hidden_state_offset >= 0,
                f"hidden_state_offset must be >= 0, got {self.hidden_state_offset}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise DataError(message)


@dataclass
class Manifest:
    base_model: str
    hidden_size: int
    vocab_size: int
    settings: dict
    prompts_sha: str  # sha256 of the selected prompts and splits: a rerun must select the same ones
    num_val: int
    num_train: int
    shards: list[dict] = field(default_factory=list)  # {file, split, sequences, positions, anchors}
    complete: bool = False
    skipped_long_prompts: int = 0
    sources: dict = field(default_factory=dict)  # prompt source file -> prompts selected from it

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise DataError(
                f"no distillation data in {directory} ({MANIFEST} missing): generate it first (stage gen)"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(
                f"cannot read {path} ({e}): delete the directory and generate the data again"
            ) from e
        if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise DataError(
                f"{path} is not entmtp distillation data version {FORMAT_VERSION}: use another --distill-dir"
            )
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        return cls(**fields)

    def write(self, directory: Path) -> None:
        write_text_atomic(directory / MANIFEST, json.dumps(self.to_json(), indent=2) + "\n")

    def shard_files(self, split: str) -> list[str]:
        return sorted(s["file"] for s in self.shards if s["split"] == split)

    def positions(self, split: str) -> int:
        return sum(s["anchors"] for s in self.shards if s["split"] == split)


@dataclass(frozen=True)
class DistillData:
    """The distillation data one training run reads: one directory, or several made apart (say the
    instruction prompts' data and GSM8K's) that train as one. Their base model, sizes, top-k and feature
    offset must agree; the splits are their shards in the order of the directories."""

    parts: tuple[tuple[Path, Manifest], ...]

    @classmethod
    def read(cls, directories) -> DistillData:
        """``directories``: a path, a comma-separated string of paths, a list of them, or a DistillData."""
        if isinstance(directories, DistillData):
            return directories
        parts = tuple((d, Manifest.read(d)) for d in distill_dirs(directories))
        first_dir, first = parts[0]
        mine = _data_shape(first)
        for d, m in parts[1:]:
            theirs = _data_shape(m)
            if theirs != mine:
                diff = ", ".join(
                    f"{k} {theirs[k]!r} (in {first_dir}: {mine[k]!r})" for k in mine if theirs[k] != mine[k]
                )
                raise DataError(
                    f"distillation data in {d} does not fit with {first_dir}: {diff}; train on directories "
                    "generated by the same base model with the same --top-k and --hidden-state-offset"
                )
        return cls(parts)

    @property
    def name(self) -> str:
        return ",".join(str(d) for d, _ in self.parts)

    @property
    def base_model(self) -> str:
        return self.parts[0][1].base_model

    @property
    def hidden_size(self) -> int:
        return self.parts[0][1].hidden_size

    @property
    def vocab_size(self) -> int:
        return self.parts[0][1].vocab_size

    @property
    def hidden_state_offset(self) -> int:
        return self.parts[0][1].settings.get("hidden_state_offset", 0)

    @property
    def hidden_state_norm(self) -> bool:
        return stored_norm(self.parts[0][1].settings)

    @property
    def prompts_sha(self) -> str:
        """The data's identity (what a resumed training run must find again): one directory's prompt hash,
        or a hash of all of them in order."""
        shas = [m.prompts_sha for _, m in self.parts]
        return shas[0] if len(shas) == 1 else hashlib.sha256(",".join(shas).encode()).hexdigest()

    def positions(self, split: str) -> int:
        return sum(m.positions(split) for _, m in self.parts)

    def has(self, split: str) -> bool:
        return any(m.shard_files(split) for _, m in self.parts)


def distill_dirs(directories) -> list[Path]:
    """The distillation directories named by ``directories``: a path, a comma-separated string of paths, or a
    list of them; at least one, none twice."""
    if isinstance(directories, (list, tuple)):
        dirs = [Path(d) for d in directories]
    else:
        dirs = [Path(d) for d in str(directories).split(",") if d.strip()]
    if not dirs:
        raise DataError("no distillation data directory given: pass --distill-dir DIR[,DIR...]")
    if len(set(dirs)) < len(dirs):
        raise DataError(f"a distillation directory is listed twice in {','.join(map(str, dirs))}")
    return dirs


def stored_norm(settings: dict) -> bool:
    """Whether the stored states went through the final norm (`heads_input`): the last layer's always did,
    an earlier layer's as the settings say (`saved_norm`)."""
    return not settings.get("hidden_state_offset", 0) or saved_norm(settings)


def _data_shape(m: Manifest) -> dict:
    """What must agree between distillation directories trained on together."""
    return {
        "base_model": m.base_model,
        "hidden_size": m.hidden_size,
        "vocab_size": m.vocab_size,
        "top_k": m.settings.get("top_k"),
        "hidden_state_offset": m.settings.get("hidden_state_offset", 0),
        "hidden_state_norm": stored_norm(m.settings),
        "hidden_dtype": m.settings.get("hidden_dtype"),
    }


# ---- prompt selection --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selected:
    ids: list[int]  # prompt token ids (chat-templated)
    split: str  # "val" | "train"
    sampled: bool
    source: str = ""  # the prompt's source file, when known


def select_prompts(
    tokenizer, prompts: list, settings: GenSettings, sources: list[str] | None = None
) -> tuple[list[Selected], int]:
    """Shuffle (seeded), skip prompts over ``max_prompt_tokens``, take ``num_prompts``; the first
    ``val_fraction`` of them (at least one when there are two or more) is the validation split.
    Returns (selected, number of long prompts skipped)."""
    rng = random.Random(settings.seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    chosen: list[list[int]] = []
    origin: list[str] = []
    skipped = 0
    for i in order:
        if len(chosen) == settings.num_prompts:
            break
        try:
            ids = encode_prompt(tokenizer, prompts[i])
        except PromptError:
            continue
        if len(ids) > settings.max_prompt_tokens:
            skipped += 1
            continue
        chosen.append(ids)
        origin.append(sources[i] if sources is not None else "")
    if not chosen:
        raise DataError(
            f"no usable prompt: all {len(prompts)} are empty or longer than max_prompt_tokens="
            f"{settings.max_prompt_tokens}; raise --max-prompt-tokens or give other prompts"
        )
    n = len(chosen)
    num_val = max(1, round(n * settings.val_fraction)) if n >= 2 and settings.val_fraction > 0 else 0
    sample_rng = random.Random(settings.seed + 1)
    selected = []
    for j, (ids, src) in enumerate(zip(chosen, origin, strict=True)):
        split = "val" if j < num_val else "train"
        if settings.both_answers:  # the prompt's greedy answer, then its sampled one, in the same shard
            selected += [Selected(ids, split, False, src), Selected(ids, split, True, src)]
        else:
            selected.append(Selected(ids, split, sample_rng.random() < settings.sample_fraction, src))
    return selected, skipped


def _prompts_sha(selected: list[Selected]) -> str:
    h = hashlib.sha256()
    for s in selected:
        h.update(json.dumps([s.split, s.sampled, s.ids]).encode())
    return h.hexdigest()[:16]


# ---- generation --------------------------------------------------------------------------------------


def eos_ids(model, tokenizer) -> list[int]:
    return sorted(eos_token_ids(model, tokenizer))


def pad_id(model, tokenizer) -> int:
    for value in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model.generation_config, "pad_token_id", None),
        *eos_ids(model, tokenizer),
    ):
        if isinstance(value, int):
            return value
    return 0


@torch.inference_mode()
def generate_responses(
    model,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sample: bool = False,
    temperature: float = 0.7,
    batch_size: int = 32,
) -> list[list[int]]:
    """Batched KV-cached generation (left padding) of each prompt's response; each response ends at its first
    EOS (kept) or after ``max_new_tokens``. Greedy unless ``sample``. Prompts are batched by length."""
    dev = model.device
    pad = pad_id(model, tokenizer)
    eos = eos_ids(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)  # [B, P] left padded
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        kwargs = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {}
        gen = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            max_new_tokens=max_new_tokens,
            min_new_tokens=1,
            do_sample=sample,
            pad_token_id=pad,
            eos_token_id=eos or None,
            **kwargs,
        )[:, width:].tolist()  # [B, new]
        for row, i in enumerate(idx):
            resp = gen[row]
            cut = next((j + 1 for j, t in enumerate(resp) if t in eos), len(resp))
            out[i] = resp[:cut]
    return out


@torch.inference_mode()
def base_targets(
    model,
    sequences: list[list[int]],
    *,
    top_k: int,
    hidden_state_offset: int = 0,
    hidden_state_norm: bool = True,
    batch_size: int = 8,
) -> list[dict[str, torch.Tensor]]:
    """One teacher-forced forward per sequence batch (right padding): for positions 0..L-2 of each sequence,
    what the heads read (`heads_input`; on CPU, model dtype), the token, and the base top-k next-token ids and
    log-probs, in the order of ``sequences``. Batches hold sequences of similar length (sorted), so little of a
    pass is padding."""
    dev = model.device
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
    for b in range(0, len(order), batch_size):
        chosen = order[b : b + batch_size]
        batch = [sequences[i] for i in chosen]
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, L] right padded
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        res = decoder(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=hidden_state_offset > 0
        )
        last = res.last_hidden_state  # [B, L, H]
        feats = heads_input(decoder, res, hidden_state_offset, hidden_state_norm)
        for row, s in enumerate(batch):
            n = len(s) - 1  # positions whose next token exists
            logp = F.log_softmax(lm_head(last[row, :n]).float(), dim=-1)  # [n, V]
            top_logp, top_ids = logp.topk(top_k, dim=-1)  # [n, K]
            out[chosen[row]] = {
                "hidden": feats[row, :n].cpu(),
                "tokens": torch.tensor(s[:n], dtype=torch.int32),
                "topk_ids": top_ids.to(torch.int32).cpu(),
                "topk_logp": top_logp.to(torch.float16).cpu(),
            }
    return out


def _shard_plan(selected: list[Selected], shard_size: int) -> list[tuple[str, list[int]]]:
    """(file name, indices into selected) per shard: validation shards first, then training shards."""
    plan = []
    for split in ("val", "train"):
        idx = [i for i, s in enumerate(selected) if s.split == split]
        for n, start in enumerate(range(0, len(idx), shard_size)):
            plan.append((f"{split}-{n:05d}.safetensors", idx[start : start + shard_size]))
    return plan


def model_name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def generate_data(
    model,
    tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    prompts: list,
    sources: list[str] | None = None,
    settings: GenSettings = GenSettings(),
    batch_size: int = 32,
    base_model: str | None = None,
    progress: bool = True,
    time_limit: float | None = None,
    answers_dir: str | os.PathLike[str] | None = None,
) -> Manifest:
    """Write (or finish writing) the distillation data for ``prompts`` into ``out_dir``; return its manifest.

    Shards already listed in an existing manifest are kept; a manifest made with other settings, another
    base model or another prompt selection is refused (use another directory). ``time_limit``: no new shard
    is started after this many seconds; the data stays incomplete (and resumable) but usable for training.
    ``answers_dir``: an `AnswerStore` directory. A shard whose answers are stored there is not generated, only
    teacher-forced from them; a generated shard's answers are written there first."""
    t_start = time.perf_counter()
    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise DataError(f"distillation directory {d} is a file: give a directory")
    selected, skipped = select_prompts(tokenizer, prompts, settings, sources)
    d.mkdir(parents=True, exist_ok=True)
    with _writer_lock(d):
        manifest = _open_manifest(d, _new_manifest(model, base_model, settings, selected, skipped), selected)
        identity = {
            **manifest.settings,
            "base_model": manifest.base_model,
            "prompts_sha": manifest.prompts_sha,
        }
        store = AnswerStore(answers_dir, {k: identity[k] for k in IDENTITY}) if answers_dir else None
        engine = Engine(model, tokenizer, graphs=False)  # no heads: plain decoding, batched
        plan = [
            (n, f, idx)
            for n, (f, idx) in enumerate(_shard_plan(selected, settings.shard_size))
            if f not in {s["file"] for s in manifest.shards}
        ]
        with _GenProgress(progress, len(plan)) as bar:
            for n, file, idx in plan:
                if time_limit is not None and time.perf_counter() - t_start > time_limit:
                    return manifest  # complete stays False: a later run finishes the remaining shards
                torch.manual_seed(settings.seed * 1_000_003 + n)  # per shard: resumed or not, same samples
                entry = _write_shard(engine, d, file, [selected[i] for i in idx], settings, batch_size, store)
                manifest.shards.append(entry)
                manifest.write(d)
                bar.advance(entry, manifest)
        manifest.complete = True
        manifest.write(d)
    return manifest


def _write_shard(
    engine: Engine,
    d: Path,
    file: str,
    chosen: list[Selected],
    settings: GenSettings,
    batch_size: int,
    store: AnswerStore | None = None,
) -> dict:
    """Generate and write shard ``file`` of ``chosen``; returns its manifest entry. With a ``store``, the
    answers are read from it when stored there, and written to it when generated."""
    t0 = time.perf_counter()
    clock = _Clock()
    responses = store.read(file, len(chosen)) if store is not None else None
    source = "stored" if responses is not None else "generated"
    if responses is None:
        responses = _responses(engine, chosen, settings, batch_size)
        if store is not None:
            store.write(file, responses, engine.model.get_output_embeddings().weight.shape[0])
    gen_wall, gen_cpu = clock.lap()
    tensors = _make_shard(engine, chosen, responses, settings, batch_size)
    tf_wall, tf_cpu = clock.lap()
    phases = {
        "answers": source,
        "anchors": sum(len(r) for r in responses),  # positions >= prompt_len - 1: one per response token
        "gen_seconds": round(gen_wall, 4),
        "gen_cpu_seconds": round(gen_cpu, 4),
        "targets_seconds": round(tf_wall, 4),
        "targets_cpu_seconds": round(tf_cpu, 4),
    }
    save_tensors_atomic(d / file, tensors)
    return {
        "file": file,
        "split": file.split("-")[0],
        "sequences": len(chosen),
        "positions": int(tensors["offsets"][-1]),
        **phases,
        "bytes": (d / file).stat().st_size,
        "seconds": round(time.perf_counter() - t0, 2),
    }


@contextlib.contextmanager
def _writer_lock(d: Path):
    """Hold ``d/.lock`` (this process's id) while writing ``d``: a second run on a directory that a live
    process (running or paused) is writing is refused; a dead process's lock is taken over."""
    path = d / LOCK
    try:
        pid = int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and pid != os.getpid() and _alive(pid):
        raise DataError(
            f"{d} is being written by process {pid} (see {path}): let it finish or stop it (delete {path} "
            f"if that process is not a generation), or use another --distill-dir"
        )
    write_text_atomic(path, f"{os.getpid()}\n")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_manifest(
    model, base_model: str | None, settings: GenSettings, selected: list[Selected], skipped
) -> Manifest:
    """The manifest of new data for ``selected`` (no shards yet)."""
    return Manifest(
        base_model=base_model or model_name(model),
        hidden_size=model.get_input_embeddings().weight.shape[1],
        vocab_size=model.get_output_embeddings().weight.shape[0],
        settings=asdict(settings),
        prompts_sha=_prompts_sha(selected),
        num_val=sum(s.split == "val" for s in selected),
        num_train=sum(s.split == "train" for s in selected),
        skipped_long_prompts=skipped,
        sources=dict(Counter(s.source for s in selected if s.source)),
    )


def _open_manifest(d: Path, fresh: Manifest, selected: list[Selected]) -> Manifest:
    """The manifest of ``d`` when it holds the same data (the shards on disk), else ``fresh``, written
    with the selected prompts (``prompts.jsonl``) into a new directory."""
    d.mkdir(parents=True, exist_ok=True)
    if (d / MANIFEST).exists():
        manifest = Manifest.read(d)
        _check_same_data(d, manifest, fresh)
        manifest.shards = [s for s in manifest.shards if (d / s["file"]).is_file()]
        for tmp in d.glob(".*.tmp-*"):  # a killed run's half-written file (a rename never happened)
            tmp.unlink(missing_ok=True)
        return manifest
    if any(d.glob("*.safetensors")):
        raise DataError(f"{d} holds shards but no {MANIFEST}: delete them or use another --distill-dir")
    lines = [
        json.dumps({"split": s.split, "sampled": s.sampled, "source": s.source, "ids": s.ids})
        for s in selected
    ]
    write_text_atomic(d / PROMPTS, "\n".join(lines) + "\n")
    fresh.write(d)
    return fresh


def engine_responses(
    engine: Engine,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sample: bool = False,
    temperature: float = 0.7,
    batch_size: int = 32,
) -> list[list[int]]:
    """Each prompt's response, decoded by the batched engine (continuous batching: a row leaves as it ends
    and the next prompt takes its place), ``batch_size`` rows at once. Greedy, or sampled at ``temperature``
    by the gumbel rule: exact sampling whose noise is a function of (seed, position), each row's seed drawn
    from torch's global RNG as it joins, so a seeded run repeats whatever the batch. A response ends at its
    first EOS (kept) or after ``max_new_tokens``."""
    sampling = {"temperature": temperature, "acceptance": "gumbel"} if sample else {"temperature": 0.0}
    options = BatchOptions(max_batch=batch_size)
    results = generate_batch(engine, prompts, options, max_new_tokens=max_new_tokens, chat=False, **sampling)
    return [r.token_ids for r in results]


class _Clock:
    """Wall and CPU seconds since the last `lap`. CPU seconds stop while the process is stopped (SIGSTOP)
    and count every thread, so a phase's wall rate is comparable only between runs that were not paused."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def _responses(
    engine: Engine, chosen: list[Selected], settings: GenSettings, batch_size: int
) -> list[list[int]]:
    """The base model's response to each prompt of ``chosen``: greedy and sampled ones in separate batches."""
    prompt_ids = [s.ids for s in chosen]
    responses: list[list[int]] = [[] for _ in chosen]
    for sample in (False, True):
        group = [j for j, s in enumerate(chosen) if s.sampled == sample]
        if not group:
            continue
        got = engine_responses(
            engine,
            [prompt_ids[j] for j in group],
            max_new_tokens=settings.max_new_tokens,
            sample=sample,
            temperature=settings.temperature,
            batch_size=batch_size,
        )
        for j, r in zip(group, got, strict=True):
            responses[j] = r
    return responses


def _make_shard(
    engine: Engine, chosen: list[Selected], responses: list[list[int]], settings: GenSettings, batch_size: int
) -> dict[str, torch.Tensor]:
    """One shard's tensors (see the module docstring): the teacher-forced pass over the prompts ``chosen``
    followed by their ``responses``."""
    prompt_ids = [s.ids for s in chosen]
    seqs = [p + r for p, r in zip(prompt_ids, responses, strict=True)]
    rows = base_targets(
        engine.model,
        seqs,
        top_k=settings.top_k,
        hidden_state_offset=settings.hidden_state_offset,
        hidden_state_norm=settings.hidden_state_norm,
        batch_size=max(1, batch_size // 4),
    )
    lengths = [r["tokens"].shape[0] for r in rows]
    tensors = {
        "hidden": torch.cat([r["hidden"] for r in rows]).to(HIDDEN_DTYPES[settings.hidden_dtype]),
        "tokens": torch.cat([r["tokens"] for r in rows]),
        "topk_ids": torch.cat([r["topk_ids"] for r in rows]),
        "topk_logp": torch.cat([r["topk_logp"] for r in rows]),
        "offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),
        "prompt_lens": torch.tensor([len(p) for p in prompt_ids], dtype=torch.int32),
        "sampled": torch.tensor([s.sampled for s in chosen], dtype=torch.uint8),
    }
    return tensors


def _check_same_data(d: Path, old: Manifest, new: Manifest) -> None:
    fix = "use another --distill-dir, or delete this one to generate it again"
    if old.base_model != new.base_model or (old.hidden_size, old.vocab_size) != (
        new.hidden_size,
        new.vocab_size,
    ):
        raise DataError(f"{d} holds data of base model {old.base_model!r}, not {new.base_model!r}: {fix}")
    defaults = asdict(GenSettings())  # a setting added since the data was made had its default value
    # hidden_state_norm: the stored states' meaning on both sides, not the flag's default
    now = {**new.settings, "hidden_state_norm": stored_norm(new.settings)}
    had = {k: old.settings.get(k, defaults.get(k)) for k in now}
    had["hidden_state_norm"] = stored_norm(old.settings)
    diff = {k: (had[k], v) for k, v in now.items() if had[k] != v}
    if diff:
        said = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
        raise DataError(f"{d} was generated with other settings ({said}): {fix}")
    if old.prompts_sha != new.prompts_sha:
        raise DataError(f"{d} was generated from another prompt set (prompt file or data dir changed): {fix}")


def shard_line(entry: dict, manifest: Manifest) -> str:
    """One shard's log line: its two phases' rates (wall seconds, which include any pause; CPU seconds
    beside them) and the data so far."""
    gen, tf = entry["gen_seconds"], entry["targets_seconds"]
    answers = (
        f"answers stored: {entry['anchors']} tokens read"
        if entry.get("answers") == "stored"
        else f"gen {entry['anchors']} tokens in {gen:.0f} s ({entry['anchors'] / max(gen, 1e-9):.0f} tokens/s, "
        f"{entry['gen_cpu_seconds']:.0f} CPU s)"
    )
    return (
        f"{entry['file']}: {entry['sequences']} sequences; {answers}; "
        f"targets {entry['positions']} positions in {tf:.0f} s ({entry['positions'] / max(tf, 1e-9):.0f}/s, "
        f"{entry['targets_cpu_seconds']:.0f} CPU s); {entry['bytes'] / max(1, entry['anchors']):.0f} bytes "
        f"per anchor; so far {manifest.positions('train')} train + {manifest.positions('val')} val anchors "
        f"in {len(manifest.shards)} shards"
    )


class _GenProgress:
    """A rich progress bar over shards showing generated tokens per second, or (disabled) one line per shard
    on stderr, for a log file."""

    def __init__(self, enabled: bool, shards: int):
        self.enabled, self.shards = enabled and shards > 0, shards
        self.tokens, self.t0 = 0, time.perf_counter()

    def __enter__(self) -> _GenProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("gen shards"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("gen", total=self.shards, rate="")
        return self

    def advance(self, entry: dict, manifest: Manifest) -> None:
        self.tokens += entry["anchors"]
        line = shard_line(entry, manifest)
        if not self.enabled:
            print(f"entmtp gen {time.strftime('%Y-%m-%dT%H:%M:%S')} {line}", file=sys.stderr, flush=True)
            return
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        self.bar.console.log(line)
        self.bar.update(self.task, advance=1, rate=f"{self.tokens} tokens, {rate:.0f} tok/s")

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)


# ---- reading -----------------------------------------------------------------------------------------


@dataclass
class SplitData:
    """All sequences of one split, concatenated along positions (see the module docstring for fields)."""

    hidden: torch.Tensor  # [N, H]
    tokens: torch.Tensor  # [N] int64
    topk_ids: torch.Tensor  # [N, K] int64
    topk_logp: torch.Tensor  # [N, K] float16
    offsets: torch.Tensor  # [S+1] int64
    prompt_lens: torch.Tensor  # [S] int64

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    @property
    def num_anchors(self) -> int:
        """Positions the heads train on: from each sequence's last prompt position on."""
        lengths = self.offsets[1:] - self.offsets[:-1]
        return int((lengths - (self.prompt_lens - 1)).clamp(min=0).sum())


def _parts(data, manifest: Manifest | None) -> tuple[tuple[Path, Manifest], ...]:
    """(directory, manifest) of each part of ``data``: a directory (with its ``manifest`` if read already),
    a comma-separated list of them, or a `DistillData`."""
    if manifest is not None and not isinstance(data, DistillData):
        return ((Path(data), manifest),)
    return DistillData.read(data).parts


def load_split(data, split: str, manifest: Manifest | None = None) -> SplitData:
    """Read every shard of ``split`` ("train" | "val") into memory: of one distillation directory, or of
    several (`DistillData`) in their order."""
    parts = _parts(data, manifest)
    files = []  # (directory, shard file, its manifest entry), in order
    for d, m in parts:
        by_file = {e["file"]: e for e in m.shards}
        files += [(d, f, by_file[f]) for f in m.shard_files(split)]
    if not files:
        where = ",".join(str(d) for d, _ in parts)
        raise DataError(
            f"{where} has no {split} shards"
            + (
                ""
                if all(m.complete for _, m in parts)
                else " (generation has not finished: run the gen stage again)"
            )
            + ("; generate with more prompts so that some are held out" if split == "val" else "")
        )
    n, seqs = sum(e["positions"] for *_, e in files), sum(e["sequences"] for *_, e in files)
    first = _read_shard(files[0][0], files[0][1], ("hidden", "topk_ids"))
    hidden_size, k = first["hidden"].shape[1], first["topk_ids"].shape[1]
    out = SplitData(  # filled shard by shard: memory holds the split once, plus one shard's tensors
        hidden=torch.empty(n, hidden_size, dtype=first["hidden"].dtype),
        tokens=torch.empty(n, dtype=torch.long),
        topk_ids=torch.empty(n, k, dtype=torch.long),
        topk_logp=torch.empty(n, k, dtype=torch.float16),
        offsets=torch.empty(seqs + 1, dtype=torch.long),
        prompt_lens=torch.empty(seqs, dtype=torch.long),
    )
    pos = seq = 0
    for d, file, entry in files:
        shard = _read_shard(d, file)
        m, s = shard["tokens"].shape[0], shard["prompt_lens"].shape[0]
        if (m, s) != (entry["positions"], entry["sequences"]):
            raise DataError(
                f"shard {d / file} holds {m} positions of {s} sequences but the manifest lists "
                f"{entry['positions']} of {entry['sequences']}: delete the shard and its "
                f"manifest entry, then rerun gen"
            )
        for key in ("hidden", "tokens", "topk_ids", "topk_logp"):
            getattr(out, key)[pos : pos + m] = shard[key]
        out.offsets[seq : seq + s] = shard["offsets"][:-1] + pos
        out.prompt_lens[seq : seq + s] = shard["prompt_lens"]
        pos, seq = pos + m, seq + s
    out.offsets[seq] = pos
    return out


def token_counts(data, split: str, manifest: Manifest | None = None) -> torch.Tensor:
    """How often each token id occurs in ``split``'s stored positions [V] (only the tokens are read)."""
    parts = _parts(data, manifest)
    counts = torch.zeros(parts[0][1].vocab_size, dtype=torch.long)
    for d, m in parts:
        for file in m.shard_files(split):
            tokens = _read_shard(d, file, ("tokens",))["tokens"].long()
            counts += torch.bincount(tokens, minlength=m.vocab_size)
    return counts


def mean_feature_rms(data, split: str, manifest: Manifest | None = None) -> float:
    """The mean over ``split``'s positions of the stored features' RMS, read one shard at a time."""
    total, n = 0.0, 0
    for d, m in _parts(data, manifest):
        for file in m.shard_files(split):
            hidden = _read_shard(d, file, ("hidden",))["hidden"]  # [N, H]
            for c in range(0, hidden.shape[0], 65536):
                total += float(hidden[c : c + 65536].float().pow(2).mean(-1).sqrt().double().sum())
            n += hidden.shape[0]
    return total / max(1, n)


def _read_shard(d: Path, file: str, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` (None: all) of one shard, with a clear error for an unreadable file."""
    try:
        with safe_open(str(d / file), "pt") as f:
            return {k: f.get_tensor(k) for k in (keys or f.keys())}
    except (OSError, SafetensorError) as e:
        raise DataError(
            f"cannot read shard {d / file} ({e}): delete it and its manifest entry, then rerun gen"
        ) from e
