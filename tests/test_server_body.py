"""How the server takes a request in, without a model: its body (server/routes.py `read_body`): a body sent
in tiny parts is joined in linear time, a body that stops arriving gets a 408, a client that leaves gets its
one access-log line (499) and no traceback, a body over the limit gets a 413; and its prompt's tokenizer lane
(server/state.py): a short prompt is never queued behind long ones."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
from starlette.requests import Request  # noqa: E402

from entmtp.server.routes import _chars, read_body  # noqa: E402
from entmtp.server.state import LONG_PROMPT_CHARS, ServerState  # noqa: E402

GENEROUS_S = 20.0  # a bound far past what is asserted to happen at once: it fails a hang, not a busy machine


def _request(parts: list[bytes], then: str = "end", declared: int | None = None) -> Request:
    """A request whose body arrives as `parts`, then ends (`then`="end"), stalls for 10 s ("stall") or whose
    client leaves ("leave")."""
    size = declared if declared is not None else sum(map(len, parts))
    headers = [(b"content-length", str(size).encode())]
    messages = iter([{"type": "http.request", "body": p, "more_body": True} for p in parts])

    async def receive():
        message = next(messages, None)
        if message is not None:
            return message
        if then == "stall":
            await asyncio.sleep(
                10
            )  # before the 408, the body was awaited that long (forever, for a real one)
        if then == "leave":
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def _read(request: Request, max_body: int = 1 << 20, timeout: float = 5.0):
    return asyncio.run(read_body(request, max_body, timeout))


def test_a_body_sent_one_byte_at_a_time_is_read_in_linear_time():
    """Adding each part to bytes copied the whole body so far: 600k one-byte parts took seconds of the event
    loop (0.25 s for 100k, growing with the square); joined as a bytearray they take a fraction of that.
    Judged by how the time grows, not by a clock's bound: 6x the parts take ~6x the time when linear, ~36x
    when quadratic, whatever else loads the machine (both reads run under the same load)."""

    def seconds(n: int) -> float:
        body = b"x" * n
        t0 = time.perf_counter()
        assert _read(_request([body[i : i + 1] for i in range(n)])) == body
        return time.perf_counter() - t0

    seconds(10_000)  # warm
    small, large = min(seconds(100_000) for _ in range(2)), seconds(600_000)
    assert large / small < 15, f"600k parts took {large / small:.1f}x 100k's: not linear"


def test_a_body_that_stops_arriving_gets_a_408_that_closes_the_connection():
    t0 = time.perf_counter()
    r = _read(_request([b'{"mess'], then="stall", declared=1000), timeout=0.3)
    assert r.status_code == 408 and r.headers["connection"] == "close"
    message = json.loads(r.body)["error"]["message"]
    assert "did not arrive within 0.3 s" in message and "1000 bytes declared" in message
    assert time.perf_counter() - t0 < GENEROUS_S  # a bound that only a hang passes: the answer comes at 0.3 s


def test_a_client_that_leaves_mid_body_is_a_499_not_an_exception():
    """It raised ClientDisconnect: logged as a 500 with two tracebacks (the app's and uvicorn's)."""
    assert _read(_request([b'{"mess'], then="leave", declared=1000)).status_code == 499


def test_a_body_over_the_limit_gets_a_413_declared_or_as_read():
    assert _read(_request([b"x" * 11]), max_body=10).status_code == 413
    assert _read(_request([b"x" * 6, b"x" * 6], declared=5), max_body=10).status_code == 413
    assert _read(_request([b"x" * 6, b"x" * 4]), max_body=10) == b"x" * 10


def test_a_short_prompt_is_tokenized_while_long_ones_wait_for_the_tokenizer():
    """Twelve 1 MB prompts made a small chat take 3.1 s: it waited for their tokenization (~0.6 s each, one
    at a time). Prompts past LONG_PROMPT_CHARS have their own lane: a short one is tokenized at once."""
    state = ServerState(
        engine=None, model_name="m", worker=None, metrics=None, max_body_bytes=0, token_text=None
    )
    long = [{"role": "user", "content": "a lighthouse keeper " * 40_000}]
    short = [{"role": "user", "content": "Name three colors."}]
    release = threading.Event()
    try:
        waiting = [state.tokenizer_lane(_chars(long)).submit(release.wait, 30) for _ in range(3)]
        done = state.tokenizer_lane(_chars(short)).submit(lambda: "tokenized")
        assert done.result(timeout=5) == "tokenized" and not any(f.done() for f in waiting)
        assert _chars("x" * (LONG_PROMPT_CHARS + 1)) > LONG_PROMPT_CHARS >= _chars(short)
    finally:
        release.set()
        state.tokenize.shutdown()
        state.tokenize_long.shutdown()
