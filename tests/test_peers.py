"""Peer decoders: transformers' generate (plain and prompt lookup) pinned to plain greedy / temperature sampling,
equal to entmtp's plain decoding token for token in float32; llama.cpp only when installed."""

from __future__ import annotations

import sys

import pytest

from conftest import ByteTokenizer, tiny_model
from entmtp.bench.peers import LLAMA_CPP_HINT, HFGenerate, LlamaCppPlain, PeerUnavailable, llama_cpp_available
from entmtp.engine import Engine
from entmtp.errors import EntMTPError, PromptError
from entmtp.model import encode_prompt, eos_token_ids

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):",
]
REPEAT = (
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."
)


# -- tiny random model: fast checks of the generation config ----------------------------------------------------


def test_model_generation_config_is_overridden():
    """A model whose generation_config samples with top-k / top-p / repetition penalty still decodes plain
    greedy (equal to the Engine) and samples the plain temperature distribution (top_k=1 would make every
    sample the greedy output)."""
    model = tiny_model()
    cfg = model.generation_config
    cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty = True, 0.3, 1, 0.5, 1.5
    cfg.no_repeat_ngram_size, cfg.min_new_tokens = 2, 30
    tok = ByteTokenizer()
    ids = list(b"hello world, hello")
    plain = Engine(model, tok).generate(ids, max_new_tokens=24)
    peer = HFGenerate(model, tok)
    greedy = peer.generate(ids, max_new_tokens=24)
    assert greedy.token_ids == plain.token_ids
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 24
    samples = [peer.generate(ids, max_new_tokens=24, temperature=1.0, seed=s).token_ids for s in range(3)]
    assert any(s != greedy.token_ids for s in samples)


def test_eos_is_kept_and_ends_generation():
    model = tiny_model()
    tok = ByteTokenizer()
    ids = list(b"abc")
    free = HFGenerate(model, tok).generate(ids, max_new_tokens=12).token_ids
    eos = free[5]  # make the 6th greedy token (its first occurrence) the EOS
    first = free.index(eos)
    model = tiny_model(eos_token_id=eos)
    plain = Engine(model, tok).generate(ids, max_new_tokens=12)
    out = HFGenerate(model, tok).generate(ids, max_new_tokens=12)
    assert out.token_ids == free[: first + 1] == plain.token_ids
    assert out.finish_reason == "eos" == plain.finish_reason


def test_result_fields_and_names():
    model = tiny_model()
    tok = ByteTokenizer()
    out = HFGenerate(model, tok).generate([1, 2, 3], max_new_tokens=5)
    assert out.prompt_tokens == 3 and out.steps == [] and out.prefill_seconds == 0.0 and out.seconds > 0
    assert out.text == tok.decode(out.token_ids)
    assert HFGenerate(model, tok).name == "hf-generate"
    assert HFGenerate(model, tok, prompt_lookup_tokens=4).name == "hf-prompt-lookup"


def test_bad_arguments():
    model = tiny_model()
    tok = ByteTokenizer()
    peer = HFGenerate(model, tok)
    with pytest.raises(PromptError, match="empty"):
        peer.generate([], max_new_tokens=4)
    with pytest.raises(PromptError, match="max_new_tokens"):
        peer.generate([1], max_new_tokens=0)
    with pytest.raises(PromptError, match="context window"):
        peer.generate([1] * 500, max_new_tokens=20)
    with pytest.raises(EntMTPError, match="temperature"):
        peer.generate([1], max_new_tokens=4, temperature=-1.0)
    with pytest.raises(EntMTPError, match="prompt_lookup_tokens"):
        HFGenerate(model, tok, prompt_lookup_tokens=0)
    model.generation_config.suppress_tokens = [5]
    with pytest.raises(EntMTPError, match="suppress_tokens"):
        HFGenerate(model, tok)


# -- the embedded SmolLM2, float32 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_engine(embedded):
    model, tok = embedded
    return Engine(model, tok)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_engine_plain(embedded, plain_engine, prompt):
    model, tok = embedded
    ids = encode_prompt(tok, prompt)
    expected = plain_engine.generate(ids, max_new_tokens=24)
    out = HFGenerate(model, tok).generate(ids, max_new_tokens=24)
    assert out.token_ids == expected.token_ids
    assert out.finish_reason == expected.finish_reason
    assert out.text == expected.text


