"""Tree construction: hand-worked examples, properties over random trees, errors, shipped trees."""

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from entmtp.errors import TreeError
from entmtp.tree import Tree, TreeBank, list_trees, load_tree

T, F = True, False

# ---- hand-worked trees ----------------------------------------------------------------------------


def test_small_tree_by_hand():
    # node ids: 0 root, 1 (0,), 2 (1,), 3 (0, 0), 4 (0, 1)
    tree = Tree.from_paths([(0, 1), (0,), (0, 0), (1,)], "small")
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1))
    assert tree.num_nodes == 4 and tree.size == 5 and tree.depth == 2 and tree.topk == 2
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1]
    expected_mask = [
        [T, F, F, F, F],
        [T, T, F, F, F],
        [T, F, T, F, F],
        [T, T, F, T, F],
        [T, T, F, F, T],
    ]
    assert tree.mask.tolist() == expected_mask
    assert tree.mask.dtype == torch.bool
    assert tree.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    # flattened [depth, topk] table with topk = 2: (d - 1) * 2 + rank
    assert tree.level_slices == (slice(1, 3), slice(3, 5))
    assert tree.nodes_per_depth == (2, 2)
    assert tree.is_rank_contiguous
    assert repr(tree) == "Tree('small', nodes=4, per_depth=(2, 2))"
    assert json.loads(tree.to_json()) == [[0], [1], [0, 0], [0, 1]]


def test_wide_tree_topk_is_the_widest_rank():
    tree = Tree.from_paths([(0,), (2,), (1,), (0, 0), (2, 0)])
    assert tree.topk == 3
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 3]


def test_chain_by_hand():
    tree = Tree.from_paths([(0, 0, 0), (0,), (0, 0)], "chain")
    assert tree.depth == 3 and tree.topk == 1 and tree.size == 4
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.ranks.tolist() == [0, 0, 0, 0]
    assert tree.mask.tolist() == [
        [T, F, F, F],
        [T, T, F, F],
        [T, T, T, F],
        [T, T, T, T],
    ]
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert tree.level_slices == (slice(1, 2), slice(2, 3), slice(3, 4))
    assert tree.nodes_per_depth == (1, 1, 1)
    assert tree.is_rank_contiguous


def test_not_rank_contiguous():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 2), (0, 1), (1, 1)], "gappy")
    assert not tree.is_rank_contiguous
    tree.check_fits(num_heads=2, topk=3)  # Medusa is fine with gaps
    with pytest.raises(TreeError, match=r"children of node \(1,\) have ranks \[1\], expected \[0\]"):
        tree.check_fits(num_heads=2, require_contiguous=True)
    root_gap = Tree.from_paths([(1,)], "root_gap")
    with pytest.raises(TreeError, match=r"children of the root have ranks \[1\]"):
        root_gap.check_fits(num_heads=1, require_contiguous=True)


def test_check_fits():
    tree = Tree.from_paths([(0,), (0, 0), (0, 0, 3)], "t")
    tree.check_fits(num_heads=3, topk=4, require_contiguous=False)
    with pytest.raises(TreeError, match=r"depth 3 .*predict only 2 tokens ahead: use a tree of depth <= 2"):
        tree.check_fits(num_heads=2)
    with pytest.raises(TreeError, match=r"uses rank 3 \(path \(0, 0, 3\)\).*top 3 candidates"):
        tree.check_fits(num_heads=4, topk=3)


def test_root_only():
    tree = Tree.root_only()
    assert tree.name == "none"
    assert tree.num_nodes == 0 and tree.size == 1 and tree.depth == 0 and tree.topk == 0
    assert tree.mask.tolist() == [[True]]
    assert tree.retrieve_indices.tolist() == [[0]]
    assert tree.level_slices == () and tree.nodes_per_depth == ()
    assert tree.is_rank_contiguous
    tree.check_fits(num_heads=0, topk=0, require_contiguous=True)
    with pytest.raises(TreeError, match="tree is empty"):
        Tree("none", ())  # only root_only() builds an empty tree
    assert Tree.root_only() is tree  # one instance: what is cached per tree is built once for it


def test_frozen():
    tree = Tree.from_paths([(0,)])
    with pytest.raises(AttributeError):
        tree.name = "other"


# ---- properties over random trees -----------------------------------------------------------------


