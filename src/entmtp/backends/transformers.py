"""The transformers backend: any Hugging Face causal LM in PyTorch. `BaseModel` runs it for the engine (the
`Base` protocol, backends/__init__.py) over the caches of cache.py; `Transformers` is what `build` asks of it
(registry.py). The reference backend, and the one that runs on a GPU."""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cache import (
    BatchKV,
    DynamicKV,
    Forward,
    KVCache,
    preallocation_blocker,
    static_mask,
    tree_mask,
)
from ..heads.config import heads_input
from ..interrupt import Interrupt
from ..tree import Tree
from .backend import Backend

_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

CPU_CANDIDATES = ("bfloat16", "float32")  # what `auto` compares on a CPU (fp16 matmuls are slow there)


class Transformers(Backend):
    name = "transformers"
    words = "transformers"
    torch_model = True

    def candidates(self, spec, probe: bool) -> list[str]:
        if spec.dtype != "auto":
            dtypes = [spec.dtype]
        elif spec.device.startswith("cuda"):
            dtypes = ["bfloat16" if torch.cuda.is_bf16_supported() else "float16"]
        elif not probe:  # nothing measured: the dtype that is faster on most CPUs for one-token steps
            dtypes = ["bfloat16"]
        else:
            dtypes = list(CPU_CANDIDATES)
        return [f"{self.name}/{d}" for d in dtypes]

    def load(self, spec):
        from ..model import load_model

        return load_model(spec.model, dtype=spec.dtype, device=spec.device, pack=spec.pack)

    def batchable(self, spec, model) -> bool:
        """batch.py steps rows over the preallocated cache (not --kv dynamic, not every attention kind)."""
        return spec.kv == "auto" and preallocation_blocker(model) is None

    def base(self, model, *, hidden_state_offset: int, kv: str, full_hidden: bool, hidden_state_norm: bool):
        return BaseModel(
            model, hidden_state_offset=hidden_state_offset, kv=kv, hidden_state_norm=hidden_state_norm
        )

    def weights_format(self, model) -> str | None:
        dtype = getattr(model, "dtype", None)
        return None if dtype is None else str(dtype).removeprefix("torch.")


TRANSFORMERS = Transformers()


