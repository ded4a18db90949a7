"""Hydra heads (head k also reads the tokens drafted before it on its branch) and Hydra++'s prefix layer at
drafting and training time; `heads_class` and `random_heads` build fresh heads of either kind."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HeadsError
from .config import HeadsConfig
from .drafting import Draft, Heads, MedusaHeads, Probe, level_plans
from .modules import PrefixLayer, randomize_norms

if TYPE_CHECKING:
    from ..tree import Tree


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

    def head_input_size(self, i: int) -> int:
        h = self.config.hidden_size
        return h * (i + 2) if self.config.grounded else h

    @property
    def grounded(self) -> bool:
        return self.config.grounded

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
                    randomize_norms(layer)
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

    def advance(
        self, hidden: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        if self.config.head_arch != "prefix-mlp":
            return super().advance(hidden, kv)
        start = 0 if kv is None else kv[0].shape[2]
        out, kv = self._run_prefix(hidden.to(self.dtype)[None], start, kv)  # out [1, T, H]
        return out[0, -1], kv

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Base input embeddings of ``tokens`` in the heads' dtype, never trained: [...] -> [..., H]."""
        with torch.no_grad():
            return self._require_base().embed(tokens).to(self.dtype)

    def _root_context(self, feat: torch.Tensor, root_token: torch.Tensor) -> torch.Tensor:
        """Level 0 is the root alone: head 1 reads concat(feature, emb(root)) [1, 2H]."""
        return torch.cat([feat, self._embed(root_token.reshape(1).to(feat.device))[0]])[None]

    def _level_topk(
        self, d: int, x: torch.Tensor, k: int, perturb: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head d's top-k token ids and log-probabilities for branch contexts x [P, (d+1)H]: [P, k] each
        (`perturb` [Vd] or [P, Vd]: ranked by log-probability + perturbation, drafting.Heads)."""
        lp = F.log_softmax(self.draft_logits(d - 1, self.heads[d - 1].blocks(x)).float(), dim=-1)  # [P, Vd]
        return self._topk(lp, k, perturb)

    def probe_at(
        self, master: Tree, feat: torch.Tensor, root_token: torch.Tensor, perturb: torch.Tensor | None = None
    ) -> Probe:
        if not self.grounded:
            return super().probe_at(master, feat, root_token, perturb)
        ctx = self._root_context(feat, root_token)  # [1, 2H]
        k = self._plan(master, feat.device, level_plans)[0].k
        return Probe(*self._level_topk(1, ctx, k, None if perturb is None else perturb[0]), context=ctx)

    def probe_rows(
        self, master: Tree, feats: torch.Tensor, roots: torch.Tensor, perturb: torch.Tensor | None = None
    ) -> list[Probe]:
        if not self.grounded:
            return super().probe_rows(master, feats, roots, perturb)
        ctx = torch.cat([feats, self._embed(roots.to(feats.device))], dim=-1)  # [B, 2H]
        k = self._plan(master, feats.device, level_plans)[0].k
        ids, lp = self._level_topk(1, ctx, k, None if perturb is None else perturb[:, 0])  # [B, k]
        return [Probe(ids[b : b + 1], lp[b : b + 1], context=ctx[b : b + 1]) for b in range(feats.shape[0])]

    def draft_at(
        self,
        tree: Tree,
        feat: torch.Tensor,
        root_token: torch.Tensor,
        probe: Probe | None,
        perturb: torch.Tensor | None = None,
    ) -> Draft:
        """Level by level: the depth-d nodes' head reads the feature and the tokens of their branch."""
        if not self.grounded:
            return self._draft_parallel(tree, feat, probe, perturb)
        plans = self._plan(tree, feat.device, level_plans)
        tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=feat.device)  # [N]
        logprobs = torch.empty(tree.num_nodes, dtype=torch.float32, device=feat.device)  # [N]
        reuse = probe is not None and probe.context is not None and plans[0].k <= probe.topk
        ctx = probe.context if reuse else self._root_context(feat, root_token)  # [1, 2H]
        for d, plan in enumerate(plans, start=1):
            x = ctx[plan.rows]  # [P, (d+1)H]: the level-(d-1) nodes that have children
            if d == 1 and reuse:  # level 1 (the root's children) is what the probe drafted
                top_tok, top_lp = probe.tokens, probe.logprobs
            else:
                row = None if perturb is None else perturb[d - 1]  # [Vd] every depth-d node's position
                top_tok, top_lp = self._level_topk(d, x, plan.k, row)  # [P, k] each
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


def heads_class(config: HeadsConfig) -> type[Heads]:
    return MedusaHeads if config.kind == "medusa" else HydraHeads
