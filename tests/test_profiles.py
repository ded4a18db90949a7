"""Profiles (scheduler/profiles.py): the typed format round-trips every shipped file unchanged, a calibrated
profile round-trips and gives lossless policies, and every bad or foreign file gets a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.calibration.traces import load_traces
from entmtp.engine import Engine
from entmtp.machine import describe_record, record
from entmtp.scheduler.profiles import Profile, ProfileError, load_profile, shipped_profiles_dir
from scheduler_helpers import copy_profile, fitted_setup, tiny_profile_setup


@pytest.fixture(scope="module")
def fitted():
    return fitted_setup()


@pytest.fixture(scope="module")
def tiny_profile(fitted, tmp_path_factory):
    return tiny_profile_setup(fitted, tmp_path_factory.mktemp("profiles"))


# ---- the format --------------------------------------------------------------------------------------------

SHIPPED = sorted(shipped_profiles_dir("hydra").glob("*.json")) + sorted(
    shipped_profiles_dir("medusa").glob("*.json")
)


@pytest.mark.parametrize("path", SHIPPED, ids=[f"{p.parent.name}/{p.stem}" for p in SHIPPED])
def test_every_shipped_profile_round_trips_unchanged(path):
    """from_json then to_json gives the very file back (the same JSON, byte for byte as written), and
    to_json then from_json the same profile: the typed format loses and adds nothing."""
    text = path.read_text()
    profile = load_profile(path)
    assert profile.to_json() == json.loads(text)
    assert json.dumps(profile.to_json(), indent=1) + "\n" == text
    assert Profile.from_json(profile.to_json()) == profile


def test_shipped_profiles_cover_every_task_and_both_head_kinds():
    assert len(SHIPPED) == 10
    for path in SHIPPED:
        profile = load_profile(path)
        # made before machine records: they load, and say the machine is unknown (with the name they hold)
        assert profile.machine is None and profile.machine_description.startswith("machine unknown")
        assert profile.heads.kind == path.parent.name and profile.task == path.stem
        assert set(profile.modes) == {"greedy", "sample", "typical"}
        for rule in ("sample", "typical"):  # each T=0.7 section: its rule's model, checked on held-out traces
            section = profile.mode(rule)
            assert section.sampling.temperature == 0.7 and section.sampling.rule == rule
            assert profile.acceptance(rule).rule == rule and section.acceptance_check
        assert profile.mode("typical").trace_tree is not None
        assert profile.best_tree().name == profile.mode().best
        assert [t.name for t in profile.bank()] == list(profile.mode().bank)


# ---- a calibrated profile ----------------------------------------------------------------------------------


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
    assert p.machine == record(model.device)  # the calibration machine: CPU, flags, cores, versions
    assert p.machine_description == describe_record(record(model.device))
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


# ---- bad and foreign files ---------------------------------------------------------------------------------


def test_bad_profile_files_get_clear_errors(tiny_profile, tmp_path):
    model, heads, path, _ = tiny_profile
    with pytest.raises(ProfileError, match="does not exist.*entmtp calibrate"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="corrupt or truncated"):
        load_profile(copy_profile(path, tmp_path, text=path.read_text()[: len(path.read_text()) // 2]))
    with pytest.raises(ProfileError, match="not an entmtp scheduler profile"):
        load_profile(copy_profile(path, tmp_path, text='{"hello": 1}'))
    with pytest.raises(ProfileError, match="format version 99"):
        load_profile(copy_profile(path, tmp_path, edit=lambda d: d.update(version=99)))
    with pytest.raises(ProfileError, match="lacks latency"):
        load_profile(copy_profile(path, tmp_path, edit=lambda d: d.pop("latency")))
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(
            copy_profile(path, tmp_path, edit=lambda d: d["modes"]["greedy"]["master"].update(paths=[[0, 0]]))
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
        load_profile(copy_profile(path, tmp_path, edit=edit)).check(
            model, heads["hydra"], warn_hardware=False
        )


def test_profile_from_other_hardware_warns_to_remeasure(tiny_profile, tmp_path):
    model, heads, path, _ = tiny_profile
    p = load_profile(
        copy_profile(path, tmp_path, edit=lambda d: d["hardware"].update(name="NVIDIA H200", device="cuda"))
    )
    with pytest.warns(UserWarning, match="other hardware.*calibrate --latency-only"):
        p.check(model, heads["hydra"])
