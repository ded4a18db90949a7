"""Medusa and Hydra draft heads on top of a frozen Hugging Face causal LM.

Glossary (t is a committed position, x_t its token):

* ``hidden[t]``: the base model's last hidden state after x_t; the base output layer on it predicts x_{t+1}.
* root token: x_{t+1}, the base model's own next token (tree node 0).
* head k (k = 1..K, index k-1 in ``heads.heads``) at position t predicts x_{t+k+1}.
* feature: what the heads read at t. Medusa and Hydra-``mlp``: hidden[t]. Hydra++ ``prefix-mlp``: the output
  of one extra decoder layer run causally over the hidden states of all committed positions.

Architectures (parameter layouts match the official code so their checkpoints load):

* Medusa-1 (FasterDecoding/Medusa, ``medusa/model/medusa_model.py``): head k = ``num_layers`` blocks
  ``x + SiLU(Linear(x))`` then a vocab projection without bias. Every head reads the feature.
* Hydra (zankner/Hydra, ``hydra/model/hydra_heads/{mlp_head,prefix_mlp_head}.py``): with ``grounded``, head
  k's first block reads ``concat(feature, emb(x_{t+1}), ..., emb(x_{t+k}))`` [(k+1)H] and maps it back to H
  in both branches: ``res_connection(x) + SiLU(linear(x))``; later blocks are plain residual blocks; the
  official per-head projection has a bias. Without ``grounded`` Hydra heads are Medusa heads.
  ``prefix-mlp`` adds one Llama decoder layer (+ final RMSNorm, as the official code runs a 1-layer
  ``LlamaModel``) over the base hidden states; it keeps its own KV cache of committed positions only.

Drafting contract: ``reset()``; ``extend(hidden)`` with the hidden states of newly committed positions (the
prompt, then each step's accepted path); ``draft(tree, root_token) -> Draft``. Training: ``features`` then
``project``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from entmtp.errors import HeadsError

if TYPE_CHECKING:
    from entmtp.tree import Tree

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


# ---- configuration --------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Draft:
    """Draft tokens of tree nodes 1..N in node order."""

    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32: log-probability of each token under its head's distribution


@dataclass(frozen=True)
class Probe:
    """The heads' top-k candidates that every tree of a bank shares, drafted before the tree is chosen.

    A scheduler reads their probabilities (how sure the heads are right now); the draft of the chosen tree
    then reuses them instead of drafting them twice. Medusa's heads are independent, so a probe holds every
    depth at the cost of one draft; Hydra's deeper heads read their branch's tokens, so a probe holds depth 1
    only (what every tree drafts first) and costs nothing extra.
    """

    tokens: torch.Tensor  # [Dp, k] int64: rank r of depth d at [d - 1, r]
    logprobs: torch.Tensor  # [Dp, k] float32: their log-probabilities under the heads
    context: torch.Tensor | None = None  # Hydra: [1, 2H] the root's branch context, read by head 1

    @property
    def depth(self) -> int:
        return self.tokens.shape[0]

    @property
    def topk(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class _BaseRefs:
    """The bound base model's parts the heads use. A plain object, so never saved or moved with the heads."""

    embed: nn.Module  # token id -> [H]
    lm_head: nn.Module  # [H] -> [V]
    rotary: nn.Module | None  # prefix-mlp: (x, position_ids) -> (cos, sin)
    rms_norm_eps: float


# ---- modules --------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class _LevelPlan:
    """How to draft the nodes of one depth d from the nodes of depth d-1 (built once per tree)."""

    out: slice  # positions of the level's nodes in the [N] draft (node id - 1)
    rows: torch.Tensor  # [P] int64: nodes of depth d-1 (index within that level) that have children
    parent: torch.Tensor  # [n_d] int64: each node's parent, as an index into rows
    rank: torch.Tensor  # [n_d] int64: each node's rank among its head's candidates
    k: int  # top-k width this level needs: max rank + 1


