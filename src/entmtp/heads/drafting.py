"""Drafting: the `Heads` base class (binding to the base model, the committed feature, top-k tables gathered into
a tree, the draft vocabulary, the teacher-forced training features) and Medusa's independent heads.

Hydra's branch-by-branch drafting and fresh heads live in `hydra.py`, files in `formats.py`."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HeadsError
from ..packing import PackedLinear, linear, packed_weight
from .config import HeadsConfig
from .int8 import Int8Linear, applies, int8_linear, int8_weight, quantize_linears
from .modules import Head

if TYPE_CHECKING:
    from ..accept import GumbelNoise
    from ..tree import Tree


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


class LazyProbe:
    """A `Probe` computed when a policy first reads it (`tokens`, `logprobs`, `context`): the engine offers the
    master's probe this way, so a policy that decides without the heads (the hybrid taking a lookup chain
    alone, scheduler/hybrid.py) costs no heads' work. `taken(probe)` is the probe if it was read, else None;
    `seconds` the time its computation took (0 if it was never read)."""

    def __init__(self, compute: Callable[[], Probe]):
        self._compute = compute
        self.probe: Probe | None = None
        self.seconds = 0.0

    def _get(self) -> Probe:
        if self.probe is None:
            t0 = time.perf_counter()
            self.probe = self._compute()
            self.seconds = time.perf_counter() - t0
        return self.probe

    @property
    def tokens(self) -> torch.Tensor:
        return self._get().tokens

    @property
    def logprobs(self) -> torch.Tensor:
        return self._get().logprobs

    @property
    def context(self) -> torch.Tensor | None:
        return self._get().context


def taken(probe: Probe | LazyProbe | None) -> Probe | None:
    """The probe a step has: `probe` itself, or a lazy one's if a policy read it (None if none did)."""
    return probe.probe if isinstance(probe, LazyProbe) else probe


@dataclass(frozen=True)
class BaseRefs:
    """The bound base model's parts the heads use. A plain object, so never saved or moved with the heads."""

    embed: nn.Module  # token id -> [H]
    lm_head: nn.Module  # [H] -> [V]
    rotary: nn.Module | None  # prefix-mlp: (x, position_ids) -> (cos, sin)
    rms_norm_eps: float


@dataclass(frozen=True)
class LevelPlan:
    """How to draft the nodes of one depth d from the nodes of depth d-1 (built once per tree)."""

    out: slice  # positions of the level's nodes in the [N] draft (node id - 1)
    rows: torch.Tensor  # [P] int64: nodes of depth d-1 (index within that level) that have children
    parent: torch.Tensor  # [n_d] int64: each node's parent, as an index into rows
    rank: torch.Tensor  # [n_d] int64: each node's rank among its head's candidates
    k: int  # top-k width this level needs: max rank + 1


