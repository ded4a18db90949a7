"""`entmtp serve` through a real server process: the official openai client, raw HTTP, streaming, the queue,
disconnects, bad input, metrics. Greedy answers are checked against plain greedy decoding (float32)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from entmtp.engine import Engine  # noqa: E402

pytestmark = pytest.mark.slow
MAX_BODY = 20_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    cmd = [sys.executable, "-m", "entmtp.cli", "serve", "--port", str(port), "--dtype", "float32"]
    cmd += [
        "--heads",
        "hydra",
        "--tree",
        "tree_4",
        "--lookup",
        "--max-queue",
        "2",
        "--max-body",
        str(MAX_BODY),
    ]
    env = dict(os.environ, ENTMTP_TEST_THREADS="2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not start in 180 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain(embedded):
    model, tokenizer = embedded
    return Engine(model, tokenizer)


CHAT = [{"role": "user", "content": "Name three colors, one per line."}]


def test_chat_streamed_equals_non_streamed_equals_plain_greedy(client, plain):
    resp = client.chat.completions.create(model="m", messages=CHAT, max_tokens=24, temperature=0)
    text = resp.choices[0].message.content
    pieces = []
    for chunk in client.chat.completions.create(
        model="m",
        messages=CHAT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text == plain.generate(CHAT, max_new_tokens=24).text
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.object == "chat.completion"
    assert usage.completion_tokens == resp.usage.completion_tokens > 0
    extras = resp.model_dump()["usage"]["entmtp"]
    assert extras["steps"] >= 1 and extras["tokens_per_step"] >= 1.0


def test_completions_and_stop_strings(client, plain):
    resp = client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert (
        resp.choices[0].text == plain.generate("The capital of France is", max_new_tokens=8, chat=False).text
    )
    stopped = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=24, temperature=0, stop=["\n"]
    )
    assert "\n" not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_repeats(client):
    a = client.chat.completions.create(model="m", messages=CHAT, max_tokens=12, temperature=0.8, seed=3)
    b = client.chat.completions.create(model="m", messages=CHAT, max_tokens=12, temperature=0.8, seed=3)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_concurrent_requests_each_get_their_own_answer(client, plain):
    prompts = ["Count from 1 to 5.", "Say hello in French.", "What is 2+2?"]
    want = {p: plain.generate([{"role": "user", "content": p}], max_new_tokens=16).text for p in prompts}
    got: dict[str, str] = {}

    def ask(p):
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
        )
        got[p] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_a_full_queue_answers_503_with_retry_after(server):
    body = {"messages": CHAT, "max_tokens": 48, "temperature": 0}
    results = []

    def post():
        results.append(httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120))

    threads = [threading.Thread(target=post) for _ in range(6)]  # 1 running + 2 waiting fit; 3 do not
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 3 and 503 in codes
    busy = next(r for r in results if r.status_code == 503)
    assert busy.headers["retry-after"] and busy.json()["error"]["type"] == "server_busy"


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


def test_a_client_that_disconnects_stops_its_generation(server, client):
    before = _metric(server, "entmtp_cancelled_generations_total")
    body = {"messages": CHAT, "max_tokens": 400, "temperature": 0.9, "seed": 1, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data:") for line in got)
    deadline = time.time() + 20
    while _metric(server, "entmtp_cancelled_generations_total") <= before and time.time() < deadline:
        time.sleep(0.2)
    assert _metric(server, "entmtp_cancelled_generations_total") == before + 1
    t0 = time.time()  # the device is free again: a short request is answered at once
    client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0)
    assert time.time() - t0 < 15


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"messages": CHAT, "max_tokens": "many"}, 400, "max_tokens"),
        ({"messages": CHAT, "stream": {"a": 1}}, 400, "stream"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "   "}]}, 400, "empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"messages": CHAT, "max_tokens": 100_000}, 400, "context window"),
        ({"messages": CHAT, "temperature": -1}, 400, "temperature"),
        ({"messages": CHAT, "top_p": 0.5}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}, 413, "over the limit"),
        ({"prompt": 12}, 400, "prompt"),
    ],
)
def test_bad_input_gets_a_4xx_in_openai_error_shape(server, body, status, words):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] and "Traceback" not in r.text


def test_unknown_routes_and_the_client_error_class(server, client):
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=100_000)


def test_metrics_parse_as_prometheus_text(server, client):
    client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0)
    names = {f.name for f in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)}
    assert {
        "entmtp_requests",
        "entmtp_generated_tokens",
        "entmtp_tokens_per_step",
        "entmtp_queue_length",
    } <= names
    assert {"entmtp_tree_steps", "entmtp_tokens_per_second", "entmtp_running"} <= names
    assert _metric(server, "entmtp_generated_tokens_total") > 0
