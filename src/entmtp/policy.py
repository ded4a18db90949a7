"""The step contract between the engine and tree policies: which tree to verify at each step.

Per generation the engine takes `policy.fresh()` (the same settings, its own state: two generations never
share trackers), then per step calls `choose(ctx)` before drafting and `observe(step)` after the step is
finished (cut at EOS, a stop string or the token limit). The engine reads exactly the members declared here.
The static policy always returns the same tree (what Medusa and Hydra do); the scheduling policies live in
entmtp.scheduler.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from .records import Step, StepContext
from .tree import Tree

if TYPE_CHECKING:
    from .lookup import Lookup


@dataclass(frozen=True)
class Menu:
    """What a cost-aware policy would verify within each budget of drafted nodes this step, so a batch can
    choose every row's tree by the cost of the whole step (scheduler/joint.py): `expected[n]` the expected
    tokens of its best tree of at most n drafted nodes (non-decreasing in n), `tree(n)` that tree."""

    expected: np.ndarray  # [M+1]
    tree: Callable[[int], Tree]


class Choice(NamedTuple):
    tree: Tree
    signals: dict[str, float]  # what the choice read, recorded with the step (Step.signals)
    menu: Menu | None = None  # cost-aware policies: the best tree per node budget (None: this tree only)


class TreePolicy(Protocol):
    """`fresh` per generation, `choose` before each step, `observe` after it."""

    trees: list[Tree]  # every tree the policy may return (checked against the heads up front)
    master: Tree | None  # contains every tree it returns: the heads probe it before `choose` (heads.Probe)
    lookup: Lookup | None  # its lookup nodes' n-grams and longest added branch (None: no lookup branch)

    def fresh(self) -> TreePolicy: ...

    def choose(self, ctx: StepContext) -> Choice: ...

    def observe(self, step: Step) -> None: ...


class Stateful:
    """`fresh()` for a policy whose `reset()` rebinds every piece of per-generation state (never mutates a
    shared object): a shallow copy, reset, shares settings and caches of built trees, and no state."""

    def reset(self) -> None:
        raise NotImplementedError

    def fresh(self):
        new = copy.copy(self)
        new.reset()
        return new


class StaticPolicy:
    """One fixed tree for the whole generation."""

    master = None  # nothing to probe: the tree is fixed
    lookup = None  # a hybrid tree's lookup nodes are drafted with `Lookup()`'s n-grams

    def __init__(self, tree: Tree):
        self.tree = tree
        self.trees = [tree]

    def fresh(self) -> StaticPolicy:
        return self  # no state

    def choose(self, ctx: StepContext) -> Choice:
        return Choice(self.tree, {})

    def observe(self, step: Step) -> None:
        pass
