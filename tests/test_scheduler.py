"""The scheduler: search on known acceptance, exact simulation, policies (lossless), hysteresis, oracle,
profile files and their errors."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.calibration.calibrate import CalibrationSettings, build_profile, fit_acceptance
from entmtp.calibration.replay import oracle, replay
from entmtp.calibration.search import PathCounts, acceptance_frontier, grow, simulate
from entmtp.calibration.traces import MISS, TOPK, Trace, load_traces, save_traces, trace_generation
from entmtp.costs import CostCurve
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, Probe, random_heads
from entmtp.lookup import Lookup
from entmtp.policy import StaticPolicy
from entmtp.records import Step, StepContext
from entmtp.scheduler.hybrid import HybridPolicy
from entmtp.scheduler.policies import (
    AcceptanceModel,
    BinaryPolicy,
    CostPolicy,
    DynamicPolicy,
    LadderPolicy,
    LatencyModel,
    OnlineCalibration,
)
from entmtp.scheduler.profiles import ProfileError, load_profile
from entmtp.tree import Tree, load_tree

# ---- synthetic traces: heads with known per-rank accuracies ------------------------------------------------

RANK_P = (0.5, 0.2, 0.1)  # P(the right token is at rank r) at every depth; 0.2 of the mass misses


def synthetic_traces(depth: int = 3, scale: int = 1000) -> list[Trace]:
    """Positions whose rank vectors occur exactly in proportion to the product of RANK_P (independent
    depths): every path's value is known in closed form."""
    rows = []
    options = [*range(len(RANK_P)), MISS]
    probs = [*RANK_P, 1 - sum(RANK_P)]
    for combo in itertools.product(range(len(options)), repeat=depth):
        p = math.prod(probs[i] for i in combo)
        rows += [[options[i] for i in combo]] * round(p * scale)
    ranks = torch.tensor(rows, dtype=torch.int64)
    n = len(rows)
    probe = torch.full((n, depth, TOPK), -20.0)
    raw = torch.zeros(n, 4)
    return [Trace(prompt_len=1, length=n + 1, ranks=ranks, probe=probe, raw=raw)]


def path_value(path) -> float:
    return math.prod(RANK_P[r] for r in path)


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


# ---- exact simulation of real decodes -----------------------------------------------------------------------


def fitted_heads(kind: str, model, tokens: list[int], steps: int = 300):
    """Random heads overfitted to one greedy sequence of the tiny model, so they accept often on it."""
    cfg = HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=1, init="random").bind(model)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        feats = heads.features(hidden, ids)
        loss = 0.0
        for k, f in enumerate(feats, start=1):
            logits = heads.project(k - 1, f[0, : -k - 1])
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, k + 1 :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.requires_grad_(False)


@pytest.fixture(scope="module")
def fitted():
    model = tiny_model("llama", seed=11)
    ids = list(range(60, 76))
    ref = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=48).token_ids
    return model, ids, ref, {k: fitted_heads(k, model, ids + ref) for k in ("medusa", "hydra")}


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_simulation_reproduces_real_decodes_step_for_step(fitted, kind):
    model, ids, ref, heads = fitted
    engine = Engine(model, ByteTokenizer(), heads=heads[kind], tree="chain_1")
    trace = trace_generation(engine.base, heads[kind], ids + ref, len(ids))
    accepted_somewhere = False
    for name in ("chain_1", "chain_4", "tree_4", "tree_16", "mc_sim_7b_63"):
        tree = load_tree(name)
        r = Engine(model, ByteTokenizer(), heads=heads[kind], tree=tree).generate(ids, max_new_tokens=48)
        assert r.token_ids == ref
        sim = simulate(tree, [trace])
        assert (sim.steps, sim.tokens) == (r.num_steps, len(ref) - 1), name
        accepted_somewhere |= any(s.accepted >= 2 for s in r.steps)
    assert accepted_somewhere  # the fitted heads make multi-draft steps: the comparison has teeth


# ---- policies: lossless, whatever they choose ---------------------------------------------------------------


