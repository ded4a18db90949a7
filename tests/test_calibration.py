"""The calibration pipeline (calibration/calibrate.py, traces.py): the fitted acceptance model, the traces
sidecar, --latency-only and the typical section."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import ByteTokenizer
from entmtp.calibration.calibrate import build_profile, fit_acceptance
from entmtp.calibration.traces import TOPK, load_traces, save_traces
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.policy import static
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.policies import AcceptanceModel
from entmtp.scheduler.profiles import ProfileError, load_profile
from scheduler_helpers import RANK_P, TINY, copy_profile, fitted_setup, synthetic_traces, tiny_profile_setup


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


def test_acceptance_check_compares_predicted_and_measured_depths_on_held_out_traces():
    from types import SimpleNamespace

    from entmtp.calibration.calibrate import check_acceptance
    from entmtp.tree import load_tree

    heads = SimpleNamespace(config=SimpleNamespace(num_heads=3), grounded=True)  # a probe of depth 1
    master = load_tree("tree_8")  # depth 3: paths (0,), (1,), (0, 0), ... drawn from RANK_P
    # head d's probability of its rank-r candidate is the rate that candidate is right (RANK_P; 0.01 below):
    # a calibrated probe, so the fitted model is exact, and two folds with the same rank frequencies
    (tr,) = synthetic_traces()
    q = torch.tensor([*RANK_P, *[0.01] * (TOPK - len(RANK_P))])
    tr = replace(tr, probe=q.log().expand_as(tr.probe).clone())
    both = [tr, tr]
    check = check_acceptance(both, heads, "greedy", master)
    assert [c.depth for c in check] == [1, 2, 3]
    assert [c.positions for c in check] == [2 * len(both[0].ranks)] * 3
    for c in check:
        assert c.predicted == pytest.approx(c.measured, abs=0.02), c
    measured = [c.measured for c in check]
    assert measured == sorted(measured, reverse=True) and measured[0] > 0.5
    assert check_acceptance(both[:1], heads, "greedy", master) == ()  # one trace: nothing held out


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


@pytest.fixture(scope="module")
def sampled_profile(tiny_profile, fitted, tmp_path_factory):
    """(profile path, the union tree, {rule: traces}): the tiny profile with its sample and typical sections."""
    from entmtp.calibration.calibrate import add_sampled, typical_union
    from entmtp.calibration.traces import SAMPLE, TYPICAL, generate_traces

    model, heads, path, greedy = tiny_profile
    _, ids, _, _ = fitted
    engine = Engine(model, ByteTokenizer(), heads=heads["hydra"], policy=static("tree_8"))
    prompts = [ids, list(range(30, 44))]
    union = typical_union(load_profile(path), heads["hydra"])
    sampled = {
        s.rule: generate_traces(engine, heads["hydra"], prompts, 24, sampling=s, union=union)[0]
        for s in (SAMPLE, TYPICAL)
    }
    profile = load_profile(path)
    for s in (SAMPLE, TYPICAL):
        profile = add_sampled(profile, heads["hydra"], sampled[s.rule], s, TINY, log=lambda *a: None)
    out = tmp_path_factory.mktemp("sampled") / "sampled.json"
    save_traces(profile, out, greedy, sampled).save(out)
    return out, union, sampled


def test_sampled_sections_from_sampled_generations(tiny_profile, sampled_profile, fitted):
    from entmtp.calibration.calibrate import add_sampled
    from entmtp.calibration.traces import TYPICAL

    model, heads, path, greedy = tiny_profile
    _, ids, _, _ = fitted
    out, union, sampled = sampled_profile
    assert all(t.passes.shape == (len(t.ranks), union.num_nodes) for t in sampled["typical"])
    assert all(t.passes is None for t in sampled["sample"])  # rank vectors replay the lossless rule exactly
    with pytest.raises(EntMTPError, match="needs traces of typical"):
        add_sampled(load_profile(path), heads["hydra"], sampled["sample"], TYPICAL, TINY, log=lambda *a: None)
    loaded = load_profile(out)
    assert loaded.mode_for(0.7) == "sample" and loaded.mode_for(0.0) == "greedy"  # auto: lossless at T > 0
    assert loaded.mode_for(0.7, "typical") == "typical" and loaded.mode_for(1.0, "sample") == "sample"
    assert {m: loaded.acceptance(m).rule for m in loaded.modes} == {
        r: r for r in ("greedy", "sample", "typical")
    }
    back = load_traces(loaded, "typical")
    assert all(torch.equal(a.passes, b.passes) for a, b in zip(back, sampled["typical"], strict=True))
    assert all(a.union.paths == union.paths for a in back)
    assert {t.name for t in loaded.bank("typical")} and all(
        set(t.paths) <= set(union.paths) for t in loaded.bank("typical")
    )  # the typical search grows subtrees of the union tree
    assert [t.ranks.tolist() for t in load_traces(loaded, "sample")] == [
        t.ranks.tolist() for t in sampled["sample"]
    ]
    loaded.check(model, heads["hydra"], warn_hardware=False)
    for mode, rule in (("sample", "sample"), ("typical", "typical")):
        bank = {t.name for t in loaded.bank(mode)} | {"master"}
        for name in ("static", "cost", "dynamic"):
            policy = profile_policy(loaded, name, mode)
            r = Engine(model, ByteTokenizer(), heads=heads["hydra"], policy=policy).generate(
                ids, max_new_tokens=24, temperature=0.7, acceptance=rule, seed=3
            )
            assert len(r.token_ids) == 24
            if name != "dynamic":
                assert {s.tree for s in r.steps} <= bank


def test_a_built_engine_gives_each_acceptance_rule_its_sections_policy(
    tiny_profile, sampled_profile, monkeypatch, tmp_path
):
    """`build` (every face: generate, chat, serve) makes one policy per rule from the profile's section for
    it, so a server's T=0 and T=0.7 requests each run the policy calibrated for their rule."""
    import entmtp.model
    import entmtp.shipped
    from entmtp.accept import Sampling
    from entmtp.build import EngineSpec, build
    from entmtp.engine import _trees

    model, heads, _, _ = tiny_profile
    out, _, _ = sampled_profile
    monkeypatch.setattr(entmtp.model, "load_model", lambda *a, **k: (model, ByteTokenizer()))
    monkeypatch.setattr(entmtp.shipped, "resolve_heads", lambda *a, **k: heads["hydra"])
    spec = EngineSpec(
        model="tiny", heads="tiny-hydra", profile=str(out), dtype="float32", probe=False, lookup=None
    )
    built = build(spec, log=lambda m: None)
    loaded = load_profile(out)
    assert set(built.plan.other_rules) == {"sample", "typical", "gumbel"}
    assert "other acceptance rules, each from its profile section: sample: " in built.plan.describe()

    def same(a, b):
        return type(a) is type(b) and [t.paths for t in _trees(a)] == [t.paths for t in _trees(b)]

    sections = {}
    for temperature, rule in ((0.0, "greedy"), (0.7, "sample"), (0.7, "typical")):
        sections[rule] = profile_policy(loaded, loaded.recommended_policy(rule), rule)
        assert same(built.engine.policy_for(Sampling(temperature, rule)), sections[rule])
    assert same(built.engine.policy_for(Sampling(0.7, "gumbel")), sections["sample"])  # no section of its own
    assert not same(sections["greedy"], sections["typical"])  # the sections differ: the check above can fail
    # prompt-lookup drafts go into every rule's trees but typical acceptance's, unless asked (Lookup.typical)
    from entmtp.lookup import Lookup
    from entmtp.scheduler.hybrid import HybridPolicy

    def lookup_rules(b):
        rules = (("greedy", 0.0), ("sample", 0.7), ("typical", 0.7), ("gumbel", 0.7))
        return [r for r, t in rules if isinstance(b.engine.policy_for(Sampling(t, r)), HybridPolicy)]

    for main in ("greedy", "typical"):
        t = 0.0 if main == "greedy" else 0.7
        unsaid = build(replace(spec, lookup=Lookup(), temperature=t, acceptance=main), log=lambda m: None)
        assert lookup_rules(unsaid) == ["greedy", "sample", "gumbel"]
        assert same(unsaid.engine.policy_for(Sampling(0.7, "typical")), sections["typical"])
        assert "prompt-lookup drafts: greedy, sample, gumbel; not typical (" in unsaid.plan.describe()
        asked = build(
            replace(spec, lookup=Lookup(typical=True), temperature=t, acceptance=main), log=lambda m: None
        )
        assert lookup_rules(asked) == ["greedy", "sample", "typical", "gumbel"]
        assert "prompt-lookup drafts: greedy, sample, typical, gumbel\n" in asked.plan.describe() + "\n"
    sub = tmp_path / "no-typical"
    sub.mkdir()
    greedy_only = copy_profile(out, sub, lambda d: [d["modes"].pop(m) for m in ("sample", "typical")])
    lone = build(replace(spec, profile=str(greedy_only), lookup=Lookup()), log=lambda m: None)
    assert lookup_rules(lone) == ["greedy", "sample", "gumbel"]  # every rule runs the greedy section's policy
    assert same(lone.engine.policy_for(Sampling(0.7, "typical")), sections["greedy"])
    # a forced policy one section cannot build: that rule runs the asked rule's policy, and the log says so
    no_ladder = copy_profile(
        out, tmp_path, lambda d: d["modes"]["typical"]["measured_on"]["thresholds"].update(ladder=None)
    )
    said = []
    forced = build(replace(spec, profile=str(no_ladder), policy="ladder"), log=said.append)
    assert forced.plan.other_rules == {"sample": "ladder", "gumbel": "ladder"}
    assert said == [f"typical acceptance runs the greedy policy: profile {no_ladder} has no tuned ladder "
                    "thresholds: calibrate again"]  # fmt: skip


