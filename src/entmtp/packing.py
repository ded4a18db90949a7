"""Prepacked bfloat16 linear layers for CPU inference: the same oneDNN kernel, without its per-call weight
reorder.

On a CPU, PyTorch runs a bfloat16 `nn.Linear` through oneDNN, which first reorders the weight into its
blocked layout on every call. For a small model verifying a few tokens at a time that reorder is a large
share of each call. `pack_linears` reorders each weight once and keeps the result beside it; the layers
then call oneDNN's linear on the packed copy (what torch.compile's CPU backend does with frozen weights).
The logits are bit-for-bit those of the unpacked model (the test suite checks whole forwards and decodes).
`python scripts/pack_check.py` measured, on this project's 2-core CPU with SmolLM2-135M in bf16: a one-token
forward 36.5 -> 31.5 ms, 17 tokens 75.7 -> 66.0 ms, 64 tokens 168.5 -> 158.7 ms; Hydra's drafting 0.67-0.76x
(docs/results/packing-cpu/). float32 is left alone: there oneDNN's packed kernel measured slower here, and it
rounds differently. The engine packs the heads too when the model is packed (their draft projection is a
slice of the packed LM head).

The layers keep their weights (state_dict, `.weight`, training and `.to()` work as before); the packed copy
costs the weights' memory once more. A layer falls back to `F.linear` whenever the packed copy may not
apply: another dtype or device, autograd, or a weight changed since it was packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose bfloat16 weight also lives in oneDNN's blocked layout (`pack_linears` turns
    existing layers into this class in place, so parameters, hooks and state_dict stay the same)."""

    _packed: torch.Tensor | None  # [out, in] opaque mkldnn tensor
    _packed_of: tuple[int, int]  # (data_ptr, version) of the weight it was packed from

    def repack(self) -> None:
        w = self.weight.detach()
        self._packed = packed_weight(w)
        self._packed_of = (w.data_ptr(), tensor_version(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, packed = self.weight, self._packed
        if packed is not None and (w.data_ptr(), tensor_version(w)) != self._packed_of:
            packed = None  # written since it was packed (or replaced): the dense weight is the truth
        return linear(x, w, self.bias, packed)


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's blocked layout for `linear`, or None where packing does not apply (not
    bfloat16 on a CPU with oneDNN's bf16 kernels)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` (from `packed_weight(weight)`) when it applies."""
    if (
        packed is None
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def tensor_version(w: torch.Tensor) -> int:
    """The weight's in-place write counter (inference tensors, which have none, cannot be written outside
    inference mode anyway)."""
    return -1 if w.is_inference() else w._version


def can_pack(model: nn.Module) -> bool:
    """Whether `pack_linears` would pack anything: a bfloat16 model on the CPU, with oneDNN's bf16 kernels."""
    try:
        p = next(model.parameters())
    except StopIteration:
        return False
    return p.device.type == "cpu" and p.dtype == torch.bfloat16 and bf16_supported()


def bf16_supported() -> bool:
    """Whether this torch build has oneDNN's bf16 kernels (what packing needs)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without these kernels
        return False


def pack_linears(model: nn.Module) -> int:
    """Pack every bfloat16 CPU `nn.Linear` of `model` in place (layers packed already are left as they are);
    returns how many layers it packed. Does nothing when `can_pack(model)` is False."""
    if not can_pack(model):
        return 0
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
                module.__class__ = PackedLinear
                module.repack()
                count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears`: plain `nn.Linear` layers again, the packed copies freed; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            del module._packed, module._packed_of
            count += 1
    return count