@st.composite
def trees(draw, max_nodes=24, max_depth=5, max_rank=5):
    """Grow a prefix-closed set: each new path extends the root or an existing path by one rank."""
    paths: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, max_nodes))):
        parents = [()] + [p for p in paths if len(p) < max_depth]
        parent = draw(st.sampled_from(parents))
        child = parent + (draw(st.integers(0, max_rank)),)
        if child not in paths:
            paths.append(child)
    return paths


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@settings(max_examples=150, deadline=None)
@given(trees())
def test_structure_properties(paths):
    tree = Tree.from_paths(paths)
    n = len(paths)
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    assert tree.num_nodes == n and tree.mask.shape == (n + 1, n + 1)
    assert tree.topk == max(p[-1] for p in tree.paths) + 1
    # nodes and paths agree: parent of paths[i] is the node of paths[i][:-1]
    node_of = {p: i + 1 for i, p in enumerate(tree.paths)} | {(): 0}
    for i, p in enumerate(tree.paths, start=1):
        assert parents[i] == node_of[p[:-1]] and parents[i] < i
        assert depths[i] == len(p) and tree.ranks[i] == p[-1]
    # every node attends to exactly its ancestors and itself; its position is its depth
    for i in range(n + 1):
        anc = _ancestors(parents, i)
        assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == anc
        assert depths[i] == len(anc) - 1
    # levels are contiguous and cover 1..N
    assert tree.level_slices[0].start == 1 and tree.level_slices[-1].stop == n + 1
    for d, s in enumerate(tree.level_slices, start=1):
        assert set(depths[s]) == {d}
    assert sum(tree.nodes_per_depth) == n
    # retrieve rows: root-to-leaf paths, one per leaf, covering every node
    leaves = set(range(n + 1)) - set(parents)
    rows = tree.retrieve_indices.tolist()
    assert len(rows) == len(leaves) and tree.retrieve_indices.shape[1] == tree.depth + 1
    seen = set()
    for row in rows:
        nodes = [x for x in row if x >= 0]
        assert row == nodes + [-1] * (len(row) - len(nodes))  # padding only at the end
        assert nodes[0] == 0 and nodes[-1] in leaves
        assert [depths[x] for x in nodes] == list(range(len(nodes)))
        assert all(parents[b] == a for a, b in zip(nodes, nodes[1:], strict=False))
        seen.update(nodes)
    assert seen == set(range(n + 1))
    # rank contiguity agrees with a direct check
    kids: dict[tuple, list[int]] = {}
    for p in tree.paths:
        kids.setdefault(p[:-1], []).append(p[-1])
    assert tree.is_rank_contiguous == all(sorted(r) == list(range(len(r))) for r in kids.values())


@settings(max_examples=60, deadline=None)
@given(trees(), st.randoms(use_true_random=False))
def test_input_order_does_not_matter(paths, rnd: random.Random):
    shuffled = list(paths)
    rnd.shuffle(shuffled)
    a, b = Tree.from_paths(paths), Tree.from_paths([list(p) for p in shuffled])
    assert a.paths == b.paths
    for attr in ("depths", "parents", "ranks", "lookup", "mask", "retrieve_indices"):
        assert torch.equal(getattr(a, attr), getattr(b, attr)), attr
    assert a.level_slices == b.level_slices
    assert Tree.from_paths(json.loads(a.to_json())).paths == a.paths


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "paths, kwargs, message",
    [
        ([], {}, r"tree is empty: give at least one path, e.g. \[\[0\]\]"),
        ([(0,), ()], {}, r"path \(\) is not a non-empty list of ranks"),
        ([(0,), (0, "1")], {}, r"path \(0, '1'\) has element '1': a lookup rank is written"),
        ([(0,), 3], {}, r"path 3 is not a non-empty list"),
        ([(True,)], {}, r"path \(True,\) is not a non-empty list of ranks"),
        ([(0.0,)], {}, r"path \(0.0,\) is not"),
        ("[[0]]", {}, r"a tree is a list of paths like \[\[0\], \[0, 0\]\], got str"),
        ([(0,), (0, -1)], {}, r"path \(0, -1\) has negative rank -1: ranks count from 0"),
        (
            [(0,), (0, 4)],
            {"max_topk": 4},
            r"path \(0, 4\) uses rank 4 but the heads keep only the top 4 candidates: use ranks < 4",
        ),
        (
            [(0,) * k for k in range(1, 6)],
            {"max_depth": 4},
            r"path \(0, 0, 0, 0, 0\) has depth 5 but the heads predict only 4 tokens ahead: use a tree of depth <= 4",
        ),
        ([(0,), (1,), (0,)], {}, r"path \(0,\) appears twice: list each path once"),
        ([[0], (0,)], {}, r"path \(0,\) appears twice"),
        ([(0,), (0, 1), (0, 1, 2)][::2], {}, r"path \(0, 1, 2\) needs its parent \(0, 1\), which is missing"),
        ([(1, 0)], {}, r"path \(1, 0\) needs its parent \(1,\), which is missing"),
    ],
)
def test_bad_paths(paths, kwargs, message):
    with pytest.raises(TreeError, match=message):
        Tree.from_paths(paths, **kwargs)