@pytest.fixture(scope="module")
def typical_only(tiny_profile, fitted):
    """(the tiny profile with a typical section only, its traces, the union tree they verified)."""
    from entmtp.calibration.calibrate import add_sampled, typical_union
    from entmtp.calibration.traces import TYPICAL, generate_traces

    model, heads, path, _ = tiny_profile
    _, ids, _, _ = fitted
    engine = Engine(model, ByteTokenizer(), heads=heads["hydra"], policy=static("tree_8"))
    union = typical_union(load_profile(path), heads["hydra"])
    typical, _ = generate_traces(engine, heads["hydra"], [ids], 16, sampling=TYPICAL, union=union)
    profile = add_sampled(load_profile(path), heads["hydra"], typical, TYPICAL, TINY, log=lambda *a: None)
    return profile, typical, union


def test_typical_traces_of_an_older_entmtp_are_refused(tiny_profile, typical_only, tmp_path):
    """A typical section without its union tree comes from an older entmtp (pass masks one level off the
    trajectory): its traces are not read, and the error says to calibrate again."""
    _, _, _, greedy = tiny_profile
    profile, typical, union = typical_only
    out = tmp_path / "t.json"
    save_traces(profile, out, greedy, {"typical": typical}).save(out)
    assert load_traces(load_profile(out), "typical")[0].union.paths == union.paths
    data = json.loads(out.read_text())
    del data["modes"]["typical"]["trace_tree"]
    out.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="made by an older entmtp .* calibrate again"):
        load_traces(load_profile(out), "typical")


