"""Int8 drafting weights (heads/int8.py): bf16 heads on a CPU draft from int8 copies of their weights, one scale
per output row, while their dense weights stay for training, gradients and other dtypes; float32 heads are never
quantized; the engine's default drafts in int8 and the probe times the heads it runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ByteTokenizer, tiny_model
from entmtp.costs.cache import cost_key
from entmtp.engine import Engine
from entmtp.heads import HeadsConfig, random_heads
from entmtp.heads.int8 import Int8Linear, int8_linear, int8_supported, int8_weight, quantize_linears
from entmtp.policy import static
from entmtp.shipped import bind_heads
from entmtp.tree import load_tree

needs_kernel = pytest.mark.skipif(not int8_supported(), reason="this torch has no CPU _weight_int8pack_mm")


def _bf16_model_and_heads(kind: str = "hydra", vocab_ids: int | None = 48):
    model = tiny_model().to(torch.bfloat16)
    heads = random_heads(HeadsConfig.for_model(model, kind, 4), seed=3, init="random")
    bind_heads(heads, model)
    if vocab_ids:
        heads.set_draft_vocab(torch.arange(vocab_ids))
    return model, heads


def test_a_weight_is_one_scale_per_row_and_rounds_by_at_most_half_a_step():
    w = torch.randn(16, 64) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different sizes
    w[3] = 0.0
    q, s = int8_weight(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (16,) and s.dtype == torch.bfloat16
    assert int(q.abs().max()) == 127  # every nonzero row uses the full range
    back = q.float() * s.float()[:, None]
    step = s.float()[:, None]
    assert bool(((back - w).abs() <= 0.5 * step + 0.01 * w.abs()).all())  # bf16 scales: ~0.4% more
    assert bool((back[3] == 0).all())


@needs_kernel
def test_the_int8_product_is_the_dense_product_of_the_dequantized_weight():
    w, b = torch.randn(40, 96), torch.randn(40).bfloat16()
    q, s = int8_weight(w)
    x = torch.randn(3, 5, 96).bfloat16()
    got = int8_linear(x, q, s, b)
    want = F.linear(x.float(), q.float() * s.float()[:, None], b.float())
    assert got.shape == (3, 5, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@needs_kernel
def test_quantized_heads_project_like_their_dense_weights():
    model, heads = _bf16_model_and_heads()
    feats = [torch.randn(4, heads.head_input_size(k)).bfloat16() for k in range(4)]  # Hydra: wider each head
    dense = [heads.draft_logits(k, heads.heads[k].blocks(feats[k])).float() for k in range(4)]
    assert heads.quantize_int8() > 0 and heads.int8
    assert all(isinstance(m, Int8Linear) for m in heads.modules() if isinstance(m, nn.Linear))
    for k in range(4):
        got = heads.draft_logits(k, heads.heads[k].blocks(feats[k])).float()
        assert F.cosine_similarity(got.flatten(), dense[k].flatten(), dim=0) > 0.99
    assert all(q is not None for *_, q in heads._draft_proj.values())  # the projection read its int8 copy
    assert heads.quantize_int8() == 0 and heads.int8  # idempotent


@needs_kernel
def test_training_gradients_and_float32_never_read_the_int8_copies():
    layer = nn.Linear(64, 32).bfloat16()
    quantize_linears(layer)
    x = torch.randn(2, 64).bfloat16().requires_grad_()
    y = layer(x)  # autograd: the dense weight, exactly
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert layer.weight.grad is not None
    with torch.no_grad():
        layer.weight.mul_(2)  # a weight written since it was quantized: the dense weight is the truth
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    model = tiny_model()  # float32
    heads = random_heads(HeadsConfig.for_model(model, "medusa", 2), seed=1)
    bind_heads(heads, model, int8=True)
    assert not heads.int8 and not any(isinstance(m, Int8Linear) for m in heads.modules())


@needs_kernel
def test_bind_with_int8_quantizes_bf16_heads_and_the_cost_key_says_so():
    model, heads = _bf16_model_and_heads()
    dense_key = cost_key(model, heads)
    bind_heads(heads, model, int8=True)
    assert heads.int8
    key = cost_key(model, heads)
    assert key["heads"]["int8"] is True and "int8" not in dense_key["heads"]  # measured apart
    assert key["heads"]["checksum"] == dense_key["heads"]["checksum"]  # the same trained weights


@needs_kernel
def test_an_engine_drafts_and_accepts_with_int8_heads():
    model, heads = _bf16_model_and_heads(vocab_ids=None)
    bind_heads(heads, model, int8=True)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static(load_tree("tree_8")))
    out = engine.generate(list(range(1, 20)), max_new_tokens=24, chat=False)
    assert len(out.token_ids) == 24 and all(s.tree == "tree_8" for s in out.steps)
    assert heads.int8  # the engine's bind keeps them so
