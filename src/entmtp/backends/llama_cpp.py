"""llama.cpp as the base model: a GGUF file on llama.cpp's CPU kernels, through llama-cpp-python's low-level API.

What runs where:
- llama.cpp runs every forward of the base model (prefill and tree verification) over its own KV cache.
- PyTorch keeps a small shell of the model for the heads: the token embeddings and the output layer read from
  the GGUF file (dequantized), a config, and a rotary embedding for Hydra++'s prefix layer. The heads read the
  hidden states llama.cpp returns (`result_norm`, the normed last hidden state: transformers'
  `last_hidden_state`).

A tree in one decode: the committed prefix lives in the generation's home sequence. A step whose tree has L
leaves borrows L - 1 more sequence ids, tags the prefix with them (`seq_cp`, metadata only in a unified KV
cache), and gives each tree token the ids of the leaves below it, so a token attends to the prefix and its own
ancestors only (llama.cpp's mask: same sequence, position not after its own). The commit keeps the accepted
path's cells (the cells of a leaf below the last accepted node, at the path's positions) in the home sequence
and drops every borrowed id's cells. Several generations (a continuous batch) are several home sequences of
one context, verified in one decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..cache import Forward
from ..errors import EntMTPError
from ..interrupt import Interrupt, Preempted, strlen_address
from ..tree import Tree
from .amx import extra_bufts_safe  # on a CPU with AMX: the canary's verdict (amx.py)
from .attention import (  # llama.cpp's flash attention on or off: timed once (attention.py)
    attention_shapes,
    flash_attention,
    shapes,
)

LLAMA_CPP_HINT = (
    "python -m entmtp.backends.llama_build (llama-cpp-python 0.3.36 with entmtp's patch, built for this CPU, "
    "a few minutes once; `make setup` runs it; a plain `pip install llama-cpp-python` works too)"
)
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids per context (home rows + borrowed leaf ids)
N_BATCH = 512  # tokens per llama_decode call: a longer prefill runs in chunks of this many
KV_TYPES = {"f16": 1, "f32": 0}  # ggml types of the KV cache
ROW_SCRATCH = 256  # KV cells per batch row past its window: room for the nodes of its largest tree
_LEAF_SEQS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tree -> per node, its leaves' indices


class LlamaCppError(EntMTPError):
    """llama.cpp cannot be used as asked (not installed, a bad GGUF file, a full KV cache)."""


def import_llama_cpp():
    """The llama_cpp module, or a one-line error that says how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppError(f"the llama-cpp backend needs llama-cpp-python: {LLAMA_CPP_HINT}") from e
    return llama_cpp


def available() -> bool:
    try:
        import_llama_cpp()
    except LlamaCppError:
        return False
    return True


# ---- the GGUF file: what the heads need from it ----------------------------------------------------------


@dataclass
class GGUFInfo:
    """The parts of a GGUF file the PyTorch side needs: a transformers config of the model's shape, the token
    embeddings [V, H] and the output layer [V, H] (None: tied to the embeddings), float32."""

    config: object
    embed: np.ndarray
    output: np.ndarray | None
    f32: bool = False  # every tensor F32 (general.file_type 0)
    weights: str = "unknown"  # the weights' format as llama.cpp names it: Q4_1, F32, BF16... (`gguf_weights`)


