"""Routing by prompt length and by draft (routing.py, costs/prefill.py, build/): each request runs on the backend
with the least expected time, prefill(prompt tokens) + new tokens / expected decode tokens/s, where a request's
prediction prices the tokens it covers at the best chain on each backend's cost curve; a routed request's output
is the chosen engine's own; `build` routes only where it measured both backends and they tokenize alike, says
the rule in the plan, and keeps the route with its cached choice."""

from __future__ import annotations

import json

import pytest

from conftest import ByteTokenizer, tiny_model
from entmtp.accept import ACCEPTANCE
from entmtp.build import bounds as bounds_mod
from entmtp.build import choose as build_mod
from entmtp.costs import PrefillCost
from entmtp.costs.cache import costs_dir, read_record
from entmtp.costs.curves import LatencyModel
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.policy import StaticPolicy
from entmtp.prediction import PREDICTED_RATE
from entmtp.routing import CopyRate, Lane, Promise, Router, chain_ms_per_token, middle
from entmtp.tree import Tree

# this EPYC's shape: llama.cpp decodes fast and prefills slowly, transformers the other way round
LLAMA_PREFILL = PrefillCost((128, 512, 2048), (4.1 * 128 + 5, 4.1 * 512 + 5, 4.1 * 2048 + 5), source="test")
TORCH_PREFILL = PrefillCost(
    (128, 512, 2048), (0.9 * 128 + 20, 0.9 * 512 + 20, 0.9 * 2048 + 20), source="test"
)


class _FakeEngine:
    """Stands for an engine where only the decision is tested: a tokenizer and the embedded model's window."""

    window = 8192

    def __init__(self, tokenizer="tok"):
        self.tokenizer = tokenizer


def _router(first_engine=None, second_engine=None, first_tps=95.0, second_tps=37.0) -> Router:
    first, second = first_engine or _FakeEngine(), second_engine or _FakeEngine()
    return Router(
        Lane("llama-cpp", first, LLAMA_PREFILL, first_tps),
        Lane("transformers", second, TORCH_PREFILL, second_tps),
    )


def test_the_prefill_fit_is_a_line_through_the_measured_points():
    assert LLAMA_PREFILL.fit == pytest.approx((5.0, 4.1))
    assert LLAMA_PREFILL(1000) == pytest.approx(4105.0)
    one = PrefillCost((100,), (50.0,))
    assert one.fit == (0.0, 0.5)  # one point: through the origin
    negative = PrefillCost((100, 200), (10.0, 40.0))  # a line that would cost less than nothing at 0 tokens
    assert negative.fit[0] == 0.0 and negative(0) == 0.0 and negative(200) > 0
    assert PrefillCost.from_json(json.loads(json.dumps(LLAMA_PREFILL.to_json()))) == LLAMA_PREFILL
    with pytest.raises(EntMTPError, match="a time per prompt length"):
        PrefillCost((), ())


def test_a_long_prompt_goes_to_the_fast_prefill_and_a_short_one_to_the_fast_decode():
    router = _router()
    llama, torch_lane = router.lanes
    assert router.lane_for(20, 256) is llama
    assert router.lane_for(3000, 256) is torch_lane
    n = router.threshold(256)
    # 5 + 4.1 n + 256000/95 = 20 + 0.9 n + 256000/37, so n = (15 + 256000/37 - 256000/95) / 3.2
    assert n == int((15 + 256000 / 37 - 256000 / 95) / 3.2) + 1
    assert router.lane_for(n - 1, 256) is llama and router.lane_for(n, 256) is torch_lane
    assert router.threshold(1024) > n  # more new tokens: the fast decode is worth a longer prefill
    assert (
        f"prompts of >= {n} tokens to transformers, shorter to llama-cpp (at 256 new tokens"
        in router.describe()
    )
    assert "prefill 4.10 vs 0.90 ms/token, decode 95.0 vs 37.0 tokens/s" in router.describe()


