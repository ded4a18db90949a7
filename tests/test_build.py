"""Building an engine as two steps (build/): `load` makes the model, its heads ready for it and this machine's
costs, once; `compose` makes one policy per acceptance rule on what was loaded, the prompt-lookup branch
wrapped around each once. Policies compare by what they were built from, so two faces can be checked to run
the same one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import save_tiny_model
from entmtp.accept import ACCEPTANCE
from entmtp.build import EngineSpec, Loaded, Loader, build, compose
from entmtp.build import loaded as build_mod
from entmtp.costs import CostCurve
from entmtp.heads import HeadsConfig, random_heads, save_heads
from entmtp.heads.int8 import Int8Linear, int8_supported
from entmtp.lookup import Lookup
from entmtp.packing import PackedLinear, bf16_supported
from entmtp.policy import StaticPolicy, static
from entmtp.scheduler.hybrid import HybridPolicy, hybrid
from entmtp.scheduler.profiles import resolve_profile
from entmtp.tree import Tree, load_tree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a tiny random model's directory, random Hydra heads' directory for it)."""
    root = tmp_path_factory.mktemp("tiny-build")
    model = save_tiny_model(root / "model")
    save_heads(random_heads(HeadsConfig.for_model(model, "hydra", 4), seed=1), root / "heads")
    return str(root / "model"), str(root / "heads")


def _curve() -> CostCurve:
    return CostCurve((0, 1, 4, 64), (30.0, 33.0, 36.0, 90.0), (0.0, 1.0, 2.0, 9.0), source="test")


@pytest.mark.skipif(not (bf16_supported() and int8_supported()), reason="needs oneDNN's bf16, torch's int8")
def test_the_heads_are_bound_and_made_ready_before_a_probe_times_them(tiny, monkeypatch):
    """The curve (and the batch surface) must time the heads the engine runs: drafting from int8 copies of
    their weights (the default on a CPU in bf16), or packed like the model (`draft_int8=False`)."""
    monkeypatch.delenv("ENTMTP_NO_PROBE")
    seen = []

    def probe(model, heads, **kw):
        kinds = {type(m) for m in heads.modules()}
        seen.append((heads.is_bound_to(model), heads.int8, Int8Linear in kinds, PackedLinear in kinds))
        return _curve()

    monkeypatch.setattr(build_mod, "costs_for", probe)
    monkeypatch.setattr(build_mod, "surface_for", lambda model, heads, **kw: probe(model, heads))
    model, heads = tiny
    spec = EngineSpec(model=model, heads=heads, dtype="bfloat16", tree="tree_4")
    built = build(spec, max_batch=4)
    assert seen == [(True, True, True, False)] * 2  # the curve's probe, then the surface's
    assert built.loaded.surface is not None and built.engine.heads is built.loaded.heads
    seen.clear()
    built = build(replace(spec, draft_int8=False), max_batch=4)
    assert seen == [(True, False, False, True)] * 2
    assert built.engine.heads is built.loaded.heads


def test_a_loader_loads_a_model_once_and_each_heads_once_on_it(tiny, monkeypatch):
    import entmtp.model

    calls = []
    original = entmtp.model.load_model
    monkeypatch.setattr(entmtp.model, "load_model", lambda *a, **k: calls.append(a) or original(*a, **k))
    model, heads = tiny
    loader = Loader()
    spec = EngineSpec(model=model, heads=heads, dtype="float32")
    with_heads, again = loader.load(spec), loader.load(spec)
    plain = loader.load(EngineSpec(model=model, heads="none", dtype="float32"))
    assert with_heads is again and plain.model is with_heads.model and len(calls) == 1
    assert plain.heads is None and with_heads.heads.is_bound_to(with_heads.model)
    built = build(EngineSpec(model=model, heads=heads, dtype="float32", tree="tree_4"), loader=loader)
    assert built.engine.model is with_heads.model and len(calls) == 1


HEADS = object()  # stands for heads where a composition reads nothing of them (a static tree)


