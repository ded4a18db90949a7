"""Backends: what runs the base model's forward passes.

The engine needs few things from a base model, the `Base` protocol below: a KV cache per generation, ONE
forward that verifies a tree of tokens over it (logits per node, and the hidden states the heads read), and a
commit that keeps the accepted path and drops the rest; for continuous batching, a batch of such caches and
one forward over every row's tree. Two backends implement it:

  transformers  `cache.BaseModel`: any Hugging Face causal LM in PyTorch, tree masks as 4D attention masks over
                a preallocated KV cache (the reference, and the one that runs on a GPU).
  llama-cpp     `backends.llama_cpp.LlamaCppBase`: a GGUF file on llama.cpp's CPU kernels through
                llama-cpp-python. A tree is one `llama_decode` whose tokens carry one sequence id per leaf
                below them; the commit keeps the accepted path's KV cells by sequence (seq_rm / seq_cp).

The heads, the policies, lookup drafts, acceptance rules, the cost probe and batching see only this protocol,
so every method runs on either backend. `base_for` picks the implementation for a loaded model.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..interrupt import Interrupt
from ..tree import Tree

BACKENDS = ("auto", "transformers", "llama-cpp")  # `auto`: measured per machine (build.py)


class Base(Protocol):
    """The base model as the engine sees it (see the module docstring)."""

    device: torch.device
    vocab_size: int
    batchable: bool  # whether `new_batch` / `forward_batch` serve continuous batching

    def new_cache(self, capacity: int, *, private: bool = False):
        """A generation's cache; `private`: one whose numbers no other generation's cache can move (a seeded
        sampled batch row's, which must repeat whatever its batch-mates)."""

    def forward(
        self,
        tokens: torch.Tensor,
        tree: Tree | None,
        cache,
        *,
        logits_to_keep: int = 0,
        hidden: bool = True,
        interrupt: Interrupt | None = None,
    ):
        """Logits (and, with `hidden`, the hidden states the heads read) of `tokens` as `tree` over `cache`.
        `hidden` False: the caller reads no hidden states, and a backend may return none (llama.cpp then
        keeps its embeddings off). `interrupt`: a prefill (`tree` None) stops part way once it is raised,
        with `Preempted`, the cache as before the call (interrupt.py); a backend may also finish it."""

    def commit(self, cache, path: list[int]) -> None: ...

    def set_threads(self, threads: int) -> None:
        """CPU threads for the forwards from now on (called on the thread that runs them)."""

    def threads(self) -> int:
        """CPU threads the forwards run on now."""

    def new_batch(self, rows: int | None = None):
        """A continuous batch's caches for up to `rows` generations at once (None: not known)."""

    def forward_batch(
        self, tokens: list[torch.Tensor], trees: list[Tree], batch, *, hidden: bool = True
    ) -> list: ...


def base_for(
    model,
    hidden_state_offset: int = 0,
    kv: str = "auto",
    *,
    full_hidden: bool = True,
    hidden_state_norm: bool = True,
) -> Base:
    """The backend that runs `model`: llama.cpp for a model loaded from a GGUF file by `llama_cpp.load_gguf`,
    else transformers. `full_hidden` False: the heads read only the last position's hidden state (Medusa,
    Hydra-`mlp`), so a llama.cpp prefill outputs the last position alone. `hidden_state_offset` and
    `hidden_state_norm`: what the heads read (`heads.config.heads_input`); llama.cpp gives the last layer's."""
    maker = getattr(model, "entmtp_base", None)
    if maker is not None:
        return maker(hidden_state_offset=hidden_state_offset, full_hidden=full_hidden)
    from ..cache import BaseModel

    return BaseModel(
        model, hidden_state_offset=hidden_state_offset, kv=kv, hidden_state_norm=hidden_state_norm
    )


def backend_name(model) -> str:
    """`llama-cpp` or `transformers`: the backend that runs `model`."""
    return "llama-cpp" if getattr(model, "entmtp_base", None) is not None else "transformers"


def describe_kernels(model) -> str:
    """For a model on llama.cpp, the build and its CPU kernels in words (the plan, the bench): "llama-cpp-python
    0.3.36 (entmtp's build: AMX patch 1a2b3c4d); AMX kernels in use"; "" on transformers."""
    runtime = getattr(model, "runtime", None)
    if getattr(model, "entmtp_base", None) is None or runtime is None:
        return ""
    from .amx import has_amx
    from .llama_build import describe_build

    if not has_amx():
        kernels = "no AMX on this CPU"
    elif runtime.extra_bufts:
        kernels = "AMX kernels in use"
    else:
        kernels = "AMX kernels off (repacked weights off)"
    return f"{describe_build()}; {kernels}"


GGUF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # float GGUF types as dtypes


def weights_format(model) -> str | None:
    """The format of the weights `model` computes with, comparable across backends: a dtype ("float32",
    "bfloat16") for transformers and for a float GGUF, else the GGUF's own type ("Q4_1"). Two engines decode
    the same weights when their formats are equal (the embedded model's GGUFs are all written from one file).
    None: not a model of either backend."""
    gguf = getattr(model, "weights", None)  # llama_cpp.LlamaCppModel: its file's type
    if gguf is not None:
        return GGUF_DTYPES.get(gguf, gguf)
    dtype = getattr(model, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def describe_weights(model) -> str:
    """The weights in words for the plan, the server's log and the bench: "Q4_1 GGUF (file.gguf) on
    llama.cpp", "float32 (F32 GGUF file.gguf) on llama.cpp", "bfloat16 on transformers"."""
    gguf = getattr(model, "weights", None)
    if gguf is None:
        return f"{weights_format(model) or 'unknown'} on transformers"
    name = getattr(getattr(model, "path", None), "name", "?")
    if gguf in GGUF_DTYPES:
        return f"{GGUF_DTYPES[gguf]} ({gguf} GGUF {name}) on llama.cpp"
    return f"{gguf} GGUF ({name}) on llama.cpp"
