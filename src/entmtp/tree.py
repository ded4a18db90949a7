"""Speculation trees: which top-k candidates of which heads are verified in one step.

A tree is a list of paths of top-k ranks, the same syntax as Medusa's ``medusa_choices`` and vLLM's
``speculative_token_tree``::

    [(0,), (1,), (0, 0), (0, 1)]

Path ``(i,)`` is the rank-i candidate of head 1 (depth 1), ``(i, j)`` the rank-j candidate of head 2
drafted below it (depth 2), and so on. A tree must be prefix-closed: every path's parent is in it too.

Hybrid trees add prompt-lookup nodes (see lookup.py), written ``"L<r>"``: the rank-r continuation that the
context's n-gram index proposes after the node's branch. ``["L0"]`` is the lookup's best next token after the
root, ``["L0", "L0"]`` the one after that, ``[0, "L0"]`` the lookup continuing the branch of head 1's top
candidate. Lookup nodes may hang below head nodes, never the other way round (a head drafts from the base
model's hidden state, which a lookup token does not have), and their depth is not bounded by the heads::

    [[0], [1], [0, 0], ["L0"], ["L0", "L0"], ["L0", "L0", "L0"]]

Node numbering (used by every tensor below):

* node 0 is the implicit ROOT: the base model's own next token, depth 0, parent -1;
* nodes 1..N are the paths in canonical order, sorted by ``(len(path), path)`` (head ranks before lookup
  ranks at each position), so the nodes of each depth are contiguous (``level_slices``) and every parent
  has a smaller id than its children.

For the example above: 0 = root, 1 = (0,), 2 = (1,), 3 = (0, 0), 4 = (0, 1).

All derived tensors are built once, on the CPU, when the tree is constructed; a ``Tree`` is frozen
and should be treated as read-only (do not modify its tensors in place). A ``TreeBank`` holds the trees
a run may switch between; switching trees is taking another reference from the bank.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import InitVar, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from entmtp.errors import TreeError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

RankPath = tuple[int | str, ...]  # one path: head ranks (ints) then lookup ranks ("L0"), e.g. (0, 1, "L0")
LOOKUP = "L"  # prefix of a lookup rank in a path


def _fmt(path: RankPath) -> str:
    """Show a path the way users write it: (0,) or (0, 'L0'); the root is ()."""
    return repr(tuple(path))


def _lookup_rank(e) -> int | None:
    """The rank of a lookup element "L<r>", else None."""
    if isinstance(e, str) and len(e) > 1 and e[0] == LOOKUP and e[1:].isdigit() and e[1:].isascii():
        return int(e[1:])
    return None


def _key(path: RankPath) -> tuple:
    """Canonical order: by length, then element by element with head ranks before lookup ranks."""
    return (len(path), tuple((0, e) if isinstance(e, int) else (1, _lookup_rank(e)) for e in path))


def _rank(e: int | str) -> int:
    return e if isinstance(e, int) else _lookup_rank(e)  # type: ignore[return-value]


def _head_depth(path: RankPath) -> int:
    """How many leading elements are head ranks (all of them for a heads-only path)."""
    return next((i for i, e in enumerate(path) if not isinstance(e, int)), len(path))


def _validate(
    paths: Iterable[Sequence[int]], *, max_depth: int | None = None, max_topk: int | None = None
) -> tuple[RankPath, ...]:
    """Check ``paths`` and return them as int tuples in canonical order (sorted by (len, path))."""
    if isinstance(paths, str | bytes) or not isinstance(paths, Iterable):
        raise TreeError(f"a tree is a list of paths like [[0], [0, 0]], got {type(paths).__name__} {paths!r}")
    seen: set[RankPath] = set()
    for raw in paths:
        ok = (
            isinstance(raw, list | tuple)
            and len(raw) > 0
            and all((isinstance(r, int) and not isinstance(r, bool)) or isinstance(r, str) for r in raw)
        )
        if not ok:
            raise TreeError(
                f"path {raw!r} is not a non-empty list of ranks: write each path like [0], [0, 1] or "
                '[0, "L0"] (integers: head ranks; "L<r>": lookup ranks)'
            )
        path = tuple(int(r) if isinstance(r, int) else r for r in raw)
        for r in path:
            if isinstance(r, str) and _lookup_rank(r) is None:
                raise TreeError(
                    f'path {_fmt(path)} has element {r!r}: a lookup rank is written "L" and a number, '
                    'like "L0" (the lookup\'s best continuation) or "L1"'
                )
            if isinstance(r, int) and r < 0:
                raise TreeError(
                    f"path {_fmt(path)} has negative rank {r}: ranks count from 0 (0 = a head's top-1 candidate)"
                )
            if isinstance(r, int) and max_topk is not None and r >= max_topk:
                raise TreeError(
                    f"path {_fmt(path)} uses rank {r} but the heads keep only the top {max_topk} "
                    f"candidates: use ranks < {max_topk}"
                )
        heads = _head_depth(path)
        if any(isinstance(r, int) for r in path[heads:]):
            raise TreeError(
                f"path {_fmt(path)} has a head rank after a lookup rank: heads draft only below the root or "
                'other head nodes, so write head ranks first (e.g. [0, "L0"], not ["L0", 0])'
            )
        if max_depth is not None and heads > max_depth:
            raise TreeError(
                f"path {_fmt(path)} has depth {heads} but the heads predict only {max_depth} tokens "
                f"ahead: use a tree of depth <= {max_depth}"
            )
        if path in seen:
            raise TreeError(f"path {_fmt(path)} appears twice: list each path once")
        seen.add(path)
    canonical = tuple(sorted(seen, key=_key))
    for path in canonical:
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeError(
                f"path {_fmt(path)} needs its parent {_fmt(path[:-1])}, which is missing: "
                f"add {list(path[:-1])} to the tree"
            )
    return canonical


@dataclass(frozen=True, eq=False)
class Tree:
    """A validated speculation tree and the index tensors the drafter and verifier need.

    Build one with ``Tree.from_paths``, ``load_tree`` or ``Tree.root_only``. N = ``num_nodes`` is the
    number of drafted nodes; tensors indexed by node have N+1 rows, row 0 being the root (see the module
    docstring for the numbering).
    """

    name: str
    paths: tuple[RankPath, ...]  # canonical order; node i (1..N) is paths[i - 1]
    path_set: frozenset[RankPath] = field(init=False)  # the same paths, for membership tests
    _allow_empty: InitVar[bool] = False  # only root_only() may build the zero-node tree

    depths: torch.Tensor = field(init=False)  # [N+1] int64; root 0. Also the position offset of each node
    parents: torch.Tensor = field(init=False)  # [N+1] int64; root -1
    ranks: torch.Tensor = field(
        init=False
    )  # [N+1] int64; root 0; rank among its head's (lookup's) candidates
    lookup: torch.Tensor = field(init=False)  # [N+1] bool; True for lookup nodes ("L<r>")
    mask: torch.Tensor = field(init=False)  # [N+1, N+1] bool; mask[i, j] iff j is i or an ancestor of i
    retrieve_indices: torch.Tensor = field(init=False)  # [num_leaves, depth+1] int64; root..leaf, -1 padded
    level_slices: tuple[slice, ...] = field(init=False)  # [depth]; level_slices[d - 1] = node ids of depth d
    nodes_per_depth: tuple[int, ...] = field(init=False)  # [depth]; node count of depth 1..depth
    heads_tree: Tree = field(init=False)  # the head nodes alone (self when there is no lookup node)
    head_nodes: torch.Tensor = field(init=False)  # [Nh+1] int64: node id here of each heads_tree node
    topk: int = field(init=False)  # max head rank + 1 (0 without head nodes)
    is_rank_contiguous: bool = field(init=False)  # every parent's head children have ranks exactly 0..m-1

    def __post_init__(self, _allow_empty: bool) -> None:
        paths = _validate(self.paths)  # direct construction is validated too
        if not paths and not _allow_empty:
            raise TreeError("tree is empty: give at least one path, e.g. [[0]] (Tree.root_only() for none)")
        n = len(paths)
        node_of = {p: i + 1 for i, p in enumerate(paths)}
        depths = [0] + [len(p) for p in paths]
        parents = [-1] + [node_of.get(p[:-1], 0) for p in paths]
        ranks = [0] + [_rank(p[-1]) for p in paths]
        is_lookup = [False] + [not isinstance(p[-1], int) for p in paths]
        depth = max(depths)

        children: dict[int, list[int]] = {i: [] for i in range(n + 1)}
        for i in range(1, n + 1):
            children[parents[i]].append(i)
        mask = _ancestor_mask(parents)  # [N+1, N+1]
        rows = _root_to_leaf_rows(parents, children, depth)  # [num_leaves][depth+1]
        level_slices = _level_slices(depths, depth)

        head_ids = [i for i in range(n + 1) if not is_lookup[i]]  # root included
        if len(head_ids) == n + 1:  # no lookup node: the heads' tree is this one
            heads_tree = self
            topk = max(ranks) + 1 if n else 0
            contiguous = all(
                sorted(ranks[c] for c in kids) == list(range(len(kids))) for kids in children.values()
            )
        else:  # what the heads draft is the subtree of head nodes
            heads_tree = Tree(self.name, tuple(paths[i - 1] for i in head_ids[1:]), True)
            topk, contiguous = heads_tree.topk, heads_tree.is_rank_contiguous

        set_ = object.__setattr__  # frozen dataclass: fields are set once, here
        set_(self, "paths", paths)
        set_(self, "path_set", frozenset(paths))
        set_(self, "depths", torch.tensor(depths, dtype=torch.int64))  # [N+1]
        set_(self, "parents", torch.tensor(parents, dtype=torch.int64))  # [N+1]
        set_(self, "ranks", torch.tensor(ranks, dtype=torch.int64))  # [N+1]
        set_(self, "lookup", torch.tensor(is_lookup))  # [N+1]
        set_(self, "mask", mask)  # [N+1, N+1]
        set_(self, "retrieve_indices", torch.tensor(rows, dtype=torch.int64))  # [num_leaves, depth+1]
        set_(self, "level_slices", tuple(level_slices))
        set_(self, "nodes_per_depth", tuple(s.stop - s.start for s in level_slices))
        set_(self, "heads_tree", heads_tree)
        set_(self, "head_nodes", torch.tensor(head_ids, dtype=torch.int64))  # [Nh+1]
        set_(self, "topk", topk)
        set_(self, "is_rank_contiguous", contiguous)

    @classmethod
    def from_paths(
        cls,
        paths: Iterable[Sequence[int]],
        name: str = "custom",
        *,
        max_depth: int | None = None,
        max_topk: int | None = None,
    ) -> Tree:
        """Validate ``paths`` (any order) and build the tree; raise TreeError naming the bad path.

        ``max_depth`` is the number of heads (tokens predicted ahead); ``max_topk`` how many candidates
        each head keeps. Either may be None to skip that check.
        """
        canonical = _validate(paths, max_depth=max_depth, max_topk=max_topk)
        if not canonical:
            raise TreeError("tree is empty: give at least one path, e.g. [[0]]")
        return cls(name, canonical)

    @classmethod
    @functools.cache
    def root_only(cls) -> Tree:
        """The zero-node tree "none": plain decoding, verify only the base model's own token. One shared
        instance (trees are frozen), so what is cached per tree (a hybrid's lookup chain, drafting plans) is
        built once for it, not on every plain or lookup-only step."""
        return cls("none", (), _allow_empty=True)

    @property
    def num_nodes(self) -> int:
        """N: drafted nodes, excluding the root."""
        return len(self.paths)

    @property
    def size(self) -> int:
        """N+1: tokens verified per step (the drafted nodes plus the root)."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """Longest path (0 for the root-only tree); without lookup nodes, the heads it needs."""
        return len(self.nodes_per_depth)

    @property
    def num_lookup(self) -> int:
        """Lookup nodes ("L<r>") among the N drafted nodes."""
        return self.num_nodes - self.heads_tree.num_nodes

    def check_fits(self, num_heads: int, topk: int | None = None, require_contiguous: bool = False) -> None:
        """Raise TreeError if the tree asks for more heads or candidates than the drafter has.

        ``require_contiguous``: Hydra drafts each child from its parent's sequence, so every parent's
        children must have ranks 0..m-1 with no gap.
        """
        heads = self.heads_tree
        if heads.depth > num_heads:
            deepest = heads.paths[-1]
            raise TreeError(
                f"tree {self.name!r} has depth {heads.depth} (path {_fmt(deepest)}) but the heads predict only "
                f"{num_heads} tokens ahead: use a tree of depth <= {num_heads}"
            )
        if topk is not None and self.topk > topk:
            widest = next(p for p in heads.paths if max(p) >= topk)
            raise TreeError(
                f"tree {self.name!r} uses rank {self.topk - 1} (path {_fmt(widest)}) but the drafter keeps "
                f"only the top {topk} candidates: use ranks < {topk} or raise topk"
            )
        if require_contiguous and not self.is_rank_contiguous:
            for parent in range(heads.size):
                kids = sorted(int(r) for r in heads.ranks[1:][heads.parents[1:] == parent])
                if kids != list(range(len(kids))):
                    where = "the root" if parent == 0 else f"node {_fmt(heads.paths[parent - 1])}"
                    raise TreeError(
                        f"tree {self.name!r} is not rank-contiguous, which Hydra drafting requires: the "
                        f"children of {where} have ranks {kids}, expected {list(range(len(kids)))}; "
                        f"add the missing ranks or drop the extra children"
                    )

    def to_json(self) -> str:
        """The paths as a JSON list of lists, in canonical order (loadable by ``load_tree``)."""
        return json.dumps([list(p) for p in self.paths])

    def __repr__(self) -> str:
        return f"Tree({self.name!r}, nodes={self.num_nodes}, per_depth={self.nodes_per_depth})"


# ---- shipped trees --------------------------------------------------------------------------------


def _ancestor_mask(parents: list[int]) -> torch.Tensor:  # [N+1, N+1] bool
    """Row i: node i and its ancestors (what node i attends to among the tree's nodes)."""
    n = len(parents) - 1
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # [N+1, N+1]
    mask[0, 0] = True
    for i in range(1, n + 1):  # parents come first, so row parent[i] is already complete
        mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def _root_to_leaf_rows(parents: list[int], children: dict[int, list[int]], depth: int) -> list[list[int]]:
    """Per leaf, its node ids root .. leaf, padded with -1 to depth + 1."""
    rows = []
    for leaf in (i for i in range(len(parents)) if not children[i]):
        chain = [leaf]
        while parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        chain.reverse()  # root .. leaf
        rows.append(chain + [-1] * (depth + 1 - len(chain)))
    return rows


def _level_slices(depths: list[int], depth: int) -> list[slice]:
    """Node ids of each depth 1..depth (nodes are ordered by depth)."""
    level_slices = []
    start = 1
    for d in range(1, depth + 1):
        count = depths.count(d)
        level_slices.append(slice(start, start + count))
        start += count
    return level_slices


def _shipped() -> dict[str, Traversable]:
    folder = resources.files("entmtp") / "trees"
    return {f.name[: -len(".json")]: f for f in folder.iterdir() if f.name.endswith(".json")}


def list_trees() -> list[str]:
    """Sorted names of the trees shipped in ``entmtp/trees/*.json``."""
    return sorted(_shipped())


def _parse(text: str, source: str, name: str, max_depth: int | None, max_topk: int | None) -> Tree:
    try:
        paths = json.loads(text)
    except json.JSONDecodeError as e:
        raise TreeError(
            f"tree file {source} is not valid JSON ({e}): write a list of paths like [[0], [0, 0]]"
        ) from e
    try:
        return Tree.from_paths(paths, name, max_depth=max_depth, max_topk=max_topk)
    except TreeError as e:
        raise TreeError(f"tree file {source}: {e}") from e


def load_tree(
    name_or_path: str | os.PathLike[str], *, max_depth: int | None = None, max_topk: int | None = None
) -> Tree:
    """Load a shipped tree by name (see ``list_trees``) or a JSON file of paths (named after its stem)."""
    shipped = _shipped()
    if isinstance(name_or_path, str) and name_or_path in shipped:
        text = shipped[name_or_path].read_text(encoding="utf-8")
        return _parse(text, f"{name_or_path}.json", name_or_path, max_depth, max_topk)
    path = Path(name_or_path)
    if path.is_file():
        return _parse(path.read_text(encoding="utf-8"), str(path), path.stem, max_depth, max_topk)
    raise TreeError(
        f"unknown tree {str(name_or_path)!r}: available trees are {', '.join(sorted(shipped))}; "
        f"a path to a JSON file of paths (e.g. [[0], [0, 0]]) also works"
    )


class TreeBank:
    """An ordered name -> Tree mapping: the trees a run may switch between."""

    def __init__(self, trees: Iterable[Tree] = ()) -> None:
        self._trees: dict[str, Tree] = {}
        for tree in trees:
            self.add(tree)

    @classmethod
    def from_names(
        cls,
        names: Iterable[str | os.PathLike[str]],
        *,
        max_depth: int | None = None,
        max_topk: int | None = None,
    ) -> TreeBank:
        """Load each name (or JSON file path) with ``load_tree``, in order."""
        return cls(load_tree(n, max_depth=max_depth, max_topk=max_topk) for n in names)

    def add(self, tree: Tree) -> None:
        if tree.name in self._trees:
            raise TreeError(
                f"the bank already has a tree named {tree.name!r}: give each tree a distinct name"
            )
        self._trees[tree.name] = tree

    @property
    def names(self) -> list[str]:
        return list(self._trees)

    def __getitem__(self, name: str) -> Tree:
        try:
            return self._trees[name]
        except KeyError:
            raise TreeError(
                f"no tree named {name!r} in the bank: it holds {', '.join(self._trees)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._trees

    def __iter__(self) -> Iterator[str]:
        return iter(self._trees)

    def __len__(self) -> int:
        return len(self._trees)

    def __repr__(self) -> str:
        return f"TreeBank({self.names})"


def union_tree(trees: Iterable[Tree], name: str = "union") -> Tree:
    """The smallest tree holding every path of ``trees`` (each of them is then a subtree of it)."""
    paths = {p for t in trees for p in t.paths}
    if not paths:
        return Tree.root_only()
    return Tree(name, tuple(paths))


def subtree_index(sub: Tree, master: Tree) -> torch.Tensor:
    """[n+1] int64: the master node id of each node of ``sub`` (root first); raise if ``sub`` is not inside."""
    node_of = {p: i + 1 for i, p in enumerate(master.paths)}
    missing = [p for p in sub.paths if p not in node_of]
    if missing:
        raise TreeError(
            f"tree {sub.name!r} is not a subtree of {master.name!r}: path {_fmt(missing[0])} is missing from it"
        )
    return torch.tensor([0] + [node_of[p] for p in sub.paths], dtype=torch.int64)


def with_lookup(tree: Tree, tokens: int, branches: int = 1) -> Tree:
    """``tree`` plus ``branches`` lookup chains of ``tokens`` nodes from the root: chain b starts with the
    lookup's rank-b next token and continues with its best continuation ("L<b>", "L0", "L0", ...)."""
    if tokens < 0 or branches < 1:
        raise TreeError(f"a lookup branch needs tokens >= 0 and branches >= 1, got {tokens} and {branches}")
    if tokens == 0:
        return tree
    chains = [(f"{LOOKUP}{b}",) + (f"{LOOKUP}0",) * (tokens - 1) for b in range(branches)]
    paths = set(tree.paths) | {c[:i] for c in chains for i in range(1, tokens + 1)}
    suffix = f"L{tokens}" if branches == 1 else f"L{branches}x{tokens}"
    return _sharing_heads(Tree(f"{tree.name}+{suffix}" if tree.num_nodes else suffix, tuple(paths)), tree)


@functools.lru_cache(maxsize=1024)
def prune(tree: Tree, keep: tuple[int, ...]) -> Tree:
    """The subtree of nodes ``keep`` (ascending node ids, root excluded, prefix-closed), under the same name:
    what a step verifies when the lookup has no proposal for some of its nodes. Cached per (tree, keep)."""
    if len(keep) == tree.num_nodes:
        return tree
    if len(keep) == tree.heads_tree.num_nodes:  # no lookup node left: the heads' own tree
        return tree.heads_tree if tree.heads_tree.num_nodes else Tree.root_only()
    return _sharing_heads(Tree(tree.name, tuple(tree.paths[i - 1] for i in keep)), tree)


@functools.lru_cache(maxsize=1024)
def subtree(tree: Tree, keep: tuple[int, ...]) -> Tree:
    """The subtree of any nodes ``keep`` (ascending node ids, root excluded, every ancestor kept), under the same
    name: what a step verifies once a grammar pruned the drafts it forbids (shaping.py). Cached per (tree, keep)."""
    if len(keep) == tree.num_nodes:
        return tree
    if not keep:
        return Tree.root_only()
    return _sharing_heads(Tree(tree.name, tuple(tree.paths[i - 1] for i in keep)), tree)


def _sharing_heads(tree: Tree, source: Tree) -> Tree:
    """``tree`` with ``source``'s heads_tree object when both hold the same head nodes, so that what the heads
    build once per tree (drafting plans) is reused across the hybrid and pruned trees of one heads tree."""
    if tree.heads_tree.paths == source.heads_tree.paths and tree.heads_tree is not tree:
        object.__setattr__(tree, "heads_tree", source.heads_tree)
    return tree