class BaseModel:
    """A causal LM seen as: (token ids, tree, cache) -> logits and hidden states.

    `kv="auto"` uses the preallocated `KVCache` where the model allows it and says once why not otherwise;
    `kv="dynamic"` always uses transformers' `DynamicCache`.
    """

    def __init__(self, model, hidden_state_offset: int = 0, kv: str = "auto", hidden_state_norm: bool = True):
        if kv not in ("auto", "dynamic"):
            raise ValueError(f"unknown kv cache {kv!r}: use 'auto' or 'dynamic'")
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.hidden_state_offset = hidden_state_offset  # what the heads read: see heads.config.heads_input
        self.hidden_state_norm = hidden_state_norm
        params = inspect.signature(self.decoder.forward).parameters
        # transformers >= 5.24 names the argument `cache`; older 5.x calls it `past_key_values`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.num_layers = model.config.num_hidden_layers
        blocker = preallocation_blocker(model) if kv == "auto" else None
        if blocker is not None:
            print(f"entmtp: this model keeps transformers' DynamicCache: {blocker}", file=sys.stderr)
        self.preallocate = kv == "auto" and blocker is None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def batchable(self) -> bool:
        """Continuous batching needs the preallocated cache (`BatchKV`)."""
        return self.preallocate

    def set_threads(self, threads: int) -> None:
        """torch's CPU threads for the forwards the calling thread runs from now on (the server's live choice,
        server/threads.py: called on the thread that steps the model)."""
        torch.set_num_threads(threads)

    def threads(self) -> int:
        return torch.get_num_threads()

    def new_batch(self, rows: int | None = None) -> BatchKV:
        """A batch cache (it grows with its rows: `rows` is for backends that size a shared one up front)."""
        return BatchKV(self.model)

    def new_cache(self, capacity: int, *, static: bool = False, private: bool = False) -> KVCache | DynamicKV:
        """A cache for `capacity` tokens (prompt, output and the largest tree's scratch). Every cache here is
        private (`private` is for backends whose generations share one: backends/__init__.py)."""
        if not self.preallocate:
            return DynamicKV(self.model.config)
        return KVCache(self.num_layers, capacity, static=static)

    def forward(
        self,
        tokens: torch.Tensor,  # [n] on the model's device
        tree: Tree | None,  # None: a causal chain (the prefill)
        cache: KVCache | DynamicKV,
        *,
        logits_to_keep: int = 0,
        hidden: bool = True,
        interrupt: Interrupt | None = None,
        outputs=None,
    ) -> Forward:
        """Tokens at positions cache.length + depth, each attending to the committed prefix and to its own
        ancestors in the tree; their keys and values go into the cache's scratch slots (`commit` keeps the
        accepted ones). `logits_to_keep` > 0: logits of the last that many tokens only (a prefill needs the
        last one's: the LM head over every prompt position is up to a fifth of a long prompt's work).
        `hidden` and `outputs` (the Base protocol's): the hidden states come with the logits either way here,
        and every row's logits (a row the caller skips costs a tree node little on this backend's curve).
        `interrupt` (a prefill's only): raised, it stops the forward before its next layer writes
        (`Preempted`; the cache's length unmoved, so nothing it wrote counts). transformers' own cache
        (`DynamicKV`) appends as it goes and is never interrupted."""
        n, past, dev = tokens.numel(), cache.length, tokens.device
        depths = torch.arange(n) if tree is None else tree.depths  # [n]
        positions = (past + depths).to(dev)
        cache.begin(n)
        chain = tree is None or tree.num_nodes == tree.depth
        if cache.static:
            mask = static_mask(tree_mask(tree, n).to(dev), past, cache.capacity)
        elif chain and (past == 0 or isinstance(cache, DynamicKV)):
            # transformers' own causal mask: on an empty cache none at all, SDPA's is_causal with grouped
            # heads, as generate's prefill runs (on the CPU bit for bit the explicit mask's keys, values and
            # hidden states, without its [n, n] mask and repeated keys)
            mask = None
        else:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=dev)  # [n, past + n]
            mask[:, past:] = tree_mask(tree, n).to(dev)
        if interrupt is None or tree is not None or not isinstance(cache, KVCache):
            return self.run(tokens, positions, mask, cache, logits_to_keep=logits_to_keep)
        cache.interrupt = interrupt
        try:
            return self.run(tokens, positions, mask, cache, logits_to_keep=logits_to_keep)
        finally:
            cache.interrupt = None

    def run(
        self,
        tokens: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        mask: torch.Tensor | None,  # [n, kv_len] bool (True = attend) or None (causal)
        cache: KVCache | DynamicKV,
        *,
        fixed_shape: bool = False,
        logits_to_keep: int = 0,
    ) -> Forward:
        """The bare decoder + LM head call (what graphs.py captures, with `fixed_shape`).

        On CUDA, cuDNN's attention builds an execution plan for every new shape, tens of milliseconds each,
        and an eager forward's key length changes every step: so eager forwards use PyTorch's own attention
        kernels, and only the fixed shapes of captured graphs use cuDNN."""
        eager_cuda = tokens.device.type == "cuda" and not fixed_shape
        with sdpa_kernel(_NO_CUDNN) if eager_cuda else contextlib.nullcontext():
            out = self._decode(tokens[None], positions[None], None if mask is None else mask[None], cache)
        last = out.last_hidden_state[0]  # [n, H]
        hidden = self._heads_input(out)[0]
        keep = last[-logits_to_keep:] if logits_to_keep > 0 else last
        return Forward(logits=self.lm_head(keep), hidden=hidden)

    def forward_batch(
        self,
        tokens: list[torch.Tensor],
        trees: list[Tree],
        batch: BatchKV,
        *,
        hidden: bool = True,
        outputs=None,
    ) -> list[Forward]:
        """Verify row b's `tokens[b]` [n_b] as `trees[b]` over `batch.rows[b]`, every row in ONE forward: rows
        padded to the largest tree (padding tokens attend only to themselves and are never committed), row b
        at positions rows[b].length + depth, attending to its own prefix and its tree's ancestors. Forward b
        has logits and hidden states of row b's n_b real tokens; `commit` on rows[b] keeps its path.
        `hidden` and `outputs` (the Base protocol's): as `forward`, every row's hidden states and logits."""
        n = max(t.numel() for t in tokens)
        lengths = batch.begin(n)  # [B]
        kv_len = int(lengths.max()) + n
        ids = torch.zeros(len(tokens), n, dtype=torch.long, device=self.device)
        depths = torch.zeros(len(tokens), n, dtype=torch.long)
        mask = torch.zeros(len(tokens), n, kv_len, dtype=torch.bool)
        for b, (toks, tree) in enumerate(zip(tokens, trees, strict=True)):
            k, past = toks.numel(), int(lengths[b])
            ids[b, :k] = toks
            depths[b, :k] = tree.depths
            mask[b, :, :past] = True
            mask[b, :k, past : past + k] = tree.mask
            pad = torch.arange(k, n)
            mask[b, pad, past + pad] = True  # a padding token sees itself: no empty softmax row
        positions = (lengths[:, None] + depths).to(self.device)
        out = self._decode(ids, positions, mask.to(self.device), batch)
        last = out.last_hidden_state  # [B, n, H]
        hidden = self._heads_input(out)
        sizes = [t.numel() for t in tokens]
        logits = self.lm_head(torch.cat([last[b, :k] for b, k in enumerate(sizes)])).split(sizes)
        return [
            Forward(logits=lg, hidden=hidden[b, :k])
            for b, (lg, k) in enumerate(zip(logits, sizes, strict=True))
        ]

    def _heads_input(self, out) -> torch.Tensor:
        return heads_input(self.decoder, out, self.hidden_state_offset, self.hidden_state_norm)

    def _decode(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache):
        """The decoder over `ids` [B, n] at `positions` [B, n], `mask` [B, n, kv_len] bool (True = attend) or
        None (causal), with the cache transformers should write to."""
        kwargs = {self._cache_kw: cache.hf if isinstance(cache, DynamicKV) else cache}
        if mask is not None:  # additive, built once: SDPA would convert a bool mask again in every layer
            bias = torch.zeros(mask.shape, dtype=self.lm_head.weight.dtype, device=mask.device)
            bias.masked_fill_(~mask, torch.finfo(bias.dtype).min)
            kwargs["attention_mask"] = bias[:, None]  # [B, 1, n, kv_len]: 0 = attend
        return self.decoder(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=self.hidden_state_offset > 0,
            **kwargs,
        )

    def commit(self, cache: KVCache | DynamicKV, path: list[int]) -> None:
        """Keep the accepted path (node ids, root first) of the last forward; drop the rest of its tokens."""
        cache.commit(path)
