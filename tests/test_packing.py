"""Prepacked bf16 linears (packing.py): the same logits bit for bit, and a safe fallback whenever the packed
copy may not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import tiny_model
from entmtp.backends.transformers import BaseModel
from entmtp.engine import Engine
from entmtp.model import load_model
from entmtp.packing import PackedLinear, bf16_supported, can_pack, pack_linears, unpack_linears
from entmtp.policy import static
from entmtp.shipped import resolve_heads
from entmtp.tree import load_tree


def _torch_has_bf16_kernels() -> bool:
    """Asked of torch directly, not of packing.py: a broken check there must fail the tests, not skip them."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def test_packing_is_available_where_torch_has_the_kernels():
    assert bf16_supported() == _torch_has_bf16_kernels()
    assert can_pack(nn.Linear(2, 2).to(torch.bfloat16)) == _torch_has_bf16_kernels()


needs_kernels = pytest.mark.skipif(
    not _torch_has_bf16_kernels(), reason="this torch build has no oneDNN bf16 kernels"
)


def _forwards(model) -> list[torch.Tensor]:
    """Logits of a prefill, a one-token step and a 16-node tree step through the engine's cache."""
    base = BaseModel(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=gen)
    tree = load_tree("tree_16")
    out = []
    with torch.inference_mode():
        cache = base.new_cache(128)
        out.append(base.forward(ids, None, cache).logits)
        base.commit(cache, list(range(40)))
        out.append(base.forward(ids[:1], None, cache).logits)
        base.commit(cache, [0])
        out.append(base.forward(ids[: tree.size], tree, cache).logits)
    return out


@needs_kernels
def test_packed_logits_are_bitwise_equal():
    model = tiny_model().to(torch.bfloat16)
    before = _forwards(model)
    assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    assert pack_linears(model) == 0  # packed already
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.lm_head, nn.Linear)
    after = _forwards(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert unpack_linears(model) == 15 and type(model.lm_head) is nn.Linear
    assert all(torch.equal(a, b) for a, b in zip(before, _forwards(model), strict=True))


def test_nothing_to_pack_in_float32():
    model = tiny_model()
    assert not can_pack(model) and pack_linears(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def _kernels(lin: nn.Linear, x: torch.Tensor) -> set[str]:
    """Which linear kernel a call runs."""
    with torch.profiler.profile() as prof:
        lin(x)
    return {e.name for e in prof.events() if e.name in ("mkldnn::_linear_pointwise", "aten::linear")}


@needs_kernels
def test_fallbacks_never_use_a_stale_or_foreign_copy():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = lin(x)
    pack_linears(lin)
    assert torch.equal(lin(x), ref) and _kernels(lin, x) == {"mkldnn::_linear_pointwise"}
    # a weight written in place after packing: the new weight is used, not the stale copy
    with torch.no_grad():
        lin.weight.mul_(2)
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias)) and _kernels(lin, x) == {
        "aten::linear"
    }
    lin.repack()
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))
    assert _kernels(lin, x) == {"mkldnn::_linear_pointwise"}
    # another dtype: plain F.linear on the cast weights
    lin.float()
    assert torch.equal(lin(x.float()), nn.functional.linear(x.float(), lin.weight, lin.bias))
    # training: autograd flows through the dense weight
    lin.to(torch.bfloat16).requires_grad_(True)
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


@needs_kernels
def test_embedded_model_packed_decodes_the_same_tokens():
    """SmolLM2 in bf16, packed (load_model's default) and not: plain and Hydra decoding give the same tokens."""
    packed, tok = load_model(dtype="bfloat16")
    plain, _ = load_model(dtype="bfloat16", pack=False)
    assert isinstance(packed.model.layers[0].mlp.down_proj, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    for tree in (None, "tree_8"):
        outs = []
        for model in (packed, plain):
            heads = resolve_heads("hydra", model) if tree else None
            outs.append(
                Engine(model, tok, heads=heads, policy=static(tree) if tree else None)
                .generate(prompt, max_new_tokens=24)
                .token_ids
            )
            if heads is not None:  # the heads follow the model, their draft projection included
                is_packed = model is packed
                assert any(isinstance(m, PackedLinear) for m in heads.modules()) == is_packed
                assert [p is not None for _, _, p, _ in heads._draft_proj.values()] == [is_packed]
        assert outs[0] == outs[1]