def small_acceptance(depth: int = 4) -> AcceptanceModel:
    """Two step contexts (head 1 unsure / sure), three probability bins."""
    ranks = tuple(
        (tuple(0.3 / (r + 1) for r in range(TOPK)), tuple(0.7 / (r + 1) for r in range(TOPK)))
        for _ in range(depth)
    )
    rates = tuple(((0.02, 0.2, 0.6), (0.05, 0.3, 0.9)) for _ in range(depth))
    return AcceptanceModel((0.0, 0.1, 0.5, 1.0), (0.0, 0.5, 1.0), rates, ranks)


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
    r = Engine(model, ByteTokenizer(), heads=heads[kind], tree=policy).generate(ids, max_new_tokens=48)
    assert r.token_ids == ref
    assert all(s.signals for s in r.steps)  # what the policy read is recorded per step


def test_dynamic_policy_switches_trees_and_stays_lossless(fitted):
    model, ids, ref, heads = fitted
    policy = DynamicPolicy(load_tree("mc_sim_7b_63"), small_acceptance(), LatencyModel([0, 63], [10.0, 13.0]))
    for kind in ("medusa", "hydra"):
        r = Engine(model, ByteTokenizer(), heads=heads[kind], tree=policy).generate(ids, max_new_tokens=48)
        assert r.token_ids == ref
        assert len({s.tree_nodes for s in r.steps}) >= 3  # many subtree sizes: switching is exercised


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_probe_reuse_drafts_the_same_tokens(kind):
    model = tiny_model("llama", seed=3)
    heads = random_heads(HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256), init="random")
    heads.bind(model)
    heads.reset()
    heads.extend(torch.randn(3, 64))
    root = torch.tensor([7])
    master = load_tree("mc_sim_7b_63")
    probe = heads.probe(master, root)
    assert probe.depth == (1 if kind == "hydra" else 4)
    for name in ("chain_1", "tree_8", "tree_16", "mc_sim_7b_63"):
        tree = load_tree(name)
        a, b = heads.draft(tree, root), heads.draft(tree, root, probe)
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logprobs, b.logprobs)


def ctx_with(chain: float, step: int = 0) -> StepContext:
    return StepContext(step, 10 + step, 100, None, raw_signals=[1.0, 0.5, chain, 0.4])


def test_hysteresis_never_flips_inside_its_band():
    small, large = load_tree("chain_1"), load_tree("tree_16")
    p = BinaryPolicy(small, large, "chain", tau_off=0.3, tau_on=0.6)
    p.reset()
    assert p.choose(ctx_with(0.1)) is small
    inside = [0.31, 0.59, 0.45, 0.3, 0.5999, 0.42] * 5
    assert all(p.choose(ctx_with(s, i)) is small for i, s in enumerate(inside))
    assert p.choose(ctx_with(0.6)) is large  # reaching tau_on switches up ...
    assert all(p.choose(ctx_with(s, i)) is large for i, s in enumerate(inside))  # ... and the band holds it
    assert p.choose(ctx_with(0.2999)) is small  # below tau_off: down


def test_ladder_maps_signal_to_trees_by_size():
    trees = [load_tree("tree_16"), load_tree("chain_1"), load_tree("tree_4")]
    p = LadderPolicy(trees, "chain", [0.2, 0.5])
    got = [p.choose(ctx_with(s)).name for s in (0.0, 0.19, 0.2, 0.49, 0.5, 0.9)]
    assert got == ["chain_1", "chain_1", "tree_4", "tree_4", "tree_16", "tree_16"]


def test_policy_arguments_are_checked():
    from entmtp.errors import EntMTPError

    a, b = load_tree("chain_1"), load_tree("tree_4")
    with pytest.raises(EntMTPError, match="tau_off <= tau_on"):
        BinaryPolicy(a, b, "chain", 0.6, 0.3)
    with pytest.raises(EntMTPError, match="unknown signal 'vibes'"):
        BinaryPolicy(a, b, "vibes", 0.3, 0.6)
    with pytest.raises(EntMTPError, match="strictly increasing"):
        LadderPolicy([a, b, load_tree("tree_8")], "chain", [0.5, 0.2])
    with pytest.raises(EntMTPError, match="one positive step latency per bank tree"):
        CostPolicy([a, b], small_acceptance(), [1.0])


