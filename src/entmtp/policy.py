"""Tree policies: which tree to verify at each step.

A policy chooses a tree before each step and observes the step's outcome after it. The static policy
always returns the same tree (what Medusa and Hydra do); the scheduling policies live in entmtp.scheduler.
"""

from __future__ import annotations

from typing import Protocol

from .records import Step, StepContext
from .tree import Tree


class TreePolicy(Protocol):
    """`choose` before each step, `observe` after it; the engine reads exactly these members."""

    trees: list[Tree]  # every tree the policy may return (checked against the heads up front)
    master: Tree | None  # contains every tree it returns: the heads probe it before `choose` (heads.Probe)
    last_signals: dict[str, float]  # what `choose` read, recorded with the step

    def reset(self) -> None: ...

    def choose(self, ctx: StepContext) -> Tree: ...

    def observe(self, step: Step) -> None: ...


class StaticPolicy:
    """One fixed tree for the whole generation."""

    master = None  # nothing to probe: the tree is fixed

    def __init__(self, tree: Tree):
        self.tree = tree
        self.trees = [tree]
        self.last_signals: dict[str, float] = {}

    def reset(self) -> None:
        pass

    def choose(self, ctx: StepContext) -> Tree:
        return self.tree

    def observe(self, step: Step) -> None:
        pass
