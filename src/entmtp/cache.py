"""The transformers backend's KV caches and tree masks (backends/transformers.py's `BaseModel` runs the forward).

The engine sees three calls of the backend: `new_cache(capacity)`, `forward(tokens, tree, cache)` and
`commit(cache, path)`. The caches, the tree masks and the commit live here, behind that boundary.

Two caches:
- `KVCache` (the default): one preallocated tensor for every layer's keys and values (gpt-fast style). A
  forward writes its tokens into the scratch slots after the committed prefix, in place; the commit copies
  the accepted path down to the first free slots in one gather over all layers at once and moves the length.
  No per-step allocation or concatenation. Kept entries need no re-rotation: they were computed at the
  positions they end up at. In `static` mode a forward writes at device-side slot indices and attends over
  the first `kv_len` slots with the mask hiding what is not committed, so each (tree size, kv_len) is one
  fixed shape (what CUDA graphs replay, graphs.py); otherwise attention reads a view of the first
  `length + n` slots.
- `DynamicKV`: transformers' `DynamicCache`, appended to and cut back each step. The fallback for models
  the preallocated cache cannot serve (sliding-window or linear-attention layers), and the reference path.

Batches (batch.py): `BatchKV` keeps several generations side by side in one tensor, each row a `KVCache`
view of its own (prefill and commit run per row, as above), and the transformers backend's `BaseModel.forward_batch`
(backends/transformers.py) verifies every
row's tree in ONE forward: trees padded to the largest, each row writing at its own length and attending to
its own prefix and tree.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .interrupt import Interrupt, Preempted
from .tree import Tree


@dataclass
class Forward:
    logits: torch.Tensor  # [n, V] base logits at each input position (the last k with logits_to_keep=k)
    hidden: torch.Tensor  # [n, H] the hidden states the heads read


class KVCache(Cache):
    """Preallocated keys and values of every layer: `kv` [2, L, 1, kv_heads, capacity, head_dim], allocated at
    the first write (its shape read off the model's own key states). Slots [0, length) hold the committed
    prefix; a forward writes slots [length, length + n)."""

    def __init__(
        self, num_layers: int, capacity: int, *, static: bool = False, kv: torch.Tensor | None = None
    ):
        super().__init__(layers=[])
        self.num_layers, self.capacity, self.static = num_layers, capacity, static
        self.kv: torch.Tensor | None = kv  # given: a row of a `BatchKV` (a view into the batch's tensor)
        self.length = 0
        self.slots: torch.Tensor | None = None  # [n] static mode: where the forward in flight writes
        self.kv_len = capacity  # static mode: how many slots attention reads
        self.interrupt: Interrupt | None = None  # raised: the forward in flight stops before a layer

    def begin(self, n: int) -> None:
        """Open an eager forward of n tokens, written at slots length .. length + n - 1 (graphs.py sets
        `slots` and `kv_len` itself, inside the captured graph)."""
        if self.length + n > self.capacity:
            raise ValueError(f"{n} tokens after {self.length} overflow the KV cache of {self.capacity}")
        self.kv_len = self.capacity
        if self.static:
            device = self.kv.device if self.kv is not None else None
            self.slots = torch.arange(n, device=device) + self.length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' attention hands each layer's new keys and values [1, kv_heads, n, head_dim] here and
        attends over what comes back."""
        if self.interrupt is not None and self.interrupt.is_set():  # before this layer writes: length unmoved
            raise Preempted("a prefill forward stopped by its interrupt")
        if self.kv is None:
            b, h, _, d = key_states.shape
            shape = (2, self.num_layers, b, h, self.capacity, d)
            # eager forwards read only slots they wrote; static ones read every slot (masked: no NaN there)
            alloc = torch.zeros if self.static else torch.empty
            self.kv = alloc(shape, dtype=key_states.dtype, device=key_states.device)
            if self.static and self.slots is not None:
                self.slots = self.slots.to(key_states.device)
        keys, values = self.kv[0, layer_idx], self.kv[1, layer_idx]  # [1, kv_heads, capacity, head_dim]
        if self.static:
            keys.index_copy_(2, self.slots, key_states)
            values.index_copy_(2, self.slots, value_states)
            return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]
        start, end = self.length, self.length + key_states.shape[2]
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def commit(self, path: list[int]) -> None:
        """Keep slots `length + path` (ascending node ids of the accepted path) as the next len(path) slots."""
        n = len(path)
        if path[-1] != n - 1:  # a path 0..n-1 is already in place (always the case for chains)
            src = torch.tensor(path, device=self.kv.device) + self.length
            end = self.length + n
            self.kv[:, :, :, :, self.length : end] = self.kv[:, :, :, :, src]  # all layers in one gather
        self.length += n

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0

    def release(self) -> None:
        """Nothing to give back early: the tensors go with the cache (a batch's rows: `BatchKV.remove`)."""


