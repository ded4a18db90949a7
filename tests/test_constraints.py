"""Structured outputs and sampling controls (constraints.py, penalties.py, shaping.py): plain decoding under a
grammar and penalties is what their definitions say; speculative decoding under them writes plain decoding's
tokens (greedy, float32) whatever the tree, the drafts, the forced chains or the batch; every output of a JSON
Schema request validates, on both backends; bad constraints and controls are named.

Distribution tests (sampling under a grammar and penalties) live with the other lossless checks in
tests/test_lossless.py."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.accept import GenerationOptions
from entmtp.batch import generate_batch
from entmtp.constraints import Constraint, ConstraintError, apply_masks, one_token
from entmtp.engine import Engine, Pending
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, random_heads
from entmtp.lookup import Lookup
from entmtp.policy import static
from entmtp.scheduler.hybrid import hybrid
from entmtp.shaping import Shaping
from entmtp.tree import Tree

EOS = 0  # the tiny models' end-of-sequence byte (a grammar needs one)
PROMPT = list(b"name: ada, age: 36; name: bob, age: 41; name:")
N = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "regex": Constraint.regex(r"[a-e]{3,8}( [0-9]{1,3}){2,6}"),
    "json_schema": Constraint.json_schema(SCHEMA),
    "lark": Constraint.lark('start: "<" WORD ">" (" " WORD)* "</>"\nWORD: /[a-z]{1,5}/'),
}
PENALTIES = {
    "none": {},
    "all": dict(
        presence_penalty=1.5,
        frequency_penalty=0.8,
        repetition_penalty=1.3,
        logit_bias={"97": 2.0, "98": -100},
    ),
}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = tiny_model("llama", seed=3, eos_token_id=EOS)
    m.lm_head.weight.mul_(4.0)  # peaked enough that greedy paths are not ties
    return m


def engine(model, heads=None, policy=None) -> Engine:
    return Engine(model, ByteTokenizer(), heads=heads, policy=policy)


# ---- plain decoding is the definition ------------------------------------------------------------------------


@torch.inference_mode()
def reference(model, prompt, n, allowed=None, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy decoding written from the definitions (float64, the whole prefix each step): logits penalised by
    the counts of the tokens generated so far (repetition: of the prompt's too), biased, restricted to
    `allowed(generated)` (a set of ids, or None), argmax."""
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        for t in set(prompt + out):
            if repetition != 1:
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        for t, b in (bias or {}).items():
            logits[t] += b
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[sorted(allowed(out))] = True
            logits[~keep] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] == EOS:
            break
    return out


def test_plain_greedy_penalties_are_their_definitions(model):
    kw = dict(presence=1.0, frequency=0.7, repetition=1.4, bias={ord("e"): 3.0, ord(" "): -100.0})
    want = reference(model, PROMPT, N, **kw)
    got = engine(model).generate(
        PROMPT, max_new_tokens=N, presence_penalty=1.0, frequency_penalty=0.7, repetition_penalty=1.4,
        logit_bias={ord("e"): 3.0, str(ord(" ")): -100},
    ).token_ids  # fmt: skip
    assert got == want
    assert ord(" ") not in got  # a -100 bias bans the token
    assert got != reference(model, PROMPT, N)  # the premise: the penalties change the text


def test_plain_greedy_under_a_grammar_picks_the_best_allowed_token(model):
    """A regex whose allowed tokens are easy to state: three letters of a-c, then digits, ending after 4."""
    digits, letters = set(b"0123456789"), set(b"abc")

    def allowed(out):
        if len(out) < 3:
            return letters
        return digits if len(out) < 7 else {EOS}

    want = reference(model, PROMPT, N, allowed)
    got = engine(model).generate(
        PROMPT, max_new_tokens=N, response_format={"type": "regex", "regex": "[a-c]{3}[0-9]{4}"}
    )
    assert (
        got.token_ids == want[:-1]
    )  # the grammar's end: "stop" without the end token, which is all it allows
    assert got.finish_reason == "stop" and re.fullmatch(rb"[a-c]{3}[0-9]{4}", bytes(got.token_ids))


