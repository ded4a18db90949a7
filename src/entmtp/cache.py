"""The base model's KV cache and the one forward pass that verifies a tree.

The cache is transformers' own `DynamicCache`. A verification forward appends every tree node to it; the
commit then keeps only the accepted path: the accepted entries are copied down to the first free slots and
the rest is cut off. Kept entries need no re-rotation: they were computed at the positions they end up at.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Forward:
    logits: torch.Tensor  # [n, V] base logits at each input position
    hidden: torch.Tensor  # [n, H] the hidden states the heads read


class BaseModel:
    """A causal LM seen as: (token ids, positions, mask, cache) -> logits and hidden states."""

    def __init__(self, model, hidden_state_offset: int = 0):
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.hidden_state_offset = hidden_state_offset
        params = inspect.signature(self.decoder.forward).parameters
        # transformers >= 5.24 names the argument `cache`; older 5.x calls it `past_key_values`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def forward(
        self,
        ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        cache: DynamicCache,
        mask: torch.Tensor | None = None,  # [n, past + n] bool (True = attend), None = causal
    ) -> Forward:
        kwargs = {self._cache_kw: cache}
        if mask is not None:
            kwargs["attention_mask"] = mask[None, None]  # [1, 1, n, past + n]
        offset = self.hidden_state_offset
        out = self.decoder(
            input_ids=ids[None],
            position_ids=positions[None],
            use_cache=True,
            output_hidden_states=offset > 0,
            **kwargs,
        )
        last = out.last_hidden_state[0]  # [n, H]
        hidden = out.hidden_states[-1 - offset][0] if offset > 0 else last
        return Forward(logits=self.lm_head(last), hidden=hidden)


def commit_path(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep cache slots `start + keep` (ascending node ids of the accepted path), moved to
    `start .. start + len(keep) - 1`, and drop every slot after them."""
    n = keep.numel()
    contiguous = bool(keep[-1] == n - 1)  # path 0..n-1 is already in place (always the case for chains)
    src = keep + start
    for layer in cache.layers:
        if not contiguous:
            layer.keys[:, :, start : start + n] = layer.keys[:, :, src]  # [B, kv_heads, n, head_dim]
            layer.values[:, :, start : start + n] = layer.values[:, :, src]
        layer.keys = layer.keys[:, :, : start + n]
        layer.values = layer.values[:, :, : start + n]