def read_gguf(path: Path) -> GGUFInfo:
    """The config and the embedding and output matrices of a GGUF file, checked; a clear error otherwise."""
    from transformers import LlamaConfig

    reader = gguf_reader(path, fix="check the file (a partial download?) or give another .gguf")

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    if arch is None or "token_embd.weight" not in tensors:
        raise LlamaCppError(f"{path} holds no language model (no architecture or token_embd.weight)")
    embed = _dequantize(tensors["token_embd.weight"])
    output = _dequantize(tensors["output.weight"]) if "output.weight" in tensors else None
    heads = int(field(f"{arch}.attention.head_count"))
    config = LlamaConfig(
        vocab_size=embed.shape[0],
        hidden_size=embed.shape[1],
        intermediate_size=int(field(f"{arch}.feed_forward_length", 4 * embed.shape[1])),
        num_hidden_layers=int(field(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings=output is None,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )
    config._name_or_path = str(path)
    return GGUFInfo(config, embed, output, f32=field("general.file_type") == 0, weights=_file_type(reader))


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 [rows, cols] (numpy order: [V, H] for the embeddings)."""
    import gguf

    return np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, order="C")


FLOAT_GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # a dtype's GGUF tensor type
_FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q8_0": 7,
    "BF16": 32,
}  # general.file_type (llama.cpp's LLAMA_FTYPE_ALL_F32, _MOSTLY_*)
WRITTEN_FORMATS = ("Q8_0", "F16", "BF16")  # what the embedded model's Q4_1 file may also be decoded as (AMX)


def gguf_attention_shapes(path: str | os.PathLike[str]) -> dict:
    """`attention.shapes` of the GGUF file at `path`, read from its header (nothing loaded): what the bench's
    llama.cpp peer reads its flash-attention verdict by."""
    c = read_gguf(path).config
    return shapes(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size)


def gguf_weights(path: str | os.PathLike[str]) -> str:
    """The weights' format of a GGUF file as llama.cpp names it (general.file_type): "Q4_1", "F32", "BF16"...;
    the most common tensor type where the file does not say."""
    return _file_type(gguf_reader(path))


def gguf_reader(path: str | os.PathLike[str], fix: str = ""):
    """The metadata (scalars and strings) and tensors of the GGUF file at `path` (gguf_header.py: ~10 ms where
    gguf's reader took ~1.8 s, building the vocabulary's arrays; that reader for a file it does not read),
    read once per process while the file is unchanged (its size and mtime): a first run under `--dtype auto`
    reads each candidate's file two or three times (its format, its header, its load). A file that is not a
    GGUF: a clear error (`fix`: what to do, appended)."""
    try:
        return _reader(*_file_key(path))
    except Exception as e:  # the reader raises ValueError, struct errors, OSError... on a corrupt file
        raise LlamaCppError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e})" + (f": {fix}" if fix else "")
        ) from e


def _file_key(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    """(resolved path, size, mtime in ns): a file once read, until it changes (the readers' cache key)."""
    stat = Path(path).stat()
    return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=8)  # the model's file, the written formats' and a user's: a first run reads ~5
def _reader(path: str, size: int, mtime_ns: int):
    import gguf

    from .gguf_header import read_header

    return read_header(path) or gguf.GGUFReader(path)


@functools.lru_cache(maxsize=2)  # the embedded Q4_1 file, which a first run on AMX writes in three formats
def _full_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def _file_type(reader) -> str:
    import gguf

    f = reader.fields.get("general.file_type")
    if f is not None:
        try:
            return gguf.LlamaFileType(int(f.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    types = [t.tensor_type.name for t in reader.tensors if len(t.shape) > 1]
    return max(set(types), key=types.count) if types else "unknown"


def write_float_gguf(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], dtype: str = "float32"
) -> Path:
    """Write `src` with every tensor dequantized and stored as `dtype` (float32 -> F32, bfloat16 -> BF16,
    float16 -> F16): the same metadata, tokenizer and values as the dequantized model transformers loads in
    that dtype, so that llama.cpp decodes the weights `--dtype` names (`write_gguf`)."""
    kind = FLOAT_GGUF_TYPES.get(dtype)
    if kind is None:
        raise LlamaCppError(f"no float GGUF for dtype {dtype!r}: use one of {', '.join(FLOAT_GGUF_TYPES)}")
    return write_gguf(src, dst, kind)


def write_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: str) -> Path:
    """Write `src` with every matrix dequantized and stored as `kind` (F32, F16, BF16 or Q8_0; norms and
    biases in F32). Written to a temporary name, then renamed."""
    import gguf

    if kind not in _FILE_TYPES:
        raise LlamaCppError(f"cannot write a {kind} GGUF: use one of {', '.join(_FILE_TYPES)}")
    qtype = gguf.GGMLQuantizationType[kind]
    reader = _full_reader(*_file_key(src))  # every field, its arrays too (the tokenizer's): gguf's reader
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = _FILE_TYPES[kind] if key == "general.file_type" else f.contents()
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, f.types[0], sub_type=sub)
        for t in reader.tensors:
            values = _dequantize(t).reshape([int(d) for d in reversed(t.shape)])
            if len(values.shape) < 2 or kind == "F32":  # norms and biases stay F32, as llama.cpp's converter
                writer.add_tensor(t.name, values)
            elif kind == "F16":
                writer.add_tensor(t.name, values.astype(np.float16))
            else:
                writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.rename(dst)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)  # nothing half-written is left behind
        raise
    return dst


def write_f32_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """`write_float_gguf` in float32: the file on which llama.cpp's greedy output is compared with
    speculative decoding's without quantization in the way."""
    return write_float_gguf(src, dst, "float32")


# ---- llama.cpp: one model, one context, a pool of sequence ids --------------------------------------------