def test_limits_accept_a_tree_that_fits():
    tree = Tree.from_paths([(0,), (0, 3)], max_depth=2, max_topk=4)
    assert tree.depth == 2 and tree.topk == 4


# ---- shipped trees --------------------------------------------------------------------------------

SMALL = {"tree_2": 2, "tree_4": 4, "tree_8": 8, "tree_16": 16, "tree_32": 32}


def test_list_trees():
    names = list_trees()
    assert names == sorted(names)
    assert {"mc_sim_7b_63", *SMALL, *(f"chain_{d}" for d in range(1, 6))} <= set(names)


def test_mc_sim_7b_63():
    tree = load_tree("mc_sim_7b_63")
    assert tree.name == "mc_sim_7b_63"
    assert tree.num_nodes == 63 and tree.size == 64
    assert tree.nodes_per_depth == (10, 28, 23, 2)
    assert tree.depth == 4 and tree.topk == 10
    assert tree.is_rank_contiguous  # so Hydra can use it
    tree.check_fits(num_heads=4, topk=10, require_contiguous=True)


def test_small_trees_are_prefixes_of_mc_sim_7b_63():
    ordered = [tuple(p) for p in json.loads(_shipped_text("mc_sim_7b_63"))]  # file order, by acceptance
    for name, n in SMALL.items():
        paths = [tuple(p) for p in json.loads(_shipped_text(name))]
        assert paths == ordered[:n], name  # exact prefix: no parents had to be added
        assert load_tree(name).num_nodes == n


def _shipped_text(name: str) -> str:
    from importlib import resources

    return (resources.files("entmtp") / "trees" / f"{name}.json").read_text()


@pytest.mark.parametrize("depth", range(1, 6))
def test_chains(depth):
    tree = load_tree(f"chain_{depth}")
    assert tree.paths == tuple((0,) * k for k in range(1, depth + 1))
    assert tree.nodes_per_depth == (1,) * depth and tree.topk == 1


def test_load_limits_apply_to_shipped_trees():
    with pytest.raises(TreeError, match=r"mc_sim_7b_63.json: path .* has depth 4 .*only 3 tokens ahead"):
        load_tree("mc_sim_7b_63", max_depth=3)


def test_unknown_name_lists_available():
    with pytest.raises(
        TreeError, match=r"unknown tree 'nope': available trees are chain_1, .*mc_sim_7b_63.*file"
    ):
        load_tree("nope")


def test_load_file(tmp_path):
    file = tmp_path / "mine.json"
    file.write_text("[[1], [0], [0, 0]]")
    for arg in (file, str(file)):
        tree = load_tree(arg)
        assert tree.name == "mine" and tree.paths == ((0,), (1,), (0, 0))


def test_broken_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("[[0], [0, 0]")
    with pytest.raises(TreeError, match=r"broken.json is not valid JSON"):
        load_tree(broken)
    orphan = tmp_path / "orphan.json"
    orphan.write_text("[[0, 0]]")
    with pytest.raises(TreeError, match=r"orphan.json: path \(0, 0\) needs its parent \(0,\)"):
        load_tree(orphan)


# ---- bank -----------------------------------------------------------------------------------------


def test_tree_bank():
    bank = TreeBank.from_names(["chain_2", "tree_8"])
    bank.add(Tree.root_only())
    assert bank.names == ["chain_2", "tree_8", "none"] and list(bank) == bank.names
    assert len(bank) == 3 and "tree_8" in bank and "tree_4" not in bank
    assert bank["tree_8"].num_nodes == 8
    assert bank["none"] is bank["none"]  # switching trees is taking a reference
    with pytest.raises(
        TreeError, match=r"no tree named 'tree_4' in the bank: it holds chain_2, tree_8, none"
    ):
        bank["tree_4"]
    with pytest.raises(TreeError, match=r"already has a tree named 'none'"):
        bank.add(Tree.root_only())
    with pytest.raises(TreeError, match="only 1 tokens ahead"):
        TreeBank.from_names(["chain_2"], max_depth=1)
