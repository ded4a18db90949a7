"""`entmtp serve --backend llama-cpp` through a real server process: on the embedded model's F32 GGUF, greedy
replies are the backend's own plain greedy decoding (streamed or not, cut at a stop string), a seeded sampled
row repeats beside batch-mates, and the structured outputs clients send work end to end: JSON Schema
(`response_format`), function calling (`tools`, `tool_choice`), a regular expression on /v1/completions,
`logit_bias` and the penalties; bad ones are 400s naming their field."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp", reason="the llama-cpp extra is not installed (make setup installs it)")

from entmtp.engine import Engine  # noqa: E402
from servers import start_server, stop  # noqa: E402

pytestmark = pytest.mark.slow
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
EXTRACT = [
    {
        "role": "user",
        "content": "Extract the person as JSON: Maria Garcia, 34, lives in Madrid and speaks Spanish and English.",
    }
]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]
CHAT = [{"role": "user", "content": "Name three colors, one per line."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url, _ = start_server(
        tmp_path_factory.mktemp("serve-llama"), "--backend", "llama-cpp", "--max-batch", "4", "--threads", "2"
    )
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain():
    """The backend's own plain decoding in this process: the embedded model's F32 GGUF, no heads."""
    from entmtp.backends.llama_cpp import embedded_f32_gguf, load_gguf
    from entmtp.model import embedded_model_dir

    model, tok = load_gguf(
        embedded_f32_gguf(), dtype=torch.float32, threads=2, tokenizer_dir=str(embedded_model_dir())
    )
    return Engine(model, tok)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, **kw)


def _streamed(client, messages, **kw):
    """(text, tool call deltas, finish reason) of a streamed reply."""
    text, calls, finish = [], [], None
    for chunk in _chat(client, messages, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text), calls, finish


# ---- the backend's own decoding, over HTTP ----------------------------------------------------------------


def test_greedy_replies_are_the_backends_plain_greedy_streamed_or_not_and_cut_at_a_stop(client, plain):
    want = plain.generate(CHAT, max_new_tokens=24).text
    whole = _chat(client, CHAT, max_tokens=24, temperature=0).choices[0].message.content
    streamed, _, _ = _streamed(client, CHAT, max_tokens=24, temperature=0)
    assert whole == streamed == want
    stop = want.split()[1]
    cut = _chat(client, CHAT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == want.split(stop)[0] and cut.choices[0].finish_reason == "stop"


def test_a_seeded_sampled_row_repeats_beside_batch_mates(client):
    ask = dict(max_tokens=24, temperature=0.9, seed=7)
    alone = _chat(client, CHAT, **ask).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        mates = [pool.submit(_chat, client, EXTRACT, max_tokens=24, temperature=0.5) for _ in range(3)]
        beside = pool.submit(_chat, client, CHAT, **ask)
        assert beside.result().choices[0].message.content == alone
        assert all(m.result().choices[0].message.content for m in mates)


# ---- structured outputs --------------------------------------------------------------------------------------


def test_a_json_schema_reply_validates_and_is_plain_constrained_greedy(client, plain):
    reply = _chat(client, EXTRACT, max_tokens=80, temperature=0, response_format=JSON_FORMAT)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert text == plain.generate(EXTRACT, max_new_tokens=80, response_format=JSON_FORMAT).text
    assert reply.choices[0].finish_reason == "stop"
    streamed, _, _ = _streamed(client, EXTRACT, max_tokens=80, temperature=0, response_format=JSON_FORMAT)
    assert streamed == text


# the person with bounded strings: every reply the grammar allows fits in SAMPLED_TOKENS (a token is at least
# one character), so a sampled reply that rambles inside a string still closes its object before the limit
BOUNDED = {
    **PERSON,
    "properties": {
        **PERSON["properties"],
        "name": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 24},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
}
SAMPLED_TOKENS = 200


def test_json_replies_validate_sampled_and_as_batch_rows(client):
    bounded = {"type": "json_schema", "json_schema": {"name": "person", "schema": BOUNDED, "strict": True}}
    asks = [dict(temperature=t, seed=s) for t, s in ((0, None), (0.8, 1), (1.0, 2), (0.7, None))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = [
            pool.submit(_chat, client, EXTRACT, max_tokens=SAMPLED_TOKENS, response_format=bounded, **a)
            for a in asks
        ]
        for r in replies:
            choice = r.result().choices[0]
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), BOUNDED)
    obj = _chat(client, EXTRACT, max_tokens=80, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_regex_on_completions_is_matched(server):
    body = {
        "prompt": "The date of the first moon landing, as YYYY-MM-DD:",
        "max_tokens": 20,
        "temperature": 0,
        "response_format": {"type": "regex", "regex": r" ?\d{4}-\d{2}-\d{2}"},
    }
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r" ?\d{4}-\d{2}-\d{2}", r.json()["choices"][0]["text"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_tool_call_is_answered_with_valid_arguments(client, choice):
    reply = _chat(
        client, ASK_WEATHER, max_tokens=60, temperature=0, tools=[TIME, WEATHER], tool_choice=choice
    )
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    text, calls, finish = _streamed(
        client, ASK_WEATHER, max_tokens=60, temperature=0, tools=[TIME, WEATHER], tool_choice=choice
    )
    assert text == "" and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_tool_choice_none_and_auto(client):
    """none: a text answer; auto: a text answer or a valid call, streamed as the whole reply is; a tool's result
    sent back in the next turn is read."""
    none = _chat(client, ASK_WEATHER, max_tokens=30, temperature=0, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    auto = _chat(client, ASK_WEATHER, max_tokens=60, temperature=0, tools=[WEATHER])
    calls = auto.choices[0].message.tool_calls
    if calls:
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    else:
        assert auto.choices[0].message.content
    text, streamed_calls, _ = _streamed(client, ASK_WEATHER, max_tokens=60, temperature=0, tools=[WEATHER])
    assert (text or None) == auto.choices[0].message.content and bool(streamed_calls) == bool(calls)
    turn = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]  # fmt: skip
    after = _chat(client, turn, max_tokens=30, temperature=0, tools=[WEATHER], tool_choice="none")
    assert after.choices[0].message.content


def test_logit_bias_and_penalties_change_the_text_as_asked(client):
    base = _chat(client, CHAT, max_tokens=24, temperature=0).choices[0].message.content
    lp = _chat(client, CHAT, max_tokens=1, temperature=0, logprobs=True).choices[0].logprobs.content[0]
    token_id = _token_id(client, lp)
    banned = _chat(client, CHAT, max_tokens=24, temperature=0, logit_bias={str(token_id): -100})
    assert banned.choices[0].message.content and not banned.choices[0].message.content.startswith(lp.token)
    assert base.startswith(lp.token)  # the premise: the banned token is the greedy reply's first
    penalised = _chat(client, CHAT, max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != base


def _token_id(client, lp) -> int:
    """The id of a logprobs entry's token (its bytes, through the embedded tokenizer)."""
    from transformers import AutoTokenizer

    from entmtp.model import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    ids = tok.encode(bytes(lp.bytes).decode("utf-8"), add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format",
        ),
        ({"messages": CHAT, "logit_bias": {"1": 500}}, "logit_bias"),
        ({"messages": CHAT, "presence_penalty": 9}, "presence_penalty"),
        ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "x", "parameters": 1}}]},
            "tools",
        ),
    ],
)
def test_a_bad_structured_field_is_a_400_naming_it(server, body, param):
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- `auto`: the backend chosen by measurement ------------------------------------------------------------


def test_serve_with_auto_chooses_a_backend_by_measurement_and_answers_as_plain_float32(tmp_path, embedded):
    """`entmtp serve --backend auto --dtype float32` measures both backends (this machine's costs, not the
    profiles'), serves on the one it chose (its log and /health say which), and replies with plain float32
    greedy decoding's tokens whichever it is (transformers float32 and llama.cpp's F32 GGUF decode the same)."""
    proc, url, log = start_server(tmp_path, "--backend", "auto", "--max-batch", "2", probe=True)
    try:
        weights = httpx.get(f"{url}/health", timeout=30).json()["weights"]
        assert "float32" in weights or "F32" in weights, weights
        model, tok = embedded
        want = Engine(model, tok).generate(CHAT, max_new_tokens=24).text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert _chat(client, CHAT, max_tokens=24, temperature=0).choices[0].message.content == want
    finally:
        stop(proc)
    said = log.read_text()
    assert "llama.cpp" in said or "transformers" in said, said[-2000:]
