"""The step contract between the engine and tree policies: which tree to verify at each step.

Per generation the engine takes `policy.fresh()` (the same settings, its own state: two generations never
share trackers), then per step calls `choose(ctx)` before drafting and `observe(step)` after the step is
finished (cut at EOS, a stop string or the token limit). The engine reads exactly the members declared here.
The static policy always returns the same tree (what Medusa and Hydra do); the scheduling policies live in
entmtp.scheduler. `static(tree)` makes a tree name or a `Tree` the policy that verifies it every step; what
takes a policy (`Engine`, `hybrid`, a batch row) takes exactly that and refuses a name or a `Tree`
(`require_policy`): nothing is coerced. Policies compare equal when they were built from the same settings
(`Settings`), so two faces that should run the same policy (`entmtp generate` and a bench's method) can be
checked to.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from .records import Step, StepContext
from .tree import Tree, load_tree

if TYPE_CHECKING:
    from .costs.curves import LatencyModel
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
    `latency(n)` ms for the largest tree's n drafted nodes (costs/curves.py, at this batch size), whatever the other
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


class Settings:
    """Equality by what a policy was built from: the attributes named in `SETTINGS` (trees by name and paths,
    tensors by value), never its per-generation state or its caches of built trees."""

    SETTINGS: tuple[str, ...] = ()

    def settings(self) -> tuple:
        return tuple(getattr(self, name) for name in self.SETTINGS)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return same(self.settings(), other.settings())

    __hash__ = None  # equal settings, equal policies: and the settings hold tensors and lists


def same(a, b) -> bool:
    """Whether two settings are equal: trees by name and paths, tensors and arrays by value, containers item by
    item, everything else (policies included) by `==`."""
    if isinstance(a, Tree) or isinstance(b, Tree):
        return isinstance(a, Tree) and isinstance(b, Tree) and (a.name, a.paths) == (b.name, b.paths)
    if isinstance(a, torch.Tensor | np.ndarray):
        return type(a) is type(b) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class Stateful:
    """`fresh()` for a policy whose `reset()` rebinds every piece of per-generation state (never mutates a
    shared object): a shallow copy, reset, shares settings and caches of built trees, and no state."""

    def reset(self) -> None:
        raise NotImplementedError

    def fresh(self):
        new = copy.copy(self)
        new.reset()
        return new


class StaticPolicy(Settings):
    """One fixed tree for the whole generation."""

    SETTINGS = ("tree",)
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


def static(tree: str | Tree) -> StaticPolicy:
    """The policy verifying `tree` every step: a tree name (`entmtp trees`, or a JSON file of paths) or a
    `Tree` (hybrid trees with lookup nodes too). `static(Tree.root_only())` is plain decoding, one token per
    step."""
    if isinstance(tree, str):
        tree = load_tree(tree)
    if not isinstance(tree, Tree):
        raise TypeError(f"static takes a tree name or a Tree, got {type(tree).__name__}: {tree!r}")
    return StaticPolicy(tree)


def require_policy(policy, where: str) -> TreePolicy:
    """`policy` itself when it is a policy; a tree name or a `Tree` (what `tree=` once took) is refused with
    the fix, `where` naming what refused it."""
    if isinstance(policy, str | Tree):
        shown = repr(policy) if isinstance(policy, str) else f"<Tree {policy.name}>"
        arg = repr(policy) if isinstance(policy, str) else "tree"
        raise TypeError(
            f"{where} takes a TreePolicy, not the tree {shown}: pass entmtp.policy.static({arg}) "
            "(one tree every step) or a scheduler's policy"
        )
    missing = [
        m for m in ("trees", "master", "lookup", "fresh", "choose", "observe") if not hasattr(policy, m)
    ]
    if missing:
        raise TypeError(
            f"{where} takes a TreePolicy (policy.TreePolicy: trees, master, lookup, fresh, choose, observe), "
            f"got {type(policy).__name__} without {', '.join(missing)}"
        )
    return policy
