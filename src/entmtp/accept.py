"""Acceptance: which drafted tree path does the base model keep?

Glossary (one verification step):
  root      node 0, the token the base model already chose at the end of the previous step (already emitted)
  draft     a head's guess at a tree node (nodes 1..N)
  accepted  the drafts on the kept root-to-node path (0 or more)
  bonus     the base model's own token after the last accepted node: always emitted, it is the next root
Tokens per step = accepted drafts + 1 (the bonus); this is the convention of every metric here.

Three rules:
  greedy   keep the longest path whose every draft equals the base argmax at its parent. Lossless.
  sample   recursive rejection sampling over the tree (SpecInfer / EAGLE-2 style) at temperature T. Drafts are
           deterministic (top-k ranks), so child c of a node is accepted with probability p'(c) under the
           node's residual distribution p', which then has c removed and is renormalised; if every child is
           rejected the bonus is drawn from the residual. Lossless: outputs follow the base model's
           temperature-T distribution exactly.
  typical  Medusa-2's typical acceptance: keep draft x if p(x) > min(eps, alpha * exp(-H(p))); the bonus is
           drawn from p restricted to tokens passing the same test. Faster at high temperature, not lossless.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .errors import EntMTPError
from .tree import Tree

ACCEPTANCE = ("greedy", "sample", "typical")
SAMPLED = ("sample", "typical")  # the rules at temperature > 0
SAMPLED_CHOICES = ("auto", *SAMPLED)  # what a server may apply to requests at T > 0 (auto: lossless sample)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    acceptance: str = "auto"  # auto: greedy at T=0, lossless "sample" otherwise
    typical_eps: float = 0.09  # Medusa-2 defaults
    typical_alpha: float = 0.3

    def __post_init__(self):
        if not self.temperature >= 0:
            raise EntMTPError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.acceptance not in ("auto", *ACCEPTANCE):
            raise EntMTPError(f"unknown acceptance {self.acceptance!r}: use auto, {', '.join(ACCEPTANCE)}")
        if self.rule != "greedy" and self.temperature == 0:
            raise EntMTPError(f"acceptance {self.acceptance!r} needs a temperature > 0")

    @property
    def rule(self) -> str:
        if self.acceptance == "auto":
            return "greedy" if self.temperature == 0 else "sample"
        return self.acceptance


@dataclass(frozen=True)
class Accepted:
    path: list[int]  # node ids root..last accepted node (path[0] == 0)
    bonus: int  # the base model's token after the last accepted node


def accept(
    tree: Tree,
    tokens: torch.Tensor,  # [N+1] root + drafts
    logits: torch.Tensor,  # [N+1, V] base logits at every node
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> Accepted:
    rule = sampling.rule
    if rule == "greedy":
        return accept_greedy(tree, tokens, logits)
    # Random draws use the caller's CPU generator (seeded runs repeat on any device): sample on the CPU.
    tokens = tokens.cpu()
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)  # [N+1, V]
    if rule == "typical":
        return accept_typical(tree, tokens, probs, sampling.typical_eps, sampling.typical_alpha, generator)
    return accept_sample(tree, tokens, probs, generator)


def accept_greedy(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> Accepted:
    # max().indices is argmax (first maximum on ties) and ~4x faster than argmax() on bf16 CPU tensors
    return accept_targets(tree, tokens, logits.max(dim=-1).indices)


def accept_targets(tree: Tree, tokens: torch.Tensor, target: torch.Tensor) -> Accepted:
    """Greedy acceptance against `target` [N+1], the token that must follow each node (the base argmax there;
    a replay's recorded continuation)."""
    if tree.num_nodes == 0:
        return Accepted([0], int(target[0]))
    # A draft is right when it equals the target at its parent; a path is kept up to its first miss.
    dev = target.device  # tree tensors live on the CPU; .to() is a no-op there
    right = tokens == target[tree.parents.to(dev).clamp(min=0)]  # [N+1] (root compared to itself: ignored)
    right[0] = True
    rows = tree.retrieve_indices.to(dev)  # [L, D+1], -1 padded
    ok = right[rows.clamp(min=0)] & (rows >= 0)  # [L, D+1]
    lengths = ok.int().cumprod(dim=1).sum(dim=1)  # [L] accepted nodes incl. root
    best = int(lengths.argmax())
    path = rows[best, : int(lengths[best])]
    return Accepted(path.tolist(), int(target[path[-1]]))


@functools.lru_cache(maxsize=64)  # per tree, built once: trees are frozen and few
def _children(tree: Tree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            kids[parent].append(node)
    for k in kids:  # try candidates in rank order (higher-ranked drafts are likelier)
        k.sort(key=lambda n: int(tree.ranks[n]))
    return kids


def accept_sample(
    tree: Tree, tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None
) -> Accepted:
    """Recursive rejection sampling over the tree. Siblings that draft the same token (a hybrid tree's lookup
    branch can repeat a head's draft) are one candidate: once the token is accepted, the walk goes on below
    every node that drafted it, so a draft is never lost to a duplicate beside it; the path kept is the first
    of the deepest nodes reached (all have the same tokens, hence the same distributions, up to rounding)."""
    kids, tok = _children(tree), tokens.tolist()
    nodes = [0]  # every node whose branch drafted exactly the tokens accepted so far
    while True:
        below = [c for n in nodes for c in kids[n]]
        if not below:
            return Accepted(
                _path(tree, nodes[0]), int(torch.multinomial(probs[nodes[0]], 1, generator=generator))
            )
        residual = probs[nodes[0]].clone()  # [V]
        nxt = None
        for t in dict.fromkeys(tok[c] for c in sorted(below, key=lambda c: int(tree.ranks[c]))):
            p = float(residual[t])
            if p > 0 and float(torch.rand((), generator=generator)) < p:
                nxt = t
                break
            residual[t] = 0.0  # rejected: remove it and renormalise
            total = residual.sum()
            if total <= 0:
                break
            residual /= total
        if nxt is None:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return Accepted(_path(tree, nodes[0]), bonus)
        nodes = [c for c in below if tok[c] == nxt]


def _path(tree: Tree, node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def _typical_ok(probs: torch.Tensor, eps: float, alpha: float) -> torch.Tensor:
    """[.., V] bool: tokens passing p(x) > min(eps, alpha * exp(-H(p)))."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-20))).sum(dim=-1, keepdim=True)
    threshold = torch.minimum(torch.full_like(entropy, eps), alpha * torch.exp(-entropy))
    return probs > threshold


def accept_typical(
    tree: Tree,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    eps: float,
    alpha: float,
    generator: torch.Generator | None,
) -> Accepted:
    dev = probs.device
    passing = _typical_ok(probs, eps, alpha)  # [N+1, V]
    right = passing[tree.parents.to(dev).clamp(min=0), tokens]  # [N+1]
    right[0] = True
    rows = tree.retrieve_indices.to(dev)
    ok = right[rows.clamp(min=0)] & (rows >= 0)
    lengths = ok.int().cumprod(dim=1).sum(dim=1)
    best = int(lengths.argmax())
    path = rows[best, : int(lengths[best])].tolist()
    last = probs[path[-1]] * passing[path[-1]]
    if last.sum() <= 0:  # nothing passes (cannot happen: the argmax always passes); fall back to argmax
        return Accepted(path, int(probs[path[-1]].argmax()))
    return Accepted(path, int(torch.multinomial(last / last.sum(), 1, generator=generator)))