# ---- speculative decoding under shaping equals plain -------------------------------------------------------


DEEP = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]])


@pytest.mark.parametrize("penalties", list(PENALTIES))
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_speculative_greedy_under_a_grammar_and_penalties_equals_plain(model, kind, penalties):
    """Oracle heads drafting the constrained text (long accepted chains), random Hydra heads (drafts the grammar
    mostly forbids: pruned), a lookup hybrid, and batch rows beside unconstrained mates: each writes plain
    decoding's tokens, and steps were speculated and pruned (the premises)."""
    options = dict(max_new_tokens=N, response_format=CONSTRAINTS[kind], **PENALTIES[penalties])
    want = engine(model).generate(PROMPT, **options)
    oracle = OracleHeads(PROMPT + want.token_ids + [EOS] * 8, num_heads=4, rank_mod=2)
    hydra = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=4), seed=1, init="random")
    engines = {
        "oracle": engine(model, oracle, static(DEEP)),
        "hydra": engine(model, hydra, static(DEEP)),
        "lookup": engine(model, None, hybrid(None, Lookup(tokens=6))),
    }
    for name, e in engines.items():
        got = e.generate(PROMPT, **options)
        assert got.token_ids == want.token_ids, name
        assert got.finish_reason == want.finish_reason, name
    rows = generate_batch(engines["oracle"], [PROMPT, PROMPT[:20], PROMPT], **options)
    assert all(r.token_ids == want.token_ids for r in (rows[0], rows[2]))
    mate = generate_batch(engines["oracle"], [PROMPT[:20]], max_new_tokens=N)[0]  # an unconstrained row
    assert rows[1].token_ids != mate.token_ids or kind == "none"
    oracle_steps = engines["oracle"].generate(PROMPT, **options).steps
    assert sum(s.accepted for s in oracle_steps) >= len(want.token_ids) // 3, "the premise: drafts accepted"


def test_drafts_the_grammar_forbids_are_pruned_before_verification(model, monkeypatch):
    """Random heads draft bytes a JSON grammar mostly forbids: the verified trees are smaller than the chosen
    one, and no verified node holds a forbidden token."""
    hydra = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=4), seed=1, init="random")
    e = engine(model, hydra, static(DEEP))
    sizes = []
    real = Shaping.draft

    def spy(self, tree, tokens, origins):
        out = real(self, tree, tokens, origins)
        sizes.append((tree.num_nodes, out[0].num_nodes))
        assert len(out[3]) == out[0].num_nodes  # the kept nodes' sources, one each
        return out

    monkeypatch.setattr(Shaping, "draft", spy)
    e.generate(PROMPT, max_new_tokens=N, response_format=CONSTRAINTS["json_schema"])
    assert any(after < before for before, after in sizes)


def test_forced_tokens_are_drafted_as_chains_and_change_no_token(model, monkeypatch):
    """A JSON schema forces its keys and punctuation: steps draft them as chains (Step.forced) and the text is
    the one decoded without forced drafts, in fewer steps."""
    options = dict(max_new_tokens=N, response_format=CONSTRAINTS["json_schema"])
    got = engine(model).generate(PROMPT, **options)
    assert sum(s.forced for s in got.steps) >= 10
    assert all(s.tree.startswith("forced") for s in got.steps if s.forced)
    assert got.drafts.accepted["forced"] == sum(s.forced for s in got.steps)  # counted as the grammar's
    monkeypatch.setattr(Shaping, "forced", lambda self, cost, limit: [])
    without = engine(model).generate(PROMPT, **options)
    assert without.token_ids == got.token_ids
    assert len(got.steps) < len(without.steps) - 5