class Runtime:
    """A llama.cpp model and context (embeddings on while a decode asks for hidden states: every output row
    then also returns its hidden state), a reusable batch, and the pool of sequence ids."""

    def __init__(
        self,
        path: Path,
        *,
        threads: int,
        n_ctx: int,
        kv_type: str = "f16",
        extra_bufts: bool | None = None,
        parent: Runtime | None = None,
    ):
        lib = self.lib = import_llama_cpp()
        self.path, self.threads, self.kv_type = path, threads, kv_type
        self.parent = parent  # a private context's: the runtime whose model it shares (kept alive)
        if parent is not None:
            self.model, self.extra_bufts, self.flash_attn = (
                parent.model,
                parent.extra_bufts,
                parent.flash_attn,
            )
        else:
            _quiet(lib)
            lib.llama_backend_init()
            mp = lib.llama_model_default_params()
            mp.n_gpu_layers = 0
            mp.use_extra_bufts = extra_bufts_safe(path) if extra_bufts is None else extra_bufts
            self.extra_bufts = bool(mp.use_extra_bufts)  # weights repacked for the CPU's kernels (AMX's too)
            self.model = lib.llama_model_load_from_file(str(path).encode(), mp)
            if not self.model:
                raise LlamaCppError(
                    f"llama.cpp could not load {path}: check that it is a complete GGUF model file"
                )
            shapes = attention_shapes(lib, self.model)
            self.flash_attn = flash_attention(
                lib, self.model, shapes, threads, self._flash_params, repacked=self.extra_bufts
            )  # its kernel or the plain one, whichever decodes faster here (attention.py)
        owned = self._owned = self.model if parent is None else None  # freed with this runtime
        self.ctx = lib.llama_init_from_model(self.model, self._params(n_ctx))
        if not self.ctx:
            if owned is not None:
                lib.llama_model_free(owned)
            raise LlamaCppError(f"llama.cpp could not make a context of {n_ctx} tokens for {path}")
        if lib.llama_pooling_type(self.ctx) != lib.LLAMA_POOLING_TYPE_NONE:
            _free(lib, self.ctx, owned, None)
            raise LlamaCppError(
                f"{path} is an embedding model (it pools its states): give a causal LM's GGUF"
            )
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.n_embd = lib.llama_model_n_embd(self.model)
        self._no_states = np.zeros((0, self.n_embd), dtype=np.float32)  # a decode's without hidden states
        self.batch = lib.llama_batch_init(N_BATCH, 0, MAX_SEQ)
        self._views = _BatchViews(self.batch)
        self.free_seqs = list(range(MAX_SEQ - 1, -1, -1))  # pop() hands out 0 first
        self.reserved = 0  # KV cells promised to the live generations (`reserve`)
        self.embeddings = False  # the context's setting: with it on, llama.cpp outputs every token
        self._finalizer = weakref.finalize(self, _free, lib, self.ctx, owned, self.batch)

    def _params(self, n_ctx: int):
        return self._flash_params(n_ctx, self.flash_attn)

    def _flash_params(self, n_ctx: int, flash: bool):
        """This runtime's context parameters for `n_ctx` cells, with llama.cpp's flash attention on or off."""
        lib, cp = self.lib, self.lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, N_BATCH, N_BATCH, MAX_SEQ
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.embeddings, cp.kv_unified = False, True  # on for the decodes that ask for hidden states
        cp.pooling_type = lib.LLAMA_POOLING_TYPE_UNSPECIFIED  # a causal LM's: none (one state per token)
        cp.type_k = cp.type_v = KV_TYPES[self.kv_type]
        cp.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        return cp

    def grow(self, n_ctx: int) -> bool:
        """At least `n_ctx` KV cells for the generations of this context: a new llama.cpp context on the
        same model, made only while no generation holds cells (True when it was). A continuous batch of R
        rows asks for R full windows when it starts (`LlamaCppBase.new_batch`), so every row it admits fits."""
        if n_ctx <= self.n_ctx or self.reserved or len(self.free_seqs) < MAX_SEQ:
            return False
        lib = self.lib
        ctx = lib.llama_init_from_model(self.model, self._params(n_ctx))
        if not ctx:
            raise LlamaCppError(
                f"llama.cpp could not make a context of {n_ctx} KV cells for {self.path}: fewer batch rows"
            )
        self._finalizer.detach()
        lib.llama_free(self.ctx)
        self.ctx, self.mem, self.n_ctx = ctx, lib.llama_get_memory(ctx), lib.llama_n_ctx(ctx)
        self.embeddings = False  # the new context's setting
        self._finalizer = weakref.finalize(self, _free, lib, self.ctx, self._owned, self.batch)
        return True

    def private(self, n_ctx: int) -> Runtime:
        """A context of its own for one generation, on the same loaded model. llama.cpp's numbers for a
        sequence depend on where its cells lie in the KV cache: in a shared context, other sequences' cells
        interleave with its own and its logits move (by up to ~1 on the Q4_1 model), so a seeded sampled
        generation would not repeat beside batch-mates. In a context of its own its cells lie in order, as
        when it runs alone."""
        n_ctx = max(n_ctx, N_BATCH)  # llama.cpp asserts on a context smaller than its batch
        return Runtime(self.path, threads=self.threads, n_ctx=n_ctx, kv_type=self.kv_type, parent=self)

    def set_threads(self, threads: int) -> None:
        """Decode with `threads` CPU threads from now on (this context's, and any later private context's; a
        private context already made keeps its own until its generation ends)."""
        self.threads = threads
        self.lib.llama_set_n_threads(self.ctx, threads, threads)

    def reserve(self, cells: int) -> None:
        """Promise `cells` more KV cells to a generation (negative: give them back). Every generation of a
        context shares its n_ctx cells; a promise past them fails here, before any token of it is decoded,
        instead of a later decode failing for lack of room (which would end its batch-mates' steps too)."""
        if cells > 0 and self.reserved + cells > self.n_ctx:
            raise LlamaCppError(
                f"this generation needs {cells} KV cells, but {self.n_ctx - self.reserved} of the llama.cpp "
                f"context's {self.n_ctx} are free (the others are held by running generations): retry when "
                "they finish, ask for fewer tokens, or give the context more cells (n_ctx)"
            )
        self.reserved += cells

    def take_seq(self) -> int:
        if not self.free_seqs:
            raise LlamaCppError(
                f"all {MAX_SEQ} llama.cpp sequence ids are in use: fewer batch rows, or smaller trees"
            )
        return self.free_seqs.pop()

    def give_seq(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.free_seqs.append(seq)

    @contextlib.contextmanager
    def interrupted(self, interrupt: Interrupt):
        """Within: llama_decode stops between two graph nodes once `interrupt` is raised (rc 2: `Preempted`).
        The callback is C's strlen over the flag (interrupt.py), set only for the call: a Python callback
        would take the GIL after every node, and steps run without one."""
        callback = self.lib.ggml_abort_callback
        self.lib.llama_set_abort_callback(self.ctx, callback(strlen_address()), interrupt.address)
        try:
            yield
        finally:
            self.lib.llama_set_abort_callback(self.ctx, callback(), None)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        seqs: list[list[int]],
        outputs: list[bool],
        embeddings: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One llama_decode of at most N_BATCH tokens: (logits [k, V], hidden [k, H]) of the k output rows, in
        batch order, copied out of llama.cpp's buffers (the next decode reuses them). With `embeddings` (the
        hidden states) llama.cpp makes every token an output row; without, `hidden` is empty. The context's
        embeddings setting follows `embeddings` (switched only when it changes)."""
        if embeddings != self.embeddings:
            self.lib.llama_set_embeddings(self.ctx, embeddings)
            self.embeddings = embeddings
        if embeddings:
            outputs = [True] * len(tokens)
        b, n = self.batch, len(tokens)
        b.n_tokens = n
        self._views.fill(tokens, positions, seqs, outputs)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc == 2:  # its abort callback stopped it (`interrupted`); llama.cpp dropped this batch's cells
            raise Preempted("llama_decode stopped by its interrupt")
        if rc != 0:
            raise LlamaCppError(
                f"llama_decode failed ({rc}{': no room in the KV cache' if rc == 1 else ''}) for {n} tokens "
                f"in a context of {self.n_ctx}: fewer or shorter requests, or a larger n_ctx"
            )
        k = sum(outputs)  # output rows (a Python sum: a numpy reduction over the batch view costs more)
        logits = _rows(self.lib.llama_get_logits(self.ctx), k, self.n_vocab)
        if not embeddings:
            return logits, self._no_states
        return logits, _rows(self.lib.llama_get_embeddings(self.ctx), k, self.n_embd)


def _rows(ptr, k: int, width: int) -> np.ndarray:
    """A copy of the k x width floats at llama.cpp's `ptr` (its output buffer, which the next decode reuses),
    read through a ctypes array at that address: `np.ctypeslib.as_array` of a pointer builds a ctypes pointer
    type and casts on every call."""
    addr = ctypes.cast(ptr, ctypes.c_void_p).value
    return (
        np.frombuffer((ctypes.c_float * (k * width)).from_address(addr), np.float32).reshape(k, width).copy()
    )


class _BatchViews:
    """numpy views of a llama_batch's arrays (made once), so filling a batch of n tokens costs a few array
    writes instead of 4n ctypes item writes; a token's sequence ids go into its row of `seq_id`."""

    def __init__(self, batch):
        def view(ptr, dtype):
            return np.ctypeslib.as_array(ptr, shape=(N_BATCH,)).view(dtype)

        self.token, self.pos = view(batch.token, np.int32), view(batch.pos, np.int32)
        self.n_seq_id, self.logits = view(batch.n_seq_id, np.int32), view(batch.logits, np.int8)
        self.seq_id = [np.ctypeslib.as_array(batch.seq_id[i], shape=(MAX_SEQ,)) for i in range(N_BATCH)]

    def fill(self, tokens: list[int], positions: list[int], seqs: list[list[int]], outputs: list[bool]):
        n = len(tokens)
        self.token[:n], self.pos[:n], self.logits[:n] = tokens, positions, outputs
        first = seqs[0]
        if all(s is first for s in seqs):  # a chain: every token in the same sequences (one list, shared)
            self.n_seq_id[:n] = len(first)
            for i in range(n):
                self.seq_id[i][: len(first)] = first
            return
        for i, ids in enumerate(seqs):
            self.n_seq_id[i] = len(ids)
            self.seq_id[i][: len(ids)] = ids