def _loaded(heads=HEADS) -> Loaded:
    """A `Loaded` for compositions that read no weights (a static tree, no costs)."""
    return Loaded(EngineSpec(), None, None, heads, "heads", None)


def test_compose_gives_every_rule_a_policy_and_wraps_each_in_lookup_once():
    """Greedy, sample and gumbel share the tree, so they share one lookup wrap; typical acceptance gets no
    lookup drafts with heads unless asked (Lookup.typical)."""
    composed = compose(_loaded(), EngineSpec(tree="tree_4", lookup=Lookup()))
    p = composed.policies
    assert set(p) == set(ACCEPTANCE) and composed.policy is p["greedy"]
    assert isinstance(p["greedy"], HybridPolicy) and p["greedy"] is p["sample"] is p["gumbel"]
    assert p["typical"] == StaticPolicy(load_tree("tree_4")) and p["greedy"].inner is p["typical"]
    assert composed.lookup_rules == ("greedy", "sample", "gumbel") and composed.uses_heads
    asked = compose(_loaded(), EngineSpec(tree="tree_4", lookup=Lookup(typical=True))).policies
    assert all(asked[r] is asked["greedy"] for r in ACCEPTANCE)
    plain = compose(_loaded(None), EngineSpec(lookup=Lookup()))  # no heads: every rule copies
    assert plain.lookup_rules == ACCEPTANCE and not plain.uses_heads and plain.name == "lookup"
    assert plain.policy == hybrid(None, Lookup())


def test_a_default_that_drafts_with_no_head_prices_its_lookup_on_the_curve_without_heads():
    """Where no tree of the profile beats a plain step, the engine runs without its heads (no hidden states,
    no drafting), so its lookup branch is sized, its prediction branch priced and its steps corrected on the
    curve of steps without heads, not on the heads' (on llama.cpp those keep the embeddings on: the default
    there once chose 1-2 token chains by the heads' curve that the real steps could not pay for). Where a
    policy drafts with the heads, their curve stays."""
    nodes = (0, 1, 2, 4, 8, 16, 32, 64)
    dear = CostCurve(
        nodes, (10.0, *(10.0 * (2 + n) for n in nodes[1:])), (0.0,) * 8, key={"k": 1}, source="probe"
    )
    without = CostCurve(nodes, (10.0, 11, 12, 13, 14, 15, 16, 17), (0.0,) * 8, key={"k": 2}, source="probe")
    loaded = Loaded(EngineSpec(), None, None, HEADS, "hydra", dear, heads_less=without)
    profile = resolve_profile("mixed", "hydra")
    c = compose(loaded, EngineSpec(lookup=Lookup()), profile=profile, log=lambda _: None)
    assert not c.uses_heads and c.name == "plain" and c.costs is without
    assert c.policy.cost[:3] == pytest.approx([1.0, 1.1, 1.2])  # the lookup branch's prices: without heads
    assert [o.curve for o in c.observers] == [without]  # its steps correct that curve, not the heads'
    kept = compose(loaded, EngineSpec(tree="tree_4", lookup=Lookup()))  # drafts with the heads: theirs
    assert kept.uses_heads and kept.costs is dear and kept.policy.cost[1] == pytest.approx(3.0)


def test_each_curve_a_first_run_measures_names_its_candidate_and_whether_with_heads(monkeypatch):
    """A first run under --dtype auto measures several curves one after another: each progress line says whose
    (the candidate, with its heads or without) rather than "this machine's step costs" each time."""
    from entmtp.build import loaded as loaded_mod

    asked = []
    monkeypatch.setattr(
        loaded_mod, "costs_for", lambda model, heads, **kw: asked.append(kw["what"]) or _curve()
    )
    spec = EngineSpec(backend="llama-cpp", dtype="bfloat16", gguf_format="Q8_0")
    ready = loaded_mod._ready(replace(spec, heads="none"), None, None, True, 12.0)
    assert asked == ["llama-cpp/bfloat16:Q8_0's step costs"] and ready.costs == _curve()
    with_heads = Loaded(spec, None, None, HEADS, "hydra", _curve())
    with_heads.curve_without_heads()
    assert asked[1] == "llama-cpp/bfloat16:Q8_0's step costs without heads"


