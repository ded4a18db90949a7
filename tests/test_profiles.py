"""Profiles (scheduler/profiles.py): every older file loads with every value it held, a calibrated profile
round-trips exactly and gives lossless policies, and every bad or foreign file gets a clear error."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.calibration.traces import load_traces
from entmtp.engine import Engine
from entmtp.machine import describe_record, record
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.profiles import (
    MachineSection,
    Profile,
    ProfileError,
    load_profile,
    shipped_profiles_dir,
)
from scheduler_helpers import copy_profile, fitted_setup, tiny_profile_setup


@pytest.fixture(scope="module")
def fitted():
    return fitted_setup()


@pytest.fixture(scope="module")
def tiny_profile(fitted, tmp_path_factory):
    return tiny_profile_setup(fitted, tmp_path_factory.mktemp("profiles"))


RESULTS = Path(__file__).parents[1] / "docs" / "results" / "profiles"
MACHINE_SECTION = [f.name for f in dataclasses.fields(MachineSection)]

# ---- the format --------------------------------------------------------------------------------------------

SHIPPED = sorted(shipped_profiles_dir("hydra").glob("*.json")) + sorted(
    shipped_profiles_dir("medusa").glob("*.json")
)
VERSION_1 = [*SHIPPED, *sorted(RESULTS.glob("*.json"))]  # files written by an older entmtp


def as_version_1(d: dict) -> dict:
    """A version-2 document in version 1's layout, written here apart from the reader's conversion: each
    section's `measured_on` fields beside its own, a frontier entry's `measured` fields beside its own."""
    d = json.loads(json.dumps(d))  # a copy: the caller's document stays as it is
    modes = {}
    for name, section in d["modes"].items():
        machine = section.pop("measured_on")
        section["acceptance_frontier"] = [
            {**{k: v for k, v in e.items() if k != "measured"}, **e.get("measured", {})}
            for e in section["acceptance_frontier"]
        ]
        modes[name] = {**section, **machine}
    return {**d, "version": 1, "modes": modes}


@pytest.mark.parametrize("path", VERSION_1, ids=[f"{p.parent.name}/{p.stem}" for p in VERSION_1])
def test_every_version_1_file_loads_with_every_value_in_its_new_place(path):
    """An older file (the shipped profiles, the results' profile) loads; written again it is version 2, each
    section's machine numbers under `measured_on`, and holds every value it held; that document round-trips
    exactly (the same JSON, byte for byte as written), and to_json then from_json gives the same profile."""
    old = json.loads(path.read_text())
    assert old["version"] == 1
    profile = load_profile(path)
    new = profile.to_json()
    assert new["version"] == 2
    assert set(new["modes"]["greedy"]["measured_on"]) == set(MACHINE_SECTION)
    back = as_version_1(new)
    for name, section in old["modes"].items():
        rule = section["sampling"]["acceptance"] if "sampling" in section else "greedy"
        assert back["modes"][name]["acceptance_model"]["rule"] == rule  # written out now
        if "rule" not in section["acceptance_model"]:
            del back["modes"][name]["acceptance_model"]["rule"]
    assert back == old
    text = json.dumps(new, indent=1) + "\n"
    again = Profile.from_json(json.loads(text))
    assert again == profile and json.dumps(again.to_json(), indent=1) + "\n" == text


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
        assert profile.best_tree().name == profile.mode().measured_on.best
        assert [t.name for t in profile.bank()] == list(profile.mode().bank)


# ---- a calibrated profile ----------------------------------------------------------------------------------


def test_profile_round_trips(tiny_profile):
    model, heads, path, traces = tiny_profile
    p = load_profile(path)
    assert p.to_json() == json.loads(path.read_text()) and p.to_json()["version"] == 2
    assert json.dumps(p.to_json(), indent=1) + "\n" == path.read_text()  # exactly what `save` wrote
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
    m = p.mode("greedy").measured_on
    assert {"static", "binary", "ladder", "cost", "dynamic", "oracle"} <= set(m.replay)
    assert (
        m.replay["oracle"].tokens_per_second
        >= max(m.replay[k].tokens_per_second for k in ("static", "binary", "ladder", "cost")) - 1e-9
    )


def test_a_profile_file_is_read_once_a_process_and_again_once_written_again(tiny_profile, tmp_path):
    """A first run composes about ten candidates on one shipped profile: each composition reads the same
    object, not the file again; a file written since is read anew, even at the same size."""
    _, _, path, _ = tiny_profile
    copy = tmp_path / "p.json"
    copy.write_text(path.read_text())
    first = load_profile(copy)
    assert load_profile(copy) is first
    doc = json.loads(copy.read_text())
    doc["task"] = "tinz"  # same length
    copy.write_text(json.dumps(doc, indent=1) + "\n")
    assert copy.stat().st_size == path.stat().st_size
    assert load_profile(copy).task == "tinz" and first.task == "tiny"


@pytest.mark.parametrize("name", ["static", "binary", "ladder", "cost", "dynamic"])
def test_policies_from_a_profile_are_lossless(tiny_profile, fitted, name):
    model, heads, path, _ = tiny_profile
    _, ids, ref, _ = fitted
    policy = profile_policy(load_profile(path), name)
    r = Engine(model, ByteTokenizer(), heads=heads["hydra"], policy=policy).generate(ids, max_new_tokens=48)
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


def test_a_field_the_reader_does_not_know_is_refused_naming_the_file_and_the_field(tiny_profile, tmp_path):
    """A field this entmtp does not know (a newer entmtp's, or an edit by hand) is refused, not dropped."""
    _, _, path, _ = tiny_profile
    with pytest.raises(ProfileError, match=r"p\.json is malformed at colour: unknown field 'colour'"):
        load_profile(copy_profile(path, tmp_path, edit=lambda d: d.update(colour="red")))

    def edit(d):
        d["modes"]["greedy"]["measured_on"]["thresholds"]["binary"]["tau_middle"] = 0.5

    where = r"modes\.greedy\.measured_on\.thresholds\.binary\.tau_middle: unknown field 'tau_middle'"
    with pytest.raises(ProfileError, match=rf"p\.json is malformed at {where} \(a BinaryThresholds has"):
        load_profile(copy_profile(path, tmp_path, edit=edit))


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
