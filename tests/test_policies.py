"""The scheduling policies (scheduler/policies.py): lossless whatever they choose, hysteresis, ladders, argument
checks, and the online recalibration of the acceptance model."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.calibration.traces import TOPK
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, Probe, random_heads
from entmtp.records import Step, StepContext
from entmtp.scheduler.policies import (
    BinaryPolicy,
    CostPolicy,
    DynamicPolicy,
    LadderPolicy,
    LatencyModel,
    OnlineCalibration,
)
from entmtp.tree import load_tree
from scheduler_helpers import fitted_setup, small_acceptance


@pytest.fixture(scope="module")
def fitted():
    return fitted_setup()


# ---- lossless, whatever they choose ------------------------------------------------------------------------


def all_policies():
    small, mid, large = load_tree("chain_1"), load_tree("tree_4"), load_tree("mc_sim_7b_63")
    acc = small_acceptance()
    lat = LatencyModel([0, 1, 4, 63], [10.0, 11.0, 12.0, 30.0])
    out = {
        f"binary-{s}": BinaryPolicy(small, large, s, 0.3, 0.5) for s in ("entropy", "path", "chain", "accept")
    }
    out["ladder"] = LadderPolicy([small, mid, large], "chain", [0.2, 0.4])
    out["cost"] = CostPolicy([small, mid, large], acc, [11.0, 12.0, 30.0])
    out["dynamic"] = DynamicPolicy(large, acc, lat)
    return out


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("name", list(all_policies()))
def test_every_policy_gives_plain_greedy_output(fitted, kind, name):
    model, ids, ref, heads = fitted
    policy = all_policies()[name]
    r = Engine(model, ByteTokenizer(), heads=heads[kind], policy=policy).generate(ids, max_new_tokens=48)
    assert r.token_ids == ref
    assert all(s.signals for s in r.steps)  # what the policy read is recorded per step


def test_policies_built_from_the_same_settings_are_equal_and_no_others():
    """Equality by what a policy was built from (policy.Settings): what one face builds can be checked
    against what another builds. A generation's state and a changed setting are told apart."""
    first, second = all_policies(), all_policies()
    for name, policy in first.items():
        assert policy == second[name] and policy.fresh() == second[name] and policy is not second[name], name
    assert all(first[x] != second[y] for x in first for y in second if x != y)
    small, large, acc = load_tree("chain_1"), load_tree("mc_sim_7b_63"), small_acceptance()
    assert BinaryPolicy(small, large, "entropy", 0.3, 0.6) != first["binary-entropy"]  # another threshold
    assert CostPolicy([small, large], acc, [11.0, 31.0]) != CostPolicy([small, large], acc, [11.0, 30.0])
    lat = LatencyModel([0, 1, 4, 63], [10.0, 11.0, 12.0, 30.0])
    assert DynamicPolicy(large, acc, lat, online=False) != first["dynamic"]


def test_dynamic_policy_switches_trees_and_stays_lossless(fitted):
    model, ids, ref, heads = fitted
    policy = DynamicPolicy(load_tree("mc_sim_7b_63"), small_acceptance(), LatencyModel([0, 63], [10.0, 13.0]))
    for kind in ("medusa", "hydra"):
        r = Engine(model, ByteTokenizer(), heads=heads[kind], policy=policy).generate(ids, max_new_tokens=48)
        assert r.token_ids == ref
        assert len({s.tree_nodes for s in r.steps}) >= 3  # many subtree sizes: switching is exercised


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_probe_reuse_drafts_the_same_tokens(kind):
    model = tiny_model("llama", seed=3)
    heads = random_heads(HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256), init="random")
    heads.bind(model)
    drafter = heads.drafter()
    drafter.extend(torch.randn(3, 64))
    root = torch.tensor([7])
    master = load_tree("mc_sim_7b_63")
    probe = drafter.probe(master, root)
    assert probe.depth == (1 if kind == "hydra" else 4)
    for name in ("chain_1", "tree_8", "tree_16", "mc_sim_7b_63"):
        tree = load_tree(name)
        a, b = drafter.draft(tree, root), drafter.draft(tree, root, probe)
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logprobs, b.logprobs)


# ---- signal policies ---------------------------------------------------------------------------------------


def ctx_with(chain: float, step: int = 0) -> StepContext:
    return StepContext(step, 10 + step, 100, None, raw_signals=[1.0, 0.5, chain, 0.4])


