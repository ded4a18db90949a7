"""Suffix drafts across requests (suffix.py): what earlier generations wrote is drafted, never emitted
unverified. With a warm cache, greedy output equals plain greedy output token for token in float32, alone and as
batch rows, whatever the policy, and seeded gumbel sampling writes plain sampling's tokens; the cache stays under
its memory cap over 1,000 requests, and remembers which prompt each output it holds answered; callers kept apart
stay apart; the index asks the cache only where the text's own n-grams have nothing. Sampling with a warm cache:
tests/test_lossless.py."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.batch import generate_batch
from entmtp.engine import Engine
from entmtp.lookup import NgramIndex
from entmtp.policy import static

suffix = pytest.importorskip("entmtp.suffix")
pytest.importorskip("arctic_inference", reason="suffix drafts need arctic-inference (make setup installs it)")
SuffixCache, SuffixCaches, SuffixError = suffix.SuffixCache, suffix.SuffixCaches, suffix.SuffixError

PROMPTS = ['{"name": "Ada", "age": 36}\nExtract:', '{"name": "Alan", "age": 41}\nExtract:', "The cat sat on"]
N = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def plain(model):
    engine = Engine(model, ByteTokenizer())
    return {p: engine.generate(p, max_new_tokens=N, chat=False).token_ids for p in PROMPTS}


def _policies(model, reference):
    heads = OracleHeads(PROMPTS[0].encode() + bytes(reference[PROMPTS[0]]), num_heads=3, wrong_every=3)
    return {"plain": {}, "tree": {"heads": heads, "policy": static("tree_4")}}


@pytest.mark.parametrize("kind", ["plain", "tree"])
def test_a_warm_cache_drafts_what_earlier_requests_wrote_and_changes_no_greedy_token(model, plain, kind):
    engine = Engine(model, ByteTokenizer(), suffix=SuffixCache(), **_policies(model, plain)[kind])
    cold = [engine.generate(p, max_new_tokens=N, chat=False) for p in PROMPTS]
    warm = [engine.generate(p, max_new_tokens=N, chat=False) for p in PROMPTS]  # each output is cached now
    for p, c, w in zip(PROMPTS, cold, warm, strict=True):
        assert c.token_ids == plain[p] and w.token_ids == plain[p]
    copied = sum(s.lookup_accepted for r in warm for s in r.steps)
    assert copied > N, "the warm runs copied little from the cache: the premise failed"
    assert sum(len(r.steps) for r in warm) < sum(len(r.steps) for r in cold) / 2


def test_batch_rows_and_seeded_gumbel_sampling_are_unchanged_by_a_warm_cache(model, plain):
    engine = Engine(model, ByteTokenizer(), suffix=SuffixCache())
    reference = Engine(model, ByteTokenizer())
    for p in PROMPTS:
        engine.generate(p, max_new_tokens=N, chat=False)  # warm
    rows = generate_batch(engine, PROMPTS, max_new_tokens=N, chat=False)
    assert [r.token_ids for r in rows] == [plain[p] for p in PROMPTS]
    assert sum(s.lookup_accepted for r in rows for s in r.steps) > N
    kw = {"max_new_tokens": N, "chat": False, "temperature": 1.0, "acceptance": "gumbel"}
    for seed in range(4):
        for p in PROMPTS:
            assert (
                engine.generate(p, seed=seed, **kw).token_ids
                == reference.generate(p, seed=seed, **kw).token_ids
            )


def test_the_cache_stays_under_its_memory_cap_over_a_thousand_requests():
    rng = np.random.default_rng(0)
    cap = 256 * 1024
    cache = SuffixCache(max_bytes=cap)
    peak, evicted = 0, False
    for i in range(1000):
        session = cache.begin(rng.integers(0, 5000, int(rng.integers(20, 200))).tolist())
        for _ in range(4):
            session.extend(rng.integers(0, 5000, 40).tolist())
        session.end()
        peak = max(peak, cache.memory())
        evicted |= cache.cached() < i + 1
    assert peak <= cap and evicted
    assert cache.memory() > cap // 4  # it is used, not emptied


def test_the_cache_knows_the_prompts_its_outputs_answered_until_they_are_evicted():
    cache = SuffixCache()
    for prompt, output in (([1, 2, 3], [4, 5, 6]), ([1, 2, 3], [7, 8]), ([9], [])):
        session = cache.begin(prompt)
        session.extend(output)
        assert cache.answered(prompt) == (
            3 if prompt == [1, 2, 3] and output == [7, 8] else 0
        )  # not before its end
        session.end()
    assert cache.answered([1, 2, 3]) == 2  # the latest answer to it
    assert cache.answered([1, 2]) == 0 and cache.answered([9]) == 0  # another prompt; an empty answer
    small = SuffixCache(max_bytes=1)  # every finished output goes at once: so does what it answered
    session = small.begin([1, 2, 3])
    session.extend([4, 5, 6])
    session.end()
    assert small.answered([1, 2, 3]) == 0 and not small._prompts and not small._answers


def test_a_live_generation_keeps_its_output_and_an_abandoned_one_ends():
    cache = SuffixCache(max_bytes=1)  # every finished output goes at once
    live = cache.begin([1, 2, 3])
    live.extend([4, 5, 6, 7, 8])
    other = cache.begin([9])
    other.end()
    assert cache.cached() == 1  # the live one stays, over the cap
    assert live.draft([3, 4, 5], 8).tokens[:3] == (6, 7, 8)  # its own prompt and output
    del live  # dropped without end(): its finalizer ends it
    assert not cache._cache.active_requests


def test_callers_kept_apart_never_see_each_others_outputs():
    caches = SuffixCaches()
    a, b = caches.for_key("key-a"), caches.for_key("key-b")
    assert caches.for_key("key-a") is a and a is not b
    s = a.begin([7, 7])
    s.extend([1, 2, 3, 4, 5, 6, 7, 8])
    s.end()
    assert a.begin([0]).draft([1, 2, 3], 8).tokens[:3] == (4, 5, 6)
    assert b.begin([0]).draft([1, 2, 3], 8).tokens == ()


class Recorder:
    """A cross source that offers a fixed chain after a match of `match` tokens, recording what it is asked
    and told."""

    def __init__(self, chain, match):
        self.chain, self.match, self.asked, self.told = chain, match, [], []

    def draft(self, context, max_tokens):
        self.asked.append(list(context))
        return suffix.Draft(tuple(self.chain), (1.0,) * len(self.chain), self.match)

    def extend(self, tokens):
        self.told += list(tokens)


def test_the_index_ranks_the_cross_source_first_where_it_continues_a_longer_context():
    short = Recorder([50, 51, 52], match=1)
    index = NgramIndex([1, 2, 3, 1, 2], max_ngram=3, cross=short)
    assert index.candidates([3, 1, 2], 2) == ([3], 2)  # the text's own 2-gram beats a 1-token match
    long = Recorder([50, 51, 52], match=5)
    index = NgramIndex([1, 2, 3, 1, 2], max_ngram=3, cross=long)
    assert index.candidates([3, 1, 2], 2) == (
        [50, 3],
        3,
    )  # 5 tokens of context: first, the text's own after it
    index.extend([9])
    assert long.told == [9]  # told of what the text grows by, not of the prompt
    assert index.candidates([1, 2, 9], 1) == ([50], 3)  # asked again for the grown text
    assert index.candidates([2, 9, 50], 1) == ([51], 3)  # the chain's next, read off the same answer
    assert index.candidates([9, 50, 51], 1) == ([52], 3)
    assert index.candidates([4, 4, 4], 1) == ([], 0)  # off the chain and no n-gram: nothing
    assert long.asked == [[1, 2, 3, 1, 2], [1, 2, 3, 1, 2, 9]]  # once per size of the text


def test_without_arctic_inference_suffix_drafts_say_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(
        SuffixError, match="suffix drafts need arctic-inference: pip install arctic-inference"
    ):
        SuffixCache()
    with pytest.raises(SuffixError, match="max_bytes >= 1"):
        suffix.SuffixCache(max_bytes=0)


def test_a_bad_suffix_cache_size_or_a_missing_library_is_named_before_a_model_loads(monkeypatch):
    from entmtp.build import EngineSpec, check_spec
    from entmtp.errors import EntMTPError

    with pytest.raises(EntMTPError, match=r"--suffix-cache is megabytes \(0: off\), got -1"):
        check_spec(EngineSpec(suffix_cache=-1))
    check_spec(EngineSpec(suffix_cache=8))
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(SuffixError, match="suffix drafts need arctic-inference"):
        check_spec(EngineSpec(suffix_cache=8))
    check_spec(EngineSpec())  # off: nothing asked of the library
