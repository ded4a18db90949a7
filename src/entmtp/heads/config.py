"""What heads are: the configuration that rebuilds their parameters, and the names of the files they live in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import HeadsError

FORMAT = "entmtp-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # optional: token ids drafts are chosen from
MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"
MEDUSA_PT = "medusa_lm_head.pt"
HYDRA_PT = "hydra_lm_head.pt"
# Any of these in a directory means it already holds heads (or a model config we must not clobber).
HEADS_FILES = (CONFIG_FILE, WEIGHTS_FILE, DRAFT_VOCAB_FILE, MEDUSA_SAFETENSORS, MEDUSA_PT, HYDRA_PT)

KINDS = ("medusa", "hydra")
HEAD_ARCHS = ("mlp", "prefix-mlp")


@dataclass(frozen=True)
class HeadsConfig:
    """What the heads are; enough to rebuild their parameters without the checkpoint."""

    kind: str  # "medusa" | "hydra"
    num_heads: int  # K: tokens predicted beyond the base model's own next token
    num_layers: int = 1  # residual blocks per head; both papers find one enough
    hidden_size: int = 576  # SmolLM2-135M, the project's default base model
    vocab_size: int = 49152  # SmolLM2-135M
    share_lm_head: bool = True  # reuse the base output layer: a small model cannot afford V x H per head
    head_arch: str = "mlp"  # hydra only: "mlp" | "prefix-mlp" (Hydra++: one extra decoder layer)
    grounded: bool = True  # hydra only: heads see the tokens drafted before them (the point of Hydra)
    hidden_state_offset: int = 0  # feed the heads the hidden state of this layer counted from the last
    # offset > 0: put that state through the base model's final norm first, as the last layer's state is
    # (False: the raw state, what heads saved without this field read; see `heads_input`)
    hidden_state_norm: bool = True
    base_model: str = ""  # informational: the model the heads were trained for
    # prefix-mlp only: geometry of the extra decoder layer, copied from the base model. All 0 = not known
    # yet: the layer is built when the heads are bound to their base model.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise HeadsError(f"heads kind {self.kind!r} is unknown: use one of {', '.join(KINDS)}")
        if self.num_heads < 1 or self.num_layers < 1:
            raise HeadsError(
                f"heads need num_heads >= 1 and num_layers >= 1, got {self.num_heads} and {self.num_layers}"
            )
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise HeadsError(f"hidden_size {self.hidden_size} and vocab_size {self.vocab_size} must be >= 1")
        if self.head_arch not in HEAD_ARCHS:
            raise HeadsError(f"head_arch {self.head_arch!r} is unknown: use one of {', '.join(HEAD_ARCHS)}")
        if self.kind == "medusa" and self.head_arch != "mlp":
            raise HeadsError(f"head_arch {self.head_arch!r} is Hydra-only: use head_arch='mlp' for Medusa")
        if self.hidden_state_offset < 0:
            raise HeadsError(f"hidden_state_offset {self.hidden_state_offset} must be >= 0 (0 = last layer)")
        if self.head_arch == "prefix-mlp":
            geometry = (
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
                self.intermediate_size,
            )
            known = min(geometry) >= 1 and self.num_attention_heads % self.num_key_value_heads == 0
            if not known and any(geometry):
                raise HeadsError(
                    f"prefix-mlp heads need the base model's attention geometry (num_attention_heads, "
                    f"num_key_value_heads, head_dim, intermediate_size), got {geometry}: build the config "
                    f"with HeadsConfig.for_model(model, ...) or leave all four 0 to take them at bind()"
                )

    @classmethod
    def for_model(cls, model: nn.Module, kind: str, num_heads: int, **fields: Any) -> HeadsConfig:
        """A config whose sizes (and prefix-mlp geometry) come from ``model``'s config."""
        cfg = model.config
        nh = cfg.num_attention_heads
        sizes = {
            "hidden_size": cfg.hidden_size,
            "vocab_size": model.get_output_embeddings().weight.shape[0],
            "base_model": getattr(cfg, "_name_or_path", "") or "",
        }
        if fields.get("head_arch") == "prefix-mlp":
            sizes.update(
                num_attention_heads=nh,
                num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or nh,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // nh,
                intermediate_size=cfg.intermediate_size,
            )
        return cls(kind=kind, num_heads=num_heads, **{**sizes, **fields})


def saved_norm(fields: dict[str, Any]) -> bool:
    """`hidden_state_norm` as a heads config or a data manifest's settings record it. Files written before the
    field existed read an earlier layer's state raw (the last layer's is normed whatever the field says)."""
    return bool(fields.get("hidden_state_norm", not fields.get("hidden_state_offset", 0)))


def heads_input(decoder: nn.Module, out, offset: int = 0, norm: bool = True) -> torch.Tensor:
    """What heads read, from the decoder's output ``out`` [B, L, H]: the last layer's state, which the final
    norm has made (``offset`` 0), or the output of the layer ``offset`` layers before the last, through the
    same final norm unless ``norm`` is False. ``out`` must hold ``hidden_states`` when ``offset`` > 0 (run the
    decoder with ``output_hidden_states=True``). The engine, the distillation data and the evaluation all read
    the heads' input here."""
    if offset == 0:
        return out.last_hidden_state
    state = out.hidden_states[-1 - offset]  # [0]: the embeddings; [-1]: the last layer, already normed
    if not norm:
        return state
    final = getattr(decoder, "norm", None)
    if final is None:
        raise HeadsError(
            f"{type(decoder).__name__} has no final norm (`.norm`) to put layer states through: use heads with "
            "hidden_state_offset 0, or hidden_state_norm False"
        )
    return final(state)