def _free(lib, ctx, model, batch) -> None:
    if batch is not None:
        lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    if model is not None:  # None: a private context's, whose model its parent runtime frees
        lib.llama_model_free(model)


def _quiet(lib) -> None:
    """llama.cpp's own log off unless ENTMTP_LLAMA_VERBOSE is set (it prints every tensor at load)."""
    if os.environ.get("ENTMTP_LLAMA_VERBOSE"):
        return
    from llama_cpp import _logger

    _logger.logger.setLevel("ERROR")
    _logger.set_verbose(False) if hasattr(_logger, "set_verbose") else None


# ---- the model: the PyTorch shell the heads bind to, with llama.cpp behind it -----------------------------


class LlamaCppModel(nn.Module):
    """A GGUF model run by llama.cpp, seen by the rest of entmtp as a causal LM: `config`, input embeddings and
    output layer (for the heads), `device` and `dtype` (the heads'); `entmtp_base` makes the engine's
    `Base` (backends/__init__.py)."""

    def __init__(self, path: Path, info: GGUFInfo, runtime: Runtime, dtype: torch.dtype):
        super().__init__()
        config = info.config
        self.path, self.config, self.runtime = path, config, runtime
        self.weights = info.weights  # the GGUF's format (Q4_1, F32, BF16...): what llama.cpp computes with
        self.generation_config = None
        self.model = nn.Module()  # transformers' layout: model.embed_tokens, model.rotary_emb, lm_head
        self.model.embed_tokens = nn.Embedding.from_pretrained(torch.from_numpy(info.embed), freeze=True)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.model.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if info.output is None:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head.weight = nn.Parameter(torch.from_numpy(info.output), requires_grad=False)
        self.to(dtype).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def entmtp_base(self, hidden_state_offset: int = 0, full_hidden: bool = True) -> LlamaCppBase:
        if hidden_state_offset:
            raise LlamaCppError(
                "llama.cpp returns the last hidden state only: heads that read an earlier layer "
                f"(hidden_state_offset {hidden_state_offset}) need --backend transformers"
            )
        return LlamaCppBase(self, full_hidden=full_hidden)