@pytest.mark.parametrize("heads_ms", [0.2, 1.0, 3.0])
def test_a_candidates_heads_priced_on_its_curve_without_heads_bound_what_its_curves_give(
    heads_ms, monkeypatch
):
    """`--dtype auto` skips a candidate once even its heads' trees priced on its curve without heads (which a
    step with heads costs more than: their drafting, llama.cpp's embeddings) cannot reach the leader: that
    price bounds what the candidate's own curves give, and where the heads' trees win it is above it (a
    bound priced on the heads' own curve would equal it)."""
    from entmtp.build import bounds

    nodes = (0, 1, 2, 4, 8, 16, 32, 64)
    without = CostCurve(nodes, (9.0, 10, 10.5, 11, 12, 14, 18, 26), (0.0,) * 8, key={"k": 2}, source="probe")
    with_heads = CostCurve(
        nodes, tuple(m + heads_ms * (1 + n / 8) for n, m in zip(nodes, without.step_ms, strict=True)),
        (0.0,) * 8, key={"k": 1}, source="probe",
    )  # fmt: skip
    loaded = Loaded(EngineSpec(), None, None, HEADS, "hydra", with_heads, heads_less=without)
    spec, profile = EngineSpec(lookup=Lookup()), resolve_profile("mixed", "hydra")
    true = compose(loaded, spec, profile=profile, log=lambda _: None)
    monkeypatch.setattr(bounds, "compose", lambda *a, log: compose(*a, profile=profile, log=log))

    class OneModel:
        def load(self, spec):
            return loaded

    curve, (plain, bound) = bounds.heads_less_case(OneModel(), spec, "llama-cpp/bfloat16")
    assert curve is without and plain == 9.0
    assert bound >= true.expected
    if true.uses_heads:
        assert bound > true.expected


def test_a_rule_that_drafts_with_no_head_prices_its_lookup_without_heads_beside_one_that_does(monkeypatch):
    """A generation whose policy drafts with no head runs without the heads (the engine builds no drafter for
    it), also where another rule's policy drafts with them: its lookup branch is sized on the curve without
    heads. (On the AMX Xeon the profile's typical section kept the heads while greedy ran plain steps and
    lookup, and greedy's chains were sized on the heads' steeper curve: 1-token chains where lookup alone,
    sized without heads, took 2-5.)"""
    from entmtp.build import composed as composed_mod

    nodes = (0, 1, 2, 4, 8, 16, 32, 64)
    with_heads = CostCurve(
        nodes, (10.0, 13.5, 15, 20, 27, 40, 80, 140), (0.0,) * 8, key={"k": 1}, source="probe"
    )
    without = CostCurve(nodes, (9.0, 11, 12, 13, 14, 15, 16, 17), (0.0,) * 8, key={"k": 2}, source="probe")
    loaded = Loaded(EngineSpec(), None, None, HEADS, "hydra", with_heads, heads_less=without)
    heads_tree = static("tree_4")
    monkeypatch.setattr(
        composed_mod,
        "_policy",
        lambda *a: (None, "plain", "test", 1.0, {"typical": (heads_tree, "tree tree_4")}),
    )
    c = compose(loaded, EngineSpec(lookup=Lookup(typical=True)))
    assert c.uses_heads and c.costs is without  # the greedy rule's curve: without heads
    assert c.policy.cost[:3] == pytest.approx([1.0, 11 / 9, 12 / 9])  # greedy's lookup: without heads
    assert c.policies["typical"].cost[1] == pytest.approx(1.35)  # typical's, which drafts heads: theirs