def test_a_lane_that_wins_both_ways_takes_every_request():
    assert _router(first_tps=20.0).threshold(256) == 0  # slower decode and slower prefill: always the second
    fast_prefill = Router(
        Lane("a", _FakeEngine(), TORCH_PREFILL, 95.0), Lane("b", _FakeEngine(), LLAMA_PREFILL, 37.0)
    )
    assert fast_prefill.threshold(256) is None and "every prompt to a" in fast_prefill.describe()


def test_a_routed_request_gives_the_chosen_engines_own_output():
    first, second = Engine(tiny_model(seed=0), ByteTokenizer()), Engine(tiny_model(seed=1), ByteTokenizer())
    router = _router(first, second)
    short, long = list(range(5, 25)), [i % 200 + 5 for i in range(router.threshold(8) + 10)]
    alone = {
        (e, len(ids)): e.generate(ids, max_new_tokens=8).token_ids
        for e in (first, second)
        for ids in (short, long)
    }
    assert alone[first, len(short)] != alone[second, len(short)]  # the two engines differ
    assert router.generate(short, max_new_tokens=8).token_ids == alone[first, len(short)]
    said = []
    router.log = said.append  # `-v`: each request's lane and why
    streamed = [e.token_ids for e in router.stream(long, max_new_tokens=8)]  # stream routes as generate does
    assert said and said[0].startswith(
        f"routed to transformers: {len(long)} prompt tokens, 8 new (expected llama"
    )
    assert sum(streamed, []) == alone[second, len(long)] != alone[first, len(long)]


# this EPYC's curves, rounded (docs/results/predicted-outputs/): llama.cpp Q4_1 a 9 ms step whose drafted nodes
# cost ~0.55 of a step each (compute-bound), transformers bf16 a 33 ms step and 16 nodes for 1.7x
LLAMA_CURVE = LatencyModel((0, 1, 4, 8, 16, 32), (9.0, 14.0, 29.0, 45.0, 88.0, 170.0))
TORCH_CURVE = LatencyModel((0, 1, 4, 8, 16, 32), (33.0, 35.0, 40.0, 46.0, 56.0, 80.0))


FLAT_CURVE = LatencyModel(
    (0, 32), (12.5, 14.0)
)  # a verifier whose 32 drafted nodes cost little (a GPU's shape)


def _curved_router(engines=(None, None), second=(30.0, TORCH_CURVE)) -> Router:
    first_engine, second_engine = (e or _FakeEngine() for e in engines)
    return Router(
        Lane("llama-cpp", first_engine, LLAMA_PREFILL, 110.0, latency=LLAMA_CURVE),
        Lane("transformers", second_engine, TORCH_PREFILL, second[0], latency=second[1]),
    )


def test_a_chain_is_priced_per_emitted_token_on_the_lanes_curve():
    # k drafted tokens right with probability q emit (1 - q^(k+1)) / (1 - q) tokens for the curve's ms at k
    ms, k = chain_ms_per_token(TORCH_CURVE, 0.75, 32)
    emitted = (1 - 0.75 ** (k + 1)) / 0.25
    assert ms == pytest.approx(float(TORCH_CURVE(k)) / emitted)
    assert all(ms <= float(TORCH_CURVE(j)) * 0.25 / (1 - 0.75 ** (j + 1)) + 1e-9 for j in range(33))
    assert (
        k > chain_ms_per_token(LLAMA_CURVE, 0.75, 32)[1] >= 1
    )  # a flat curve takes longer chains than a steep one
    assert chain_ms_per_token(LLAMA_CURVE, 0.1, 32) == (9.0, 0)  # drafts that are rarely right: plain steps
    assert chain_ms_per_token(TORCH_CURVE, 1.0, 32) == (
        pytest.approx(80.0 / 33),
        32,
    )  # certain drafts: longest


