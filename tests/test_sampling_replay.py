"""Replays at T > 0 (calibration/traces.py): under lossless rejection sampling a trace of one sampled generation
replays any tree exactly for that random outcome, so replays of many generations match real seeded decodes in
distribution; the acceptance rule itself keeps the longest tree path that matches the emitted tokens. Under
typical acceptance a trace verified on a union tree replays its own generation's tree exactly; another tree's
replay follows a trajectory that tree would not have produced (measured below, not hidden)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import ByteTokenizer
from entmtp.accept import Sampling, accept
from entmtp.calibration.replay import replay
from entmtp.calibration.search import step_tokens
from entmtp.calibration.traces import GUMBEL, SAMPLE, TYPICAL, generate_traces, trace_generation
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.policy import static
from entmtp.tree import Tree, load_tree, union_tree
from scheduler_helpers import fitted_setup

PEAKED = 32.0  # the tiny model's logits scaled up: at T=0.7 its samples often follow the fitted heads


@pytest.fixture(scope="module")
def peaked():
    """(model, prompt ids, fitted Hydra heads) with a base model peaked enough for drafts to be accepted when
    sampling (its greedy output is unchanged by the scale)."""
    model, ids, _, heads = fitted_setup()
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAKED)
    return model, ids, heads["hydra"]


def test_sample_rule_accepts_the_longest_path_matching_the_emitted_tokens():
    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        V = 5
        logits = torch.randn(tree.size, V, generator=g) * 2
        tokens = torch.randint(0, V, (tree.size,), generator=g)
        for node in range(tree.size):  # siblings draft distinct tokens, as top-k ranks do
            kids = [c for c in range(tree.size) if int(tree.parents[c]) == node]
            tokens[kids] = torch.randperm(V, generator=g)[: len(kids)]
        acc = accept(tree, tokens, logits, Sampling(0.7, "sample"), g)
        emitted = [int(tokens[n]) for n in acc.path[1:]] + [acc.bonus]
        node, matched = 0, [0]  # walk the tree along the emitted tokens
        for tok in emitted:
            kids = [c for c in range(tree.size) if int(tree.parents[c]) == node and int(tokens[c]) == tok]
            if not kids:
                break
            node = kids[0]
            matched.append(node)
        assert matched == acc.path, trial  # the bonus never equals a child that was tried


@pytest.mark.parametrize("name", ["chain_4", "tree_8", "mc_sim_7b_63"])
def test_a_sampled_generation_replays_step_for_step(peaked, name):
    model, ids, heads = peaked
    tree = load_tree(name)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree))
    multi = 0
    for seed in range(4):
        r = engine.generate(ids, max_new_tokens=24, temperature=0.7, acceptance="sample", seed=seed)
        trace = trace_generation(engine.base, heads, ids + r.token_ids, len(ids), SAMPLE)
        assert trace.passes is None  # rank vectors are all the lossless rule needs
        assert step_tokens(tree, trace) == [s.tokens for s in r.steps], seed
        multi += sum(s.accepted >= 2 for s in r.steps)
    assert multi  # steps that accept several drafts: the comparison has teeth


@pytest.mark.parametrize("name", ["chain_4", "tree_8", "mc_sim_7b_63"])
def test_a_gumbel_generation_replays_step_for_step_and_every_tree_writes_it(peaked, name):
    """Under the gumbel rule the heads draft under the seed's noise and a trace ranks their candidates under
    the same noise, so the trace replays the decode step for step; and the text is the seed's whatever the
    tree (plain decoding's included)."""
    model, ids, heads = peaked
    tree = load_tree(name)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree))
    plain = Engine(model, ByteTokenizer())
    multi = 0
    for seed in range(4):
        kw = dict(max_new_tokens=24, temperature=0.7, acceptance="gumbel", seed=seed)
        r = engine.generate(ids, **kw)
        assert r.token_ids == plain.generate(ids, **kw).token_ids, seed
        trace = trace_generation(engine.base, heads, ids + r.token_ids, len(ids), GUMBEL, seed=seed)
        assert trace.seed == seed
        assert step_tokens(tree, trace) == [s.tokens for s in r.steps], seed
        multi += sum(s.accepted >= 2 for s in r.steps)
    assert multi  # steps that accept several drafts: the comparison has teeth
    with pytest.raises(EntMTPError, match="needs the generation's seed"):
        trace_generation(engine.base, heads, ids + r.token_ids, len(ids), GUMBEL)


def _histogram(lengths) -> dict[int, float]:
    c = Counter(lengths)
    return {k: v / len(lengths) for k, v in sorted(c.items())}