def test_a_tree_name_becomes_a_policy_in_one_place():
    """`static` makes a tree name or a `Tree` the policy verifying it every step; `compose` makes a spec's
    tree name that policy (no tree, no heads: plain decoding), the one place a user's name becomes a policy;
    `hybrid` wraps the policy it is given as it is and refuses a name."""
    tree = load_tree("tree_4")
    assert static("tree_4") == static(tree) == StaticPolicy(tree)
    assert compose(_loaded(), EngineSpec(tree="tree_4")).policy == static(tree)
    assert compose(_loaded(None), EngineSpec(lookup=None)).policy == static(Tree.root_only())
    inner = static("tree_4")
    assert hybrid(inner, Lookup()).inner is inner and hybrid(static(tree), Lookup()) == hybrid(
        inner, Lookup()
    )
    with pytest.raises(TypeError, match=r"hybrid takes a TreePolicy, not the tree 'tree_4'"):
        hybrid("tree_4", Lookup())


def test_policies_are_equal_when_built_from_the_same_settings():
    """Equality by settings (policy.Settings), never by the state of a generation or identity."""
    a, b = hybrid(static("tree_4"), Lookup(), _curve()), hybrid(static("tree_4"), Lookup(), _curve())
    assert a == b and a.fresh() == b and a is not b
    assert a != hybrid(static("tree_4"), Lookup(tokens=5), _curve())  # another lookup
    assert a != hybrid(static("tree_4"), Lookup())  # another curve (CPU_COST)
    assert a != hybrid(static("tree_8"), Lookup(), _curve())  # another tree
    assert StaticPolicy(load_tree("tree_4")) != a.inner.tree  # a tree is not a policy


def _measured_here(monkeypatch, tmp_path) -> list:
    """A cost cache of its own, and the probe replaced by a hand-made curve of the right key (counted)."""
    from entmtp.costs import cost_key, measured
    from entmtp.costs.measured import SIZES

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    calls = []

    def measure(model, heads, *, graphs, sampling, **kw):
        calls.append(heads)
        key = cost_key(model, heads, graphs, sampling, SIZES)
        return CostCurve((0, 1, 4, 64), (20.0, 30.0, 40.0, 200.0), (0.0, 2.0, 3.0, 9.0), key=key)

    monkeypatch.setattr(measured, "measure", measure)
    return calls


def test_no_probe_reads_this_machines_cached_curve_and_sizes_the_lookup_branch_on_it(
    tiny, tmp_path, monkeypatch
):
    """--no-probe measures nothing; a curve measured here before is still this machine's, so the policies and
    the lookup branch are sized on it, not on another machine's constant (costs.CPU_COST)."""
    calls = _measured_here(monkeypatch, tmp_path)
    model, heads = tiny
    spec = EngineSpec(model=model, heads=heads, dtype="float32", tree="tree_4", lookup=Lookup())
    monkeypatch.delenv("ENTMTP_NO_PROBE")
    first = build(spec)  # measures once (the fake probe) and caches the curve
    monkeypatch.setenv("ENTMTP_NO_PROBE", "1")
    unprobed = build(spec)
    assert len(calls) == 1  # the second build measured nothing
    assert unprobed.plan.costs == first.plan.costs
    hybrid_policy = unprobed.composed.policies["greedy"]
    assert isinstance(hybrid_policy, HybridPolicy)
    assert hybrid_policy.cost[:5] == pytest.approx([1.0, 1.5, 5 / 3, 11 / 6, 2.0])  # the curve over its 20 ms
    assert hybrid_policy.draft_cost == pytest.approx(first.plan.costs.draft_share)
    assert "read from this machine's cost cache" in unprobed.plan.describe()
    assert unprobed.composed.observers == ()  # nothing measured, so nothing corrected either


def test_no_probe_without_a_cached_curve_says_the_lookup_branch_is_sized_on_another_machines_costs(
    tiny, tmp_path, monkeypatch
):
    calls = _measured_here(monkeypatch, tmp_path)
    model, heads = tiny
    built = build(EngineSpec(model=model, heads=heads, dtype="float32", tree="tree_4", lookup=Lookup()))
    assert calls == [] and built.plan.costs is None
    said = built.plan.describe()
    assert "CPU_COST" in said and "not on this one" in said


