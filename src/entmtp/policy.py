"""Tree policies: which tree to verify at each step.

A policy chooses a tree before each step and observes the step's outcome after it. The static policy
always returns the same tree (what Medusa and Hydra do); the entropy-aware scheduler plugs in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .tree import Tree

if TYPE_CHECKING:
    from .engine import Step


@dataclass(frozen=True)
class StepContext:
    step: int  # index of the step about to run (0 = first after the prefill)
    position: int  # tokens in the KV cache
    remaining: int  # tokens still allowed before max_new_tokens
    root_logits: torch.Tensor  # [V] base logits the root token was drawn from


class TreePolicy(Protocol):
    trees: list[Tree]  # every tree the policy may return (checked against the heads up front)

    def reset(self) -> None: ...

    def choose(self, ctx: StepContext) -> Tree: ...

    def observe(self, step: Step) -> None: ...


class StaticPolicy:
    """One fixed tree for the whole generation."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self.trees = [tree]

    def reset(self) -> None:
        pass

    def choose(self, ctx: StepContext) -> Tree:
        return self.tree

    def observe(self, step: Step) -> None:
        pass
