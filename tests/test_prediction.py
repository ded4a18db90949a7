"""Predicted Outputs (prediction.py): a request's expected output is drafted from, never emitted unverified.
Greedy output with a prediction (right, wrong, partly right, empty) is the output without one, token for token
in float32, alone and as batch rows, whatever the policy; the prediction's tokens join the lookup index ahead of
the text without an n-gram crossing into it; as a draft source it offers its continuation after the longest
stretch of the text it holds, estimated at its copy rate where the stretch says the text follows it; usage
counts the prediction's tokens found in the output; a bad prediction is named. Sampling with a prediction:
tests/test_lossless.py."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.batch import generate_batch
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.lookup import Lookup, NgramIndex, TextLookup
from entmtp.policy import StaticPolicy, static
from entmtp.prediction import (
    FOLLOWED,
    FOLLOWED_WEIGHT,
    MIN_ALIGN,
    PREDICTED_RATE,
    PREDICTION,
    Prediction,
    PredictionUsage,
    prediction_ids,
    prediction_usage,
)
from entmtp.records import StepContext
from entmtp.scheduler.hybrid import HybridPolicy, hybrid
from entmtp.scheduler.policies import LatencyModel
from entmtp.tree import Tree

PROMPTS = ["def add(a, b):\n    return a + b\n# again:\n", "The cat sat on the mat. The cat sat on"]
N = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def plain(model):
    engine = Engine(model, ByteTokenizer())
    return {p: engine.generate(p, max_new_tokens=N, chat=False).token_ids for p in PROMPTS}


def _text(ids) -> str:
    return ByteTokenizer().decode(ids)


def _predictions(out: list[int]) -> dict[str, object]:
    """Right (the output's ids), wrong, partly right (an edit: a stretch replaced, one inserted), empty, and a
    text (the random model's bytes decoded: a prediction right only where its bytes are valid UTF-8)."""
    edited = out[:10] + [ord("x")] * 5 + out[15:25] + [ord("y")] * 3 + out[25:]
    return {
        "right": list(out),
        "wrong": "zzzz qqqq " * 8,
        "partly right": edited,
        "empty": "",
        "text": _text(out),
    }


def _engines(model, reference: dict[str, list[int]]):
    """Plain, a static heads' tree, and heads with a prompt-lookup hybrid: each policy kind a prediction
    wraps (a hybrid's inner policy gets the prediction's longer branch)."""
    heads = OracleHeads(PROMPTS[0].encode() + bytes(reference[PROMPTS[0]]), num_heads=3, wrong_every=3)
    return {
        "plain": Engine(model, ByteTokenizer()),
        "tree": Engine(model, ByteTokenizer(), heads=heads, policy=static("tree_4")),
        "hybrid": Engine(model, ByteTokenizer(), heads=heads, policy=hybrid(static("chain_2"), Lookup())),
    }


@pytest.mark.parametrize("kind", ["right", "wrong", "partly right", "empty", "text"])
def test_greedy_output_with_a_prediction_is_the_output_without_one(model, plain, kind):
    for name, engine in _engines(model, plain).items():
        for prompt in PROMPTS:
            pred = _predictions(plain[prompt])[kind]
            got = engine.generate(prompt, max_new_tokens=N, chat=False, prediction=pred)
            assert got.token_ids == plain[prompt], f"{name}, {kind} prediction, {prompt!r}"
            assert got.prediction is not None


def test_a_right_prediction_is_drafted_and_accepted_in_long_chains(model, plain):
    engine = Engine(model, ByteTokenizer())
    prompt = PROMPTS[1]
    got = engine.generate(prompt, max_new_tokens=N, chat=False, prediction=plain[prompt])
    assert got.token_ids == plain[prompt]
    # chains sized on another CPU's cost curve (no curve given): several tokens a step, not one at a time
    assert got.num_steps <= N // 4 and max(s.accepted for s in got.steps) >= 4
    assert got.prediction == PredictionUsage(N, 0)


def test_batch_rows_with_and_without_predictions_each_get_their_own_output(model, plain):
    engine = _engines(model, plain)["tree"]
    rows = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    preds = [plain[PROMPTS[0]], None, "zzzz " * 6, plain[PROMPTS[1]][:12]]
    kw = dict(max_new_tokens=N, chat=False)
    results = [generate_batch(engine, [p], prediction=q, **kw)[0] for p, q in zip(rows, preds, strict=True)]
    assert [r.token_ids for r in results] == [plain[p] for p in rows]
    together = generate_batch(engine, rows[:2], **kw)  # one batch: rows without predictions
    assert [r.token_ids for r in together] == [plain[p] for p in rows[:2]]
    mixed = [generate_batch(engine, rows, prediction=q, **kw) for q in (preds[0], None)]
    assert all(r.token_ids == plain[p] for batch in mixed for r, p in zip(batch, rows, strict=True))


def test_the_prediction_sits_ahead_of_the_text_and_no_ngram_crosses_into_it():
    index = NgramIndex([7, 8, 9], max_ngram=3, prefix=[1, 2, 3])
    assert index.tokens == [1, 2, 3, 7, 8, 9] and index.start == 3
    assert index.candidates([1, 2], 4) == ([3], 2)  # the prediction continues itself
    assert index.candidates([2, 3], 4) == ([], 0)  # ... but its last token continues nothing of the text
    assert (3, 7) not in index.ends and (2, 3, 7) not in index.ends
    assert index.tail(5) == [7, 8, 9]  # a query's context is the text's
    index.extend([1, 2])
    assert index.candidates(index.tail(3), 2) == ([3], 2)  # the text meets the prediction: it copies on
    assert NgramIndex([1, 2, 3]).start == 0


def test_a_prediction_offers_its_continuation_after_the_longest_stretch_it_holds_at_its_copy_rate():
    source = Prediction([1, 2, 3, 4, 5, 6, 7, 2, 3, 9], rate=0.8)
    session = source.begin([0, 0])
    draft = session.draft([7, 1, 2, 3], 4)  # (1, 2, 3): the prediction's first stretch
    assert draft.tokens == (4, 5, 6, 7) and draft.match == 3
    assert draft.probs == pytest.approx((0.8, 0.8**2, 0.8**3, 0.8**4))  # right to each token, cumulative
    assert session.draft([6, 7, 2, 3], 4).tokens == (9,)  # the longer stretch (7, 2, 3) places it
    short = session.draft([5, 2, 3], 3)  # (2, 3) only: the earliest occurrence, and too short to estimate
    assert short.tokens == (4, 5, 6) and short.match == 2 < MIN_ALIGN and short.probs == ()
    assert (
        session.draft([42], 4).tokens == () and session.draft([3, 9], 4).tokens == ()
    )  # no stretch; the end
    with pytest.raises(EntMTPError, match=r"copy rate is a probability in \[0, 1\], got 1.5"):
        Prediction([1, 2], rate=1.5)


def test_where_the_text_follows_the_prediction_its_chain_is_priced_at_the_rate_the_text_kept_to_it():
    """A chain from where the text's last FOLLOWED tokens lie in the prediction is estimated at the rate the text
    has kept to the prediction from such alignments in this generation (from the flat rate, FOLLOWED_WEIGHT
    pseudo-tokens behind it); a chain the text has just re-aligned on (3 tokens) at the flat rate; a new
    generation's session starts again."""
    source = Prediction(list(range(100, 160)), rate=0.75)
    session = source.begin([1, 2])
    text = [1, 2, *range(100, 100 + FOLLOWED)]
    assert session.draft(text, 3).probs == pytest.approx((0.75, 0.75**2, 0.75**3))  # nothing seen yet
    session.extend(range(100, 100 + FOLLOWED + 20))  # the text keeps to it: 20 tokens emitted while followed
    kept = (20 + FOLLOWED_WEIGHT * 0.75) / (20 + FOLLOWED_WEIGHT)
    assert session.followed == pytest.approx(kept)
    text = [1, 2, *range(100, 100 + FOLLOWED + 20)]
    assert session.draft(text, 3).probs == pytest.approx((kept, kept**2, kept**3))
    assert session.draft([7, 130, 131, 132], 3).probs == pytest.approx((0.75, 0.75**2, 0.75**3))  # re-aligned
    session.extend([7] * 10)  # the text leaves it where it followed it (one token), then follows nothing
    assert session.followed == pytest.approx((20 + FOLLOWED_WEIGHT * 0.75) / (21 + FOLLOWED_WEIGHT))
    assert source.begin([1, 2]).followed == 0.75


def test_a_chain_the_text_has_followed_is_drafted_longer_than_before_any_evidence():
    """On a curve where drafted nodes are cheap (llama.cpp's AMX path here: 16 tokens ~3x a one-token decode),
    the hybrid drafts a followed prediction's chain as long as the text has kept to it: after 40 tokens of it,
    longer than the flat copy rate allows."""
    nodes = [0, 1, 2, 3, 5, 7, 11, 15, 23, 31]
    curve = LatencyModel(nodes, [6.0 * r for r in (1, 1.12, 1.26, 1.42, 1.82, 2.34, 2.77, 3.06, 4.56, 5.71)])
    lengths = []
    for followed in (0, 40):
        source = Prediction(list(range(100, 200)))
        index = TextLookup(3, source.begin([1, 2])).begin([1, 2])
        index.extend(range(100, 100 + FOLLOWED + followed))
        policy = HybridPolicy(StaticPolicy(Tree.root_only()), PREDICTION, curve)
        lengths.append(
            policy.choose(StepContext(0, len(index.tokens), 100, None, lookup=index)).tree.num_lookup
        )
    assert lengths[1] > 2 * lengths[0] > 0, lengths


def test_the_index_gives_a_chain_from_the_prediction_its_estimates_and_the_texts_own_none():
    prediction = Prediction([1, 2, 3, 4, 5, 6, 7, 8], rate=PREDICTED_RATE)
    index = TextLookup(3, prediction).begin([9, 1, 2, 3])
    assert index.tokens[: index.start] == prediction.tokens and index.prediction is prediction
    found = index.ranked(index.tail(3), 1)
    assert found.tokens == [4] and found.origins == ["prediction"]
    assert index.estimates(source="prediction") == pytest.approx([PREDICTED_RATE] * 5)  # 4 .. 8, each at q
    assert index.estimates(source="lookup") == [] and index.estimates(source="suffix") == []
    assert index.draft(index.tail(3), 10).tokens == (4, 5, 6, 7, 8)  # what a chain of lookup nodes drafts
    index.extend([7])  # (2, 3, 7) is in no stretch of the prediction's 3 or more: its chain is not estimated
    assert index.estimates(source="prediction") == []


def test_a_prediction_aligned_on_more_than_the_texts_ngrams_drafts_its_own_continuation():
    """A list's items: the text's last n-grams (".0, ") recur after every item, and the continuation they hold
    most often is the item just written, which is what prompt lookup alone would draft. The prediction, aligned
    on up to MAX_ALIGN tokens, knows the next one; its continuation ranks first where its alignment is longer
    than the text's own match, and a chain follows it item after item (each node placed in the chain by its
    depth, not by its last n-gram, which every item ends alike)."""
    dot, zero, comma = 60, 61, 62
    items = [t for d in (1, 2, 3, 4, 5) for t in (d, dot, zero, comma)]
    text = [9, *items[:8]]  # "1.0, 2.0, " written so far
    n_grams = NgramIndex(text, max_ngram=3, prefix=items)
    assert n_grams.candidates(n_grams.tail(3), 1)[0] == [2]  # the n-grams alone: the item just written
    index = TextLookup(3, Prediction(items)).begin(text)
    found = index.ranked(index.tail(3), 2, depth=0)
    assert found.tokens[0] == 3 and found.origins[0] == "prediction" and found.match == 3
    assert index.draft(index.tail(3), 12).tokens == tuple(items[8:])  # 3.0, 4.0, 5.0,
    assert index.estimates(source="prediction") == pytest.approx([PREDICTED_RATE] * 12)


def test_usage_counts_the_predictions_tokens_found_in_the_output_in_order():
    assert prediction_usage([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == PredictionUsage(4, 1)
    assert prediction_usage([1, 2, 3], [1, 2, 3]) == PredictionUsage(3, 0)
    assert prediction_usage([5, 6], [1, 2]) == PredictionUsage(0, 2)
    assert prediction_usage([], [1, 2]) == PredictionUsage(0, 0)
    assert prediction_usage([3, 1, 2], [1, 2, 3]) == PredictionUsage(2, 1)  # in order: one 3 is out of it


def test_a_prediction_policy_wraps_the_inner_policy_with_the_longer_branch(model, plain):
    heads = OracleHeads(list(range(8)), num_heads=3)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=hybrid(static("tree_4"), Lookup(tokens=5)))
    from entmtp.accept import Sampling

    wrapped = engine.policy_for(Sampling(0.0), predicted=True)
    assert isinstance(wrapped, HybridPolicy) and not isinstance(wrapped.inner, HybridPolicy)
    assert wrapped.lookup.tokens == PREDICTION.tokens and wrapped is engine.policy_for(Sampling(0.0), True)
    assert engine.policy_for(Sampling(0.7, "typical"), predicted=True) is engine.policy  # not lossless: none
    assert engine.scratch >= max(t.size for t in wrapped.trees) + PREDICTION.tokens


def test_a_bad_prediction_is_named():
    tok = ByteTokenizer()
    with pytest.raises(EntMTPError, match="more than the model's context window"):
        prediction_ids(tok, "x" * 600, window=512)
    with pytest.raises(EntMTPError, match="a prediction is a text"):
        prediction_ids(tok, [1.5, 2], window=512)
    with pytest.raises(EntMTPError, match=r"prediction token ids must be in 0\.\.255"):
        prediction_ids(tok, [1, 300], window=512, vocab_size=256)
    assert prediction_ids(tok, None, window=512) == [] and prediction_ids(tok, "ab", 512) == [97, 98]