def test_a_row_that_allows_one_token_is_one_no_verification_reads():
    """`one_token`: the rows of a mask that allow exactly one token (any bit of any word, the sign bit too);
    a step reads every other node's logits, and every node's where log-probabilities are asked for."""
    masks = np.zeros((5, 4), dtype=np.int32)
    masks[0, 0] = 1 << 5  # one token
    masks[1, 3] = np.int32(-(2**31))  # one token: the word's top bit
    masks[2, 1] = 0b11  # two tokens
    masks[3, 0], masks[3, 2] = 1, 1  # two tokens, in two words
    masks[4] = -1  # every token (an end-of-sequence node's row)
    assert one_token(masks).tolist() == [True, True, False, False, False]
    step = Pending(Tree.root_only(), torch.tensor([0]), {}, {}, None, masks=masks)
    assert step.outputs(logprobs=False) == [False, False, True, True, True]
    assert step.outputs(logprobs=True) is None
    assert Pending(Tree.root_only(), torch.tensor([0]), {}, {}, None, masks=masks[2:]).outputs(False) is None


@pytest.mark.parametrize("vocab", [100, 128, 140])
def test_a_mask_keeps_the_allowed_logits_and_nothing_else(vocab):
    """`apply_masks`: each row keeps its logit where the token's bit is set and is -inf elsewhere (ids past the
    masks' vocabulary too), whether the row allows one token (the bit in any word, the sign bit, a bit past the
    logits' vocabulary), many, none, all, or all but a few; the logits are not changed."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, vocab, generator=g)
    before = logits.clone()
    masks = np.zeros((11, 4), dtype=np.int32)
    masks[0, 0] = 1 << 5  # one token
    masks[1, 3] = np.int32(-(2**31))  # one token, the top bit: id 127 (past a vocabulary of 100)
    masks[2, 1] = 0b11  # two tokens
    masks[3, 0], masks[3, 2] = 1, 1  # two tokens, in two words
    masks[4] = -1  # every token
    masks[5, 2] = 1 << 7  # one token: id 71
    masks[6] = np.frombuffer(np.random.default_rng(1).bytes(16), dtype=np.int32)  # many
    masks[8, 1] = 1 << 0  # one token: id 32
    masks[9], masks[9, 1] = -1, ~(1 << 3)  # every token but one: id 35
    masks[10], masks[10, 0], masks[10, 3] = -1, 0, np.int32(2**31 - 1)  # all but a word and the top id, 127
    expected = torch.full_like(logits, float("-inf"))
    for row in range(11):
        for t in range(min(vocab, 128)):
            if (int(masks[row, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = logits[row, t]
    got = apply_masks(logits, masks)
    assert torch.equal(got, expected) and torch.equal(logits, before)
    wide = torch.randn(3, 49152, generator=g)  # the embedded vocabulary: rows of many words
    masks = np.full((3, 1536), -1, dtype=np.int32)
    masks[0, 7] = ~(1 << 4)  # every token but id 228
    masks[1, :1000] = 0  # the first 32000 ids forbidden
    masks[2] = 0
    masks[2, 1535] = np.int32(-(2**31))  # the last id, 49151
    expected = torch.where(torch.from_numpy(_bits(masks, 49152)), wide, -torch.inf)
    assert torch.equal(apply_masks(wide, masks), expected)


def _bits(masks: np.ndarray, vocab: int) -> np.ndarray:
    """[n, vocab] bool, bit by bit: the reference of what `masks` allows."""
    ids = np.arange(vocab)
    return ((masks[:, ids // 32].astype(np.int64) >> (ids % 32)) & 1).astype(bool)


def test_a_masked_distribution_gives_the_policies_finite_signals():
    """The root's distribution under a grammar has -inf logits: its entropy is that of the allowed tokens, not
    NaN (0 log 0), so a policy reading it keeps choosing trees."""
    from entmtp.scheduler.signals import root_stats

    logits = torch.tensor([[2.0, 1.0, float("-inf"), float("-inf")]])
    entropy, top = root_stats(logits)[0].tolist()
    p = torch.softmax(torch.tensor([2.0, 1.0]), dim=0)
    assert entropy == pytest.approx(float(-(p * p.log()).sum())) and top == pytest.approx(float(p[0]))


def test_a_grammar_with_one_answer_is_written_in_one_step(model):
    got = engine(model).generate(
        PROMPT, max_new_tokens=N, response_format={"type": "regex", "regex": "abcdefgh"}
    )
    assert bytes(got.token_ids) == b"abcdefgh" and got.finish_reason == "stop"
    assert len(got.steps) <= 2


def test_json_outputs_parse_and_validate(model):
    """The tiny model writes nonsense, but valid nonsense: greedy and sampled, alone and as batch rows."""
    options = dict(
        max_new_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    texts = [engine(model).generate(PROMPT, **options).text]
    texts += [engine(model).generate(PROMPT, temperature=1.0, seed=s, **options).text for s in range(3)]
    texts += [r.text for r in generate_batch(engine(model), [PROMPT] * 3, temperature=0.8, **options)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


# ---- bad input is named ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response_format, words",
    [
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}},
            "uniqueItems",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "cannot be used"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, '"schema"'),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": False}}, "strict"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "object"),
        ({"type": "regex", "regex": "(unclosed"}, "regular expression"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "grammar"),
        ({"type": "xml"}, "one of"),
        ("json", "one of"),
    ],
)
def test_a_bad_response_format_is_named(response_format, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        GenerationOptions(response_format=response_format)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(presence_penalty=2.5), "presence_penalty must be a number from -2 to 2"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
        (dict(logit_bias={"x": 1}), "logit_bias keys are token ids"),
        (dict(logit_bias={"5": 101}), "from -100 to 100"),
        (dict(logit_bias={"5": True}), "from -100 to 100"),
    ],
)
def test_bad_controls_are_named(fields, words):
    with pytest.raises(EntMTPError, match=re.escape(words)):
        GenerationOptions(**fields)


def test_a_logit_bias_outside_the_vocabulary_is_named_by_the_engine(model):
    with pytest.raises(EntMTPError, match=re.escape("token ids in 0..255")):
        engine(model).generate(PROMPT, max_new_tokens=4, logit_bias={"256": 1})


def test_a_model_without_an_end_token_cannot_take_a_grammar():
    with pytest.raises(ConstraintError, match="end-of-sequence"):
        engine(tiny_model("llama")).generate(
            PROMPT, max_new_tokens=4, response_format={"type": "json_object"}
        )


# ---- the embedded model on both backends --------------------------------------------------------------------


EXTRACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "languages", "employed"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Garcia, 34, lives in Madrid, speaks Spanish and English, and works as a nurse.",
    "Kenji Watanabe is a retired teacher of 71 from Osaka who speaks Japanese.",
]


@pytest.mark.slow
def test_json_schema_outputs_validate_and_speculation_changes_no_token_on_both_backends(embedded):
    """On transformers float32 and llama.cpp's F32 GGUF, plain and with the shipped Hydra heads' tree_8: every
    output parses and validates, greedy and sampled, alone and as batch rows, and speculative greedy output is
    plain greedy output."""
    llama_cpp = pytest.importorskip("llama_cpp")  # noqa: F841
    from entmtp.backends.llama_cpp import embedded_f32_gguf, load_gguf
    from entmtp.model import embedded_model_dir
    from entmtp.shipped import resolve_heads

    gguf, tok = load_gguf(
        embedded_f32_gguf(), dtype=torch.float32, threads=2, tokenizer_dir=str(embedded_model_dir())
    )
    hf, hf_tok = embedded
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": EXTRACT}}
    prompts = [f"Extract the person's details as JSON.\n\n{t}" for t in TEXTS]
    for label, (m, t) in {"transformers": (hf, hf_tok), "llama-cpp": (gguf, tok)}.items():
        plain, tree = Engine(m, t), Engine(m, t, heads=resolve_heads("hydra", m), policy=static("tree_8"))
        for prompt in prompts:
            want = plain.generate(prompt, max_new_tokens=80, response_format=rf)
            jsonschema.validate(json.loads(want.text), EXTRACT)
            got = tree.generate(prompt, max_new_tokens=80, response_format=rf)
            assert got.token_ids == want.token_ids, (label, prompt)
            assert sum(s.forced for s in got.steps) > 0
        rows = generate_batch(tree, prompts + prompts, max_new_tokens=80, response_format=rf, temperature=0.7)
        for r in rows:
            jsonschema.validate(json.loads(r.text), EXTRACT)
