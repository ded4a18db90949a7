"""A generation's target distribution beyond the model's logits: its grammar (constraints.py) and its sampling
controls (penalties.py), each computed per tree node on the node's own path.

The engine asks it at four points of a generation (engine.py):

  draft    (2) the drafted tree pruned to the tokens the grammar allows, and each kept node's mask
  forced   (1) the grammar's forced continuation, as a chain of drafts (engine.forced_step), priced on the
           machine's cost curve: the chain length whose tokens per unit of time are best, where that beats a
           plain step
  logits   (4) the verification logits [N+1, V] penalised and masked, what every acceptance rule reads (the
           first token's too); log-probabilities stay the model's own (records.TokenLogprob)
  consume  (6) the emitted tokens; a grammar that allows nothing more ends the generation ("stop")

Plain decoding is the same code on the root-only tree, so speculative output equals plain output under the
same shaping (greedy: token for token; sampling: in distribution).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from .constraints import Constraint, Matcher, apply_masks, grammar_tokenizer
from .penalties import Counts, Penalties
from .tree import LOOKUP, Tree, subtree


class Shaping:
    """One generation's grammar matcher and penalty counts (either may be None, not both)."""

    def __init__(self, matcher: Matcher | None, counts: Counts | None):
        self.matcher, self.counts = matcher, counts

    @classmethod
    def of(
        cls,
        constraint: Constraint | None,
        penalties: Penalties | None,
        *,
        tokenizer,
        vocab_size: int,
        eos_ids: Sequence[int],
        prompt: Sequence[int],
    ) -> Shaping | None:
        """The shaping a generation needs (None: it needs none, and costs nothing)."""
        matcher = None
        if constraint is not None:
            matcher = Matcher(constraint, grammar_tokenizer(tokenizer, vocab_size, eos_ids), eos_ids)
        counts = Counts(penalties, prompt, vocab_size) if penalties is not None and penalties.active else None
        return cls(matcher, counts) if matcher is not None or counts is not None else None

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more but the end of the sequence."""
        return self.matcher is not None and self.matcher.stopped

    def draft(
        self, tree: Tree, tokens: torch.Tensor, origins: tuple[str, ...]
    ) -> tuple[Tree, torch.Tensor, np.ndarray | None, tuple[str, ...]]:
        """The drafted tree (`tokens` [N+1], root first; `origins` [N], each node's source) with every token the
        grammar forbids pruned: its tokens, each node's mask [N'+1, words] (None: no grammar) and sources."""
        if self.matcher is None:
            return tree, tokens, None, origins
        kept, masks = self.matcher.tree(tree.parents.tolist(), tokens.tolist())
        if len(kept) < tree.num_nodes:
            tree = subtree(tree, tuple(kept))
            tokens = tokens[torch.tensor([0, *kept], device=tokens.device)]
            origins = tuple(origins[i - 1] for i in kept)
        return tree, tokens, masks, origins

    def root_masks(self) -> np.ndarray | None:
        """[1, words] the mask after the emitted tokens (None: no grammar): the first token's."""
        return self.matcher.root_mask() if self.matcher is not None else None

    def logits(
        self, logits: torch.Tensor, tree: Tree, tokens: torch.Tensor, masks: np.ndarray | None
    ) -> torch.Tensor:
        """[N+1, V] float32, a new tensor: `logits` (of `tree`'s nodes, tokens [N+1]) penalised on each node's
        path, then masked by `masks`."""
        out = logits
        if self.counts is not None:
            out = self.counts.apply(logits.to(torch.float32, copy=True), node_paths(tree, tokens.tolist()))
        if masks is not None:
            out = apply_masks(out, masks)  # a new tensor
        return out if out is not logits else logits.to(torch.float32, copy=True)

    def consume(self, tokens: Sequence[int], eos_ids) -> int:
        """The emitted tokens, up to an end-of-sequence token or the one that completes the grammar: how many of
        `tokens` the generation keeps (the rest, which a step drafted past the grammar's end, are not emitted,
        as plain decoding ends there too)."""
        kept = 0
        for t in tokens:
            kept += 1
            if t in eos_ids:
                break
            if self.matcher is not None:
                self.matcher.consume([t])
            if self.counts is not None:
                self.counts.consume([t])
            if self.stopped:
                break
        return kept

    def forced(self, relative_cost, limit: int) -> list[int]:
        """The grammar's forced tokens to draft this step (none: draft as usual): the first k of them, k <=
        `limit`, with the most tokens (k + 1: the chain and the bonus) per unit of step time
        (`relative_cost(k)`: a step verifying k drafted nodes, in plain steps), where that beats a plain step."""
        if self.matcher is None or limit < 1:
            return []
        forced = self.matcher.forced()[:limit]
        if not forced:
            return []
        k = np.arange(1, len(forced) + 1)
        rate = (k + 1) / np.maximum(np.asarray(relative_cost(k), dtype=float), 1e-9)
        best = int(rate.argmax())
        return forced[: best + 1] if rate[best] > 1.0 else []


def node_paths(tree: Tree, tokens: Sequence[int]) -> list[list[int]]:
    """[N+1] each node's drafted tokens from depth 1 to the node itself (the root's: none)."""
    parents = tree.parents.tolist()
    paths: list[list[int]] = [[]]
    for node in range(1, len(parents)):  # parents come before their children
        paths.append([*paths[parents[node]], tokens[node]])
    return paths


@functools.lru_cache(maxsize=64)
def forced_chain(k: int) -> Tree:
    """A chain of k drafted nodes for the grammar's forced tokens (lookup-kind nodes: no head drafts them)."""
    return Tree(f"forced{k}", tuple((f"{LOOKUP}0",) * d for d in range(1, k + 1)))