def load_gguf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    threads: int | None = None,
    n_ctx: int | None = None,
    kv_type: str | None = None,
    tokenizer_dir: str | None = None,
) -> tuple[LlamaCppModel, object]:
    """(model, tokenizer) of a GGUF file on llama.cpp. `dtype`: the heads' side (embeddings, output layer);
    `n_ctx`: KV cells shared by every generation on this model (default: the model's context window);
    `kv_type`: f16, or f32 (the default for an F32 file, so nothing is rounded on its way through the cache);
    `tokenizer_dir`: a transformers tokenizer to use instead of the one in the GGUF file."""
    from transformers import AutoTokenizer

    import_llama_cpp()  # before reading a large file: a missing install fails first
    path = Path(path).expanduser()
    if not path.is_file():
        raise LlamaCppError(f"GGUF file {path} does not exist: give the path of a .gguf model file")
    info = read_gguf(path)
    if kv_type is None:
        kv_type = "f32" if info.f32 else "f16"
    window = info.config.max_position_embeddings
    runtime = Runtime(
        path, threads=threads or torch.get_num_threads(), n_ctx=n_ctx or window, kv_type=kv_type
    )
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return LlamaCppModel(path, info, runtime, dtype), tokenizer


# ---- the engine's Base on llama.cpp -----------------------------------------------------------------------


