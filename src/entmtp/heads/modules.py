"""The heads' building blocks as torch modules: residual blocks, one head, and Hydra++'s prefix decoder layer.

Parameter names follow the official Medusa and Hydra code (see `entmtp.heads`), so their checkpoints map
onto these modules key for key."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import HeadsConfig


class ResBlock(nn.Module):
    """``res(x) + SiLU(linear(x))``; ``res`` is the identity, or a Linear when the input is wider than H."""

    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, hidden_size)
        self.res_connection = nn.Linear(in_features, hidden_size) if in_features != hidden_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., H]
        res = x if self.res_connection is None else self.res_connection(x)
        return res + F.silu(self.linear(x))


class Head(nn.Module):
    """One head: residual blocks (the feature) and, unless shared with the base model, a vocab projection."""

    def __init__(self, in_features: int, config: HeadsConfig, proj_bias: bool) -> None:
        super().__init__()
        h = config.hidden_size
        blocks = [ResBlock(in_features, h)] + [ResBlock(h, h) for _ in range(config.num_layers - 1)]
        self.blocks = nn.Sequential(*blocks)
        self.proj = None if config.share_lm_head else nn.Linear(h, config.vocab_size, bias=proj_bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        # Llama computes the statistics in float32 and scales in the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PrefixLayer(nn.Module):
    """Hydra++'s extra decoder layer: one Llama decoder layer followed by the final RMSNorm.

    Parameter names follow ``LlamaModel.layers.0`` (and ``norm``) so the official ``prefix_embeding_layer``
    maps onto it key for key. No attention biases (Llama).
    """

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h)
        self.post_attention_layernorm = RMSNorm(h)
        self.norm = RMSNorm(h)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, hd]
        sin: torch.Tensor,  # [B, T, hd]
        eps: float,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,  # k, v: [B, nkv, P, hd]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        attn, mlp = self.self_attn, self.mlp
        y = self.input_layernorm(x, eps)
        q = attn.q_proj(y).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = attn.k_proj(y).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = attn.v_proj(y).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, hd]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # [B, nkv, P+T, hd]
            v = torch.cat([past[1], v], dim=2)
        p = k.shape[2] - t
        groups = self.num_heads // self.num_kv_heads
        kr = k.repeat_interleave(groups, dim=1)  # [B, nh, P+T, hd]
        vr = v.repeat_interleave(groups, dim=1)
        # New query i sits at absolute position p+i and sees keys 0..p+i.
        mask = torch.ones(t, p + t, dtype=torch.bool, device=x.device).tril(diagonal=p)  # [T, P+T]
        o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)  # [B, nh, T, hd]
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        y = self.post_attention_layernorm(x, eps)
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(y)) * mlp.up_proj(y))
        return self.norm(x, eps), (k, v)


def randomize_norms(module: nn.Module) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.normal_(1.0, 0.1)