@pytest.mark.slow
def test_prompt_lookup_greedy_equals_plain(embedded):
    model, tok = embedded
    ids = encode_prompt(tok, REPEAT)
    plain = HFGenerate(model, tok).generate(ids, max_new_tokens=40)
    lookup = HFGenerate(model, tok, prompt_lookup_tokens=8).generate(ids, max_new_tokens=40)
    assert "banana, cherry" in plain.text  # the answer repeats the prompt: drafts get accepted
    assert lookup.token_ids == plain.token_ids
    assert lookup.finish_reason == plain.finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("lookup", [None, 8])
def test_sampling_is_seeded(embedded, lookup):
    model, tok = embedded
    peer = HFGenerate(model, tok, prompt_lookup_tokens=lookup)
    ids = encode_prompt(tok, PROMPTS[0])
    a, b, c = (peer.generate(ids, max_new_tokens=16, temperature=1.0, seed=s) for s in (7, 7, 8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert 0 < len(a.token_ids) <= 16


@pytest.mark.slow
def test_eos_on_short_answer(embedded, plain_engine):
    model, tok = embedded
    ids = encode_prompt(tok, "Say only: yes")
    out = HFGenerate(model, tok).generate(ids, max_new_tokens=40)
    assert out.finish_reason == "eos"
    assert out.token_ids[-1] in eos_token_ids(model, tok)
    assert out.token_ids == plain_engine.generate(ids, max_new_tokens=40).token_ids
    assert out.text.strip().lower().startswith("yes")


# -- llama.cpp ------------------------------------------------------------------------------------------------


def test_llama_cpp_missing_raises_with_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails as if not installed
    assert not llama_cpp_available()
    with pytest.raises(PeerUnavailable, match="pip install llama-cpp-python") as err:
        LlamaCppPlain("model.gguf", n_threads=2)
    assert LLAMA_CPP_HINT in str(err.value)
    assert isinstance(err.value, EntMTPError)


@pytest.mark.slow
def test_llama_cpp_plain_runs(embedded):
    pytest.importorskip("llama_cpp")
    peer = LlamaCppPlain(n_threads=2)
    ids = encode_prompt(embedded[1], "Say only: yes")  # the embedded GGUF shares the HF tokenizer's ids
    out = peer.generate(ids, max_new_tokens=8)
    assert 0 < len(out.token_ids) <= 8 and out.finish_reason in ("eos", "length")
    assert peer.generate(ids, max_new_tokens=8).token_ids == out.token_ids
    a, b = (peer.generate(ids, max_new_tokens=8, temperature=1.0, seed=3) for _ in range(2))
    assert a.token_ids == b.token_ids


@pytest.mark.slow
def test_llama_cpp_peer_runs_the_backends_settings_and_writes_its_plain_tokens(monkeypatch):
    """The bench's llama.cpp baseline is the backend's own plain decoding without entmtp's loop: the same
    attention kernel (flash attention on or off, as timed faster on this CPU, backends/attention.py; the two
    round differently: on this ShareGPT prompt the Q4_1 model's greedy texts part within 12 tokens), the same
    threads for prefill and decode, so its greedy tokens are the backend's, with either kernel."""
    pytest.importorskip("llama_cpp")
    from entmtp.backends.attention import ENV
    from entmtp.backends.llama_cpp import load_gguf
    from entmtp.model import embedded_model_dir
    from entmtp.prompts import load_prompts

    texts = {}
    for flash in ("1", "0"):
        monkeypatch.setenv(ENV, flash)
        peer = LlamaCppPlain(n_threads=1)
        assert peer.llm.context_params.n_threads_batch == peer.llm.context_params.n_threads == 1
        model, tok = load_gguf(peer.path, threads=1, tokenizer_dir=str(embedded_model_dir()))
        assert model.runtime.flash_attn is (flash == "1")
        ids = encode_prompt(tok, load_prompts("sharegpt", "test", 1)[0])
        texts[flash] = Engine(model, tok).generate(ids, max_new_tokens=12).token_ids
        assert peer.generate(ids, max_new_tokens=12).token_ids == texts[flash]
    assert texts["1"] != texts["0"]  # the setting reaches llama.cpp: each kernel rounds its own way