# ---- replay and oracle --------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("online", [False, True])
def test_replay_of_scheduled_hybrids_is_the_real_decode_step_for_step(fitted, kind, online):
    """The dynamic policy with a prompt-lookup branch, replayed from the trace of the same greedy output, takes
    the very steps the engine takes: the same trees (lookup nodes pruned alike), accepted drafts and tokens."""
    model, ids, ref, heads = fitted
    lat = LatencyModel([0, 1, 4, 63], [10.0, 14.0, 20.0, 60.0])  # costly nodes: trees of every kind

    costs = CostCurve.from_latency(list(lat.nodes), list(lat.ms), "test")  # what the hybrid costs steps by

    def policy():
        return DynamicPolicy(load_tree("mc_sim_7b_63"), small_acceptance(), lat, online=online)

    engine = Engine(model, ByteTokenizer(), heads=heads[kind], tree=policy(), lookup=Lookup(), costs=costs)
    real = engine.generate(ids, max_new_tokens=48)
    assert real.token_ids == ref
    trace = trace_generation(engine.base, heads[kind], ids + ref, len(ids))
    steps: list = []
    replay(HybridPolicy(policy(), Lookup(), lat), [trace], lambda t: 10.0, record=steps)
    got = [(s.tree, s.tree_nodes, s.lookup_nodes, s.tokens) for s in steps]
    want = [(s.tree, s.tree_nodes, s.lookup_nodes, s.tokens) for s in real.steps]
    assert got[:-1] == want[:-1]  # the last step: the engine cuts it at max_new_tokens
    assert [s.sources for s in steps[:-1]] == [s.sources for s in real.steps[:-1]]
    assert any(s.lookup_nodes for s in real.steps)  # the check has teeth: lookup branches, and heads' drafts
    assert any(s.accepted >= 2 and not s.lookup_nodes for s in real.steps)  # accepted without them


def test_a_lookup_replay_needs_the_traces_tokens():
    tr = synthetic_traces()[0]
    with pytest.raises(EntMTPError, match="greedy traces with their tokens"):
        replay(HybridPolicy(StaticPolicy(load_tree("tree_4")), Lookup()), [tr], lambda t: 10.0)


# ---- online recalibration of the acceptance model ------------------------------------------------------------


def _probe_step(policy, right: bool, first: int = 7):
    """One step of `policy` with a probe whose rank-0 depth-1 candidate is `first`; the base model's token is
    `first` when `right`, else a token no head proposed."""
    depth = 1
    lp = torch.log(torch.tensor([[0.6, 0.2, 0.1] + [0.01] * (TOPK - 3)] * depth))
    tokens = torch.tensor([[first, first + 1, first + 2] + [-1] * (TOPK - 3)] * depth)
    ctx = StepContext(0, 10, 100, None, probe=Probe(tokens, lp))
    tree = policy.choose(ctx)
    emitted = [first if right else 999]
    policy.observe(Step(tree.name, tree.num_nodes, 0, 1, emitted))
    return tree


def test_online_calibration_shrinks_trees_when_the_heads_keep_missing_and_grows_them_back():
    lat = LatencyModel([0, 1, 4, 63], [10.0, 10.5, 11.0, 13.0])
    master = load_tree("mc_sim_7b_63")
    fixed = DynamicPolicy(master, small_acceptance(), lat, online=False)
    online = DynamicPolicy(master, small_acceptance(), lat)
    for p in (fixed, online):
        p.reset()
    start = _probe_step(online, right=False).num_nodes
    assert start == _probe_step(fixed, right=False).num_nodes  # a fresh generation: the calibrated model
    for _ in range(40):
        missed, same = _probe_step(online, right=False), _probe_step(fixed, right=False)
    assert online.calibration.scale < 0.2 and online.last_signals["calibration"] < 0.2
    assert missed.num_nodes < same.num_nodes == start
    for _ in range(60):  # right again, as often as the model predicts (its depth-1 nodes sum to 1 here)
        grown = _probe_step(online, right=True)
    assert online.calibration.scale > 0.8
    assert grown.num_nodes == start
    online.reset()
    assert online.calibration.scale == 1.0


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