def _node_index(tree: Tree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (depth - 1) and column (rank) of nodes 1..N in a top-k table [depth, k]: [N] each."""
    return (tree.depths[1:] - 1).to(device), tree.ranks[1:].to(device)


def _level_plans(tree: Tree, device: torch.device) -> tuple[_LevelPlan, ...]:
    plans = []
    prev_start = 0  # node id of the first node of depth d-1 (the root for d = 1)
    for sl in tree.level_slices:
        local = tree.parents[sl] - prev_start  # [n_d] parent index within level d-1
        rows, parent = torch.unique(local, sorted=True, return_inverse=True)
        k = max(p[-1] for p in tree.paths[sl.start - 1 : sl.stop - 1]) + 1  # from the Python paths
        plans.append(
            _LevelPlan(
                out=slice(sl.start - 1, sl.stop - 1),
                rows=rows.to(device),
                parent=parent.to(device),
                rank=tree.ranks[sl].to(device),
                k=k,
            )
        )
        prev_start = sl.start
    return tuple(plans)


class Heads(nn.Module):
    """K draft heads. See the module docstring for the drafting and training contracts."""

    config: HeadsConfig

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            Head(self.head_input_size(i), config, proj_bias=self.proj_bias) for i in range(config.num_heads)
        )
        self._base: _BaseRefs | None = None
        self._feature: torch.Tensor | None = None  # [H]: what the next draft starts from
        self._plans: weakref.WeakKeyDictionary[Tree, dict[torch.device, Any]] = weakref.WeakKeyDictionary()
        self.draft_vocab: torch.Tensor | None = None  # [Vd] token ids drafts are chosen from (None: all)
        self._draft_proj: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    proj_bias = False  # Medusa's projections have no bias; Hydra's do

    def head_input_size(self, i: int) -> int:
        """Input width of head i's (0-based) first block."""
        return self.config.hidden_size

    @property
    def grounded(self) -> bool:
        """Whether head k reads the embeddings of the k tokens before it on its branch."""
        return False

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def needs_all_hidden_states(self) -> bool:
        """True when the engine must run the base model with ``output_hidden_states=True``."""
        return self.config.hidden_state_offset != 0

    @property
    def hidden_state_index(self) -> int:
        """Index into ``outputs.hidden_states`` of the state the heads read (-1: the last, normed one)."""
        return -(self.config.hidden_state_offset + 1)

    # ---- binding --------------------------------------------------------------------------------

    def bind(self, model: nn.Module) -> Heads:
        """Keep references to ``model``'s embeddings, output layer (and rotary embedding); check sizes."""
        cfg = self.config
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is None or lm_head is None:
            raise HeadsError(
                f"model {type(model).__name__} has no input embeddings or output layer: "
                f"bind the heads to a causal LM (AutoModelForCausalLM)"
            )
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        fix = "train heads for this model or pick the right base model"
        if cfg.base_model:
            fix += f" (these were trained for {cfg.base_model})"
        model_hidden, model_vocab = embed.weight.shape[1], lm_head.weight.shape[0]
        if model_hidden != cfg.hidden_size:
            raise HeadsError(
                f"heads expect hidden size {cfg.hidden_size} but the model has {model_hidden} ({name}); {fix}"
            )
        if model_vocab != cfg.vocab_size:
            raise HeadsError(
                f"heads expect vocab size {cfg.vocab_size} but the model has {model_vocab} ({name}); {fix}"
            )
        layers = getattr(model.config, "num_hidden_layers", None)
        if layers is not None and cfg.hidden_state_offset > layers:
            raise HeadsError(
                f"hidden_state_offset {cfg.hidden_state_offset} is deeper than the model's {layers} layers; {fix}"
            )
        eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
        rotary = None
        if cfg.head_arch == "prefix-mlp":
            rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
            if rotary is None:
                raise HeadsError(
                    f"prefix-mlp heads need the base model's rotary embedding (model.model.rotary_emb), "
                    f"which {type(model).__name__} lacks: use a Llama-style base model or head_arch='mlp'"
                )
            self._bind_prefix(model, fix)
        self._base = _BaseRefs(embed=embed, lm_head=lm_head, rotary=rotary, rms_norm_eps=eps)
        return self

    def _bind_prefix(self, model: nn.Module, fix: str) -> None:
        raise NotImplementedError  # only Hydra heads have a prefix layer

    def _require_base(self) -> _BaseRefs:
        if self._base is None:
            raise HeadsError("the heads are not bound to a base model: call heads.bind(model) first")
        return self._base

    # ---- drafting ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the drafting state (the last feature and the prefix layer's KV cache)."""
        self._feature = None

    @torch.inference_mode()
    def extend(self, hidden: torch.Tensor) -> None:
        """Take the base hidden states of newly committed positions: ``hidden`` [T, H]."""
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
            raise HeadsError(
                f"extend() takes hidden states [T, {self.config.hidden_size}], got {tuple(hidden.shape)}"
            )
        if hidden.shape[0] == 0:
            return
        self._feature = hidden[-1].to(self.dtype).clone()  # [H]

    def _require_feature(self) -> torch.Tensor:
        if self._feature is None:
            raise HeadsError(
                "no committed position yet: call heads.extend(prompt hidden states) before draft()"
            )
        return self._feature

    def _plan(self, tree: Tree, device: torch.device, build: Callable[[Tree, torch.device], Any]) -> Any:
        """Per-tree index tensors, built on the first draft with that tree and device, then reused."""
        per_tree = self._plans.setdefault(tree, {})
        key = (device, build)
        if key not in per_tree:
            per_tree[key] = build(tree, device)
        return per_tree[key]

    def _check_tree(self, tree: Tree) -> None:
        if tree.depth > self.config.num_heads:
            raise HeadsError(
                f"tree {tree.name!r} has depth {tree.depth} but the heads predict only "
                f"{self.config.num_heads} tokens ahead: use a tree of depth <= {self.config.num_heads}"
            )

    @torch.inference_mode()
    def draft(self, tree: Tree, root_token: torch.Tensor, probe: Probe | None = None) -> Draft:
        """Draft tokens for tree nodes 1..N; ``root_token`` is the base model's next token (node 0).
        ``probe``: this step's `probe` of a tree that contains ``tree``, reused instead of drafted again."""
        self._check_tree(tree)
        feat = self._require_feature()  # [H]
        if tree.num_nodes == 0:
            empty = torch.empty(0, device=feat.device)
            return Draft(tokens=empty.long(), logprobs=empty.float())
        return self._draft(tree, feat, root_token, probe)

    @torch.inference_mode()
    def probe(self, master: Tree, root_token: torch.Tensor) -> Probe:
        """What every subtree of ``master`` drafts first, with its probabilities (see `Probe`)."""
        self._check_tree(master)
        if master.num_nodes == 0:
            raise HeadsError("probe() needs a tree with at least one node: the root-only tree drafts nothing")
        return self._probe(master, self._require_feature(), root_token)

    def _probe(self, master: Tree, feat: torch.Tensor, root_token: torch.Tensor) -> Probe:
        return Probe(*self._topk_table(feat, master.depth, master.topk))

    def _draft(self, tree: Tree, feat: torch.Tensor, root_token: torch.Tensor, probe: Probe | None) -> Draft:
        return self._draft_parallel(tree, feat, probe)

    def _topk_table(self, feat: torch.Tensor, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head reads the same feature: top-k token ids and log-probabilities [depth, k] of heads 1..depth."""
        hs = torch.stack([self.heads[i].blocks(feat) for i in range(depth)])  # [depth, H]
        logits = self._project_stack(hs)  # [depth, Vd]
        top_lp, top = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [depth, k]
        return self._draft_ids(top), top_lp

    def _draft_parallel(self, tree: Tree, feat: torch.Tensor, probe: Probe | None = None) -> Draft:
        """One top-k table [depth, k] (the probe's when it covers the tree), gathered into the tree."""
        if probe is not None and tree.depth <= probe.depth and tree.topk <= probe.topk:
            tokens, logprobs = probe.tokens, probe.logprobs
        else:
            tokens, logprobs = self._topk_table(feat, tree.depth, tree.topk)
        depth, rank = self._plan(tree, feat.device, _node_index)  # [N] each
        return Draft(tokens=tokens[depth, rank], logprobs=logprobs[depth, rank])

    def _project_stack(self, hs: torch.Tensor) -> torch.Tensor:
        """Draft logits of heads 0..D-1 for hs [D, ..., H] -> [D, ..., Vd] (one matmul when shared)."""
        if self.config.share_lm_head:
            return self._draft_logits(0, hs)
        return torch.stack([self._draft_logits(i, h) for i, h in enumerate(hs)])

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only from these token ids (a frequency-ranked subset of the vocabulary, as in FR-Spec).

        The heads' vocab projection is the largest cost of drafting on a CPU (a [V, H] matrix-vector
        product per head, or per tree level for Hydra); projecting onto a third of the vocabulary that covers
        nearly every token the model writes cuts it about threefold. Verification still sees the full
        vocabulary, so outputs are unchanged: a right token outside the subset is only a missed draft."""
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long).flatten().unique()
            if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
                raise HeadsError(
                    f"draft vocabulary must be non-empty token ids in 0..{self.config.vocab_size - 1}"
                )
        self.draft_vocab = ids
        self._draft_proj.clear()

    def _draft_logits(self, k: int, feats: torch.Tensor) -> torch.Tensor:
        """Head k's logits over the draft vocabulary (all of it when none is set): [..., H] -> [..., Vd]."""
        if self.draft_vocab is None:
            return self.project(k, feats)
        proj = self.heads[k].proj
        layer = proj if proj is not None else self._require_base().lm_head
        key = (
            k if proj is not None else -1,
            layer.weight.device,
            layer.weight.dtype,
            layer.weight.data_ptr(),
        )
        if key not in self._draft_proj:  # the sliced matrix, built once per device and dtype
            ids = self.draft_vocab.to(layer.weight.device)
            bias = layer.bias[ids] if getattr(layer, "bias", None) is not None else None
            self._draft_proj = {kk: v for kk, v in self._draft_proj.items() if kk[0] != key[0]}
            self._draft_proj[key] = (layer.weight[ids].contiguous(), bias)  # [Vd, H], [Vd]
        weight, bias = self._draft_proj[key]
        return F.linear(feats.to(weight.dtype), weight, bias)

    def _draft_ids(self, top: torch.Tensor) -> torch.Tensor:
        """Map indices into the draft vocabulary back to token ids."""
        return top if self.draft_vocab is None else self.draft_vocab.to(top.device)[top]

    # ---- training ---------------------------------------------------------------------------------

    def features(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced pre-projection features of every head: K tensors [B, T, H].

        ``hidden`` [B, T, H] are base hidden states after tokens [B, T] (x_0..x_{T-1}). Head k's feature at
        t predicts x_{t+k+1}; positions with t+k+1 >= T are garbage (the trainer masks them).
        """
        x = hidden.to(self.dtype)
        return [head.blocks(x) for head in self.heads]

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        return self.features(hidden, tokens)

    def project(self, k: int, feats: torch.Tensor) -> torch.Tensor:
        """Head k's (0-based) vocab projection: feats [..., H] -> logits [..., V]."""
        if not 0 <= k < self.config.num_heads:
            raise HeadsError(
                f"head index {k} is out of range: these heads have indices 0..{self.config.num_heads - 1}"
            )
        proj = self.heads[k].proj
        if proj is not None:
            return proj(feats)
        lm_head = self._require_base().lm_head
        return lm_head(feats.to(lm_head.weight.dtype))

    def init_projections_from_base(self) -> None:
        """Copy the bound base output layer into each head's own projection (the official Medusa init)."""
        lm_weight = self._require_base().lm_head.weight
        with torch.no_grad():
            for head in self.heads:
                if head.proj is not None:
                    head.proj.weight.copy_(lm_weight)
                    if head.proj.bias is not None:
                        head.proj.bias.zero_()


class MedusaHeads(Heads):
    """Medusa-1: independent heads, all on the last committed feature."""


class HydraHeads(Heads):
    """Hydra: head k also reads the embeddings of the k tokens before it on its branch (``grounded``).

    Choices where the official code is loose: drafts and ``features`` pad the token shift with id 0 (the
    official training uses ``torch.roll``, which wraps; both only touch positions the loss masks), and each
    residual block owns its weights (the official ``[ResBlock(h)] * (n - 1)`` reuses ONE module, so an
    official checkpoint with ``num_layers > 2`` stores equal copies, which load here unchanged).
    """

    proj_bias = True

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "hydra":
            raise HeadsError(f"HydraHeads needs kind='hydra', got {config.kind!r}")
        super().__init__(config)
        # prefix-mlp without geometry in the config: built by bind(), from the base model.
        self.prefix = PrefixLayer(config) if config.head_arch == "prefix-mlp" and config.head_dim else None
        self._prefix_init = (0, "medusa")  # (seed, init) for a prefix layer built at bind()
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None  # prefix-mlp cache: [1, nkv, S, hd] x2

    def head_input_size(self, i: int) -> int:
        h = self.config.hidden_size
        return h * (i + 2) if self.config.grounded else h

    @property
    def grounded(self) -> bool:
        return self.config.grounded

    def reset(self) -> None:
        super().reset()
        self._kv = None

    def _bind_prefix(self, model: nn.Module, fix: str) -> None:
        """Build the prefix layer from the model's geometry, or check it against the model and take the
        head count / head size split from it (official Hydra configs do not record the split)."""
        cfg, mc = self.config, model.config
        nh = mc.num_attention_heads
        nkv = getattr(mc, "num_key_value_heads", None) or nh
        hd = getattr(mc, "head_dim", None) or mc.hidden_size // nh
        if self.prefix is None:  # geometry unknown until now: build the layer (seeded, like random_heads)
            self.config = dataclasses.replace(
                cfg,
                num_attention_heads=nh,
                num_key_value_heads=nkv,
                head_dim=hd,
                intermediate_size=mc.intermediate_size,
            )
            seed, init = self._prefix_init
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 1)
                layer = PrefixLayer(self.config)
                if init == "random":
                    _randomize_norms(layer)
            self.prefix = layer.to(device=self.device, dtype=self.dtype)
            return
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        if (nh * hd, nkv * hd, mc.intermediate_size) != (q_size, kv_size, cfg.intermediate_size):
            raise HeadsError(
                f"prefix-mlp layer has attention sizes q={q_size}, kv={kv_size}, mlp={cfg.intermediate_size} "
                f"but the model has q={nh * hd}, kv={nkv * hd}, mlp={mc.intermediate_size}; {fix}"
            )
        self.config = dataclasses.replace(cfg, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd)
        self.prefix.num_heads, self.prefix.num_kv_heads, self.prefix.head_dim = nh, nkv, hd

    def _run_prefix(
        self, x: torch.Tensor, start: int, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The prefix layer over x [B, T, H] at absolute positions start..start+T-1."""
        base = self._require_base()
        assert self.prefix is not None  # bind() builds it
        positions = torch.arange(start, start + x.shape[1], device=x.device).expand(x.shape[0], -1)  # [B, T]
        cos, sin = base.rotary(x, positions)  # [B, T, hd] each
        return self.prefix(x, cos, sin, base.rms_norm_eps, past)

    @torch.inference_mode()
    def extend(self, hidden: torch.Tensor) -> None:
        if self.config.head_arch != "prefix-mlp":
            return super().extend(hidden)
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
            raise HeadsError(
                f"extend() takes hidden states [T, {self.config.hidden_size}], got {tuple(hidden.shape)}"
            )
        if hidden.shape[0] == 0:
            return
        start = 0 if self._kv is None else self._kv[0].shape[2]
        out, self._kv = self._run_prefix(hidden.to(self.dtype)[None], start, self._kv)  # out [1, T, H]
        self._feature = out[0, -1]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Base input embeddings of ``tokens`` in the heads' dtype, never trained: [...] -> [..., H]."""
        with torch.no_grad():
            return self._require_base().embed(tokens).to(self.dtype)

    def _root_context(self, feat: torch.Tensor, root_token: torch.Tensor) -> torch.Tensor:
        """Level 0 is the root alone: head 1 reads concat(feature, emb(root)) [1, 2H]."""
        return torch.cat([feat, self._embed(root_token.reshape(1).to(feat.device))[0]])[None]

    def _level_topk(self, d: int, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Head d's top-k token ids and log-probabilities for branch contexts x [P, (d+1)H]: [P, k] each."""
        lp = F.log_softmax(self._draft_logits(d - 1, self.heads[d - 1].blocks(x)).float(), dim=-1)  # [P, Vd]
        top_lp, top = lp.topk(k, dim=-1)  # [P, k]
        return self._draft_ids(top), top_lp

    def _probe(self, master: Tree, feat: torch.Tensor, root_token: torch.Tensor) -> Probe:
        if not self.grounded:
            return super()._probe(master, feat, root_token)
        ctx = self._root_context(feat, root_token)  # [1, 2H]
        k = self._plan(master, feat.device, _level_plans)[0].k
        return Probe(*self._level_topk(1, ctx, k), context=ctx)

    def _draft(self, tree: Tree, feat: torch.Tensor, root_token: torch.Tensor, probe: Probe | None) -> Draft:
        """Level by level: the depth-d nodes' head reads the feature and the tokens of their branch."""
        if not self.grounded:
            return self._draft_parallel(tree, feat, probe)
        plans = self._plan(tree, feat.device, _level_plans)
        tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=feat.device)  # [N]
        logprobs = torch.empty(tree.num_nodes, dtype=torch.float32, device=feat.device)  # [N]
        reuse = probe is not None and probe.context is not None and plans[0].k <= probe.topk
        ctx = probe.context if reuse else self._root_context(feat, root_token)  # [1, 2H]
        for d, plan in enumerate(plans, start=1):
            x = ctx[plan.rows]  # [P, (d+1)H]: the level-(d-1) nodes that have children
            if d == 1 and reuse:  # level 1 (the root's children) is what the probe drafted
                top_tok, top_lp = probe.tokens, probe.logprobs
            else:
                top_tok, top_lp = self._level_topk(d, x, plan.k)  # [P, k] each
            tok = top_tok[plan.parent, plan.rank]  # [n_d]
            tokens[plan.out] = tok
            logprobs[plan.out] = top_lp[plan.parent, plan.rank]
            if d < len(plans):
                ctx = torch.cat([x[plan.parent], self._embed(tok)], dim=-1)  # [n_d, (d+2)H]
        return Draft(tokens=tokens, logprobs=logprobs)

    def features(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        x = hidden.to(self.dtype)  # [B, T, H]
        if self.config.head_arch == "prefix-mlp":
            x, _ = self._run_prefix(x, 0, None)
        if not self.grounded:
            return [head.blocks(x) for head in self.heads]
        b, t = tokens.shape
        k_max = self.config.num_heads
        padded = torch.cat([tokens, tokens.new_zeros(b, k_max)], dim=1)  # [B, T+K]
        emb = self._embed(padded)  # [B, T+K, H]
        out, ctx = [], x
        for k, head in enumerate(self.heads, start=1):
            ctx = torch.cat([ctx, emb[:, k : k + t]], dim=-1)  # [B, T, (k+1)H]; tokens[t+k] at t
            out.append(head.blocks(ctx))
        return out


def frequent_tokens(counts: torch.Tensor, size: int, keep: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids by `counts` [V], plus the ids in `keep` (EOS and other special
    tokens, which must stay draftable however rare): a draft vocabulary for `Heads.set_draft_vocab`."""
    if size < 1:
        raise HeadsError(f"draft vocabulary size must be >= 1, got {size}")
    top = counts.float().topk(min(size, counts.numel())).indices
    return torch.cat([top, torch.as_tensor(list(keep), dtype=torch.long)]).unique()


def _heads_class(config: HeadsConfig) -> type[Heads]:
    return MedusaHeads if config.kind == "medusa" else HydraHeads


def random_heads(
    config: HeadsConfig, seed: int = 0, dtype: torch.dtype = torch.float32, init: str = "medusa"
) -> Heads:
    """Fresh heads. ``init="medusa"``: residual blocks start as the identity (zero ``linear`` weights), as
    Medusa and Hydra do; ``init="random"``: every weight nonzero, for tests that must see each parameter."""
    if init not in ("medusa", "random"):
        raise HeadsError(f"init {init!r} is unknown: use 'medusa' or 'random'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = _heads_class(config)(config)
        with torch.no_grad():
            for module in heads.modules():
                if init == "medusa" and isinstance(module, ResBlock):
                    module.linear.weight.zero_()
            if init == "random":
                _randomize_norms(heads)
    heads._prefix_init = (seed, init)
    return heads.to(dtype)


def _randomize_norms(module: nn.Module) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.normal_(1.0, 0.1)


# ---- files ----------------------------------------------------------------------------------------


def _write_atomically(
    directory: str | os.PathLike[str], files: dict[str, Callable[[Path], None]], overwrite: bool
) -> None:
    """Write each ``name -> writer(path)`` into temp files, then rename them into place (weights first,
    ``config.json`` last). Other heads files left there by an earlier save are removed."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise HeadsError(f"{d} is a file, not a directory: give a directory to save the heads into")
    d.mkdir(parents=True, exist_ok=True)
    existing = [n for n in HEADS_FILES if (d / n).exists()]
    if existing and not overwrite:
        raise HeadsError(
            f"{d} already holds heads ({', '.join(existing)}): pass overwrite=True (--overwrite) to replace them"
        )
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temps = {name: d / f".{name}.tmp-{tag}" for name in files}
    try:
        for name, write in files.items():
            write(temps[name])
        for name in sorted(files, key=lambda n: n == CONFIG_FILE):
            os.replace(temps[name], d / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    for stale in set(existing) - set(files):
        (d / stale).unlink(missing_ok=True)


def _json_writer(obj: dict[str, Any]) -> Callable[[Path], None]:
    return lambda p: p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _tensor_writer(state: dict[str, torch.Tensor], safetensors: bool) -> Callable[[Path], None]:
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}

    def write(p: Path) -> None:
        if safetensors:
            from safetensors.torch import save_file

            save_file(state, str(p))
        else:
            torch.save(state, p)

    return write


def _check_complete(heads: Heads) -> None:
    if heads.config.head_arch == "prefix-mlp" and getattr(heads, "prefix", None) is None:
        raise HeadsError(
            "these prefix-mlp heads have no prefix layer yet (it takes its shape from the base model): "
            "call heads.bind(model) before saving"
        )


def save_heads(heads: Heads, directory: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Save in our format: ``config.json`` (format, version, HeadsConfig) + ``heads.safetensors``."""
    _check_complete(heads)
    config = {"format": FORMAT, "version": FORMAT_VERSION, **dataclasses.asdict(heads.config)}
    files = {WEIGHTS_FILE: _tensor_writer(heads.state_dict(), safetensors=True)}
    if heads.draft_vocab is not None:
        files[DRAFT_VOCAB_FILE] = _tensor_writer({"ids": heads.draft_vocab.cpu()}, safetensors=True)
    files[CONFIG_FILE] = _json_writer(config)
    _write_atomically(directory, files, overwrite)


# Our parameter name -> official name. Official checkpoints hold per-head projections.
def _medusa_name(name: str, config: HeadsConfig) -> str:
    name = re.sub(r"^heads\.(\d+)\.blocks\.(\d+)\.", r"\1.\2.", name)
    return re.sub(r"^heads\.(\d+)\.proj\.", rf"\1.{config.num_layers}.", name)


def _hydra_name(name: str, config: HeadsConfig) -> str:
    if config.head_arch == "mlp":
        name = re.sub(r"^heads\.(\d+)\.blocks\.(\d+)\.", r"hydra_mlp.\1.\2.", name)
        return re.sub(r"^heads\.(\d+)\.proj\.", r"hydra_lm_head.\1.", name)
    # prefix-mlp interleaves Dropout modules: blocks sit at odd indices, the projection at index 1.
    name = re.sub(r"^heads\.(\d+)\.blocks\.(\d+)\.", lambda m: f"hydra_mlp.{m[1]}.{2 * int(m[2]) + 1}.", name)
    name = re.sub(r"^heads\.(\d+)\.proj\.", r"hydra_lm_head.\1.1.", name)
    if name == "prefix.norm.weight":
        return "prefix_embeding_layer.norm.weight"
    return re.sub(r"^prefix\.", "prefix_embeding_layer.layers.0.", name)


def _official_state(heads: Heads, rename: Callable[[str, HeadsConfig], str]) -> dict[str, torch.Tensor]:
    """The heads' weights under official names, with a projection per head (copied from the base when shared)."""
    _check_complete(heads)
    cfg = heads.config
    state = dict(heads.state_dict())
    if cfg.share_lm_head:
        lm_weight = heads._require_base().lm_head.weight.detach()
        for i in range(cfg.num_heads):
            state[f"heads.{i}.proj.weight"] = lm_weight.to(heads.dtype)
            if heads.proj_bias:
                state[f"heads.{i}.proj.bias"] = torch.zeros(cfg.vocab_size, dtype=heads.dtype)
    return {rename(k, dataclasses.replace(cfg, share_lm_head=False)): v for k, v in state.items()}


def save_medusa_official(
    heads: Heads,
    directory: str | os.PathLike[str],
    *,
    config_heads: int | None = None,
    safetensors: bool = False,
    overwrite: bool = False,
) -> None:
    """Write the official Medusa-1 layout: ``config.json`` + ``medusa_lm_head.pt`` (or ``.safetensors``).

    ``config_heads`` overrides ``medusa_num_heads`` in the config, to reproduce published checkpoints whose
    config disagrees with their weights. Shared projections need the heads bound (the base layer is copied).
    """
    cfg = heads.config
    if cfg.kind != "medusa":
        raise HeadsError(f"save_medusa_official needs Medusa heads, got kind {cfg.kind!r}")
    config = {
        "medusa_num_heads": cfg.num_heads if config_heads is None else config_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": cfg.base_model,
    }
    name = MEDUSA_SAFETENSORS if safetensors else MEDUSA_PT
    files = {
        name: _tensor_writer(_official_state(heads, _medusa_name), safetensors),
        CONFIG_FILE: _json_writer(config),
    }
    _write_atomically(directory, files, overwrite)


def save_hydra_official(
    heads: Heads,
    directory: str | os.PathLike[str],
    config_heads: int | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Write the official Hydra layout: ``config.json`` (HydraConfig fields) + ``hydra_lm_head.pt`` (the
    state dict of the official ``hydra_head`` module, minus its unused embedding tables)."""
    cfg = heads.config
    if cfg.kind != "hydra":
        raise HeadsError(f"save_hydra_official needs Hydra heads, got kind {cfg.kind!r}")
    config: dict[str, Any] = {
        "hydra_num_heads": cfg.num_heads if config_heads is None else config_heads,
        "hydra_num_layers": cfg.num_layers,
        "hydra_head_arch": cfg.head_arch,
        "base_model_name_or_path": cfg.base_model,
        "grounded_heads": cfg.grounded,
        "hidden_state_offset": cfg.hidden_state_offset,
    }
    if cfg.head_arch == "prefix-mlp":  # not in official configs; recorded so the split needs no guess
        config.update(
            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads
        )
    files = {
        HYDRA_PT: _tensor_writer(_official_state(heads, _hydra_name), False),
        CONFIG_FILE: _json_writer(config),
    }
    _write_atomically(directory, files, overwrite)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsError(f"cannot read heads config {path} ({e}): fix the JSON or download it again") from e
    if not isinstance(data, dict):
        raise HeadsError(f"heads config {path} is not a JSON object: download or save the heads again")
    return data


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip all raise their own types
        raise HeadsError(
            f"cannot read heads weights {path}: the file is corrupt or truncated "
            f"({type(e).__name__}: {e}); download or save the heads again"
        ) from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HeadsError(
            f"heads weights {path} are not a state dict of tensors: download or save the heads again"
        )
    return state


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _build(
    config: HeadsConfig,
    state: dict[str, torch.Tensor],
    path: Path,
    rename: Callable[[str, HeadsConfig], str] | None = None,
) -> Heads:
    """Heads for ``config`` holding ``state`` (official names when ``rename`` maps ours to them)."""
    with torch.device("meta"):
        heads = _heads_class(config)(config)
    expected = heads.state_dict()
    to_ours = {(rename(k, config) if rename else k): k for k in expected}
    missing = sorted(set(to_ours) - set(state))
    unexpected = sorted(set(state) - set(to_ours))
    if missing or unexpected:
        parts = [
            f"missing keys {_few(missing)}" if missing else "",
            f"unexpected keys {_few(unexpected)}" if unexpected else "",
        ]
        raise HeadsError(
            f"heads weights {path} do not match their config ({config.kind}, {config.num_heads} heads, "
            f"{config.num_layers} layers): {'; '.join(p for p in parts if p)}; the file is incomplete or "
            f"belongs to other heads: download or save them again"
        )
    ours, seen = {}, set()
    for name, ours_name in to_ours.items():
        tensor = state[name]
        if tensor.shape != expected[ours_name].shape:
            raise HeadsError(
                f"heads weights {path}: {name} has shape {tuple(tensor.shape)} but hidden size "
                f"{config.hidden_size} / vocab size {config.vocab_size} need {tuple(expected[ours_name].shape)}; "
                f"the shapes are inconsistent: the file is corrupt or mixes two checkpoints"
            )
        # Official checkpoints may store one tensor under several names (a reused module): untie them.
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        ours[ours_name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    heads.load_state_dict(ours, assign=True)
    return heads


def _ints_after(prefix: str, keys: list[str]) -> list[int]:
    """Sorted distinct integers ``n`` in keys that start with ``prefix`` + ``n.``."""
    found = {int(m[1]) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return sorted(found)


def _load_medusa(directory: Path, cfg: dict[str, Any]) -> Heads:
    path = directory / MEDUSA_SAFETENSORS
    if not path.exists():
        path = directory / MEDUSA_PT
    state = _read_weights(path)
    if state and all(k.startswith("medusa_head.") for k in state):
        state = {k[len("medusa_head.") :]: v for k, v in state.items()}
    keys = list(state)
    heads_ids = _ints_after("", keys)
    layers = _ints_after("0.", [k for k in keys if k.endswith(".linear.weight")])
    if not heads_ids or not layers:
        raise HeadsError(
            f"no Medusa heads in {path} (expected keys like 0.0.linear.weight, found {_few(keys)}): "
            f"download the heads again"
        )
    num_layers = len(layers)
    hidden = state["0.0.linear.weight"].shape[1]
    proj = state.get(f"0.{num_layers}.weight")
    if proj is None:
        raise HeadsError(
            f"Medusa weights {path} lack the projection 0.{num_layers}.weight: download them again"
        )
    config = HeadsConfig(
        kind="medusa",
        num_heads=len(heads_ids),  # from the weights: published configs under-report (2 vs 5)
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=proj.shape[0],
        share_lm_head=False,
        base_model=str(cfg.get("base_model_name_or_path", "")),
    )
    return _build(config, state, path, _medusa_name)


def _load_hydra(directory: Path, cfg: dict[str, Any]) -> Heads:
    path = directory / HYDRA_PT
    if not path.exists():
        raise HeadsError(f"Hydra config in {directory} but no {HYDRA_PT} beside it: download the weights too")
    arch = cfg.get("hydra_head_arch", "mlp")
    if arch not in HEAD_ARCHS:
        raise HeadsError(
            f"{directory}: hydra_head_arch {arch!r} is not supported: use {', '.join(HEAD_ARCHS)} heads"
        )
    raw = _read_weights(path)
    # The official module also registers the base embedding (input_embed_fn) and an unused one in the prefix
    # LlamaModel; old transformers saved rotary inv_freq buffers. None of these are head weights.
    ignored = ("input_embed_fn.", "prefix_embeding_layer.embed_tokens.")
    state = {
        k: v for k, v in raw.items() if not k.startswith(ignored) and not k.endswith("rotary_emb.inv_freq")
    }
    keys = list(state)
    heads_ids = _ints_after("hydra_mlp.", keys)
    first = 1 if arch == "prefix-mlp" else 0
    blocks = _ints_after("hydra_mlp.0.", [k for k in keys if k.endswith(".linear.weight")])
    proj_key = "hydra_lm_head.0.1.weight" if arch == "prefix-mlp" else "hydra_lm_head.0.weight"
    if not heads_ids or not blocks or proj_key not in state:
        raise HeadsError(
            f"no {arch} Hydra heads in {path} (expected keys like hydra_mlp.0.{first}.linear.weight and "
            f"{proj_key}, found {_few(keys)}): check hydra_head_arch in config.json or download the heads again"
        )
    hidden = state[f"hydra_mlp.0.{first}.linear.weight"].shape[0]
    fields: dict[str, Any] = {}
    if arch == "prefix-mlp":
        q = state.get("prefix_embeding_layer.layers.0.self_attn.q_proj.weight")
        k = state.get("prefix_embeding_layer.layers.0.self_attn.k_proj.weight")
        gate = state.get("prefix_embeding_layer.layers.0.mlp.gate_proj.weight")
        if q is None or k is None or gate is None:
            raise HeadsError(
                f"prefix-mlp Hydra weights {path} lack the prefix decoder layer: download them again"
            )
        # Official configs do not record the head split; bind() takes it from the base model. Until then
        # guess Llama's head size 128 (or the largest divisor of both sizes below it) unless config.json
        # names the head count. Only the split is guessed: parameter shapes come from the weights.
        nh = cfg.get("num_attention_heads")
        head_dim = q.shape[0] // nh if nh else math.gcd(q.shape[0], k.shape[0], 128)
        fields = {
            "num_attention_heads": q.shape[0] // head_dim,
            "num_key_value_heads": k.shape[0] // head_dim,
            "head_dim": head_dim,
            "intermediate_size": gate.shape[0],
        }
    config = HeadsConfig(
        kind="hydra",
        num_heads=len(heads_ids),
        num_layers=len(blocks),
        hidden_size=hidden,
        vocab_size=state[proj_key].shape[0],
        share_lm_head=False,
        head_arch=arch,
        grounded=f"hydra_mlp.0.{first}.res_connection.weight" in state,
        hidden_state_offset=int(cfg.get("hidden_state_offset", 0)),
        base_model=str(cfg.get("base_model_name_or_path", "")),
        **fields,
    )
    if "grounded_heads" in cfg and bool(cfg["grounded_heads"]) != config.grounded:
        raise HeadsError(
            f"{directory}: config.json says grounded_heads={cfg['grounded_heads']} but the weights in {path} "
            f"are {'' if config.grounded else 'un'}grounded: fix config.json or download the heads again"
        )
    return _build(config, state, path, _hydra_name)


def _load_ours(directory: Path, cfg: dict[str, Any]) -> Heads:
    path = directory / WEIGHTS_FILE
    if cfg.get("version") != FORMAT_VERSION:
        raise HeadsError(
            f"{directory / CONFIG_FILE} has format version {cfg.get('version')!r}; this entmtp reads "
            f"version {FORMAT_VERSION}: upgrade entmtp or save the heads again"
        )
    if not path.exists():
        raise HeadsError(f"{directory} has a heads config but no {WEIGHTS_FILE}: save the heads again")
    fields = {k: v for k, v in cfg.items() if k not in ("format", "version")}
    known = {f.name for f in dataclasses.fields(HeadsConfig)}
    if set(fields) - known:
        raise HeadsError(
            f"{directory / CONFIG_FILE} has unknown fields {sorted(set(fields) - known)}: "
            f"it was written by a newer entmtp; upgrade entmtp"
        )
    try:
        config = HeadsConfig(**fields)
    except TypeError as e:
        raise HeadsError(f"{directory / CONFIG_FILE} is incomplete ({e}): save the heads again") from e
    heads = _build(config, _read_weights(path), path)
    vocab_path = directory / DRAFT_VOCAB_FILE
    if vocab_path.exists():
        heads.set_draft_vocab(_read_weights(vocab_path)["ids"])
    return heads


def load_heads(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Heads:
    """Load heads from a directory in our format, the official Medusa layout or the official Hydra layout.

    The number of heads (and layers, hidden and vocab sizes) is read from the weights, never from an
    official config. Weights keep their stored dtype unless ``dtype`` is given.
    """
    directory = Path(path)
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise HeadsError(
            f"heads directory {directory} {what}: give the directory holding config.json and the weights"
        )
    cfg_path = directory / CONFIG_FILE
    cfg = _read_json(cfg_path) if cfg_path.exists() else {}
    if cfg.get("format") == FORMAT:
        heads = _load_ours(directory, cfg)
    elif "hydra_num_heads" in cfg or (not cfg and (directory / HYDRA_PT).exists()):
        heads = _load_hydra(directory, cfg)
    elif (directory / MEDUSA_SAFETENSORS).exists() or (directory / MEDUSA_PT).exists():
        heads = _load_medusa(directory, cfg)
    else:
        raise HeadsError(
            f"no heads found in {directory}: expected config.json + {WEIGHTS_FILE} (entmtp), "
            f"{MEDUSA_PT} or {MEDUSA_SAFETENSORS} (Medusa), or config.json + {HYDRA_PT} (Hydra)"
        )
    if dtype is not None or device is not None:
        heads = heads.to(device=device, dtype=dtype)
    return heads
