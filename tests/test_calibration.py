"""The calibration pipeline (calibration/calibrate.py, traces.py): the fitted acceptance model, the traces
sidecar, --latency-only and the typical section."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ByteTokenizer
from entmtp.calibration.calibrate import build_profile, fit_acceptance
from entmtp.calibration.traces import load_traces, save_traces
from entmtp.engine import Engine
from entmtp.scheduler.policies import AcceptanceModel
from entmtp.scheduler.profiles import ProfileError, load_profile
from scheduler_helpers import TINY, copy_profile, fitted_setup, synthetic_traces, tiny_profile_setup


@pytest.fixture(scope="module")
def fitted():
    return fitted_setup()


@pytest.fixture(scope="module")
def tiny_profile(fitted, tmp_path_factory):
    return tiny_profile_setup(fitted, tmp_path_factory.mktemp("profiles"))


# ---- the acceptance model ----------------------------------------------------------------------------------


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


# ---- the traces sidecar and saving -------------------------------------------------------------------------


def test_tampered_traces_are_refused(tiny_profile, tmp_path):
    _, _, path, _ = tiny_profile
    copy = copy_profile(path, tmp_path)
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


# ---- re-measuring and the typical section ------------------------------------------------------------------


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
