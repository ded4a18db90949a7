"""Offline tree search on traces (calibration/search.py): greedy growth on known acceptance, the acceptance
frontier, exact simulation of real decodes, and typical acceptance through a union tree's passes."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import ByteTokenizer
from entmtp.calibration.search import (
    PathCounts,
    TraceAcceptance,
    UnionPasses,
    acceptance_frontier,
    grow,
    simulate,
)
from entmtp.calibration.traces import MISS, TOPK, Trace, trace_generation
from entmtp.engine import Engine
from entmtp.policy import static
from entmtp.tree import Tree, load_tree
from scheduler_helpers import RANK_P, fitted_setup, path_value, synthetic_traces


@pytest.fixture(scope="module")
def fitted():
    return fitted_setup()


# ---- growth and the acceptance frontier --------------------------------------------------------------------


def test_greedy_growth_finds_the_known_optimal_trees():
    counts = PathCounts(synthetic_traces())
    paths = [p for d in (1, 2, 3) for p in itertools.product(range(len(RANK_P)), repeat=d)]
    best = sorted((path_value(p) for p in paths), reverse=True)
    grown = grow(counts, max_depth=3, max_nodes=30)
    for n in range(1, 31):
        got = counts.mean_accepted(grown.order[:n])
        assert got == pytest.approx(sum(best[:n]), rel=2e-3), n  # the top-n paths: the optimum of size n
    assert grown.order[:4] == ((0,), (0, 0), (1,), (0, 0, 0))  # .5, .25, .2, .125
    chain = grow(counts, max_depth=1, max_nodes=10)
    assert chain.order == ((0,), (1,), (2,))  # depth 1: only 3 ranks carry value; the growth stops there


def test_growth_ties_go_to_smaller_rank_sum_then_shallower():
    rows = [[0, 0]] * 4 + [[0, 1]] * 2 + [[1, MISS]] * 2 + [[2, MISS]] * 2
    tr = Trace(1, 11, torch.tensor(rows), torch.zeros(10, 2, TOPK), torch.zeros(10, 4))
    g = grow(PathCounts([tr]), max_depth=2, max_nodes=10)
    # (1,) and (0, 1) tie at 2/10 with rank sum 1: the shallower (1,) first; then (0, 1) beats (2,) (same
    # value, rank sum 1 < 2); then nothing left that ever accepts, so the growth stops
    assert g.order == ((0,), (0, 0), (1,), (0, 1), (2,))


def test_acceptance_frontier_is_undominated_and_rescored():
    traces = synthetic_traces()
    counts = PathCounts(traces)
    frontier = acceptance_frontier(counts, traces, [grow(counts, d, 20) for d in (1, 2, 3)])
    sizes = [f.tree.num_nodes for f in frontier]
    scores = [f.mean_accepted for f in frontier]
    assert sizes == sorted(sizes) and scores == sorted(scores)
    assert all(b > a for a, b in itertools.pairwise(scores))
    for f in frontier:  # own-tree decodes give fewer tokens per step than 1 + the all-position mean here
        assert 1 < f.tokens_per_step <= 1 + f.mean_accepted + 1e-9


# ---- exact simulation of real decodes ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_simulation_reproduces_real_decodes_step_for_step(fitted, kind):
    model, ids, ref, heads = fitted
    engine = Engine(model, ByteTokenizer(), heads=heads[kind], policy=static("chain_1"))
    trace = trace_generation(engine.base, heads[kind], ids + ref, len(ids))
    accepted_somewhere = False
    for name in ("chain_1", "chain_4", "tree_4", "tree_16", "mc_sim_7b_63"):
        tree = load_tree(name)
        r = Engine(model, ByteTokenizer(), heads=heads[kind], policy=static(tree)).generate(
            ids, max_new_tokens=48
        )
        assert r.token_ids == ref
        sim = simulate(tree, [trace])
        assert (sim.steps, sim.tokens) == (r.num_steps, len(ref) - 1), name
        accepted_somewhere |= any(s.accepted >= 2 for s in r.steps)
    assert accepted_somewhere  # the fitted heads make multi-draft steps: the comparison has teeth


# ---- typical acceptance (T > 0): passes of a union tree ---------------------------------------------------

UNION = Tree("u", ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (0, 0, 0)))  # canonical order: parents first


def typical_trace(passes) -> Trace:
    """A typical trace whose rows pass the given UNION nodes (by path) at each root."""
    n = len(passes)
    table = torch.tensor([[p in row for p in UNION.paths] for row in passes])
    return Trace(
        1,
        n + 1,
        torch.full((n, 3), MISS),
        torch.zeros(n, 1, TOPK),
        torch.zeros(n, 4),
        passes=table,
        union=UNION,
    )


def test_typical_acceptance_takes_the_deepest_node_whose_whole_path_passes():
    tr = typical_trace([{(0,), (2,), (2, 0), (0, 0, 0)}])  # (0, 0, 0) passes but its parent (0, 0) does not
    accepted = TraceAcceptance(tr)
    assert accepted(0, load_tree("mc_sim_7b_63").path_set) == 2  # (2,) then (2, 0): off rank 0 entirely
    assert accepted(0, frozenset({(0,), (1,)})) == 1
    assert accepted(0, frozenset({(1,), (1, 0)})) == 0
    assert accepted(0, frozenset({(0,), (0, 0), (0, 0, 0)})) == 1
    assert accepted(0, frozenset({(0,), (3,), (0, 5)})) == 1  # paths the union never verified never pass


def test_typical_growth_counts_a_depth_once_however_many_siblings_pass():
    # every position: (0,) and (1,) pass at depth 1, (0, 0) at depth 2
    tr = typical_trace([{(0,), (1,), (0, 0)}] * 10)
    scores = UnionPasses([tr])
    g = grow(scores, max_depth=2, max_nodes=5)
    assert g.order == ((0,), (0, 0))  # (1,) would add nothing: depth 1 is already accepted everywhere
    assert scores.mean_accepted(g.order) == 2.0
    assert simulate(Tree("t", g.order), [tr]).tokens_per_step == pytest.approx(9 / 3)  # 3 steps of 3, 3, 3


def test_greedy_traces_score_the_same_as_union_passes_of_their_own_path():
    """A greedy trace is a typical trace where exactly the trajectory's own nodes pass: both scorers agree."""
    greedy = synthetic_traces(depth=2, scale=200)[0]
    union = Tree("u", tuple((a,) for a in range(3)) + tuple((a, b) for a in range(3) for b in range(3)))
    rows = greedy.ranks.tolist()
    passes = torch.tensor([[p == tuple(r[: len(p)]) for p in union.paths] for r in rows])
    as_typical = Trace(
        greedy.prompt_len, greedy.length, greedy.ranks, greedy.probe, greedy.raw, passes=passes, union=union
    )
    a, b = grow(PathCounts([greedy]), 2, 12), grow(UnionPasses([as_typical]), 2, 12)
    assert a.order == b.order
    tree = Tree("t", a.order)
    assert simulate(tree, [greedy]) == simulate(tree, [as_typical])
