"""CUDA graphs of the verification forward: capture once per token-count bucket, replay every step.

On a GPU a small model's forward is host-bound: hundreds of kernel launches and the Python around them cost
more than the arithmetic. A tree of n nodes is a fixed shape, so the whole forward (embedding, every layer,
the KV write, the LM head) is captured once as a CUDA graph and replayed with one launch. Trees are padded to
the next bucket size (`BUCKETS`), so a whole bank, pruned hybrid trees included, needs a handful of graphs.

A graph reads its inputs from fixed buffers: the token ids [b], the node depths [b], the tree mask [b, b] and
the committed length (a device scalar). Slots, positions and the [b, kv_len] attention mask are computed
inside the graph, so a step costs four small copies and one replay. Attention reads the first kv_len slots
of the cache, kv_len rounded up from what is in use (`kv_bucket`), so a graph is captured per (tree bucket,
kv_len) pair and attention costs what the context needs, not the whole capacity. Padding nodes attend
only to themselves; their slots lie past the tree's and are never committed. The graphs write into one
static `KVCache` that this object owns, so one generation at a time uses them (a concurrent one falls back
to an eager cache). Captured forwards use cuDNN attention (fixed shapes); eager ones do not (cache.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from .backends.transformers import BaseModel
from .cache import Forward, KVCache, static_mask
from .tree import Tree

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256)
MIN_CAPACITY = 1024  # caches grow in powers of two from here, so graphs survive most new generations
KV_UNIT = 256  # attention reads the first 256 * {1, 2, 3, 4, 6, 8, 12, ...} slots: at most 1.5x what is used


@dataclass
class _Graph:
    size: int  # b: the bucket
    kv_len: int  # slots attention reads: the committed prefix and the tree, rounded up (kv_bucket)
    ids: torch.Tensor  # [b] int64 input
    depths: torch.Tensor  # [b] int64 input
    mask: torch.Tensor  # [b, b] bool input
    graph: torch.cuda.CUDAGraph | None = None
    out: Forward | None = None  # logits [b, V], hidden [b, H]: overwritten by each replay


def bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


def kv_bucket(n: int, capacity: int) -> int:
    """Slots a forward attends over when n are in use: KV_UNIT times 1, 2, 3, 4, 6, 8, 12, 16, ... (at most
    the capacity), so attention costs what the context needs and a generation crosses a few sizes only."""
    m = 1
    while KV_UNIT * m < n:
        m = 2 if m == 1 else (m * 3 // 2 if m & (m - 1) == 0 else m * 4 // 3)
    return min(KV_UNIT * m, capacity)


class VerifyGraphs:
    def __init__(self, base: BaseModel, *, capture: bool = True, verbose: bool = True):
        """`capture=False` runs the same padded static-shape forward eagerly instead of replaying a graph
        (what the CPU tests check, and a way to tell a graph problem from a padding problem)."""
        self.base, self.capture, self.verbose = base, capture, verbose
        self.cache: KVCache | None = None
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (bucket, kv_len) -> graph
        self.padded: dict[tuple[Tree, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.in_use = False
        dev = base.device
        self.past = torch.zeros((), dtype=torch.int64, device=dev)  # the committed length, on the device
        self.arange = torch.arange(BUCKETS[-1], device=dev)
        self.captures: list[dict] = []  # {"size", "seconds"} per capture: what warm-up cost

    def cache_for(self, need: int, limit: int) -> KVCache:
        """The graphs' static cache, emptied, holding at least `need` tokens (at most `limit`). A larger
        cache than the current one drops the captured graphs (they point at the old one)."""
        if self.cache is None or self.cache.capacity < need:
            capacity = min(limit, max(MIN_CAPACITY, 1 << (need - 1).bit_length()))
            self.cache = self.base.new_cache(capacity, static=True)
            self.graphs.clear()
            self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.cache.reset()
        return self.cache

    def forward(self, tokens: torch.Tensor, tree: Tree) -> Forward | None:
        """Replay the bucket's graph for this tree (capturing it on first use); None when the tree is too
        large for any bucket or for the cache's free slots (the caller then runs it eagerly)."""
        cache, n = self.cache, tokens.numel()
        b = bucket(n)
        if b is None or cache.length + b > cache.capacity:
            return None
        kv_len = kv_bucket(cache.length + b, cache.capacity)
        depths, mask = self._inputs(tree, b)
        g = self.graphs.get((b, kv_len))
        fresh = g is None
        if fresh:
            ids = torch.zeros(b, dtype=torch.int64, device=tokens.device)
            g = _Graph(b, kv_len, ids, depths.clone(), mask.clone())
        g.ids[:n].copy_(tokens)
        g.depths.copy_(depths)
        g.mask.copy_(mask)
        self.past.fill_(cache.length)
        if fresh:
            self._capture(g)
            self.graphs[(b, kv_len)] = g
        if self.capture:
            g.graph.replay()
        else:
            g.out = self._body(g)
        return Forward(logits=g.out.logits[:n], hidden=g.out.hidden[:n])

    def _inputs(self, tree: Tree, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's depths [b] and mask [b, b] padded to the bucket, on the device (built once per tree)."""
        key = (tree, b)
        if key not in self.padded:
            n = tree.size
            depths = torch.zeros(b, dtype=torch.int64)
            depths[:n] = tree.depths
            mask = torch.eye(b, dtype=torch.bool)  # padding nodes see themselves only
            mask[:n, :n] = tree.mask
            dev = self.base.device
            self.padded[key] = (depths.to(dev), mask.to(dev))
        return self.padded[key]

    def _body(self, g: _Graph) -> Forward:
        cache = self.cache
        cache.slots, cache.kv_len = self.past + self.arange[: g.size], g.kv_len
        mask = static_mask(g.mask, self.past, g.kv_len)  # [b, kv_len]
        return self.base.run(g.ids, self.past + g.depths, mask, cache, fixed_shape=True)

    def _capture(self, g: _Graph) -> None:
        if not self.capture:
            return
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, allocator, kernel choice
            for _ in range(2):
                self._body(g)
        torch.cuda.current_stream().wait_stream(stream)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = self._body(g)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.captures.append({"size": g.size, "kv_len": g.kv_len, "seconds": seconds})
        if self.verbose:
            print(
                f"entmtp: captured the CUDA graph for {g.size}-token verification over {g.kv_len} cache "
                f"slots ({seconds:.2f} s)",
                file=sys.stderr,
            )
