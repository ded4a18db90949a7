"""The probe's step is the engine's (costs/probe.py), and replays charge the heads' drafting and probe at the
measured curve's share (calibration/replay.py), the constant of another machine only without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ByteTokenizer, script_module, tiny_model
from entmtp import batch as batch_mod
from entmtp import engine as engine_mod
from entmtp.accept import Sampling
from entmtp.backends.transformers import BaseModel
from entmtp.calibration.calibrate import fit_acceptance
from entmtp.calibration.replay import replay, step_ms
from entmtp.calibration.traces import load_traces
from entmtp.costs import HEADS_DRAFT_COST, CostCurve, CostsError, measure, measure_surface, priced_ms
from entmtp.costs.cache import PROBE
from entmtp.costs.probe import Probe
from entmtp.heads import HeadsConfig, random_heads
from entmtp.scheduler.policies import DynamicPolicy
from entmtp.scheduler.profiles import resolve_profile
from entmtp.tree import Tree, load_tree, with_lookup
from scheduler_helpers import synthetic_traces

ROOT = Path(__file__).resolve().parents[1]


def recorded(monkeypatch) -> dict[str, list]:
    """The engine's prepare / conclude / accept, and the batch's draft / conclude (the engine's, as batch.py
    imports them: "batch.draft", "batch.conclude"), wrapped to record what each was called with (and its
    result): the probe reaches them as module attributes, so it goes through these."""
    calls: dict[str, list] = {}

    def wrap(module, name, label):
        real = getattr(module, name)
        calls[label] = []

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            calls[label].append((args, out))
            return out

        monkeypatch.setattr(module, name, spy)

    for name in ("prepare", "conclude", "accept"):
        wrap(engine_mod, name, name)
    for name in ("draft", "conclude"):
        wrap(batch_mod, name, f"batch.{name}")
    return calls


def heads_for(model):
    heads = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=3), seed=0)
    return heads.bind(model)  # bound before probing, as the caller hands them over


@pytest.mark.parametrize("rule", ["sample", "gumbel"])
def test_a_probed_step_is_the_engines_step_under_the_generations_rule(monkeypatch, rule):
    """Every timed step went through the engine's prepare and conclude, on a DecodeState sampling by the
    asked rule, its acceptance being the engine's accept() under that rule (a probe that accepted greedily
    in its own copy, as the curves once were, records no such call), and the ms it returns are the engine's
    own clock's for that step."""
    model = tiny_model()
    heads = heads_for(model)
    calls = recorded(monkeypatch)
    probe = Probe(model, heads, (0, 1, 4), Sampling(0.7, rule))
    row = probe.row(16, probe.room(8))
    got = [probe.step(row, n) for n in (0, 4, 1, 4)]
    concluded = [out.step for _, out in calls["conclude"]]
    assert [s.tree_nodes for s in concluded] == [0, 4, 1, 4]
    assert [ms for ms, _ in got] == [priced_ms(s.seconds) for s in concluded]  # the engine's clock
    assert [draft for _, draft in got] == [1000 * s.seconds["draft"] for s in concluded]
    assert len(calls["prepare"]) == 4 and all(a[1].sampling.rule == rule for a, _ in calls["prepare"])
    rules = [args[3].rule for args, _ in calls["accept"]]
    assert len(rules) == 5 and set(rules) == {rule}  # the prefill's token and each step's


def test_a_measured_curve_and_surface_are_timed_through_the_engine(monkeypatch):
    """measure / measure_surface, end to end: every step the curve timed went through the engine's prepare and
    conclude, every batched one through the batch's own step (batch.Batch.step: its drafts, one forward_batch
    for its rows, its conclude), and the curve's key names the rule."""
    model = tiny_model()
    calls = recorded(monkeypatch)
    curve = measure(
        model, None, sizes=(0, 2), contexts=(16,), budget_s=2.0, progress=False, sampling=Sampling(0.7)
    )
    assert curve.key["acceptance"] == "sample" and curve.key["probe"] == PROBE  # the probe's version
    steps = [out.step for _, out in calls["conclude"] if out.step is not None]
    assert {s.tree_nodes for s in steps} == {0, 2} and len(calls["prepare"]) == len(steps)
    assert {args[3].rule for args, _ in calls["accept"]} == {"sample"}
    for name in ("prepare", "conclude", "accept"):
        calls[name].clear()
    batched = []  # rows per forward_batch
    real_batch = BaseModel.forward_batch
    monkeypatch.setattr(
        BaseModel,
        "forward_batch",
        lambda self, tokens, trees, kv, **kw: (
            batched.append(len(tokens)) or real_batch(self, tokens, trees, kv, **kw)
        ),
    )
    surface = measure_surface(model, None, batches=(1, 3), sizes=(0, 2), budget_s=60.0, progress=False)
    assert surface.batches == (1, 3) and set(batched) == {3}
    concluded = [out.step.tree_nodes for _, out in calls["batch.conclude"]]
    assert len(concluded) == len(calls["batch.draft"]) >= 3 * len(batched) and set(concluded) == {0, 2}
    assert not calls["prepare"]  # no step of its own: the batch's


