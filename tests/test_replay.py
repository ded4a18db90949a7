"""Replays (calibration/replay.py): the oracle bounds every policy, a static replay is its simulation, and a
replayed hybrid is the real decode step for step."""

from __future__ import annotations

import pytest

from conftest import ByteTokenizer, run_script
from entmtp.calibration.calibrate import fit_acceptance
from entmtp.calibration.replay import oracle, oracle_batch, replay, replay_batch
from entmtp.calibration.search import simulate
from entmtp.calibration.traces import trace_generation
from entmtp.costs import ChoiceCost, CostCurve, CostSurface
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.lookup import Lookup
from entmtp.policy import StaticPolicy
from entmtp.scheduler.hybrid import HybridPolicy, hybrid
from entmtp.scheduler.policies import BinaryPolicy, CostPolicy, DynamicPolicy, LadderPolicy, LatencyModel
from entmtp.tree import load_tree
from scheduler_helpers import fitted_setup, small_acceptance, synthetic_traces


@pytest.fixture(scope="module")
def fitted():
    return fitted_setup()


# ---- replay and oracle -------------------------------------------------------------------------------------


def test_oracle_is_never_below_any_policy_on_the_same_replay():
    traces = synthetic_traces()
    bank = [load_tree("chain_1"), load_tree("tree_4"), load_tree("tree_16")]
    ms = {"chain_1": 11.0, "tree_4": 13.0, "tree_16": 19.0}
    ms_of = lambda t: ms[t.name]  # noqa: E731
    best = oracle(bank, traces, ms_of).tokens_per_second
    acc = fit_acceptance(traces, probe_depth=3, num_heads=3)
    policies = [
        BinaryPolicy(bank[0], bank[2], s, lo, hi)
        for s in ("chain", "accept")
        for lo, hi in ((0.1, 0.2), (1, 2))
    ]
    policies += [LadderPolicy(bank, "accept", [0.5, 1.5]), CostPolicy(bank, acc, list(ms.values()))]
    policies += [StaticPolicy(t) for t in bank]
    for p in policies:
        assert replay(p, traces, ms_of).tokens_per_second <= best + 1e-9
    assert best > max(replay(StaticPolicy(t), traces, ms_of).tokens_per_second for t in bank)


def test_replay_of_a_static_tree_is_its_simulation():
    traces = synthetic_traces()
    tree = load_tree("tree_8")
    r = replay(StaticPolicy(tree), traces, lambda t: 10.0)
    s = simulate(tree, traces)
    assert (r.steps, r.tokens) == (s.steps, s.tokens)


EAGER = Lookup(caution=0.0)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("online", [False, True])
def test_replay_of_scheduled_hybrids_is_the_real_decode_step_for_step(fitted, kind, online):
    """The dynamic policy with a prompt-lookup branch, replayed from the trace of the same greedy output, takes
    the very steps the engine takes: the same trees (lookup nodes pruned alike), accepted drafts and tokens.
    Lookup chains sized on the copy rates themselves (caution 0): on this short output the default caution
    would draft none, and the check would lose its lookup branches."""
    model, ids, ref, heads = fitted
    lat = LatencyModel([0, 1, 4, 63], [10.0, 14.0, 20.0, 60.0])  # costly nodes: trees of every kind

    costs = CostCurve.from_latency(list(lat.nodes), list(lat.ms), "test")  # what the hybrid costs steps by

    def policy():
        return DynamicPolicy(load_tree("mc_sim_7b_63"), small_acceptance(), lat, online=online)

    engine = Engine(
        model, ByteTokenizer(), heads=heads[kind], policy=hybrid(policy(), EAGER, costs), costs=costs
    )
    real = engine.generate(ids, max_new_tokens=48)
    assert real.token_ids == ref
    trace = trace_generation(engine.base, heads[kind], ids + ref, len(ids))
    steps: list = []
    replay(HybridPolicy(policy(), EAGER, lat), [trace], lambda t: 10.0, record=steps)
    got = [(s.tree, s.tree_nodes, s.lookup_nodes, s.tokens) for s in steps]
    want = [(s.tree, s.tree_nodes, s.lookup_nodes, s.tokens) for s in real.steps]
    assert got[:-1] == want[:-1]  # the last step: the engine cuts it at max_new_tokens
    assert [s.sources for s in steps[:-1]] == [s.sources for s in real.steps[:-1]]
    assert any(s.lookup_nodes for s in real.steps)  # the check has teeth: lookup branches, and heads' drafts
    assert any(s.accepted >= 2 and not s.lookup_nodes for s in real.steps)  # accepted without them