# ---- a model of the user's own: the shipped heads only where they fit (issue #69) ---------------------------


def test_the_embedded_model_in_a_rewritten_format_without_the_shipped_heads_is_named_by_its_file():
    """The embedded model in a weight format entmtp wrote (`--dtype auto` measures Q8_0/F16/BF16 files on an AMX
    CPU) has other token embeddings than the shipped heads were trained on: the line names its file, not the
    model the user gave (none: it said "no heads for None ... --model None")."""
    from types import SimpleNamespace

    from entmtp import shipped

    said = []
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path="/cache/smollm2-135m-instruct-q8_0.gguf"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shipped, "fits_shipped", lambda m: False)
        mp.setattr(shipped, "default_heads", lambda: "hydra")
        assert shipped.default_heads_for(model, None, said.append) == "none"
        assert shipped.default_heads_for(model, "mine", said.append) == "none"
    assert said[0].startswith("no heads for the embedded model as smollm2-135m-instruct-q8_0.gguf: its token")
    assert "None" not in said[0] and "/cache" not in said[0]
    assert said[1].startswith("no heads for mine: the shipped hydra heads") and "--model mine" in said[1]


def test_your_own_model_decodes_without_the_shipped_heads_and_says_why(tmp_path, capsys):
    """`entmtp generate --model DIR` with no --heads: a model of another width gets no heads (prompt lookup and
    plain steps, as any model), one line says why and how to train some; it used to fail binding SmolLM2's."""
    from entmtp.cli import main

    save_tiny_model(tmp_path / "mine")
    assert main(["generate", "Hi there", "--model", str(tmp_path / "mine"), "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert f"no heads for {tmp_path / 'mine'}: the shipped hydra heads were trained for the embedded" in err
    assert f"entmtp train-heads --model {tmp_path / 'mine'} --out DIR" in err
    built = build(EngineSpec(model=str(tmp_path / "mine"), lookup=Lookup()), log=lambda m: None)
    assert built.plan.policy == "lookup" and built.plan.heads == "none" and built.engine.heads is None
    from entmtp.errors import HeadsError
    from entmtp.shipped import resolve_heads

    with pytest.raises(
        HeadsError, match=r"trained for smollm2-135m-instruct: train heads .*\(--heads none\)"
    ):
        resolve_heads("hydra", built.engine.model)  # named, they still fail, and the error names the ways out


@pytest.mark.slow
def test_the_shipped_heads_fit_the_embedded_model_from_any_file_and_no_other_gguf(tmp_path, capsys):
    """The embedded model matches the shipped heads by its token embeddings' hash in any dtype and from its
    GGUF given as a path; another GGUF (here its embeddings changed) decodes without them."""
    pytest.importorskip("llama_cpp")
    import gguf
    import numpy as np

    from entmtp.backends.llama_cpp import _dequantize
    from entmtp.model import embedded_gguf, load_model
    from entmtp.shipped import fits_shipped

    assert fits_shipped(load_model(dtype="float32")[0]) and fits_shipped(load_model(dtype="bfloat16")[0])
    as_path = build(
        EngineSpec(model=str(embedded_gguf()), backend="llama-cpp", tree="tree_4"), log=lambda m: None
    )
    assert as_path.plan.heads.startswith("hydra") and as_path.engine.heads is not None
    reader = gguf.GGUFReader(str(embedded_gguf()))  # another model: the embedding rows scaled
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            value = 0 if key == "general.file_type" else f.contents()
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, f.types[0], sub_type=sub)
    for t in reader.tensors:
        values = _dequantize(t).reshape([int(d) for d in reversed(t.shape)])
        writer.add_tensor(t.name, values * np.float32(1.5) if t.name == "token_embd.weight" else values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    other = build(EngineSpec(model=str(tmp_path / "other.gguf"), backend="llama-cpp"), log=lambda m: None)
    assert other.plan.heads == "none" and other.engine.heads is None
    assert "no heads for" in capsys.readouterr().err