def _distance(a: dict[int, float], b: dict[int, float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def test_replayed_and_real_accepted_lengths_agree_in_distribution(peaked):
    """Traces of generations sampled with one tree (tree_8, seeds 0..) replayed with another (mc_sim_7b_63)
    against real decodes with that other tree (seeds 1000..): the same histogram of tokens per step, and a
    clearly different one from replaying greedy traces (what the search would see without sampled ones)."""
    model, ids, heads = peaked
    n, new = 40, 24
    tracer = Engine(model, ByteTokenizer(), heads=heads, policy=static("tree_8"))
    traces, _ = generate_traces(tracer, heads, [ids] * n, new, sampling=SAMPLE)  # seed = prompt index
    target = load_tree("mc_sim_7b_63")
    replayed = [k for tr in traces for k in step_tokens(target, tr)]
    real_engine = Engine(model, ByteTokenizer(), heads=heads, policy=static(target))
    real = []
    for seed in range(1000, 1000 + n):
        r = real_engine.generate(ids, max_new_tokens=new, temperature=0.7, acceptance="sample", seed=seed)
        real += [s.tokens for s in r.steps]
    greedy, _ = generate_traces(tracer, heads, [ids], new)
    as_greedy = step_tokens(target, greedy[0])
    h_rep, h_real, h_greedy = _histogram(replayed), _histogram(real), _histogram(as_greedy)
    assert len(h_real) >= 3  # several step lengths occur: the histograms have a shape to compare
    # measured here: distance 0.05, means 1.50 and 1.63 tokens per step. Whole generations either follow
    # the heads or not, so seed sets of 40 differ by ~0.06 in the mean (150 each: 1.49, 1.44, 1.51)
    assert _distance(h_rep, h_real) < 0.1, (h_rep, h_real)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # the means differ by 0.13 here; a 40-seed mean spreads by ~0.06 between seed sets: 0.13 + 2 x 0.06 = 0.25
    assert abs(mean(replayed) - mean(real)) < 0.13 + 2 * 0.06
    assert _distance(h_greedy, h_real) > 0.3, (h_greedy, h_real)


@pytest.mark.parametrize("name", ["chain_4", "tree_8", "mc_sim_7b_63"])
def test_a_typical_generation_replays_its_own_tree_step_for_step(peaked, name):
    """The union tree's passes at every root give any subtree's accepted length there: replaying the tree a
    typical decode used, over the trace of that decode, takes its very steps (off-trajectory siblings too)."""
    model, ids, heads = peaked
    union = union_tree([load_tree(n) for n in ("chain_4", "tree_8", "mc_sim_7b_63")], "u")
    tree = load_tree(name)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree))
    multi = 0
    for seed in range(4):
        r = engine.generate(ids, max_new_tokens=24, temperature=0.7, acceptance="typical", seed=seed)
        trace = trace_generation(engine.base, heads, ids + r.token_ids, len(ids), TYPICAL, union)
        assert step_tokens(tree, trace) == [s.tokens for s in r.steps], seed
        multi += sum(s.accepted >= 2 for s in r.steps)
    assert multi


def test_a_sampled_hybrid_decode_replays_step_for_step(peaked):
    """Lookup drafts under lossless sampling are drafts like any other: the dynamic policy with a lookup
    branch, replayed from the trace of a sampled generation, takes the engine's very steps (trees, pruned
    lookup nodes, tokens), duplicate siblings included."""
    from entmtp.costs import CostCurve
    from entmtp.lookup import Lookup
    from entmtp.scheduler.hybrid import HybridPolicy, hybrid
    from entmtp.scheduler.policies import DynamicPolicy, LatencyModel
    from scheduler_helpers import small_acceptance

    model, ids, heads = peaked
    lat = LatencyModel([0, 1, 4, 63], [10.0, 14.0, 20.0, 60.0])
    costs = CostCurve.from_latency(list(lat.nodes), list(lat.ms), "test")

    def policy():
        return DynamicPolicy(load_tree("mc_sim_7b_63"), small_acceptance(), lat)

    engine = Engine(
        model, ByteTokenizer(), heads=heads, policy=hybrid(policy(), Lookup(), costs), costs=costs
    )
    lookups = 0
    for seed in range(4):
        real = engine.generate(ids, max_new_tokens=48, temperature=0.7, acceptance="sample", seed=seed)
        trace = trace_generation(engine.base, heads, ids + real.token_ids, len(ids), SAMPLE)
        steps: list = []
        replay(HybridPolicy(policy(), Lookup(), lat), [trace], lambda t: 10.0, record=steps)
        got = [(s.tree, s.tree_nodes, s.lookup_nodes, s.tokens) for s in steps]
        want = [(s.tree, s.tree_nodes, s.lookup_nodes, s.tokens) for s in real.steps]
        assert got[:-1] == want[:-1], seed  # the last step: the engine cuts it at max_new_tokens
        lookups += sum(s.lookup_accepted for s in real.steps)
    assert lookups  # accepted lookup drafts: the check has teeth