class LlamaSeq:
    """One generation's KV cache: its home sequence id in the shared context, the committed length, and the
    step in flight (the sequence ids its tree borrowed, and for each node one sequence that holds it)."""

    def __init__(self, runtime: Runtime, capacity: int):
        runtime.reserve(capacity)
        self.runtime, self._capacity = runtime, capacity
        self.seq = runtime.take_seq()
        self.length = 0
        self.borrowed: list[int] = []
        self.node_seq: list[int] | None = None
        self.step_tokens = 0  # tokens the step in flight decoded
        self._held = [capacity]  # the promise, in a list the finalizer shares (it must not hold self)
        self._finalizer = weakref.finalize(self, _give_back, runtime, self.seq, self._held)

    @property
    def capacity(self) -> int:
        """Tokens this generation may hold (its promise of KV cells, `Runtime.reserve`)."""
        return self._capacity

    @capacity.setter
    def capacity(self, cells: int) -> None:
        self.runtime.reserve(cells - self._capacity)
        self._held[0] += cells - self._capacity
        self._capacity = cells

    def release(self) -> None:
        """Give the sequence id, its KV cells and its promise back (also done when the cache is collected)."""
        self._return_borrowed()
        self._finalizer()

    def _return_borrowed(self) -> None:
        for s in self.borrowed:
            self.runtime.give_seq(s)
        self.borrowed = []

    def open_step(self, tree: Tree | None, n: int) -> list[list[int]]:
        """Borrow a sequence id per extra leaf of `tree` (tagging the prefix with each) and return each of its
        n nodes' sequence ids: the ids of the leaves below it. A chain (or the prefill, `tree` None) stays at
        home."""
        self.step_tokens = n
        if tree is None or tree.num_nodes == tree.depth:
            self.node_seq = None
            return [[self.seq]] * n
        leaves = leaf_sets(tree)
        n_leaves = max(max(s) for s in leaves) + 1
        self.borrowed = [self.runtime.take_seq() for _ in range(n_leaves - 1)]
        ids = [self.seq, *self.borrowed]
        for s in self.borrowed:
            self.runtime.seq_cp(self.seq, s, 0, self.length)
        self.node_seq = [ids[s[0]] for s in leaves]
        return [[ids[k] for k in s] for s in leaves]

    def commit(self, path: list[int]) -> None:
        """Keep the cells of `path` (node ids, root first) in the home sequence, drop the rest of the step."""
        past, a, rt = self.length, len(path), self.runtime
        keep = self.seq if self.node_seq is None else self.node_seq[path[-1]]
        if keep == self.seq:
            if a < self.step_tokens:  # a chain cut short (a plain step or a prefill keeps every token)
                rt.seq_rm(self.seq, past + a)
        else:
            rt.seq_rm(self.seq, past)
            rt.seq_cp(keep, self.seq, past, past + a)
        self._return_borrowed()
        self.node_seq = None
        self.length += a


def _give_back(runtime: Runtime, seq: int, held: list[int]) -> None:
    runtime.give_seq(seq)
    runtime.reserve(-held[0])


def _chunks(start: int, end: int, embeddings: bool) -> list[tuple[int, int, bool]]:
    return [(a, min(end, a + N_BATCH), embeddings) for a in range(start, end, N_BATCH)]


def leaf_sets(tree: Tree) -> list[list[int]]:
    """For each node of `tree`, the indices of the leaves (rows of `retrieve_indices`) below it or at it."""
    cached = _LEAF_SEQS.get(tree)
    if cached is None:
        rows = tree.retrieve_indices.tolist()  # [leaves, depth + 1], -1 padded
        leaves = [max(i for i in row if i >= 0) for row in rows]
        mask = tree.mask  # [n, n]: mask[i, j] iff j is i or an ancestor of i
        cached = [[k for k, leaf in enumerate(leaves) if mask[leaf, node]] for node in range(tree.size)]
        _LEAF_SEQS[tree] = cached
    return cached


class LlamaBatch:
    """A continuous batch's caches: one `LlamaSeq` per row, all in the model's one context."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.rows: list[LlamaSeq] = []

    def add(self, tokens: int, scratch: int = 0, like: LlamaSeq | None = None) -> LlamaSeq:
        """A row for `tokens` tokens (its prompt and output) whose steps verify up to `scratch` more; `like`: a
        cache whose prompt was prefilled apart, which becomes the row as it is (its cells are already in the
        shared context: nothing is copied). A llama.cpp batch pads no row to another's tree."""
        if like is not None and like.runtime is not self.runtime:
            raise LlamaCppError("a generation in a private llama.cpp context cannot join a batch")
        row = like if like is not None else LlamaSeq(self.runtime, tokens + scratch)
        row.capacity = tokens + scratch
        self.rows.append(row)
        return row

    def remove(self, row: LlamaSeq) -> None:
        self.rows.remove(row)
        row.release()