def test_hysteresis_never_flips_inside_its_band():
    small, large = load_tree("chain_1"), load_tree("tree_16")
    p = BinaryPolicy(small, large, "chain", tau_off=0.3, tau_on=0.6)
    assert p.choose(ctx_with(0.1)).tree is small
    inside = [0.31, 0.59, 0.45, 0.3, 0.5999, 0.42] * 5
    assert all(p.choose(ctx_with(s, i)).tree is small for i, s in enumerate(inside))
    assert p.choose(ctx_with(0.6)).tree is large  # reaching tau_on switches up ...
    assert all(p.choose(ctx_with(s, i)).tree is large for i, s in enumerate(inside))  # ... and the band holds
    assert p.choose(ctx_with(0.2999)).tree is small  # below tau_off: down
    assert p.fresh().choose(ctx_with(0.5)).tree is small  # a new generation starts low: its own state


def test_ladder_maps_signal_to_trees_by_size():
    trees = [load_tree("tree_16"), load_tree("chain_1"), load_tree("tree_4")]
    p = LadderPolicy(trees, "chain", [0.2, 0.5])
    got = [p.choose(ctx_with(s)).tree.name for s in (0.0, 0.19, 0.2, 0.49, 0.5, 0.9)]
    assert got == ["chain_1", "chain_1", "tree_4", "tree_4", "tree_16", "tree_16"]


def test_policy_arguments_are_checked():

    a, b = load_tree("chain_1"), load_tree("tree_4")
    with pytest.raises(EntMTPError, match="tau_off <= tau_on"):
        BinaryPolicy(a, b, "chain", 0.6, 0.3)
    with pytest.raises(EntMTPError, match="unknown signal 'vibes'"):
        BinaryPolicy(a, b, "vibes", 0.3, 0.6)
    with pytest.raises(EntMTPError, match="strictly increasing"):
        LadderPolicy([a, b, load_tree("tree_8")], "chain", [0.5, 0.2])
    with pytest.raises(EntMTPError, match="one positive step latency per bank tree"):
        CostPolicy([a, b], small_acceptance(), [1.0])


# ---- online recalibration of the acceptance model ----------------------------------------------------------


def _probe_step(policy, right: bool, first: int = 7):
    """One step of `policy` with a probe whose rank-0 depth-1 candidate is `first`; the base model's token is
    `first` when `right`, else a token no head proposed."""
    depth = 1
    lp = torch.log(torch.tensor([[0.6, 0.2, 0.1] + [0.01] * (TOPK - 3)] * depth))
    tokens = torch.tensor([[first, first + 1, first + 2] + [-1] * (TOPK - 3)] * depth)
    ctx = StepContext(0, 10, 100, None, probe=Probe(tokens, lp))
    choice = policy.choose(ctx)
    emitted = [first if right else 999]
    policy.observe(Step(choice.tree.name, choice.tree.num_nodes, 0, 1, emitted))
    return choice


def test_online_calibration_shrinks_trees_when_the_heads_keep_missing_and_grows_them_back():
    lat = LatencyModel([0, 1, 4, 63], [10.0, 10.5, 11.0, 13.0])
    master = load_tree("mc_sim_7b_63")
    fixed = DynamicPolicy(master, small_acceptance(), lat, online=False)
    online = DynamicPolicy(master, small_acceptance(), lat)
    start = _probe_step(online, right=False).tree.num_nodes
    assert start == _probe_step(fixed, right=False).tree.num_nodes  # a fresh generation: the calibrated model
    for _ in range(40):
        missed, same = _probe_step(online, right=False), _probe_step(fixed, right=False)
    assert online.calibration.scale < 0.2 and missed.signals["calibration"] < 0.2
    assert online.fresh().calibration.scale == 1.0  # a new generation starts from the calibrated model ...
    assert online.calibration.scale < 0.2  # ... without touching this one's
    assert missed.tree.num_nodes < same.tree.num_nodes == start
    for _ in range(60):  # right again, as often as the model predicts (its depth-1 nodes sum to 1 here)
        grown = _probe_step(online, right=True)
    assert online.calibration.scale > 0.8
    assert grown.tree.num_nodes == start


