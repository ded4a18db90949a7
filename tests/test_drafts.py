"""Draft sources (drafts.py): every drafted node of a step is counted under the source that drafted it, and every
accepted draft under the same. Per step the sources' drafted nodes add up to the tree's nodes and their accepted
drafts to the step's; the lookup kinds (the text's own n-grams, a prediction, the suffix cache) add up to
`lookup_accepted`. A right prediction's drafts are the prediction's, a warm suffix cache's the cache's, the text's
own repeats lookup's, the heads' the heads'. The sources that draft from tokens (the text's lookup, a prediction,
the suffix cache) are one protocol: begun over a prompt, told the emitted tokens, offering a continuation with
their own estimate (or none), ended. (A grammar's forced tokens: tests/test_constraints.py; the server's
metrics by source: tests/test_server.py.)"""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp import suffix
from entmtp.batch import generate_batch
from entmtp.drafts import COPIED, HEADS, LOOKUP, PREDICTION, SOURCES, SUFFIX, Draft, SourceCounts
from entmtp.engine import Engine
from entmtp.lookup import Lookup, NgramIndex, TextLookup
from entmtp.policy import static
from entmtp.prediction import Prediction
from entmtp.scheduler.hybrid import hybrid

PROMPT = "The cat sat on the mat. The cat sat on"
N = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def plain(model):
    return Engine(model, ByteTokenizer()).generate(PROMPT, max_new_tokens=N, chat=False).token_ids


def _accounted(result) -> SourceCounts:
    """The result's counts by source, once each step's add up to what the step drafted and accepted."""
    for s in result.steps:
        assert sum(s.drafts.drafted.values()) == s.tree_nodes, s
        assert sum(s.drafts.accepted.values()) == s.accepted, s
        assert sum(s.drafts.accepted.get(k, 0) for k in COPIED) == s.lookup_accepted, s
        assert set(s.drafts.drafted) <= set(SOURCES) and set(s.drafts.accepted) <= set(s.drafts.drafted)
    return result.drafts


def test_the_index_names_each_candidates_source():
    index = NgramIndex([7, 8, 9, 4, 7, 8, 5], max_ngram=2, prefix=[1, 7, 8, 6])
    found = index.ranked([7, 8], 3)
    # after (7, 8): the text's 9 and 5 (5 most recent first at equal counts) and the prediction's 6
    assert found.tokens == [5, 9, 6] and found.match == 2
    assert found.origins == [LOOKUP, LOOKUP, PREDICTION]
    assert index.candidates([7, 8], 3) == (found.tokens, found.match)  # the same ranking, without sources


def test_the_sources_that_copy_begin_offer_and_end_as_one_protocol():
    """The text's lookup, a prediction and the suffix cache answer the same faces (drafts.DraftSource): each,
    under its own name, begins a session over the prompt that is told the emitted tokens, offers its
    continuation of the text as a `Draft` (with its estimate of each token, or none), and ends."""
    prompt, out = [5, 1, 2, 3, 4, 9], [1, 2, 3]
    sources = [TextLookup(3), Prediction([1, 2, 3, 4, 8])]
    if suffix.available():
        cache = suffix.SuffixCache()
        earlier = cache.begin([7])
        earlier.extend([1, 2, 3, 4, 6])
        earlier.end()
        sources.append(cache)
    assert [s.name for s in sources] == [LOOKUP, PREDICTION, SUFFIX][: len(sources)]
    for source in sources:
        session = source.begin(prompt)
        session.extend(out)
        draft = session.draft(prompt + out, 4)
        assert isinstance(draft, Draft) and draft.tokens[0] == 4 and draft.match >= 3, source.name
        assert len(draft.probs) in (0, len(draft.tokens)), source.name
        session.end()
    estimated = [s.name for s in sources if s.begin(prompt).draft(prompt + out, 4).probs]
    assert estimated == [PREDICTION, SUFFIX][: len(sources) - 1]  # the text's own n-grams give none


def test_a_right_prediction_is_counted_as_the_predictions_drafts(model, plain):
    engine = Engine(model, ByteTokenizer())
    got = engine.generate(PROMPT, max_new_tokens=N, chat=False, prediction=plain)
    assert got.token_ids == plain
    drafts = _accounted(got)
    assert drafts.accepted[PREDICTION] >= N // 2 and HEADS not in drafts.drafted
    assert drafts.accepted[PREDICTION] > drafts.accepted.get(LOOKUP, 0)
    wrong = engine.generate(PROMPT, max_new_tokens=N, chat=False, prediction="zzzz qqqq " * 8)
    assert wrong.token_ids == plain and _accounted(wrong).accepted.get(PREDICTION, 0) == 0


def test_heads_and_the_texts_own_repeats_are_each_counted_as_theirs(model, plain):
    heads = OracleHeads(PROMPT.encode() + bytes(plain), num_heads=3, wrong_every=3)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=hybrid(static("chain_2"), Lookup()))
    got = engine.generate(PROMPT, max_new_tokens=N, chat=False)
    assert got.token_ids == plain
    drafts = _accounted(got)
    assert drafts.accepted[HEADS] > 0 and PREDICTION not in drafts.drafted and SUFFIX not in drafts.drafted
    assert sum(drafts.accepted.values()) == sum(s.accepted for s in got.steps)
    rows = generate_batch(engine, [PROMPT, PROMPT], max_new_tokens=N, chat=False, prediction=plain)
    for row in rows:  # batch rows count theirs the same way
        assert row.token_ids == plain and _accounted(row).accepted[PREDICTION] > 0


def test_a_warm_suffix_cache_is_counted_as_the_caches_drafts(model, plain):
    suffix = pytest.importorskip("entmtp.suffix")
    pytest.importorskip(
        "arctic_inference", reason="suffix drafts need arctic-inference (make setup installs it)"
    )
    engine = Engine(model, ByteTokenizer(), suffix=suffix.SuffixCache())
    engine.generate(PROMPT, max_new_tokens=N, chat=False)
    warm = engine.generate(PROMPT, max_new_tokens=N, chat=False)
    assert warm.token_ids == plain
    assert _accounted(warm).accepted[SUFFIX] >= N // 2


def test_counts_add_up_and_read_in_the_sources_order():
    a = SourceCounts.of([HEADS, LOOKUP, HEADS], accepted=[1, 2])
    assert a.drafted == {HEADS: 2, LOOKUP: 1} and a.accepted == {HEADS: 1, LOOKUP: 1}
    total = SourceCounts().add(a).add(SourceCounts.of([PREDICTION], accepted=[1]))
    assert list(total.to_json()) == [HEADS, LOOKUP, PREDICTION]
    assert total.describe() == "heads 1/2, lookup 1/1, prediction 1/1"