def test_a_request_whose_prediction_covers_its_output_goes_to_the_flatter_verifier():
    router = _curved_router()
    llama, torch_lane = router.lanes
    right = Promise(200, rate=0.95)  # an edit that keeps nearly all of its text
    assert router.lane_for(100, 200) is llama  # without a prediction: the fast decode
    assert router.lane_for(100, 200, right) is torch_lane  # long chains cost least on the flatter curve
    assert router.lane_for(100, 200, Promise(200, rate=0.3)) is llama  # a prediction that is mostly wrong
    # at the edits task's mean rate these two curves (this EPYC's) keep a short prompt on llama.cpp, whose short
    # chains win per token; a longer one moves, since an edit writes about its prediction's length: without a
    # prediction only prompts of (15 + 200000/30 - 200000/110) / 3.2 = 1520 tokens and more would
    assert router.lane_for(100, 200, Promise(200)) is llama
    assert router.lane_for(400, 200, Promise(200)) is torch_lane and router.lane_for(400, 200) is llama
    assert router.lane_for(100, 200, Promise(20, rate=0.95)) is torch_lane  # a short edit: mostly its prefill
    # an edit writes about its prediction's length (at most the new tokens), each token at the chain's ms
    covered, _ = torch_lane.chain(Promise(200))
    assert torch_lane.expected_ms(100, 200, Promise(150)) == pytest.approx(TORCH_PREFILL(100) + 150 * covered)
    assert torch_lane.expected_ms(100, 20, Promise(150)) == pytest.approx(TORCH_PREFILL(100) + 20 * covered)
    unmeasured = Lane("transformers", _FakeEngine(), TORCH_PREFILL, 30.0)  # no curve: priced as without it
    assert unmeasured.expected_ms(100, 200, Promise(200)) == unmeasured.expected_ms(100, 200)
    assert "a short prompt whose prediction covers its output to llama-cpp" in router.describe()
    flat = _curved_router(second=(80.0, FLAT_CURVE))
    assert "a short prompt whose prediction covers its output to transformers" in flat.describe()


def test_a_promises_chains_are_priced_at_the_requests_own_context():
    """A drafted token's share of a step depends on the context (llama.cpp: 1.8x a plain step after ~200
    tokens, 1.45x after 768): a lane prices a promise's chains on its curve at the request's middle (its prompt
    and half of what it writes), not on the mean of the measured contexts, which would send this short edit to
    the other lane."""
    cheap_early = (6.0, 7.0, 9.0, 12.0, 18.0, 30.0)  # after 128 tokens: drafted nodes cost little
    dear_late = (20.0, 40.0, 80.0, 140.0, 260.0, 500.0)  # after 2048: they cost much
    mean = tuple((a + b) / 2 for a, b in zip(cheap_early, dear_late, strict=True))
    nodes = (0, 1, 4, 8, 16, 32)
    curve = LatencyModel(nodes, mean, contexts=(128, 2048), by_context=(cheap_early, dear_late))
    llama = Lane("llama-cpp", _FakeEngine(), LLAMA_PREFILL, 110.0, latency=curve)
    router = Router(llama, _curved_router().lanes[1])
    edit = Promise(200, rate=0.95)
    assert llama.chain(edit, middle(100, 200)) == chain_ms_per_token(curve.at(200), 0.95, 32)
    assert llama.chain(edit, 100)[1] > llama.chain(edit, 3000)[1]  # longer chains where nodes are cheap
    assert llama.expected_ms(100, 200, edit) == pytest.approx(
        LLAMA_PREFILL(100) + 200 * min(llama.chain(edit, 200)[0], 1000 / 110)
    )
    assert router.lane_for(100, 200, edit) is llama
    # priced on the mean curve (as before), the same request would go to transformers
    mean_ms = LLAMA_PREFILL(100) + 200 * min(llama.chain(edit)[0], 1000 / 110)
    assert mean_ms > router.lanes[1].expected_ms(100, 200, edit) > llama.expected_ms(100, 200, edit)


