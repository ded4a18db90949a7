"""The policy's choice at this machine's measured cost: timed in the engine's own steps, cached per policy
(costs/choice.py), and charged on every replayed step of that policy (calibration/replay.py), the replay's JSON
saying where each charge came from."""

from __future__ import annotations

import json
import time

import pytest

from conftest import script_module, tiny_model
from entmtp.calibration.replay import oracle, replay, step_ms
from entmtp.calibration.traces import load_traces
from entmtp.costs import ChoiceCost, CostCurve
from entmtp.costs import choice as choice_mod
from entmtp.policy import StaticPolicy
from entmtp.scheduler.profiles import resolve_profile
from entmtp.tree import Tree, load_tree
from scheduler_helpers import synthetic_traces

MEASURED = CostCurve(
    (0, 1, 4), (10.0, 14.0, 20.0), (0.0, 3.0, 3.0), key={"heads": {"kind": "hydra"}}, source="probe"
)  # this machine's probe curve: plain 10 ms, drafting 3 ms


# ---- replays charge the choice ------------------------------------------------------------------------------


def test_a_replay_charges_every_step_the_policys_measured_choice():
    """The same replay with a measured 2.5 ms choice: the same steps, each 2.5 ms dearer, so tokens/s drops by
    exactly that; the JSON names each charge's source, and without a measurement says the choice is free."""
    traces, policy = synthetic_traces(), StaticPolicy(load_tree("chain_2"))
    prices = step_ms(MEASURED)
    free = replay(policy, traces, prices)
    charged = replay(policy, traces, prices.with_choice(ChoiceCost("StaticPolicy", 2.5, 16)))
    assert (charged.steps, charged.tokens, charged.usage) == (free.steps, free.tokens, free.usage)
    assert charged.ms == pytest.approx(free.ms + 2.5 * free.steps)
    assert charged.tokens_per_second == pytest.approx(1000 * free.tokens / (free.ms + 2.5 * free.steps))
    assert charged.tokens_per_second < free.tokens_per_second

    said = charged.to_json()["charges"]
    assert said["choice"]["source"] == "measured" and said["choice"]["ms"] == 2.5
    assert said["step"]["source"] == "measured" and said["drafting"]["source"] == "measured"
    assert free.to_json()["charges"]["choice"] == {
        "source": "none",
        "ms": 0.0,
        "note": "choice not charged: no measurement",
    }
    given = replay(policy, traces, step_ms(MEASURED.latency())).to_json()["charges"]  # a profile's latencies
    assert given["step"]["source"] == "constant" and given["drafting"]["source"] == "constant"
    assert given["choice"]["source"] == "none"


def test_the_oracle_chooses_in_hindsight_and_is_charged_no_choice():
    traces, bank = synthetic_traces(), [load_tree("chain_1"), load_tree("chain_2")]
    prices = step_ms(MEASURED)
    charged = oracle(bank, traces, prices.with_choice(ChoiceCost("StaticPolicy", 2.5, 16)))
    assert charged.ms == pytest.approx(oracle(bank, traces, prices).ms)
    assert charged.to_json()["charges"]["choice"]["source"] == "none"


def test_replay_policies_prices_every_method_on_this_machines_curve_and_choice_when_asked():
    """scripts/replay_policies.py's published figures: by default on the profile's stored latencies (another
    machine's, and said so); with --this-machine every policy's steps on the measured curve, its drafting
    share and the policy's own measured choice (the oracle's none)."""
    script = script_module("replay_policies.py")
    profile = resolve_profile("mixed", "hydra")
    traces = load_traces(profile)[:1]
    here = CostCurve(
        (0, 1, 2, 4, 8, 16, 32, 64), (30.0, 31.0, 32.0, 33.0, 36.0, 42.0, 55.0, 80.0), (0.0,) + (2.0,) * 7,
        key={"heads": {"kind": "hydra"}}, source="probe",
    )  # fmt: skip
    got = script._replay_task(profile, traces, here, lambda p: ChoiceCost(type(p).__name__, 0.5, 16))
    for name, r in got.items():
        said = r["charges"]
        assert said["step"]["source"] == said["drafting"]["source"] == "measured", name
        assert said["choice"]["source"] == ("none" if name == "oracle" else "measured"), name
    for name, r in script._replay_task(profile, traces).items():
        said = r["charges"]
        assert said["step"]["source"] == said["drafting"]["source"] == "constant", name
        assert said["choice"]["source"] == "none", name


# ---- measuring the choice ------------------------------------------------------------------------------------


class SlowChoice(StaticPolicy):
    """A static policy whose choice takes at least 4 ms (what a costly policy's signals and menu would)."""

    def choose(self, ctx):
        time.sleep(0.004)
        return super().choose(ctx)


def test_a_choice_is_timed_in_the_engines_steps_and_cached_per_policy(tmp_path, monkeypatch):
    """The measurement reads the engine's clock around the policy's choose: a 4 ms choice measures at least
    4 ms, a static tree's far less; a second ask reads the cache, another policy is measured again."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.setattr(choice_mod, "STEPS", 5)
    measured = []
    real = choice_mod.measure_choice
    monkeypatch.setattr(choice_mod, "measure_choice", lambda *a, **k: measured.append(1) or real(*a, **k))
    model = tiny_model()
    slow = choice_mod.choice_for(model, None, SlowChoice(Tree.root_only()))
    fast = choice_mod.choice_for(model, None, StaticPolicy(Tree.root_only()))
    assert slow.ms_per_step >= 4.0 > fast.ms_per_step and slow.steps == fast.steps == 5
    assert (slow.policy, fast.policy) == ("SlowChoice", "StaticPolicy") and slow.machine["cpu"]
    assert len(measured) == 2
    assert choice_mod.choice_for(model, None, SlowChoice(Tree.root_only())) == slow  # read back
    assert len(measured) == 2
    files = sorted((tmp_path / "costs").glob("choice-*.json"))
    assert len(files) == 2 and ChoiceCost.from_json(json.loads(files[0].read_text())) in (slow, fast)


def test_a_policys_key_follows_its_settings():
    key = choice_mod.policy_key
    assert key(StaticPolicy(load_tree("tree_8"))) == key(StaticPolicy(load_tree("tree_8")))
    assert key(StaticPolicy(load_tree("tree_8"))) != key(StaticPolicy(load_tree("tree_4")))
    assert key(SlowChoice(load_tree("tree_8")))["kind"] == "SlowChoice"