def test_a_profile_without_a_rules_section_lends_the_other_one(tiny_profile, typical_only):
    """Older profiles hold a typical section only: lossless sampling uses it rather than the greedy one."""
    profile, _, _ = typical_only
    assert profile.mode_for(0.7) == "typical" and profile.mode_for(0.7, "sample") == "typical"
    assert load_profile(tiny_profile[2]).mode_for(0.7) == "greedy"  # no T > 0 section at all


def test_retrace_re_derives_a_profile_for_heads_with_another_draft_vocabulary(
    tiny_profile, sampled_profile, tmp_path
):
    """The profile's stored generations teacher-forced through the changed heads: a target outside their draft
    vocabulary is a miss, one inside ranks no worse (fewer tokens compete), every section is retuned, and the
    profile is then made for these heads, its latencies and generations kept."""
    from entmtp.calibration.calibrate import retrace, retune
    from entmtp.calibration.traces import MISS

    model, heads, _, _ = tiny_profile
    out, union, _ = sampled_profile
    path = copy_profile(out, tmp_path)
    hydra = heads["hydra"]
    changed = type(hydra)(hydra.config)
    changed.load_state_dict(hydra.state_dict())
    changed.bind(model).requires_grad_(False)
    changed.set_draft_vocab(torch.arange(0, hydra.config.vocab_size, 2))  # odd tokens are never drafted
    old = load_profile(path)
    with pytest.raises(ProfileError, match="calibrate --retrace --profile"):
        old.check(model, changed, warn_hardware=False)

    profile, greedy, sampled = retrace(old, model, ByteTokenizer(), changed)
    assert set(sampled) == {"sample", "typical"}
    for mode, new in (("greedy", greedy), *sampled.items()):
        before = load_traces(old, mode)
        assert [t.tokens.tolist() for t in new] == [t.tokens.tolist() for t in before]
        for a, b in zip(before, new, strict=True):
            target = torch.stack(
                [
                    a.tokens[j + 1 : j + 1 + b.ranks.shape[1]]
                    for j in range(a.prompt_len, a.length - b.ranks.shape[1])
                ]
            )
            rows = len(target)
            odd = target % 2 == 1
            assert (b.ranks[:rows][odd] == MISS).all()
            kept = ~odd & (a.ranks[:rows] != MISS)
            assert (b.ranks[:rows][kept] <= a.ranks[:rows][kept]).all()
        if mode == "typical":
            assert all(t.union.paths == union.paths for t in new)
            assert [t.passes.shape for t in new] == [t.passes.shape for t in before]
    assert any(
        (t.ranks == MISS).sum() > (a.ranks == MISS).sum()
        for t, a in zip(greedy, load_traces(old), strict=True)
    )
    saved = retune(save_traces(profile, path, greedy, sampled), changed, TINY, log=lambda *a: None).save(path)
    loaded = load_profile(path)
    loaded.check(model, changed, warn_hardware=False)
    assert loaded.latency == old.latency and set(loaded.modes) == set(old.modes) == set(saved.modes)
    assert [t.ranks.tolist() for t in load_traces(loaded)] == [t.ranks.tolist() for t in greedy]
    with pytest.raises(EntMTPError, match="calibrate these heads from scratch"):
        retrace(old, model, ByteTokenizer(), heads["medusa"])