def test_a_routed_request_with_a_prediction_gives_the_chosen_engines_own_output():
    first, second = Engine(tiny_model(seed=0), ByteTokenizer()), Engine(tiny_model(seed=1), ByteTokenizer())
    router = _curved_router((first, second), second=(80.0, FLAT_CURVE))
    ids = list(range(5, 25))
    alone = {e: e.generate(ids, max_new_tokens=24).token_ids for e in (first, second)}
    assert alone[first] != alone[second]  # the two engines differ
    said = []
    router.log = said.append
    predicted = router.generate(ids, max_new_tokens=24, prediction=alone[second])
    assert predicted.token_ids == alone[second]  # the flatter verifier's own output, its prediction drafted
    assert said[-1].startswith("routed to transformers: 20 prompt tokens, 24 new, a prediction of 24 tokens")
    assert "transformers chains of" in said[-1] and "llama-cpp chains of" in said[-1]
    assert router.generate(ids, max_new_tokens=24).token_ids == alone[first]
    assert said[-1].startswith("routed to llama-cpp: 20 prompt tokens, 24 new (expected")
    typical = router.generate(
        ids, max_new_tokens=24, prediction=alone[second], acceptance="typical", temperature=0.7, seed=0
    )
    assert said[-1].startswith("routed to llama-cpp") and typical.prediction is not None  # typical ignores it


def test_the_copy_rate_is_learned_from_predicted_requests_and_moves_the_next_ones():
    first, second = Engine(tiny_model(seed=0), ByteTokenizer()), Engine(tiny_model(seed=1), ByteTokenizer())
    router = _curved_router(
        (first, second)
    )  # this EPYC's curves: at the prior rate, predictions stay on llama-cpp
    ids = list(range(5, 25))
    right = first.generate(ids, max_new_tokens=24).token_ids
    assert router.copy_rate("prediction", router.lanes[0]).value == PREDICTED_RATE
    said = []
    router.log = said.append
    assert router.generate(ids, max_new_tokens=24, prediction=right).token_ids == right
    assert said[-1].startswith("routed to llama-cpp") and "copies right 0.75 of the time" in said[-1]
    assert (
        router.copy_rate("prediction", router.lanes[0]).value > 0.9
    )  # every copied chain was right: only the prior's wrong ones remain
    again = router.generate(ids, max_new_tokens=24, prediction=right)
    assert (
        said[-1].startswith("routed to transformers")
        and again.token_ids == second.generate(ids, max_new_tokens=24).token_ids
    )


def test_a_retry_of_a_prompt_the_shared_suffix_cache_answered_is_priced_by_that_answer():
    """A prompt the suffix cache answered before promises about that answer's length, copied at the cache's own
    learned rate: on a flat second verifier the retry moves there (a first request of it stayed on the fast
    decode), gives that engine's own output, and the two lanes share one cache (what one wrote, the other drafts)."""
    suffix = pytest.importorskip("entmtp.suffix")
    pytest.importorskip(
        "arctic_inference", reason="suffix drafts need arctic-inference (make setup installs it)"
    )
    first = Engine(tiny_model(seed=0), ByteTokenizer(), suffix=suffix.SuffixCache())
    second = Engine(tiny_model(seed=1), ByteTokenizer(), suffix=suffix.SuffixCache())
    alone = {
        e: Engine(e.model, ByteTokenizer()).generate(list(range(5, 25)), max_new_tokens=24).token_ids
        for e in (first, second)
    }
    router = _curved_router((first, second), second=(80.0, FLAT_CURVE))
    assert second.suffix is first.suffix is router.suffix
    ids, said = list(range(5, 25)), []
    router.log = said.append
    assert router.generate(ids, max_new_tokens=24).token_ids == alone[first]
    assert said[-1].startswith("routed to llama-cpp: 20 prompt tokens, 24 new (expected")
    retry = router.generate(ids, max_new_tokens=24)
    assert said[-1].startswith(
        "routed to transformers: 20 prompt tokens, 24 new, a prompt the suffix cache answered before in 24 tokens "
        "(copies right 0.75 of the time"
    )
    assert (
        retry.token_ids == alone[second] != alone[first]
    )  # the lane's own output, the cache's drafts verified
    assert (
        router.copy_rate("suffix", router.lanes[1]).value != PREDICTED_RATE
    )  # learned, apart from predictions'
    assert router.copy_rate("prediction", router.lanes[1]).value == PREDICTED_RATE