def test_fitted_acceptance_is_monotone():
    acc = fit_acceptance(synthetic_traces(), probe_depth=3, num_heads=3)
    for depth in acc.rates:
        for row in depth:
            assert list(row) == sorted(row)
    for depth in acc.rank_rates:
        for row in depth:
            assert list(row) == sorted(row, reverse=True)
    # the synthetic probe carries no information: every context is the overall rate RANK_P[0]
    assert acc.rank_rates[0][0][0] == pytest.approx(0.5, abs=0.01)
    assert AcceptanceModel.from_json(json.loads(json.dumps(acc.to_json()))) == acc


# ---- profiles: build, round-trip, policies from them, and every bad file ------------------------------------

TINY = CalibrationSettings(max_new_tokens=24, latency_prompts=1, latency_tokens=12, latency_repeats=1)


@pytest.fixture(scope="module")
def tiny_profile(fitted, tmp_path_factory):
    model, ids, ref, heads = fitted
    prompts = [ids, list(range(30, 44)), list(range(90, 101))]
    profile, traces = build_profile(
        model,
        ByteTokenizer(),
        heads["hydra"],
        heads_name="tiny-hydra",
        task="tiny",
        prompts=prompts,
        settings=TINY,
        log=lambda *a: None,
    )
    path = tmp_path_factory.mktemp("profiles") / "tiny.json"
    save_traces(profile, path, traces).save(path)
    return model, heads, path, traces


def test_profile_round_trips(tiny_profile):
    model, heads, path, traces = tiny_profile
    p = load_profile(path)
    assert p.to_json() == json.loads(path.read_text())
    assert p.task == "tiny" and p.best_tree().name in [t.name for t in p.bank()]
    sizes = [t.num_nodes for t in p.bank()]
    assert sizes == sorted(sizes)
    for a, b in zip(load_traces(p), traces, strict=True):
        assert torch.equal(a.ranks, b.ranks) and torch.allclose(a.raw, b.raw)
        assert torch.equal(a.tokens, b.tokens)  # what lookup replays copy from
        assert torch.allclose(a.probe, b.probe, atol=1e-2)  # stored as float16
    p.check(model, heads["hydra"], warn_hardware=False)
    m = p.mode("greedy")
    assert {"static", "binary", "ladder", "cost", "dynamic", "oracle"} <= set(m.replay)
    assert (
        m.replay["oracle"].tokens_per_second
        >= max(m.replay[k].tokens_per_second for k in ("static", "binary", "ladder", "cost")) - 1e-9
    )


@pytest.mark.parametrize("name", ["static", "binary", "ladder", "cost", "dynamic"])
def test_policies_from_a_profile_are_lossless(tiny_profile, fitted, name):
    model, heads, path, _ = tiny_profile
    _, ids, ref, _ = fitted
    policy = load_profile(path).policy(name)
    r = Engine(model, ByteTokenizer(), heads=heads["hydra"], tree=policy).generate(ids, max_new_tokens=48)
    assert r.token_ids == ref


def _copy(path, tmp_path, edit=None, text=None):
    import shutil

    out = tmp_path / "p.json"
    shutil.copy(path.with_name(path.stem + ".traces.safetensors"), tmp_path / "p.traces.safetensors")
    data = json.loads(path.read_text())
    if edit:
        edit(data)
    out.write_text(text if text is not None else json.dumps(data))
    return out