class DynamicKV:
    """transformers' DynamicCache behind the same interface: each forward appends, the commit cuts back."""

    static = False

    def __init__(self, config):
        self.hf = DynamicCache(config=config)
        self.length, self.capacity = 0, sys.maxsize

    def begin(self, n: int) -> None:
        pass

    def release(self) -> None:
        """Nothing to give back early: the tensors go with the cache."""

    def commit(self, path: list[int]) -> None:
        n, start = len(path), self.length
        contiguous = path[-1] == n - 1
        src = None if contiguous else torch.tensor(path, device=self.hf.layers[0].keys.device) + start
        for layer in self.hf.layers:
            if src is not None:
                layer.keys[:, :, start : start + n] = layer.keys[:, :, src]  # [B, kv_heads, n, head_dim]
                layer.values[:, :, start : start + n] = layer.values[:, :, src]
            layer.keys = layer.keys[:, :, : start + n]
            layer.values = layer.values[:, :, : start + n]
        self.length += n


class BatchKV(Cache):
    """Several generations' keys and values side by side: `kv` [2, L, rows, kv_heads, capacity, head_dim]
    (zeros: a batched forward reads every row's slots up to the longest row's, masked, so none may be NaN).
    Row b is `rows[b]`, a `KVCache` whose tensor is a view of slice b: prefill and commit run on it alone.
    Rows are kept contiguous (`remove` moves the last row into the gap). The tensor is sized to its rows: it
    grows on demand (`add`) and shrinks when rows leave (`remove`: a long generation's slots come back when
    it ends), re-pointing every row's view. Its capacity is the longest row's tokens plus the largest tree any
    row verifies: a batched forward pads every row to the largest tree of the step, so a row at the end of
    the context window still has slots for its padding. During a batched forward (`begin` .. the forward)
    transformers hands each layer's keys and values [B, kv_heads, n, head_dim] to `update`, which writes row
    b at slots rows[b].length .. + n - 1."""

    def __init__(self, model):
        super().__init__(layers=[])
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype, self.device = model.dtype, model.device
        self.kv = self._zeros(0, 0)
        self.rows: list[KVCache] = []
        self._needs: dict[int, tuple[int, int]] = {}  # id(row) -> (its tokens, its largest tree's slots)
        self._slots: torch.Tensor | None = None  # [B * kv_heads * n]: where the forward in flight writes
        self._kv_len = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def add(self, tokens: int, scratch: int = 0, like: KVCache | None = None) -> KVCache:
        """A new row for `tokens` tokens (its prompt and output) whose steps verify up to `scratch` tokens past
        them; `like`: a cache whose committed slots it starts with (a prompt prefilled apart)."""
        need = (tokens, scratch)
        rows, capacity = self.kv.shape[2], self._capacity_for([*self._needs.values(), need])
        if len(self.rows) == rows or capacity > self.capacity:
            self._resize(max(rows, len(self.rows) + 1), max(capacity, self.capacity))
        row = KVCache(self.num_layers, self.capacity, kv=self._view(len(self.rows)))
        self._needs[id(row)] = need
        if like is not None:
            row.kv[:, :, :, :, : like.length] = like.kv[:, :, :, :, : like.length]
            row.length = like.length
        self.rows.append(row)
        return row

    def remove(self, row: KVCache) -> None:
        """Drop `row`; the last row moves into its place (its committed slots copied, its view re-pointed),
        and the tensor shrinks when it holds over twice what the rows left need."""
        b, last = next(i for i, r in enumerate(self.rows) if r is row), len(self.rows) - 1
        if b != last:
            moved = self.rows[last]
            self.kv[:, :, b, :, : moved.length] = self.kv[:, :, last, :, : moved.length]
            moved.kv = self._view(b)
            self.rows[b] = moved
        self.rows.pop()
        self._needs.pop(id(row), None)
        capacity = self._capacity_for(self._needs.values())
        if self.kv.shape[2] * self.capacity > 2 * len(self.rows) * capacity:
            self._resize(len(self.rows), capacity)

    @staticmethod
    def _capacity_for(needs) -> int:
        """Slots every row needs: the longest row's tokens plus the largest tree's (whole blocks of 256, so a
        few rows joining rarely reallocate)."""
        needs = list(needs)
        if not needs:
            return 0
        capacity = max(t for t, _ in needs) + max(s for _, s in needs)
        return -(-capacity // 256) * 256

    def _view(self, b: int) -> torch.Tensor:
        return self.kv[:, :, b : b + 1]

    def _zeros(self, rows: int, capacity: int) -> torch.Tensor:
        shape = (2, self.num_layers, rows, self.kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _resize(self, rows: int, capacity: int) -> None:
        """A new tensor of `rows` x `capacity`, every row's committed slots copied and its view re-pointed."""
        kv = self._zeros(rows, capacity)
        for b, row in enumerate(self.rows):
            kv[:, :, b, :, : row.length] = self.kv[:, :, b, :, : row.length]
        self.kv = kv
        for b, row in enumerate(self.rows):
            row.kv, row.capacity = self._view(b), capacity

    def begin(self, n: int) -> torch.Tensor:
        """Open a batched forward of n tokens per row; the lengths [B] it writes after."""
        lengths = torch.tensor([r.length for r in self.rows])
        if int(lengths.max()) + n > self.capacity:
            raise ValueError(
                f"{n} tokens after {int(lengths.max())} overflow the batch cache of {self.capacity}"
            )
        self._slots = self._flat_slots(lengths, n).to(self.device)
        self._kv_len = int(lengths.max()) + n
        return lengths

    def _flat_slots(self, lengths: torch.Tensor, n: int) -> torch.Tensor:
        """[B * kv_heads * n]: where row b, head h, token i goes in one layer's keys seen as [B * kv_heads *
        capacity, head_dim] rows (slot lengths[b] + i), in the order of a [B, kv_heads, n, head_dim] tensor."""
        b, h, capacity = len(lengths), self.kv_heads, self.capacity
        slots = lengths[:, None] + torch.arange(n)  # [B, n]
        heads = torch.arange(b)[:, None] * h + torch.arange(h)  # [B, kv_heads]: row b's head h
        return (heads[:, :, None] * capacity + slots[:, None, :]).reshape(-1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the forward's keys and values (row b at its slots, see `begin`) with one `index_copy_` each
        over the layer's slots seen as rows of head_dim: it touches those rows alone (`scatter_` on a bf16
        cache copied the whole [B, kv_heads, capacity, head_dim] layer to float32 and back on every call)."""
        b, h, n, d = key_states.shape
        keys, values = self.kv[0, layer_idx, :b], self.kv[1, layer_idx, :b]  # [B, kv_heads, capacity, hd]
        keys.view(-1, d).index_copy_(0, self._slots, key_states.reshape(-1, d))
        values.view(-1, d).index_copy_(0, self._slots, value_states.reshape(-1, d))
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((r.length for r in self.rows), default=0)


def preallocation_blocker(model) -> str | None:
    """Why the preallocated cache cannot serve `model` (None: it can)."""
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers are {', '.join(sorted(kinds))}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"it uses a sliding attention window ({config.sliding_window})"
    return None


def tree_mask(tree: Tree | None, n: int) -> torch.Tensor:
    """[n, n] bool: the tree's ancestor mask, or causal for a chain of n tokens (tree None)."""
    return torch.ones(n, n, dtype=torch.bool).tril_() if tree is None else tree.mask


def static_mask(mask: torch.Tensor, past: int | torch.Tensor, capacity: int) -> torch.Tensor:
    """[n, capacity] bool over the whole cache: the committed prefix [0, past), then the tree's own [n, n]
    mask at slots past .. past + n - 1, nothing after. `past` may be a device scalar: then nothing here
    reads it on the host, so the mask can be built inside a captured graph."""
    n = mask.shape[0]
    rel = torch.arange(capacity, device=mask.device) - past  # [capacity] slot - past
    inside = (rel >= 0) & (rel < n)
    own = mask[:, rel.clamp(0, n - 1)] & inside  # [n, capacity]
    return own | (rel < 0)