class LlamaCppBase:
    """The engine's `Base` (backends/__init__.py) on llama.cpp. `full_hidden` False: a prefill outputs its
    last position alone (heads that read the last hidden state only), the other rows of its hidden states are
    zeros."""

    batchable = True
    preallocate = False  # no CUDA graphs

    def __init__(self, model: LlamaCppModel, *, full_hidden: bool = True):
        self.model, self.runtime, self.full_hidden = model, model.runtime, full_hidden
        self.device = torch.device("cpu")
        self.vocab_size = model.runtime.n_vocab
        self.lm_head = model.lm_head
        self.dtype = model.dtype
        # the hidden states of a forward that reads none, made once (empty: nothing to write into)
        self._no_hidden = torch.empty(0, model.runtime.n_embd, dtype=model.dtype)

    def new_cache(self, capacity: int, *, private: bool = False) -> LlamaSeq:
        """A generation's cache in the shared context, or (`private`) in a context of its own
        (`Runtime.private`: its numbers then do not depend on other generations')."""
        runtime = self.runtime.private(capacity) if private else self.runtime
        return LlamaSeq(runtime, capacity)

    def set_threads(self, threads: int) -> None:
        """llama.cpp's CPU threads from the next decode on (the server's live choice, server/threads.py)."""
        self.runtime.set_threads(threads)

    def threads(self) -> int:
        return self.runtime.threads

    def new_batch(self, rows: int | None = None) -> LlamaBatch:
        """The caches of a continuous batch of up to `rows` generations; the shared context grows to hold that
        many full windows (plus their trees' scratch) if no generation holds cells now."""
        if rows:
            self.runtime.grow(rows * (self.model.config.max_position_embeddings + ROW_SCRATCH))
        return LlamaBatch(self.runtime)

    def forward(
        self,
        tokens: torch.Tensor,
        tree: Tree | None,
        cache: LlamaSeq,
        *,
        logits_to_keep: int = 0,
        hidden: bool = True,
        interrupt: Interrupt | None = None,
        outputs: Sequence[bool] | None = None,
    ) -> Forward:
        """Tokens at positions cache.length + depth over `cache` (see the module docstring); a prefill (`tree`
        None) runs in chunks of N_BATCH tokens. `logits_to_keep` > 0: the logits of the last that many.
        `outputs` (a tree's, without `hidden`): only those nodes are output rows (llama.cpp runs no output head
        for the others, whose rows are zeros; with hidden states on, every token is an output row anyway).
        `hidden` False: the caller reads no hidden states (no heads), so llama.cpp computes and copies none
        (its embeddings stay off) and `Forward.hidden` is empty [0, H]. `interrupt` (a prefill's only): raised,
        it stops llama.cpp between two graph nodes (its abort callback, interrupt.py): `Preempted`, with the
        cells this call wrote dropped."""
        n, past = tokens.numel(), cache.length
        if past + n > cache.capacity:
            raise ValueError(f"{n} tokens after {past} overflow the KV cache of {cache.capacity}")
        toks = tokens.tolist()
        seqs = cache.open_step(tree, n)
        if tree is None:
            rt = cache.runtime
            with rt.interrupted(interrupt) if interrupt is not None else contextlib.nullcontext():
                try:
                    return self._prefill(rt, toks, past, seqs[0], logits_to_keep, hidden)
                except Preempted:  # drop what an earlier llama_decode of this call wrote too
                    rt.seq_rm(cache.seq, past)
                    raise
        # positions past + depth; a chain's (a plain step's) in Python: a tensor op costs ~10x more after a decode
        chain = tree.num_nodes == tree.depth
        positions = list(range(past, past + n)) if chain else (past + tree.depths).tolist()
        rows = [True] * n if outputs is None or hidden or all(outputs) else [bool(o) for o in outputs]
        rows[-1] = rows[-1] or not any(rows)  # a decode with no output row: the last node's
        logits, states = cache.runtime.decode(toks, positions, seqs, rows, embeddings=hidden)
        if len(logits) < n:  # the rows not read: zeros
            full = np.zeros((n, logits.shape[1]), dtype=logits.dtype)
            full[np.flatnonzero(rows)] = logits
            logits = full
        return self._forward(logits, states)

    def _prefill(
        self, runtime: Runtime, toks: list[int], past: int, seq: list[int], logits_to_keep: int, hidden: bool
    ) -> Forward:
        """A causal chain into the home sequence, in chunks of N_BATCH. llama.cpp makes every token an output
        row while hidden states are on, so unless the heads read every position (`full_hidden`) all but the
        last token run with them off (logits of the last `logits_to_keep` only), the last one with them on;
        without `hidden` every token runs with them off."""
        n = len(toks)
        keep = logits_to_keep if logits_to_keep > 0 else n
        plain = n if not hidden else 0 if self.full_hidden else n - 1  # tokens decoded without hidden states
        logits, states = [], []
        for start, end, emb in [*_chunks(0, plain, False), *_chunks(plain, n, True)]:
            outputs = [i >= n - keep for i in range(start, end)]
            lg, hd = runtime.decode(
                toks[start:end], list(range(past + start, past + end)), [seq] * (end - start), outputs, emb
            )
            logits.append(lg)
            states.append(hd)
        fwd = self._forward(np.concatenate(logits)[-keep:], np.concatenate(states))
        if plain and hidden:  # rows the heads never read (they read the last hidden state only)
            full = torch.zeros(n, fwd.hidden.shape[1], dtype=fwd.hidden.dtype)
            full[plain:] = fwd.hidden
            fwd = Forward(fwd.logits, full)
        return fwd

    def _forward(self, logits: np.ndarray, hidden: np.ndarray) -> Forward:
        if not hidden.size:  # no hidden states asked for: no conversion (a plain step's `.to` cost ~0.05 ms)
            return Forward(logits=torch.from_numpy(logits), hidden=self._no_hidden)
        return Forward(logits=torch.from_numpy(logits), hidden=torch.from_numpy(hidden).to(self.dtype))

    def commit(self, cache: LlamaSeq, path: list[int]) -> None:
        cache.commit(path)

    def forward_batch(
        self,
        tokens: list[torch.Tensor],
        trees: list[Tree],
        batch: LlamaBatch,
        *,
        hidden: bool = True,
        outputs: Sequence[Sequence[bool] | None] | None = None,
    ) -> list[Forward]:
        """Row b's `tokens[b]` as `trees[b]` over `batch.rows[b]`, every row in ONE llama_decode; `hidden`:
        `forward`'s (False: no row reads hidden states). `outputs[b]` (without `hidden`): row b's nodes that are
        output rows, as `forward`'s `outputs` (the others' logits are zeros; each row's logits stay [n_b, V])."""
        reads = outputs if outputs is not None and not hidden else [None] * len(tokens)
        toks, positions, seqs, rows, sizes = [], [], [], [], []
        for t, tree, row, read in zip(tokens, trees, batch.rows, reads, strict=True):
            n = t.numel()
            if row.length + n > row.capacity:
                raise ValueError(f"{n} tokens after {row.length} overflow the KV cache of {row.capacity}")
            if read is not None and len(read) != n:
                raise ValueError(f"{len(read)} outputs for a row of {n} tokens")
            toks += t.tolist()
            positions += (row.length + tree.depths).tolist()
            seqs += row.open_step(tree, n)
            rows += [True] * n if read is None else [bool(o) for o in read]
            sizes.append(n)
        if len(toks) > N_BATCH:
            raise LlamaCppError(
                f"a batched step of {len(toks)} tokens exceeds llama.cpp's batch of {N_BATCH}"
            )
        rows[-1] = rows[-1] or not any(rows)  # a decode with no output row: the last node's
        logits, states = self.runtime.decode(toks, positions, seqs, rows, embeddings=hidden)
        if len(logits) < len(toks):  # the rows not read: zeros
            full = np.zeros((len(toks), logits.shape[1]), dtype=logits.dtype)
            full[np.flatnonzero(rows)] = logits
            logits = full
        out, start = [], 0
        for k in sizes:
            out.append(
                self._forward(logits[start : start + k], states[start : start + k] if hidden else states)
            )
            start += k
        return out


