"""Int8 drafting weights: the heads' linear layers and their draft projection read as int8, with one scale per
output row (weight-only: activations stay bfloat16), through PyTorch's CPU kernel `_weight_int8pack_mm`.

Why: on a CPU, drafting is a chain of matrix-vector products whose weights the base model's forward has just
pushed out of the caches, so its time is the bytes it reads: Hydra's tree_8 reads ~56 MB of bf16 weights a
step (the 8,192 x 576 draft projection once per level, and each level's blocks). Int8 halves the bytes. On a
2-core AMD EPYC (avx512_bf16) a cold 8,192 x 576 projection took 0.45 ms in bf16, 0.37 ms prepacked and 0.23
ms in int8, a block 0.13-0.24 ms against 0.07-0.11 ms; Hydra's tree_8 draft phase fell from 2.8-3.3 ms to
1.6-1.7 ms on llama.cpp and from 1.8 to 1.5 ms on transformers (prepacked before), with tokens per step level
(`docs/results/heads-int8/`: the commands, the machine, the tables).

The drafts may differ where rounding moves a near tie. Every draft is verified by the base model, so what is
kept is what the base model writes, whatever the heads propose; that int8 heads exist only in bf16 does not
change bf16's own caveat (a verify of another tree shape can round a near tie differently, with any heads:
docs/sampling.md), and float32 heads are never quantized, so a float32 run stays token for token plain
decoding's. The dense weights stay: training,
`state_dict` and anything with gradients or another dtype or device use them, as `PackedLinear` does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..packing import PackedLinear, tensor_version

QMAX = 127  # symmetric: -127..127 (no -128, so the scale maps both signs alike)


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as (int8 [out, in], bfloat16 scales [out]): row r is round(w_r / s_r), s_r = max|w_r|
    / 127 (a zero row gets a tiny scale and zeros)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / QMAX).clamp(min=1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8).contiguous()
    return q, scale.to(torch.bfloat16)


@functools.cache
def int8_supported() -> bool:
    """Whether this torch build runs `_weight_int8pack_mm` on the CPU for bfloat16 inputs."""
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        q, s = int8_weight(torch.ones(8, 32))
        return torch.ops.aten._weight_int8pack_mm(x, q, s).shape == (1, 8)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def applies(x: torch.Tensor) -> bool:
    """Whether an int8 product may stand in for the dense one on `x`: bfloat16 on a CPU, no autograd."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, q * scales[:, None], bias)` for x [..., in] bfloat16 on a CPU: [..., out] bfloat16."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(flat, q, scales).reshape(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias


class Int8Linear(nn.Linear):
    """An `nn.Linear` (or `PackedLinear`) that also keeps an int8 copy of its weight for drafting
    (`quantize_linears` turns layers into this class in place: parameters and state_dict stay the same)."""

    _q: torch.Tensor  # [out, in] int8
    _scales: torch.Tensor  # [out] bfloat16
    _quantized_of: tuple[int, int]  # (data_ptr, version) of the weight it was quantized from

    def requantize(self) -> None:
        w = self.weight.detach()
        self._q, self._scales = int8_weight(w)
        self._quantized_of = (w.data_ptr(), tensor_version(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            applies(x)
            and not (torch.is_grad_enabled() and w.requires_grad)
            and (w.data_ptr(), tensor_version(w)) == self._quantized_of  # unchanged since it was quantized
        ):
            return int8_linear(x, self._q, self._scales, self.bias)
        return F.linear(x, w, self.bias)


def quantize_linears(module: nn.Module) -> int:
    """Give every bfloat16 CPU linear layer of `module` an int8 drafting copy, in place (layers done already are
    left as they are); returns how many it quantized. Nothing where the kernel is missing."""
    if not int8_supported():
        return 0
    count = 0
    with torch.no_grad():
        for m in module.modules():
            if (
                type(m) in (nn.Linear, PackedLinear)
                and m.weight.dtype == torch.bfloat16
                and m.weight.device.type == "cpu"
            ):
                if type(m) is PackedLinear:  # its packed copy is not needed any more
                    del m._packed, m._packed_of
                m.__class__ = Int8Linear
                m.requantize()
                count += 1
    return count
