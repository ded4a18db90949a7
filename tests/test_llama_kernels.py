"""The kernels entmtp's patch adds to llama.cpp (backends/llama_build.py), called through ggml itself: Q4_1
weights times a few columns of activations (a speculative step's drafted tokens) by tiles of weight rows and
columns on every AVX2 CPU, where llama.cpp's generic path takes one weight row's dot product with one column at
a time. Each column of a many-column product must be bit for bit the product of that column alone (the
one-column path, which the patch leaves to llama.cpp): so a drafted token's logits are the ones its own decode
would give, up to the attention. Checked at every column count from 2 to 9 (whole tiles and remainders), with
a row count that is no multiple of the tile's, on one thread and on two (the tiles shared between them).

A mutant that sums a tile's eight partial sums in another order than llama.cpp's one-column kernel (a plain
loop instead of its pairwise reduction) fails it (columns off by ~2e-6), checked on the AMX Xeon 2026-12-07.

And the patch's change to how a step's values reach the transposed V cache (flash attention off: each token's
values are written one element a row, `ggml_set_rows`): each element goes to the thread that owns its
destination cache line, not to the thread of its half of the tokens (which had both cores write every line).
Every element must still be written once, where its index says, as fp16 rounds it."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama-cpp extra is not installed (make setup installs it)"
)

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_1, GGML_TYPE_I64 = 0, 1, 3, 27  # ggml.h's enum ggml_type
Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])  # block_q4_1: 32 weights, d*q + m


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """The few ggml calls a matrix product needs, from the libraries llama-cpp-python ships."""

    def __init__(self):
        lib = Path(llama_cpp.__file__).parent / "lib"
        self.base = base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        p = ctypes.c_void_p
        for name, args, res in [
            ("ggml_init", [_InitParams], p),
            ("ggml_free", [p], None),
            ("ggml_new_tensor_2d", [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], p),
            ("ggml_new_tensor_1d", [p, ctypes.c_int, ctypes.c_int64], p),
            ("ggml_mul_mat", [p, p, p], p),
            ("ggml_set_rows", [p, p, p, p], p),
            ("ggml_new_graph", [p], p),
            ("ggml_build_forward_expand", [p, p], None),
            ("ggml_get_data", [p], p),
        ]:
            fn = getattr(base, name)
            fn.argtypes, fn.restype = args, res
        cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
        cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        cpu.ggml_cpu_init()

    def mul_mat(self, weights: np.ndarray, x: np.ndarray, threads: int) -> np.ndarray:
        """weights: Q4_1 blocks [rows, width/32]; x: float32 [n, width]; the product [n, rows] as ggml_mul_mat
        computes it (the activations quantized to Q8_1 inside, as in a decode)."""
        rows, blocks = weights.shape
        n, width = x.shape
        assert width == 32 * blocks
        x = np.ascontiguousarray(x, dtype=np.float32)
        ctx = self.base.ggml_init(_InitParams(weights.nbytes + 8 * x.nbytes + (1 << 20), None, False))
        try:
            a = self.base.ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_1, width, rows)
            b = self.base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, width, n)
            ctypes.memmove(self.base.ggml_get_data(a), weights.ctypes.data, weights.nbytes)
            ctypes.memmove(self.base.ggml_get_data(b), x.ctypes.data, x.nbytes)
            c = self.base.ggml_mul_mat(ctx, a, b)
            graph = self.base.ggml_new_graph(ctx)
            self.base.ggml_build_forward_expand(graph, c)
            assert self.cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) == 0
            out = np.empty((n, rows), np.float32)
            ctypes.memmove(out.ctypes.data, self.base.ggml_get_data(c), out.nbytes)
            return out
        finally:
            self.base.ggml_free(ctx)

    def set_rows(self, dst: np.ndarray, src: np.ndarray, idx: np.ndarray, threads: int) -> np.ndarray:
        """dst (float16 [n]) with src[i] (float32) written at dst[idx[i]], one element a row, as ggml_set_rows
        writes the transposed V cache; the result read back."""
        ctx = self.base.ggml_init(_InitParams(dst.nbytes + src.nbytes + idx.nbytes + (1 << 20), None, False))
        try:
            a = self.base.ggml_new_tensor_2d(ctx, GGML_TYPE_F16, 1, dst.size)
            b = self.base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, src.size)
            c = self.base.ggml_new_tensor_1d(ctx, GGML_TYPE_I64, idx.size)
            for t, arr in (
                (a, dst.astype(np.float16)),
                (b, src.astype(np.float32)),
                (c, idx.astype(np.int64)),
            ):
                arr = np.ascontiguousarray(arr)
                ctypes.memmove(self.base.ggml_get_data(t), arr.ctypes.data, arr.nbytes)
            out = self.base.ggml_set_rows(ctx, a, b, c)
            graph = self.base.ggml_new_graph(ctx)
            self.base.ggml_build_forward_expand(graph, out)
            # ggml runs a graph on as many threads as its most parallel node takes (set_rows alone: one); a
            # product beside it, as in a decode's graph, gives set_rows all `threads`
            x = self.base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 32, 4)
            self.base.ggml_build_forward_expand(graph, self.base.ggml_mul_mat(ctx, x, x))
            assert self.cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) == 0
            got = np.empty(dst.size, np.float16)
            ctypes.memmove(got.ctypes.data, self.base.ggml_get_data(a), got.nbytes)
            return got
        finally:
            self.base.ggml_free(ctx)


@pytest.fixture(scope="module")
def ggml():
    return Ggml()


def q4_1_weights(rng, rows: int, width: int) -> np.ndarray:
    """Random Q4_1 blocks with a trained model's kind of scales (d > 0, m <= 0)."""
    w = np.zeros((rows, width // 32), Q4_1)
    w["d"] = rng.uniform(0.001, 0.05, w.shape).astype(np.float16)
    w["m"] = rng.uniform(-0.4, 0.0, w.shape).astype(np.float16)
    w["qs"] = rng.integers(0, 256, w["qs"].shape, dtype=np.uint8)
    return w


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [37, 576])
def test_each_column_of_a_q4_1_product_is_that_column_alone_bit_for_bit(ggml, threads, rows):
    rng = np.random.default_rng(rows)
    w = q4_1_weights(rng, rows, 576)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    alone = np.stack([ggml.mul_mat(w, x[j : j + 1], threads)[0] for j in range(9)])
    for n in range(2, 10):
        together = ggml.mul_mat(w, x[:n], threads)
        assert np.array_equal(together, alone[:n]), (n, float(np.abs(together - alone[:n]).max()))


def test_a_q4_1_product_is_the_dequantized_product(ggml):
    """The oracle above compares the kernel with llama.cpp's own; this one pins both to the arithmetic: Q4_1
    weights dequantized (d*q + m) times the activations, up to Q8_1's rounding of the activations."""
    rng = np.random.default_rng(1)
    w = q4_1_weights(rng, 64, 576)
    x = rng.standard_normal((6, 576)).astype(np.float32)
    q = np.stack([w["qs"] & 15, w["qs"] >> 4], axis=-2).reshape(64, -1, 32).astype(np.float32)
    dense = (w["d"].astype(np.float32)[..., None] * q + w["m"].astype(np.float32)[..., None]).reshape(64, 576)
    want = x @ dense.T
    got = ggml.mul_mat(w, x, threads=os.cpu_count() or 1)
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


@pytest.mark.parametrize("threads", [1, 2, 3, 17])  # past 16 threads, llama.cpp's own split by rows
@pytest.mark.parametrize("tokens", [1, 2, 7, 16])
def test_a_steps_values_reach_the_transposed_v_cache_each_element_once_where_its_index_says(
    ggml, threads, tokens
):
    """The V cache without flash attention, as llama.cpp writes it: [dims, cells] (each dim's values of the
    cells side by side), a step's values written one element a row, token by token, at `dim * cells + cell`;
    the step's cells follow a context of 37 (not a cache line's multiple). Every other element untouched."""
    dims, cells, context = 192, 256, 37
    rng = np.random.default_rng(tokens * 10 + threads)
    cache = rng.standard_normal(dims * cells).astype(np.float16)
    values = rng.standard_normal((tokens, dims)).astype(np.float32)
    idx = (np.arange(dims)[None, :] * cells + context + np.arange(tokens)[:, None]).reshape(-1)
    want = cache.copy()
    want[idx] = values.reshape(-1).astype(np.float16)
    got = ggml.set_rows(cache, values.reshape(-1), idx, threads)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), int((got != want).sum())
