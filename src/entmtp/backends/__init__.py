"""Backends: what runs the base model's forward passes.

The engine needs few things from a base model, the `Base` protocol below: a KV cache per generation, ONE
forward that verifies a tree of tokens over it (logits per node, and the hidden states the heads read), and a
commit that keeps the accepted path and drops the rest; for continuous batching, a batch of such caches and
one forward over every row's tree. Two backends implement it:

  transformers  `backends.transformers.BaseModel`: any Hugging Face causal LM in PyTorch, tree masks as 4D
                attention masks over a preallocated KV cache (the reference, and the one that runs on a GPU;
                calibration's typical traces also use its `run`, a forward under any explicit mask).
  llama-cpp     `backends.llama_cpp.LlamaCppBase`: a GGUF file on llama.cpp's CPU kernels through
                llama-cpp-python. A tree is one `llama_decode` whose tokens carry one sequence id per leaf
                below them; the commit keeps the accepted path's KV cells by sequence (seq_rm / seq_cp).

The heads, the policies, lookup drafts, acceptance rules, the cost probe and batching see only this protocol,
so every method runs on either backend. `base_for` picks the implementation for a loaded model; registry.py
says what `build` asks of each backend (which candidates, how to load them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..interrupt import Interrupt
from ..tree import Tree
from .registry import BACKENDS, REGISTRY, backend_of  # noqa: F401  (what `build` asks of each, by name)


class Cache(Protocol):
    """A generation's KV cache as the engine sees it; the backend reads and writes it in `forward` and
    `commit`."""

    length: int  # tokens committed

    def release(self) -> None:
        """Give back now what the cache holds beyond memory (llama.cpp: its sequence id and KV cells; the
        transformers caches: nothing). The engine calls it when a generation ends."""


class Base(Protocol):
    """The base model as the engine sees it (see the module docstring)."""

    device: torch.device
    vocab_size: int
    batchable: bool  # whether `new_batch` / `forward_batch` serve continuous batching
    # transformers' preallocated KV cache: CUDA graphs can replay over it, a probe rewinds rows in place, the
    # batch has a cost surface (costs/); False on llama.cpp and on transformers' DynamicCache
    preallocate: bool

    def new_cache(self, capacity: int, *, private: bool = False) -> Cache:
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
        outputs: Sequence[bool] | None = None,
    ):
        """Logits (and, with `hidden`, the hidden states the heads read) of `tokens` as `tree` over `cache`.
        `hidden` False: the caller reads no hidden states, and a backend may return none (llama.cpp then
        keeps its embeddings off). `interrupt`: a prefill (`tree` None) stops part way once it is raised,
        with `Preempted`, the cache as before the call (interrupt.py); a backend may also finish it.
        `outputs` [n] (a tree's): the nodes whose logits the caller reads (None: all); the other rows may
        hold anything finite (llama.cpp computes none of them: no output head, no copy)."""

    def commit(self, cache, path: list[int]) -> None: ...

    def set_threads(self, threads: int) -> None:
        """CPU threads for the forwards from now on (called on the thread that runs them)."""

    def threads(self) -> int:
        """CPU threads the forwards run on now."""

    def new_batch(self, rows: int | None = None):
        """A continuous batch's caches for up to `rows` generations at once (None: not known)."""

    def forward_batch(
        self,
        tokens: list[torch.Tensor],
        trees: list[Tree],
        batch,
        *,
        hidden: bool = True,
        outputs: Sequence[Sequence[bool] | None] | None = None,
    ) -> list:
        """Row b's `tokens[b]` as `trees[b]` over `batch.rows[b]`, every row in ONE forward; `hidden` and
        `outputs[b]` (row b's nodes whose logits the caller reads; None: all, every row's) as `forward`'s,
        each row's logits [n_b, V] either way."""


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
    return backend_of(model).base(
        model,
        hidden_state_offset=hidden_state_offset,
        kv=kv,
        full_hidden=full_hidden,
        hidden_state_norm=hidden_state_norm,
    )


def backend_name(model) -> str:
    """`llama-cpp` or `transformers`: the backend that runs `model`."""
    return backend_of(model).name


def describe_kernels(model) -> str:
    """For a model on llama.cpp, the build and its CPU kernels in words (the plan, the bench); "" on
    transformers."""
    return backend_of(model).describe_kernels(model)


def weights_format(model) -> str | None:
    """The format of the weights `model` computes with, comparable across backends: a dtype ("float32",
    "bfloat16") for transformers and for a float GGUF, else the GGUF's own type ("Q4_1"). Two engines decode
    the same weights when their formats are equal (the embedded model's GGUFs are all written from one file).
    None: not a model of either backend."""
    return backend_of(model).weights_format(model)


def describe_weights(model) -> str:
    """The weights in words for the plan, the server's log and the bench: "Q4_1 GGUF (file.gguf) on
    llama.cpp", "float32 (F32 GGUF file.gguf) on llama.cpp", "bfloat16 on transformers"."""
    return backend_of(model).describe_weights(model)