def test_a_lookup_replay_needs_the_traces_tokens():
    tr = synthetic_traces()[0]
    with pytest.raises(EntMTPError, match="lossless sampled generations with their tokens"):
        replay(HybridPolicy(StaticPolicy(load_tree("tree_4")), Lookup()), [tr], lambda t: 10.0)


@pytest.mark.parametrize("name", ["replay_policies.py", "replay_sampling.py"])
def test_replay_scripts_name_an_unknown_task_before_loading_anything(tmp_path, name):
    out = tmp_path / "out"
    run = run_script(name, "--tasks", "gsm8k,nosuch", "--out", str(out))
    assert run.returncode != 0
    assert "unknown task(s) nosuch: use some of humaneval" in run.stderr
    assert not out.exists()  # nothing half-made


def test_replay_sampling_names_an_unknown_rule_before_loading_anything(tmp_path):
    out = tmp_path / "out"
    run = run_script("replay_sampling.py", "--rules", "sample,greedy", "--out", str(out))
    assert run.returncode != 0
    assert "--rules sample,greedy: use some of sample, typical, gumbel" in run.stderr
    assert not out.exists()


def test_accept_cost_names_an_unknown_rule_before_measuring_anything(tmp_path):
    out = tmp_path / "cost.json"
    run = run_script("accept_cost.py", "--rules", "sample,beam", "--out", str(out))
    assert run.returncode != 0
    assert "--rules sample,beam: use some of greedy, sample, typical, gumbel" in run.stderr
    assert not out.exists()


# ---- batches -----------------------------------------------------------------------------------------------

BUSY = CostSurface(
    (1, 8), (0, 4, 16), ((10.0, 10.5, 11.0), (20.0, 60.0, 140.0))
)  # nodes: free alone, dear at 8


def test_a_batch_of_one_replays_as_the_single_row_replay():
    traces, tree = synthetic_traces(), load_tree("tree_8")
    one = replay_batch(StaticPolicy(tree), traces, BUSY, 1, aware=False)
    alone = replay(StaticPolicy(tree), traces, BUSY.latency(1).ms_of)
    assert (one.tokens, one.steps) == (alone.tokens, alone.steps)
    assert one.ms == pytest.approx(alone.ms)
    assert one.to_json()["charges"]["choice"]["source"] == "none"


def test_a_batched_replay_charges_every_rows_measured_choice():
    """Each row of a batch chooses in turn: a step of n rows pays n choices on top of the surface's step."""
    traces, policy = synthetic_traces() * 3, StaticPolicy(load_tree("tree_8"))
    free = replay_batch(policy, traces, BUSY, 3, aware=False)
    charged = replay_batch(policy, traces, BUSY, 3, aware=False, choice=ChoiceCost("StaticPolicy", 0.5, 16))
    assert (charged.tokens, charged.steps) == (free.tokens, free.steps)  # steps: rows' steps
    assert charged.ms == pytest.approx(free.ms + 0.5 * free.steps)
    assert charged.to_json()["charges"]["choice"]["source"] == "measured"


def test_on_a_busy_batch_choosing_by_the_whole_step_beats_choosing_alone_and_the_step_oracle_leads():
    traces = synthetic_traces() * 8  # eight rows of the same text: one batch
    acc = fit_acceptance(traces[:1], probe_depth=3, num_heads=3)
    policy = DynamicPolicy(load_tree("tree_16"), acc, BUSY.latency(1), online=False)
    aware = replay_batch(policy, traces, BUSY, 8).tokens_per_second
    alone = replay_batch(policy, traces, BUSY, 8, aware=False).tokens_per_second
    plain = replay_batch(StaticPolicy(load_tree("chain_1").root_only()), traces, BUSY, 8).tokens_per_second
    bank = [load_tree(n) for n in ("chain_1", "tree_4", "tree_8", "tree_16")]
    hindsight = oracle_batch(bank, traces, BUSY, 8).tokens_per_second
    assert alone < plain <= aware  # alone each row takes big trees that the busy batch pays for
    assert hindsight >= aware
    # with one row the same policy takes its big trees and they pay: above plain
    assert (
        replay_batch(policy, traces[:1], BUSY, 1).tokens_per_second
        > replay_batch(StaticPolicy(bank[0].root_only()), traces[:1], BUSY, 1).tokens_per_second
    )


def test_replay_sampling_names_missing_heads_before_loading_anything(tmp_path):
    out = tmp_path / "out"
    run = run_script("replay_sampling.py", "--heads", f"hydra,{tmp_path / 'nothing'}", "--out", str(out))
    assert run.returncode != 0
    assert f"--heads {tmp_path / 'nothing'}: no heads there" in run.stderr
    assert not out.exists()