def test_bad_profile_files_get_clear_errors(tiny_profile, tmp_path):
    model, heads, path, _ = tiny_profile
    with pytest.raises(ProfileError, match="does not exist.*entmtp calibrate"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="corrupt or truncated"):
        load_profile(_copy(path, tmp_path, text=path.read_text()[: len(path.read_text()) // 2]))
    with pytest.raises(ProfileError, match="not an entmtp scheduler profile"):
        load_profile(_copy(path, tmp_path, text='{"hello": 1}'))
    with pytest.raises(ProfileError, match="format version 99"):
        load_profile(_copy(path, tmp_path, edit=lambda d: d.update(version=99)))
    with pytest.raises(ProfileError, match="lacks latency"):
        load_profile(_copy(path, tmp_path, edit=lambda d: d.pop("latency")))
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(
            _copy(path, tmp_path, edit=lambda d: d["modes"]["greedy"]["master"].update(paths=[[0, 0]]))
        )


def test_profile_for_other_model_or_heads_is_refused(tiny_profile, tmp_path):
    model, heads, path, _ = tiny_profile
    p = load_profile(path)
    with pytest.raises(ProfileError, match="made for other heads.*entmtp calibrate"):
        p.check(model, heads["medusa"], warn_hardware=False)
    other = tiny_model("llama", seed=12)
    with pytest.raises(ProfileError, match="made for base model.*embedding_sha256"):
        p.check(other, heads["hydra"], warn_hardware=False)
    bigger = tiny_model("llama", seed=11, hidden_size=32, intermediate_size=64)
    with pytest.raises(ProfileError, match="hidden_size 64.*hidden_size 32"):
        p.check(bigger, heads["hydra"], warn_hardware=False)


def test_profile_trees_that_do_not_fit_the_heads_are_refused(tiny_profile, tmp_path):
    model, heads, path, _ = tiny_profile
    deep = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]

    def edit(d):
        d["modes"]["greedy"]["master"]["paths"] = deep

    with pytest.raises(ProfileError, match="depth 5.*only 4 tokens ahead"):
        load_profile(_copy(path, tmp_path, edit=edit)).check(model, heads["hydra"], warn_hardware=False)


def test_profile_from_other_hardware_warns_to_remeasure(tiny_profile, tmp_path):
    model, heads, path, _ = tiny_profile
    p = load_profile(
        _copy(path, tmp_path, edit=lambda d: d["hardware"].update(name="NVIDIA H200", device="cuda"))
    )
    with pytest.warns(UserWarning, match="other hardware.*calibrate --latency-only"):
        p.check(model, heads["hydra"])


def test_tampered_traces_are_refused(tiny_profile, tmp_path):
    _, _, path, _ = tiny_profile
    copy = _copy(path, tmp_path)
    side = tmp_path / "p.traces.safetensors"
    side.write_bytes(side.read_bytes()[:-10])
    with pytest.raises(ProfileError, match="does not match its profile"):
        load_traces(load_profile(copy))


def test_interrupted_save_leaves_no_half_written_file(tiny_profile, tmp_path, monkeypatch):
    import entmtp.scheduler.profiles as profiles

    _, _, path, traces = tiny_profile
    p = load_profile(path)
    target = tmp_path / "new.json"

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(profiles, "write_text_atomic", boom)
    with pytest.raises(KeyboardInterrupt):
        save_traces(p, target, traces).save(target)
    assert not target.exists()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temp files left behind


def test_latency_only_keeps_the_traces(tiny_profile, fitted):
    model, heads, path, traces = tiny_profile
    old = load_profile(path)
    ids = old.calibration.latency_prompt_ids
    new, kept = build_profile(
        model,
        ByteTokenizer(),
        heads["hydra"],
        heads_name="tiny-hydra",
        task="tiny",
        prompts=ids,
        settings=TINY,
        traces=load_traces(old),
        log=lambda *a: None,
    )
    stats = ("name", "paths", "mean_accepted_all_positions", "tokens_per_step_simulated")
    same = [[getattr(e, k) for k in stats] for e in new.mode().acceptance_frontier]
    assert same == [
        [getattr(e, k) for k in stats] for e in old.mode().acceptance_frontier
    ]  # the same statistics
    assert new.latency.trees.keys() == old.latency.trees.keys()


# ---- typical acceptance (T > 0): pass masks ----------------------------------------------------------------


def typical_trace(rows, masks) -> Trace:
    n = len(rows)
    return Trace(
        1,
        n + 1,
        torch.tensor(rows),
        torch.zeros(n, len(rows[0]), TOPK),
        torch.zeros(n, 4),
        torch.tensor(masks),
    )


def test_typical_acceptance_takes_the_deepest_passing_node_below_the_trajectory():
    from entmtp.calibration.search import accepted_length

    tree = frozenset(load_tree("mc_sim_7b_63").paths)
    # depth 1: ranks 0 and 2 pass, the trajectory went through rank 2; depth 2 below it: rank 0 passes
    assert accepted_length(tree, [2, 0, 5], [0b101, 0b1, 0]) == 2  # (2,) and (2, 0) are in the tree
    assert (
        accepted_length(frozenset({(0,), (1,)}), [2, 0, 5], [0b101, 0b1, 0]) == 1
    )  # (0,) passes; (2,) absent
    assert accepted_length(tree, [2, 0, 5], [0b001, 0b1, 0]) == 1  # the trajectory's rank 2 did not pass
    assert (
        accepted_length(tree, [MISS, 0, 0], [0b010, 0b1, 0b1]) == 1
    )  # off-trajectory passes count one level
    assert accepted_length(tree, [0, 0, 0], [0, 0b1, 0b1]) == 0


def test_typical_growth_counts_a_depth_once_however_many_siblings_pass():
    from entmtp.calibration.search import PassScores

    # every position: ranks 0 and 1 pass at depth 1 (trajectory rank 0); rank 0 passes at depth 2
    tr = typical_trace([[0, 0]] * 10, [[0b11, 0b1]] * 10)
    scores = PassScores([tr])
    g = grow(scores, max_depth=2, max_nodes=5)
    assert g.order == ((0,), (0, 0))  # (1,) would add nothing: depth 1 is already accepted everywhere
    assert scores.mean_accepted(g.order) == 2.0
    assert simulate(Tree("t", g.order), [tr]).tokens_per_step == pytest.approx(9 / 3)  # 3 steps of 3, 3, 3


def test_greedy_traces_score_the_same_through_pass_masks():
    """A greedy trace is a typical trace whose only passing rank is the trajectory's: both scorers agree."""
    from entmtp.calibration.search import PassScores

    greedy = synthetic_traces(depth=2, scale=200)[0]
    bits = torch.where(
        greedy.ranks < MISS, 1 << greedy.ranks.clamp(max=TOPK - 1), torch.zeros_like(greedy.ranks)
    )
    as_typical = Trace(greedy.prompt_len, greedy.length, greedy.ranks, greedy.probe, greedy.raw, bits)
    a, b = grow(PathCounts([greedy]), 2, 12), grow(PassScores([as_typical]), 2, 12)
    assert a.order == b.order
    tree = Tree("t", a.order)
    assert simulate(tree, [greedy]) == simulate(tree, [as_typical])


def test_typical_section_from_sampled_generations(tiny_profile, fitted, tmp_path):
    from entmtp.calibration.calibrate import add_typical
    from entmtp.calibration.traces import TYPICAL, generate_traces

    model, heads, path, greedy = tiny_profile
    _, ids, _, _ = fitted
    engine = Engine(model, ByteTokenizer(), heads=heads["hydra"], tree="tree_8")
    typical, outs = generate_traces(engine, heads["hydra"], [ids, list(range(30, 44))], 24, sampling=TYPICAL)
    assert all(t.passmask is not None for t in typical)
    profile = add_typical(load_profile(path), heads["hydra"], typical, TINY, log=lambda *a: None)
    out = tmp_path / "typ.json"
    save_traces(profile, out, greedy, typical).save(out)
    loaded = load_profile(out)
    assert loaded.mode_for(0.7) == "typical" and loaded.mode_for(0.0) == "greedy"
    back = load_traces(loaded, "typical")
    assert all(torch.equal(a.passmask, b.passmask) for a, b in zip(back, typical, strict=True))
    loaded.check(model, heads["hydra"], warn_hardware=False)
    bank = {t.name for t in loaded.bank("typical")} | {"master"}
    for name in ("static", "cost", "dynamic"):
        policy = loaded.policy(name, "typical")
        r = Engine(model, ByteTokenizer(), heads=heads["hydra"], tree=policy).generate(
            ids, max_new_tokens=24, temperature=0.7, acceptance="typical", seed=3
        )
        assert len(r.token_ids) == 24
        if name != "dynamic":
            assert {s.tree for s in r.steps} <= bank


def test_replay_policies_script_names_an_unknown_task_before_loading_anything(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "replay_policies.py"
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(script), "--tasks", "gsm8k,nosuch", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "unknown task(s) nosuch: use some of humaneval" in run.stderr
    assert not out.exists()  # nothing half-made
