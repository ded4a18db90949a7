"""The step contract between the engine and tree policies: which tree to verify at each step.

Per generation the engine takes `policy.fresh()` (the same settings, its own state: two generations never
share trackers), then per step calls `choose(ctx)` before drafting and `observe(step)` after the step is
finished (cut at EOS, a stop string or the token limit). The engine reads exactly the members declared here.
The static policy always returns the same tree (what Medusa and Hydra do); the scheduling policies live in
entmtp.scheduler.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from .records import Step, StepContext
from .tree import Tree

if TYPE_CHECKING:
    from .costs import LatencyModel
    from .lookup import Lookup


@dataclass(frozen=True)
class Menu:
    """What a cost-aware policy would verify within each budget of drafted nodes this step, so a batch can
    choose every row's tree by the cost of the whole step (`joint_budget`): `expected[n]` the expected
    tokens of its best tree of at most n drafted nodes (non-decreasing in n), `tree(n)` that tree."""

    expected: np.ndarray  # [M+1]
    tree: Callable[[int], Tree]


def joint_budget(menus: Sequence[Menu | None], sizes: Sequence[int], latency: LatencyModel) -> int | None:
    """A batch's joint choice: one node budget per row for the whole batched step (None when no row offers a
    menu). `sizes`: each row's chosen tree's drafted nodes.

    One forward verifies every row's tree padded to the largest (cache.BaseModel.forward_batch), so a step costs
    `latency(n)` ms for the largest tree's n drafted nodes (surface.py, at this batch size), whatever the other
    rows verify. Each row's policy offers a `Menu`: its expected tokens for every budget of at most n nodes. The
    budget that maximizes the batch's expected tokens per ms of the whole step is

        argmax_n  sum_rows expected_row[min(n, top_row)] / latency(n)

    and every row with a menu verifies its best tree within it: a row's tree shrinks when the batch is busy (a
    larger budget costs every row) and grows for free up to what another row needs. Rows without a menu
    (static and signal policies) keep their tree, which bounds the budget from below, and count one token each.
    """
    offered = [m for m in menus if m is not None]
    if not offered:
        return None
    floor = max((n for m, n in zip(menus, sizes, strict=True) if m is None), default=0)
    top = max(floor, *(len(m.expected) - 1 for m in offered))
    budgets = np.arange(floor, top + 1)
    tokens = sum(m.expected[np.minimum(budgets, len(m.expected) - 1)] for m in offered)
    tokens = tokens + (len(menus) - len(offered))
    return int(budgets[int(np.argmax(tokens / latency(budgets)))])


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