def test_retrace_decodes_again_the_greedy_generations_an_older_sidecar_lacks(tiny_profile, fitted, tmp_path):
    """Greedy traces saved without their generations (an older entmtp): a retrace decodes them again from the
    calibration prompts (greedy output does not depend on the heads, so the traces come out the same), and
    refuses prompts that are not the ones the traces were made from."""
    from entmtp.calibration.calibrate import retrace

    model, heads, path, greedy = tiny_profile
    _, ids, _, _ = fitted
    prompts = [ids, list(range(30, 44)), list(range(90, 101))]  # tiny_profile_setup's
    bare = [replace(t, tokens=None) for t in greedy]
    out = tmp_path / "old.json"
    save_traces(load_profile(path), out, bare).save(out)
    old = load_profile(out)
    assert all(t.tokens is None for t in load_traces(old))
    for wrong in (None, prompts[:2], [p[:-1] for p in prompts]):
        with pytest.raises(EntMTPError, match="not the ones they were made from"):
            retrace(old, model, ByteTokenizer(), heads["hydra"], wrong)
    _, again, _ = retrace(old, model, ByteTokenizer(), heads["hydra"], prompts)
    assert [t.tokens.tolist() for t in again] == [t.tokens.tolist() for t in greedy]
    assert [t.ranks.tolist() for t in again] == [t.ranks.tolist() for t in greedy]