def test_a_calibrations_bank_is_priced_by_the_probe_on_its_own_trees(monkeypatch):
    """`costs.measure_trees` (what calibrate stores as a bank's latencies): each given tree stepped by name
    through the engine's own step, a plain step without heads beside them, the ms the engine's clock priced;
    and calibration's `measure_trees` stores exactly those ms (its decodes count tokens, they time nothing)."""
    from entmtp.calibration import calibrate
    from entmtp.costs import measured

    model = tiny_model()
    heads = heads_for(model)
    bank = [load_tree("chain_1"), Tree("wide", ((0,), (1,), (0, 0)))]
    calls = recorded(monkeypatch)
    ms = measured.measure_trees(model, heads, bank, context=16, budget_s=0.0)
    assert set(ms) == {"none", "chain_1", "wide"}
    timed = [out.step for _, out in calls["conclude"] if out.step is not None]
    nodes = sorted({s.tree_nodes for s in timed})
    assert nodes == [0, 1, 3]  # each tree itself, not a synthetic one of its size
    per_tree = {n: [priced_ms(s.seconds) for s in timed if s.tree_nodes == n] for n in nodes}
    for name, n in (("none", 0), ("chain_1", 1), ("wide", 3)):
        rounds = per_tree[n][-measured.MIN_REPS :]  # the timed rounds (budget 0: MIN_REPS of them)
        assert ms[name] == pytest.approx(sorted(rounds)[len(rounds) // 2])
    with pytest.raises(CostsError, match="no tree 5: it steps 2, chain_1, wide"):
        Probe(model, heads, (2,), trees=bank).step(None, 5)  # neither a size nor a name it holds

    priced = {"none": 3.0, "chain_1": 5.0, "wide": 11.0}
    monkeypatch.setattr(measured, "measure_trees", lambda *a, **k: priced)
    from scheduler_helpers import TINY

    got = calibrate.measure_trees(model, ByteTokenizer(), heads, bank, [[1, 2, 3, 4]], TINY)
    assert {k: m.ms_per_step for k, m in got.items()} == priced
    assert got["wide"].nodes == 3 and got["wide"].measured_tokens_per_step >= 1.0


def test_a_curve_probed_without_heads_saves_no_drafting_and_a_profiles_latencies_split_none():
    plain = CostCurve((0, 4), (10.0, 20.0), (0.0, 0.0), key={"heads": None}, source="probe")
    assert plain.draft_share == 0.0  # measured: nothing drafts, so dropping the heads saves nothing
    assert CostCurve.from_latency([0, 4], [10.0, 20.0], "profile").draft_share is None


# ---- replays: the measured drafting share -----------------------------------------------------------------

MEASURED = CostCurve(
    (0, 1, 4), (10.0, 14.0, 20.0), (0.0, 3.0, 3.0), key={"heads": {"kind": "hydra"}}, source="probe"
)  # drafting: 3 ms of a 10 ms plain step, 0.3 plain steps (another machine's constant says 0.11)


def test_replays_price_lookup_only_steps_and_unused_probes_at_the_measured_share():
    prices = step_ms(MEASURED)
    lookup = with_lookup(Tree.root_only(), 4, 1)  # four lookup nodes, no head node
    assert prices(lookup) == pytest.approx(20.0 - 3.0)  # the heads drafted nothing
    assert prices(lookup, probed=True) == pytest.approx(20.0)  # ... but their probe was computed
    assert prices(Tree.root_only(), probed=True) == pytest.approx(13.0)
    assert prices(Tree.root_only()) == pytest.approx(10.0)
    assert prices(load_tree("chain_1")) == pytest.approx(14.0)  # a heads' tree: its drafting is in its ms
    assert "measured" in prices.note and "3.00 ms" in prices.note
    fallback = step_ms(MEASURED.latency())  # no measured curve: another machine's constant, and it says so
    assert fallback(lookup) == pytest.approx(20.0 - HEADS_DRAFT_COST * 10.0)
    assert "HEADS_DRAFT_COST" in fallback.note and "no measured curve" in fallback.note


def test_a_replay_charges_the_probe_of_every_step_that_drafted_nothing_from_it():
    """A dynamic policy on a curve where every tree loses reads the heads' probe and takes plain steps: the
    engine pays for each probe, so the replay does, at the measured share, and says so in its output."""
    dear = CostCurve((0, 1, 4, 64), (10.0, 40.0, 80.0, 900.0), (0.0, 3.0, 3.0, 3.0), key={"h": 1})
    traces = synthetic_traces()
    acceptance = fit_acceptance(traces[:1], probe_depth=3, num_heads=3)
    policy = DynamicPolicy(load_tree("tree_16"), acceptance, dear.latency(), online=False)
    r = replay(policy, traces, step_ms(dear))
    assert r.usage and set(r.usage) == {Tree.root_only().name}  # plain steps only, each after a probe
    assert r.ms == pytest.approx(r.steps * (10.0 + 3.0))  # uncharged, they cost 10 ms each
    assert "measured" in r.to_json()["pricing"]


def test_a_probed_generation_runs_past_the_models_end_of_text_token():
    """Random context makes a model write anything, its end-of-text token included: the probe's generation
    does not end there (its steps would be cut short, and the probe fail), whatever the model's config says."""
    first = Probe(tiny_model(), None, (0, 2))
    state, _, _ = row = first.row(16, first.room(4))
    first.step(row, 2)
    eos = state.out[-1]  # a token this row writes: made the end-of-text token of the same model below
    probe = Probe(tiny_model(eos_token_id=eos), None, (0, 2))
    row = probe.row(16, probe.room(4))
    assert [probe.step(row, 2)[0] > 0 for _ in range(3)] == [True] * 3


def test_the_published_replays_on_other_machines_curves_charge_each_curves_own_drafting_share():
    """scripts/machine_curves.py and replay_sampling.py publish replays on several machines' curves: a curve
    that measured its heads' drafting (a step-costs table) prices lookup-only steps and unused probes by it,
    not by the constant of another machine, and the result says where each charge came from."""
    script = script_module("machine_curves.py")
    profile = resolve_profile("mixed", "hydra")
    traces = load_traces(profile)[:4]
    table = CostCurve.from_step_costs(ROOT / "tests/data/machines/avx512bf16-bfloat16.json")
    measured = script.replayed(profile, traces, table)["charges"]
    assert measured["drafting"]["source"] == "measured"
    assert measured["drafting"]["ms"] == pytest.approx(table.draft_share * table.plain_ms)
    sampling = script_module("replay_sampling.py")._replay_methods(
        profile, "greedy", traces[:1], table, "sample"
    )
    for name, r in sampling.items():  # scripts/replay_sampling.py's replays on the same curves
        assert r["charges"]["drafting"]["source"] == "measured", name
    lat = profile.latency.model()
    stored = script.replayed(profile, traces, CostCurve.from_latency(list(lat.nodes), list(lat.ms), "stored"))
    assert stored["charges"]["drafting"]["source"] == "constant"  # no split stored: another machine's, said


def test_every_curve_the_published_replays_use_names_its_machine_and_the_h200_its_drafting():
    """machine_curves.py and replay_sampling.py price replays on other machines' curves: each curve carries the
    record of the machine it was measured on, and the H200's (its step-costs rows time the drafting) prices
    lookup-only steps and unused probes by its own share, not by another machine's constant."""
    from entmtp.machine import describe_record

    curves = script_module("machine_curves.py").shared_curves()
    said = {name: describe_record(c.machine) for name, c in curves.items()}
    assert said["avx2 bf16"].endswith("(? cores, 2 CPUs, 2 threads; avx2, fma)")
    assert said["avx512 bf16"].endswith("avx2, fma, avx512f, avx512_bf16)")
    assert said["h200 graphs"] == "NVIDIA H200 (driver unknown, CUDA unknown)"
    assert not any(s.startswith("machine unknown") for s in said.values())
    h200 = curves["h200 graphs"]
    # its draft phase: 0.39, 0.52 and 0.87 ms beside a 3.19 ms plain step (median 0.52)
    assert h200.draft_share == pytest.approx(0.52 / 3.19, abs=0.005)
    assert step_ms(h200).charges["drafting"]["source"] == "measured"


def test_the_replays_cached_only_mode_refuses_to_measure_and_says_what_is_missing(tmp_path, monkeypatch):
    """--cached-only: the published replays run on a busy machine, so they may read this machine's curve and
    choice costs from the cache but never time them; a missing one ends the script, named, before any figure."""
    import argparse

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    model = tiny_model()
    heads = random_heads(HeadsConfig.for_model(model, "hydra", 2), seed=0)
    script = script_module("replay_policies.py")
    monkeypatch.setattr(script, "costs_for", lambda *a, **k: pytest.fail("measured a curve"))
    with pytest.raises(SystemExit, match="this machine's cost curve with hydra is not cached: run this"):
        script._here(model, heads, "hydra", argparse.Namespace(cached_only=True))
    import entmtp.model
    import entmtp.shipped

    monkeypatch.setattr(entmtp.model, "load_model", lambda dtype: (model, None))  # the tiny model stands in
    monkeypatch.setattr(entmtp.shipped, "resolve_heads", lambda kind, m: heads)
    curves = script_module("machine_curves.py")
    monkeypatch.setattr(curves, "costs_for", lambda *a, **k: pytest.fail("measured a curve"))
    with pytest.raises(SystemExit, match="bfloat16 cost curve with the hydra heads is not in the cost cache"):
        curves.here_curves("hydra", cached_only=True)