def test_a_retry_is_priced_at_the_copy_rate_of_the_weights_each_lane_decodes():
    """The suffix cache holds what the lanes wrote, so a lane that decodes other weights copies the other's
    answers less often: its retries' rate is learned apart, per weights, and stays at the prior until it runs
    some; lanes of the same weights share one. A prediction (the user's text) copies alike on any lane."""
    from entmtp.drafts import SUFFIX

    def router(weights):
        return Router(
            Lane("llama-cpp", _FakeEngine(), LLAMA_PREFILL, 110.0, weights[0], latency=LLAMA_CURVE),
            Lane("transformers", _FakeEngine(), TORCH_PREFILL, 30.0, weights[1], latency=TORCH_CURVE),
        )

    retry = Promise(200, PREDICTED_RATE, SUFFIX)
    mixed, same = router(("Q4_1 GGUF", "bfloat16")), router(("bfloat16", "bfloat16"))
    for r in (mixed, same):  # the llama.cpp lane's retries copied every token right
        r.copy_rate(SUFFIX, r.lanes[0]).right += 200
        r.copy_rate("prediction", r.lanes[0]).right += 200
    llama, torch_lane = (p.rate for p in mixed.offers(retry))
    assert llama > 0.95 and torch_lane == PREDICTED_RATE  # bf16 wrote none of those answers
    assert [p.rate for p in same.offers(retry)] == [llama, llama]
    edit = Promise(200, PREDICTED_RATE)
    assert [p.rate for p in mixed.offers(edit)] == [llama, llama]
    # the flatter verifier takes the retries only where its own rate is the learned one
    assert same._choose(20, 200, same.offers(retry)) is same.lanes[1]
    assert mixed._choose(20, 200, mixed.offers(retry)) is mixed.lanes[0]
    said = mixed._why(mixed.lanes[0], 20, 200, mixed.offers(retry))
    assert "copies right 1.00 of the time on llama-cpp, 0.75 of the time on transformers" in said


def test_the_copy_rate_is_a_censored_geometric_estimate():
    from entmtp.drafts import SourceCounts
    from entmtp.records import Step

    def step(drafted, accepted):
        return Step(
            "t",
            drafted,
            accepted,
            accepted + 1,
            [],
            drafts=SourceCounts.of(["prediction"] * drafted, range(1, accepted + 1)),
        )

    rate = CopyRate(right=0.0, wrong=0.0)
    rate.observe(
        [step(4, 4), step(4, 1), step(0, 0), step(3, 0)]
    )  # whole, stopped at 2nd, none drafted, at 1st
    assert (rate.right, rate.wrong) == (5, 2) and rate.value == pytest.approx(5 / 7)


def test_a_router_needs_each_lanes_decode_speed():
    with pytest.raises(EntMTPError, match="no expected decode speed"):
        _router(first_tps=0.0)


# ---- build: where routing applies -------------------------------------------------------------------------

