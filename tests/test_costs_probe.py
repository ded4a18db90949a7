"""The probe's step is the engine's (costs/probe.py)."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from entmtp import engine as engine_mod
from entmtp.accept import Sampling
from entmtp.cache import BaseModel
from entmtp.costs import CostCurve, measure, measure_surface, priced_ms
from entmtp.costs.probe import Probe
from entmtp.heads import HeadsConfig, random_heads


def recorded(monkeypatch) -> dict[str, list]:
    """The engine's prepare / conclude / accept, wrapped to record what each was called with (and conclude's
    events): the probe reaches them as the engine's module attributes, so it goes through these."""
    calls: dict[str, list] = {"prepare": [], "conclude": [], "accept": [], "forward_batch": []}

    def wrap(name):
        real = getattr(engine_mod, name)

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            calls[name].append((args, out))
            return out

        monkeypatch.setattr(engine_mod, name, spy)

    for name in ("prepare", "conclude", "accept"):
        wrap(name)
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
    """measure / measure_surface, end to end: every step each timed went through the engine's prepare and
    conclude, the batched ones with one forward_batch for their rows, and the curve's key names the rule."""
    model = tiny_model()
    calls = recorded(monkeypatch)
    curve = measure(
        model, None, sizes=(0, 2), contexts=(16,), budget_s=2.0, progress=False, sampling=Sampling(0.7)
    )
    assert curve.key["acceptance"] == "sample" and curve.key["probe"] == 2
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
        lambda self, tokens, trees, kv: batched.append(len(tokens)) or real_batch(self, tokens, trees, kv),
    )
    surface = measure_surface(model, None, batches=(1, 3), sizes=(0, 2), budget_s=2.0, progress=False)
    assert surface.batches == (1, 3) and set(batched) == {3}
    concluded = [out.step.tree_nodes for _, out in calls["conclude"]]
    assert len(concluded) == len(calls["prepare"]) >= 3 * len(batched) and set(concluded) == {0, 2}


def test_a_curve_probed_without_heads_saves_no_drafting_and_a_profiles_latencies_split_none():
    plain = CostCurve((0, 4), (10.0, 20.0), (0.0, 0.0), key={"heads": None}, source="probe")
    assert plain.draft_share == 0.0  # measured: nothing drafts, so dropping the heads saves nothing
    assert CostCurve.from_latency([0, 4], [10.0, 20.0], "profile").draft_share is None