def node_index(tree: Tree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (depth - 1) and column (rank) of nodes 1..N in a top-k table [depth, k]: [N] each."""
    return (tree.depths[1:] - 1).to(device), tree.ranks[1:].to(device)


def level_plans(tree: Tree, device: torch.device) -> tuple[LevelPlan, ...]:
    plans = []
    prev_start = 0  # node id of the first node of depth d-1 (the root for d = 1)
    for sl in tree.level_slices:
        local = tree.parents[sl] - prev_start  # [n_d] parent index within level d-1
        rows, parent = torch.unique(local, sorted=True, return_inverse=True)
        k = max(p[-1] for p in tree.paths[sl.start - 1 : sl.stop - 1]) + 1  # from the Python paths
        plans.append(
            LevelPlan(
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
    """K draft heads. See `entmtp.heads` for the drafting and training contracts."""

    config: HeadsConfig

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            Head(self.head_input_size(i), config, proj_bias=self.proj_bias) for i in range(config.num_heads)
        )
        self._base: BaseRefs | None = None
        self._plans: weakref.WeakKeyDictionary[Tree, dict[torch.device, Any]] = weakref.WeakKeyDictionary()
        self.draft_vocab: torch.Tensor | None = None  # [Vd] token ids drafts are chosen from (None: all)
        # key -> (weight [Vd, H], bias, packed weight or None, (int8 weight, scales) or None)
        self._draft_proj: dict[tuple, tuple] = {}
        self.int8 = False  # drafting reads int8 copies of the weights (`quantize_int8`)

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
        fix = "train heads for this model (`entmtp train-heads`), pick the right base model, or decode without heads"
        if cfg.base_model:
            fix = f"these were trained for {cfg.base_model}: {fix}"
        fix += " (--heads none)"
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
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None  # llama.cpp's has none
        if (
            cfg.hidden_state_offset
            and cfg.hidden_state_norm
            and decoder is not None
            and not hasattr(decoder, "norm")
        ):
            raise HeadsError(
                f"heads read layer states through the base model's final norm, which {name} lacks (no "
                "`.norm` on its decoder): use heads that read the last layer (hidden_state_offset 0) or the "
                "raw state (hidden_state_norm False)"
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
        self._base = BaseRefs(embed=embed, lm_head=lm_head, rotary=rotary, rms_norm_eps=eps)
        return self

    def is_bound_to(self, model: nn.Module) -> bool:
        return self._base is not None and self._base.embed is model.get_input_embeddings()

    def _bind_prefix(self, model: nn.Module, fix: str) -> None:
        raise NotImplementedError  # only Hydra heads have a prefix layer

    def _require_base(self) -> BaseRefs:
        if self._base is None:
            raise HeadsError("the heads are not bound to a base model: call heads.bind(model) first")
        return self._base

    # ---- drafting ---------------------------------------------------------------------------------

    def drafter(self, noise: GumbelNoise | None = None, temperature: float = 1.0) -> Drafter:
        """A fresh drafting state for one generation (see `Drafter`); `noise` and `temperature`: the gumbel
        acceptance rule's, to draft with (accept.py)."""
        return Drafter(self, noise, temperature)

    def advance(
        self, hidden: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(the feature after newly committed positions' hidden states [T, H], T >= 1; the prefix layer's
        KV cache after them). Medusa and Hydra-`mlp`: the last hidden state, no cache."""
        return hidden[-1].to(self.dtype).clone(), None

    def _plan(self, tree: Tree, device: torch.device, build: Callable[[Tree, torch.device], Any]) -> Any:
        """Per-tree index tensors, built on the first draft with that tree and device, then reused."""
        per_tree = self._plans.setdefault(tree, {})
        key = (device, build)
        if key not in per_tree:
            per_tree[key] = build(tree, device)
        return per_tree[key]

    def check_tree(self, tree: Tree) -> None:
        if tree.depth > self.config.num_heads:
            raise HeadsError(
                f"tree {tree.name!r} has depth {tree.depth} but the heads predict only "
                f"{self.config.num_heads} tokens ahead: use a tree of depth <= {self.config.num_heads}"
            )

    # `perturb` (the gumbel rule, accept.py): T g_t over the draft vocabulary, [depth, Vd], one row per depth
    # (the noise of the position that depth's drafts take); the heads rank candidates by log-probability +
    # perturbation instead of log-probability, and still report each candidate's log-probability.

    def probe_at(
        self, master: Tree, feat: torch.Tensor, root_token: torch.Tensor, perturb: torch.Tensor | None = None
    ) -> Probe:
        return Probe(*self._topk_table(feat, master.depth, master.topk, perturb))

    def draft_at(
        self,
        tree: Tree,
        feat: torch.Tensor,
        root_token: torch.Tensor,
        probe: Probe | None,
        perturb: torch.Tensor | None = None,
    ) -> Draft:
        return self._draft_parallel(tree, feat, probe, perturb)

    def probe_rows(
        self, master: Tree, feats: torch.Tensor, roots: torch.Tensor, perturb: torch.Tensor | None = None
    ) -> list[Probe]:
        """`probe_at` of B rows at once (a batched step): feats [B, H], roots [B], perturb [B, depth, Vd]; one
        matmul per head for every row instead of one per row (the projection's weights are read once)."""
        rows = perturb[:, : master.depth].transpose(0, 1) if perturb is not None else None  # [depth, B, Vd]
        ids, lp = self._topk_table(feats, master.depth, master.topk, rows)  # [depth, B, k]
        return [Probe(ids[:, b], lp[:, b]) for b in range(feats.shape[0])]

    def _topk_table(
        self, feat: torch.Tensor, depth: int, k: int, perturb: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head reads the same feature [..., H]: top-k token ids and log-probabilities [depth, ..., k] of
        heads 1..depth (`perturb` [depth, ..., Vd]: ranked by log-probability + perturbation)."""
        hs = torch.stack([self.heads[i].blocks(feat) for i in range(depth)])  # [depth, ..., H]
        logits = self._project_stack(hs)  # [depth, ..., Vd]
        return self._topk(F.log_softmax(logits.float(), dim=-1), k, perturb)

    def _topk(
        self, lp: torch.Tensor, k: int, perturb: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and log-probabilities [..., k] of the k best of `lp` [..., Vd] (+ `perturb`, its shape)."""
        if perturb is None:
            top_lp, top = lp.topk(k, dim=-1)
        else:
            top = (lp + perturb.to(lp.device)).topk(k, dim=-1).indices
            top_lp = lp.gather(-1, top)
        return self._draft_ids(top), top_lp

    def _draft_parallel(
        self, tree: Tree, feat: torch.Tensor, probe: Probe | None = None, perturb: torch.Tensor | None = None
    ) -> Draft:
        """One top-k table [depth, k] (the probe's when it covers the tree), gathered into the tree."""
        if probe is not None and tree.depth <= probe.depth and tree.topk <= probe.topk:
            tokens, logprobs = probe.tokens, probe.logprobs
        else:
            rows = perturb[: tree.depth] if perturb is not None else None
            tokens, logprobs = self._topk_table(feat, tree.depth, tree.topk, rows)
        depth, rank = self._plan(tree, feat.device, node_index)  # [N] each
        return Draft(tokens=tokens[depth, rank], logprobs=logprobs[depth, rank])

    def _project_stack(self, hs: torch.Tensor) -> torch.Tensor:
        """Draft logits of heads 0..D-1 for hs [D, ..., H] -> [D, ..., Vd] (one matmul when shared)."""
        if self.config.share_lm_head:
            return self.draft_logits(0, hs)
        return torch.stack([self.draft_logits(i, h) for i, h in enumerate(hs)])

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

    def weights_changed(self) -> None:
        """Forget the draft projections sliced from the weights: call it after writing weights in place (an
        optimiser does), so that the next draft slices the new ones."""
        self._draft_proj.clear()

    def draft_logits(self, k: int, feats: torch.Tensor) -> torch.Tensor:
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
            weight = layer.weight[ids].contiguous()  # [Vd, H]
            packed = packed_weight(weight) if isinstance(layer, PackedLinear) else None  # the layer's choice
            q = int8_weight(weight) if self.int8 and weight.dtype == torch.bfloat16 else None
            self._draft_proj[key] = (weight, bias, None if q is not None else packed, q)  # bias [Vd]
        weight, bias, packed, q = self._draft_proj[key]
        x = feats.to(weight.dtype)
        if q is not None and applies(x):
            return int8_linear(x, *q, bias)
        return linear(x, weight, bias, packed)

    def quantize_int8(self) -> int:
        """Draft from int8 copies of the heads' weights and of the draft projection (heads/int8.py: the same
        outputs, about half the bytes a draft reads), in place, where the heads are bfloat16 on a CPU and
        torch has the kernel; returns how many layers it quantized (0: nothing changed). Training and
        anything with gradients still read the dense weights."""
        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return 0
        count = quantize_linears(self)
        if count or any(isinstance(m, Int8Linear) for m in self.modules()):
            self.int8 = True
            self._draft_proj = {}  # rebuilt with its int8 copy on the next draft
        return count

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

    def project_draft(self, k: int, feats: torch.Tensor) -> torch.Tensor:
        """Head k's (0-based) logits over the draft vocabulary, for training: feats [..., H] -> [..., Vd].
        Differentiable in the features and in the head's own projection (sliced afresh each call); a frozen
        shared lm_head is sliced once (`draft_logits`)."""
        if self.draft_vocab is None:
            raise HeadsError("these heads have no draft vocabulary: set one (set_draft_vocab) first")
        proj = self.heads[k].proj
        if proj is None or not proj.weight.requires_grad:
            return self.draft_logits(k, feats)
        ids = self.draft_vocab.to(proj.weight.device)
        return F.linear(feats, proj.weight[ids], None if proj.bias is None else proj.bias[ids])

    def init_projections_from_base(self) -> None:
        """Copy the bound base output layer into each head's own projection (the official Medusa init)."""
        lm_weight = self._require_base().lm_head.weight
        with torch.no_grad():
            for head in self.heads:
                if head.proj is not None:
                    head.proj.weight.copy_(lm_weight)
                    if head.proj.bias is not None:
                        head.proj.bias.zero_()


class Drafter:
    """One generation's drafting state over `heads`: the feature the next draft starts from and (Hydra++
    `prefix-mlp`) the prefix layer's KV cache of the committed positions. Each generation owns one, so two
    generations over the same heads never see each other's positions.

    Contract: `extend(hidden)` with the hidden states of newly committed positions (the prompt, then each
    step's accepted path); `probe(master, root_token)` before the tree is chosen; `draft(tree, root_token,
    probe)` for the chosen tree. With `noise` (the gumbel rule, accept.py) the drafts of depth d are the heads'
    best candidates under the noise of position `length + d` (`length`: the committed positions; the root is
    the next one), scaled by `temperature`."""

    def __init__(self, heads: Heads, noise: GumbelNoise | None = None, temperature: float = 1.0):
        self.heads, self.noise, self.temperature = heads, noise, temperature
        self.length = 0  # committed positions: the root token's position
        self._feature: torch.Tensor | None = None  # [H]
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None  # prefix-mlp: [1, nkv, S, hd] x2
        self.pending: list[torch.Tensor] = []  # committed hidden states [T, H] not yet advanced over

    @property
    @torch.inference_mode()
    def feature(self) -> torch.Tensor | None:
        """[H] the feature after every committed position (None before any): the heads advance over the
        pending positions first."""
        if self.pending:
            hidden = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
            self.pending = []
            self._feature, self.kv = self.heads.advance(hidden, self.kv)
        return self._feature

    @torch.inference_mode()
    def extend(self, hidden: torch.Tensor) -> None:
        """Take the base hidden states of newly committed positions: ``hidden`` [T, H]. The heads advance over
        them when the next probe or draft needs the feature, all pending positions at once: steps that draft
        nothing (a batch's plain steps, batch.Gate) cost the heads nothing."""
        size = self.heads.config.hidden_size
        if hidden.ndim != 2 or hidden.shape[1] != size:
            raise HeadsError(f"extend() takes hidden states [T, {size}], got {tuple(hidden.shape)}")
        if hidden.shape[0]:
            self.pending.append(hidden)
            self.length += hidden.shape[0]

    def perturbation(self, depth: int) -> torch.Tensor | None:
        """[depth, Vd] T g over the draft vocabulary for depths 1..depth of this step's tree (None: no noise)."""
        if self.noise is None:
            return None
        rows = self.noise.at(range(self.length + 1, self.length + 1 + depth))  # [depth, V]
        vocab = self.heads.draft_vocab
        if vocab is not None:
            rows = rows[:, vocab.to(rows.device)]
        return (self.temperature * rows).to(self.heads.device)

    def _require_feature(self) -> torch.Tensor:
        feature = self.feature
        if feature is None:
            raise HeadsError(
                "no committed position yet: call extend(prompt hidden states) before draft() or probe()"
            )
        return feature

    @torch.inference_mode()
    def draft(self, tree: Tree, root_token: torch.Tensor, probe: Probe | None = None) -> Draft:
        """Draft tokens for tree nodes 1..N; ``root_token`` is the base model's next token (node 0).
        ``probe``: this step's `probe` of a tree that contains ``tree``, reused instead of drafted again."""
        self.heads.check_tree(tree)
        feat = self._require_feature()  # [H]
        if tree.num_nodes == 0:
            empty = torch.empty(0, device=feat.device)
            return Draft(tokens=empty.long(), logprobs=empty.float())
        return self.heads.draft_at(tree, feat, root_token, probe, self.perturbation(tree.depth))

    @staticmethod
    @torch.inference_mode()
    def probe_rows(drafters: list[Drafter], master: Tree, roots: torch.Tensor) -> list[Probe]:
        """Each drafter's `probe(master, roots[b])`, computed for all rows at once (drafters over the same
        heads: one generation each, a batched step's rows)."""
        heads = drafters[0].heads
        heads.check_tree(master)
        feats = torch.stack([d._require_feature() for d in drafters])  # [B, H]
        perturb = None
        if any(d.noise is not None for d in drafters):  # rows without noise rank by log-probability alone
            rows = [d.perturbation(master.depth) for d in drafters]
            zero = torch.zeros_like(next(r for r in rows if r is not None))
            perturb = torch.stack([zero if r is None else r for r in rows])  # [B, depth, Vd]
        return heads.probe_rows(master, feats, roots, perturb)

    @torch.inference_mode()
    def probe(self, master: Tree, root_token: torch.Tensor) -> Probe:
        """What every subtree of ``master`` drafts first, with its probabilities (see `Probe`)."""
        self.heads.check_tree(master)
        if master.num_nodes == 0:
            raise HeadsError("probe() needs a tree with at least one node: the root-only tree drafts nothing")
        feature = self._require_feature()
        return self.heads.probe_at(master, feature, root_token, self.perturbation(master.depth))


class MedusaHeads(Heads):
    """Medusa-1: independent heads, all on the last committed feature."""


def frequent_tokens(counts: torch.Tensor, size: int, keep: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids by `counts` [V], plus the ids in `keep` (EOS and other special
    tokens, which must stay draftable however rare): a draft vocabulary for `Heads.set_draft_vocab`."""
    if size < 1:
        raise HeadsError(f"draft vocabulary size must be >= 1, got {size}")
    top = counts.float().topk(min(size, counts.numel())).indices
    return torch.cat([top, torch.as_tensor(list(keep), dtype=torch.long)]).unique()