SPEEDS = {"transformers/bfloat16": 40.0, "transformers/float32": 30.0, "llama-cpp/bfloat16": 90.0}


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """`build` over fake candidates (SPEEDS): what it loads, by candidate; tokenizers by backend."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_NO_PROBE", raising=False)
    loaded, tokenizers = [], {"transformers": "tok", "llama-cpp": "tok"}

    def fake_load(loader, spec, cand, budget, log):
        loaded.append(cand)
        tok = tokenizers[cand.split("/")[0]]
        model = build_mod.Loaded(build_mod.at(spec, cand), object(), tok, None, "none", None)
        policies = dict.fromkeys(ACCEPTANCE, StaticPolicy(Tree.root_only()))
        return build_mod._Option(
            model, build_mod.Composed(policies, "greedy", "plain", "test", SPEEDS[cand], {}, (), False)
        )

    prefill = {90.0: LLAMA_PREFILL, 40.0: TORCH_PREFILL, 30.0: TORCH_PREFILL, 50.0: LLAMA_PREFILL}
    monkeypatch.setattr(build_mod, "_load", fake_load)
    monkeypatch.setattr(build_mod, "_best_cases", lambda *a: {})  # every candidate measured
    monkeypatch.setattr(build_mod, "candidates", lambda spec, probe: list(SPEEDS))
    monkeypatch.setattr(build_mod, "_room_for_another", lambda model, cand: True)
    monkeypatch.setattr(build_mod, "assemble", lambda loaded, composed, spec: _FakeEngine(loaded.tokenizer))
    monkeypatch.setattr(build_mod, "_prefill", lambda option: prefill[option.composed.expected])
    return loaded, tokenizers


MIXED = build_mod.EngineSpec(mixed_weights=True)  # the Q4_1 GGUF's lane and bf16's may share requests


def test_auto_decodes_one_weights_format_unless_mixing_is_allowed(fake_build):
    """`--dtype auto` keeps the fastest candidate's weights for every request: llama.cpp's GGUF as given
    (Q4_1) and transformers' bf16 are other weights, so no route joins them, and the plan says why."""
    built = build_mod.build(build_mod.EngineSpec(), log=lambda m: None)
    assert isinstance(built.engine, _FakeEngine) and built.plan.backend == "llama-cpp"
    assert built.plan.route.startswith("none: llama-cpp decodes GGUF as given weights and the other backend")
    assert "--mixed-weights" in built.plan.route
    assert isinstance(build_mod.build(MIXED, log=lambda m: None).engine, Router)


def test_a_named_dtype_routes_between_backends_that_decode_its_weights(fake_build, monkeypatch):
    """`--dtype float32`: transformers in float32 and llama.cpp on the F32 GGUF decode the same weights, so
    requests are routed between them; naming a dtype and asking for mixed weights contradict each other."""
    speeds = {"llama-cpp/float32": 50.0, "transformers/float32": 30.0}
    monkeypatch.setitem(globals(), "SPEEDS", speeds)
    monkeypatch.setattr(build_mod, "candidates", lambda spec, probe: list(speeds))
    built = build_mod.build(build_mod.EngineSpec(dtype="float32"), log=lambda m: None)
    assert isinstance(built.engine, Router)
    assert [lane.weights for lane in built.engine.lanes] == ["float32", "float32"]
    with pytest.raises(
        EntMTPError, match="--mixed-weights routes between weights formats, and --dtype float32"
    ):
        build_mod.build(build_mod.EngineSpec(dtype="float32", mixed_weights=True), log=lambda m: None)


def test_auto_routes_between_the_fastest_candidate_and_the_other_backends_best(fake_build):
    loaded, _ = fake_build
    built = build_mod.build(MIXED, log=lambda m: None)
    assert isinstance(built.engine, Router)
    assert [(lane.backend, lane.tokens_per_second) for lane in built.engine.lanes] == [
        ("llama-cpp", 90.0),
        ("transformers", 40.0),
    ]
    assert built.plan.backend == "llama-cpp"
    assert (
        "route: prompts of >= " in built.plan.describe() and "tokens to transformers" in built.plan.describe()
    )
    loaded.clear()
    again = build_mod.build(MIXED, log=lambda m: None)  # cached: the two lanes, no third
    assert loaded == ["llama-cpp/bfloat16", "transformers/bfloat16"]
    assert isinstance(again.engine, Router) and again.plan.route == built.plan.route