def embedded_gguf_in(dtype: str) -> Path:
    """The embedded model's weights as a `dtype` GGUF (F32, BF16 or F16) in the user cache, written once from its
    Q4_1 file (`write_float_gguf`: ~10 s, 540 MB in float32): the same weights as the converted model
    transformers loads in that dtype, so that `--dtype` names the weights on either backend."""
    kind = FLOAT_GGUF_TYPES.get(dtype)
    if kind is None:
        raise LlamaCppError(f"no float GGUF for dtype {dtype!r}: use one of {', '.join(FLOAT_GGUF_TYPES)}")
    return embedded_gguf_as(kind)


def embedded_gguf_as(kind: str) -> Path:
    """The embedded model's weights as a GGUF of `kind` (F32, F16, BF16, Q8_0) in the user cache, written once
    from its Q4_1 file (`write_gguf`)."""
    from ..model import embedded_gguf

    path = embedded_gguf_path(kind)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(embedded_gguf(), path, kind)
    return path


def embedded_gguf_path(kind: str) -> Path:
    """Where `embedded_gguf_as(kind)` keeps its file (written or not)."""
    from ..model import cache_dir

    return cache_dir() / "models" / f"smollm2-135m-instruct-{kind.lower()}.gguf"


def embedded_f32_gguf() -> Path:
    """The embedded model as an F32 GGUF (`embedded_gguf_in("float32")`): llama.cpp on it gives transformers'
    float32 logits' greedy tokens."""
    return embedded_gguf_in("float32")