def test_online_calibration_keeps_depth_one_a_probability_and_needs_probe_tokens():
    master = load_tree("tree_8")
    cal = OnlineCalibration(master)
    p = torch.full((master.size,), 0.5)
    p[0] = 1.0
    for _ in range(50):  # always right: the scale grows past 1 ...
        cal.predict(p * 0.2, Probe(torch.tensor([[3, 4, 5]]), torch.zeros(1, 3)))
        cal.observe(Step("t", 8, 0, 1, [3]))
    assert cal.scale > 2
    scaled = cal.predict(p, None)  # ... but the depth-1 nodes never sum above 1
    assert float(scaled[cal.first].sum()) == pytest.approx(1.0) and scaled[0] == 1.0
    before = cal.scale
    cal.predict(p, Probe(torch.empty(0, dtype=torch.long), torch.zeros(1, 3)))  # a replay without tokens
    cal.observe(Step("t", 8, 0, 1, [999]))
    assert cal.scale == before


# ---- expected accepted drafts per acceptance rule ----------------------------------------------------------


def _enumerated_typical(tree, rates: list[float]) -> float:
    """E[deepest passing chain from the root] with every node passing independently given its parent: all
    2^N pass patterns."""
    import itertools

    n = tree.num_nodes
    total = 0.0
    for passes in itertools.product((False, True), repeat=n):
        weight = 1.0
        for i, ok in enumerate(passes, start=1):
            weight *= rates[i] if ok else 1 - rates[i]
        alive = [True] + [False] * n  # a node counts when it and every ancestor pass
        for i in range(1, n + 1):
            alive[i] = passes[i - 1] and alive[int(tree.parents[i])]
        total += weight * max(int(tree.depths[i]) for i in range(n + 1) if alive[i])
    return total


def test_expected_accepted_follows_each_rule():
    from entmtp.scheduler.policies import ExpectedAccepted
    from entmtp.tree import Tree

    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)])
    g = torch.Generator().manual_seed(0)
    rates = torch.rand(tree.size, generator=g) * 0.6 + 0.2
    rates[0] = 1.0
    subsets = [list(range(1, n + 1)) for n in (1, 3, 5, 8)]  # prefix-closed: nodes are in canonical order
    member = torch.zeros(len(subsets), tree.size)
    for s, nodes in enumerate(subsets):
        member[s, nodes] = 1.0
    path = torch.ones(tree.size)  # the product of rates along each node's path
    for i in range(1, tree.size):
        path[i] = rates[i] * path[int(tree.parents[i])]
    for rule in ("greedy", "sample"):  # exclusive children: the sum of path probabilities
        got = ExpectedAccepted(tree, rule)(rates, member)
        assert got.tolist() == pytest.approx([float(path[nodes].sum()) for nodes in subsets], rel=1e-5)
    typical = ExpectedAccepted(tree, "typical")(rates, member)
    for s, nodes in enumerate(subsets):
        sub = Tree.from_paths([tree.paths[i - 1] for i in nodes])
        sub_rates = [1.0] + [float(rates[i]) for i in nodes]
        assert float(typical[s]) == pytest.approx(_enumerated_typical(sub, sub_rates), rel=1e-5)
    # siblings that can both pass count a depth once: below the exclusive sum once a node has two children
    assert float(typical[-1]) < float(path[subsets[-1]].sum())


def test_typical_dynamic_policy_stops_adding_siblings_that_only_overlap():
    """Two depth-1 candidates each right 45% of the time: exclusive (greedy, sample) they add up to 0.9 drafts;
    under typical acceptance both may pass, so the second adds 0.45 * 0.55 only and is not worth its cost."""
    from dataclasses import replace

    lat = LatencyModel([0, 63], [10.0, 10.0 + 63 * 3.0])  # 3 ms per node on a 10 ms step
    rank_rates = tuple(((0.45, 0.45) + (0.01,) * (TOPK - 2),) * 2 for _ in range(4))
    acc = replace(small_acceptance(), rank_rates=rank_rates)
    ctx = StepContext(0, 10, 100, None, probe=None)
    picks = {
        rule: DynamicPolicy(load_tree("tree_8"), replace(acc, rule=rule), lat, online=False).choose(ctx)
        for rule in ("greedy", "typical")
    }
    assert picks["greedy"].tree.paths == ((0,), (1,))
    assert picks["greedy"].signals["expected_tokens"] == pytest.approx(1.9)
    assert picks["typical"].tree.paths == ((0,),)
    assert picks["typical"].signals["expected_tokens"] == pytest.approx(1.45)