def test_a_choice_cached_before_routing_is_measured_again_to_find_the_route(fake_build):
    loaded, _ = fake_build
    build_mod.build(MIXED, log=lambda m: None)
    path = costs_dir() / "dtype-choices.json"
    choices = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("route:")}
    path.write_text(json.dumps(choices))  # an older cache: the choice alone
    loaded.clear()
    built = build_mod.build(MIXED, log=lambda m: None)
    assert loaded == list(SPEEDS) and isinstance(built.engine, Router)


def test_no_route_when_asked_for_one_engine_or_the_backends_tokenize_differently(fake_build):
    _, tokenizers = fake_build
    one = build_mod.build(MIXED, log=lambda m: None, route=False)
    assert isinstance(one.engine, _FakeEngine) and one.plan.route.startswith(
        "off: every request on llama-cpp"
    )
    tokenizers["llama-cpp"] = "another"
    (costs_dir() / "dtype-choices.json").unlink()
    other = build_mod.build(MIXED, log=lambda m: None)
    assert isinstance(other.engine, _FakeEngine)
    assert other.plan.route == "none: transformers tokenizes differently, so every request runs on llama-cpp"


def test_a_named_backend_is_never_routed(fake_build, monkeypatch):
    monkeypatch.setattr(build_mod, "candidates", lambda spec, probe: ["transformers/bfloat16"])
    built = build_mod.build(build_mod.EngineSpec(backend="transformers"), log=lambda m: None)
    assert isinstance(built.engine, _FakeEngine) and built.plan.route == ""
    assert "route:" not in built.plan.describe()


def test_prefill_costs_are_measured_at_each_length_once_and_cached_beside_the_curve(monkeypatch, tmp_path):
    from entmtp.costs import prefill_for

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    model = tiny_model()  # a window of 512 tokens: the longest length is cut to fit
    first = prefill_for(model, None, progress=False)
    assert first.lengths == (64, 256, 510) and all(ms > 0 for ms in first.ms)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and read_record(files[0], PrefillCost) == first and first.key["prefill"] == [1]
    assert prefill_for(model, None, progress=False) == first  # read, not measured again


def test_auto_measures_only_the_candidates_that_can_still_win(fake_build, monkeypatch):
    """Before any curve, each candidate's best case (its plain step timed, every tree priced as one plain step:
    `_best_cases`); the most promising is measured first, and a candidate whose best case is below the
    measured leader is not measured at all (one line says why); one whose best case is not gets a tighter
    bound first (`bounds.floor_case`: its steps timed briefly at a few sizes). The fake best cases: llama.cpp at
    most 150 (measured 90); float32 at most 95, then at most 80 by its steps' sizes; bf16 at most 60."""
    loaded, _ = fake_build
    bounds = {
        "transformers/bfloat16": (30.0, 60.0),
        "transformers/float32": (35.0, 95.0),
        "llama-cpp/bfloat16": (8.0, 150.0),
    }
    floors = []
    low = build_mod.CostCurve((0, 1), (34.0, 40.0), (0.0, 0.0))

    def floor_case(loader, spec, cand):
        floors.append(cand)
        return low, (34.0, 80.0)

    monkeypatch.setattr(build_mod, "_best_cases", lambda *a: bounds)
    monkeypatch.setattr(bounds_mod, "floor_case", floor_case)
    said: list[str] = []
    built = build_mod.build(build_mod.EngineSpec(), log=said.append, route=False)
    assert loaded == ["llama-cpp/bfloat16"]  # neither could reach 90
    assert floors == ["transformers/float32"]  # bf16's first bound was enough
    assert built.plan.backend == "llama-cpp"
    text = "\n".join(said)
    assert "not measuring transformers/bfloat16: at most 60.0 tokens/s here (its plain step 30.0 ms" in text
    assert "not measuring transformers/float32: at most 80.0 tokens/s here (its steps timed briefly" in text
    assert "below llama-cpp/bfloat16's 90.0" in text
    assert "weighing llama-cpp/bfloat16, candidate 1 of 3" in said[0]
    assert "timing transformers/float32's steps briefly (~2 s): can it reach 90.0 tokens/s?" in text
    assert built.plan.backend_reason.endswith(
        "; not measured, at most: transformers/bfloat16 60.0, transformers/float32 80.0"
    )


@pytest.mark.parametrize("without_heads, measured", [(None, True), (91.0, True), (85.0, False)])
def test_a_candidate_whose_tighter_bounds_still_reach_the_leader_is_measured(
    fake_build, monkeypatch, without_heads, measured
):
    """float32's brief probe still reaches llama.cpp's 90 (91): its curve without heads is measured next and its
    heads' trees priced on it (None: a candidate without heads, which has no such step); measured fully only
    where that too reaches the leader."""
    loaded, _ = fake_build
    bounds = {"transformers/float32": (35.0, 95.0), "llama-cpp/bfloat16": (8.0, 150.0)}
    low = build_mod.CostCurve((0, 1), (34.0, 40.0), (0.0, 0.0))
    monkeypatch.setattr(build_mod, "candidates", lambda spec, probe: list(bounds))
    monkeypatch.setattr(build_mod, "_best_cases", lambda *a: bounds)
    monkeypatch.setattr(bounds_mod, "floor_case", lambda *a: (low, (34.0, 91.0)))
    found = None if without_heads is None else (low, (34.0, without_heads))
    monkeypatch.setattr(bounds_mod, "heads_less_case", lambda *a: found)
    said: list[str] = []
    build_mod.build(build_mod.EngineSpec(), log=said.append, route=False)
    assert loaded == ["llama-cpp/bfloat16"] + (["transformers/float32"] if measured else [])
    if not measured:
        assert "at most 85.0 tokens/s here (its curve without heads measured" in "\n".join(said)


def test_the_floor_prices_each_size_at_the_least_it_could_cost():
    """A step costs no less for more nodes, but where between two measured sizes it climbs is unknown: the
    floor holds each measured cost (shaved to its margin over a plain step) up to the next measured size, so
    it never exceeds a curve that climbs anywhere in between; interpolating would."""
    measured = build_mod.CostCurve((0, 1, 4, 8), (10.0, 14.0, 16.0, 30.0), (0.0,) * 4)
    low = bounds_mod.floor(measured, margin=0.5)
    sizes = range(0, 12)
    assert [float(low.latency()(n)) for n in sizes] == [10, 12, 12, 12, 13, 13, 13, 13, 20, 20, 20, 20]
    climbs_late = [10, 14, 14, 14, 16, 16, 16, 16, 30, 30, 30, 30]  # the same measured points, steps at them
    assert all(low.latency()(n) <= c for n, c in zip(sizes, climbs_late, strict=True))
    noisy = build_mod.CostCurve((0, 1, 2), (10.0, 14.0, 13.0), (0.0,) * 3)  # 2 nodes measured below 1's
    assert float(bounds_mod.floor(noisy, margin=1.0).latency()(2)) == 14.0


def test_the_best_case_is_skipped_where_a_route_needs_both_backends_or_there_is_one_candidate():
    spec = build_mod.EngineSpec(dtype="float32")
    assert build_mod._best_cases(None, spec, ["llama-cpp/float32", "transformers/float32"], True) == {}
    mixed = build_mod.EngineSpec(mixed_weights=True)
    assert build_mod._best_cases(None, mixed, ["llama-cpp/bfloat16", "transformers/bfloat16"], True) == {}
    assert build_mod._best_cases(None, build_mod.EngineSpec(), ["transformers/bfloat16"], True) == {}
