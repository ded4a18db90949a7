"""What a request gets back: errors in OpenAI's shape, a whole reply once its generation ends, or a stream of
server-sent events. Both replies cancel their generation when the client goes away; a generation the server
cut (a shutdown past its drain time) ends a whole reply with a 503 and a stream with an error event and [DONE]."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import EntMTPError
from ..tools import OPEN, Tools
from . import schema
from .worker import Cut, Job

log = logging.getLogger("entmtp.server")
PING_S = 15.0  # an SSE comment this often while a stream waits (queued): proxies keep the connection
_PING = object()  # what `_next_or_ping` returns when no event came within PING_S


def error(
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    code: str | None = None,
    **headers,
) -> JSONResponse:
    return JSONResponse(
        schema.error_body(message, kind, param, code), status_code=status, headers=headers or None
    )


def shutting_down() -> JSONResponse:
    return error(
        503, "the server is shutting down: retry on another instance", kind="server_error", code="shutdown"
    )


def busy(max_queue: int, wait: int) -> JSONResponse:
    return error(
        503,
        f"the server is busy: {max_queue} requests are already waiting; retry in {wait} s",
        kind="server_busy",
        **{"Retry-After": str(wait)},
    )


@dataclass(frozen=True)
class Reply:
    """Who answers: the response id, the model reported, whether it is a chat completion, and the request's
    functions (tools.Tools: a reply that calls them answers with tool_calls)."""

    id: str
    model: str
    chat: bool
    tools: Tools | None = None


def streamed(job: Job, reply: Reply, token_text: schema.TokenText, include_usage: bool) -> StreamingResponse:
    """The streamed reply: server-sent events (`events`), never cached or buffered by a proxy."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        events(job, reply, token_text, include_usage), media_type="text/event-stream", headers=headers
    )


async def whole(request: Request, job: Job, reply: Reply, token_text: schema.TokenText) -> Response:
    """The non-streamed reply: the chat.completion or text_completion once `job` ends."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    result = None
    try:
        while (event := await job.next()) is not None:
            result = event.result or result
    except Cut as e:
        return error(503, str(e), kind="server_error", code="shutdown")
    except EntMTPError as e:
        return error(400, str(e))
    finally:
        watcher.cancel()
        job.cancel.set()  # no-op when it finished; stops it when this coroutine is cancelled
    if result is None:  # the client left and the generation stopped: nobody reads this
        return Response(status_code=499)
    return JSONResponse(schema.response(reply.id, reply.model, reply.chat, result, token_text, reply.tools))


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel `job` when its client goes away (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()


async def events(job: Job, reply: Reply, token_text: schema.TokenText, include_usage: bool):
    """Server-sent events of `job`'s chunks, pings while it waits, always ending in
    [DONE] (after an error event in OpenAI's shape when it failed or was cut)."""
    chunks = _Chunks(reply, token_text, include_usage)
    try:
        if reply.chat:
            yield _sse(schema.chunk(reply.id, reply.model, True, None, None, first=True))
        while (event := await _next_or_ping(job)) is not None:
            if event is _PING:
                yield ": ping\n\n"
                continue
            for obj in chunks.of(event):
                yield _sse(obj)
    except Cut as e:
        yield _sse(schema.error_body(str(e), "server_error", code="shutdown"))
    except EntMTPError as e:
        yield _sse(schema.error_body(str(e)))
    except Exception as e:  # noqa: BLE001 - the 200 is sent: the stream still ends in OpenAI's shape
        log.exception("internal error in a stream (%s)", reply.id)
        yield _sse(schema.error_body(f"internal error: {type(e).__name__}", "server_error"))
    finally:  # the client disconnected (the task is cancelled) or the stream ended
        job.cancel.set()
    yield "data: [DONE]\n\n"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _next_or_ping(job: Job):
    """`job`'s next event (None: over), or _PING when none came within PING_S."""
    try:
        return await asyncio.wait_for(job.next(), timeout=PING_S)
    except asyncio.TimeoutError:
        return _PING


class _Chunks:
    """One stream's chunks, event by event: its text piece and the logprobs of its tokens, then, with the
    last event, the rest of the text, the finish reason and (when asked) the usage. A token's logprobs go
    out with the text it writes: held back while the text is (it could begin a stop string), and cut where
    a stop string cuts the text (the engine's result has the tokens that write the reply, and no more)."""

    def __init__(self, reply: Reply, token_text: schema.TokenText, include_usage: bool):
        self.reply, self.token_text, self.include_usage = reply, token_text, include_usage
        self.sent = 0  # characters streamed
        self.sent_bytes = 0  # ... as UTF-8 bytes
        self.offset = 0  # characters of the tokens streamed (completions' text_offset)
        self.pending: list = []  # logprob items whose text is not streamed yet
        self.items = 0  # logprob items streamed
        self.item_bytes = 0  # ... and the bytes of their tokens
        self.held = ""  # text held back as a possible tool call (`_held`)
        self.text_streams = False  # the reply is a text answer: no more holding

    def _ready(self, event) -> list | None:
        """The logprob items to stream with `event` (None: logprobs were not asked for)."""
        result = event.result
        if result is not None:  # the last event: the result's items not streamed yet, all of them
            return None if result.logprobs is None else result.logprobs[self.items :]
        if event.logprobs is None:
            return None
        self.pending += event.logprobs
        ready = []
        while self.pending:
            size = len(self.token_text(self.pending[0].token_id)[1])
            if self.item_bytes + size > self.sent_bytes:
                break
            ready.append(self.pending.pop(0))
            self.item_bytes += size
        return ready

    def _held(self, event) -> bool:
        """Whether `event`'s text is held back as a possible tool call: a reply that may call the request's
        functions streams no text while its text so far could begin `<tool_call>` (under tool_choice
        "required" or a named function: never), and answers with the calls at its end."""
        tools = self.reply.tools
        if tools is None or self.text_streams:
            return False
        self.held += event.text if event.result is None else event.result.text[len(self.held) :]
        if tools.choice == "auto" and not (OPEN.startswith(self.held) or self.held.startswith(OPEN)):
            self.text_streams = True  # a text answer: what was held goes out now
            return False
        return True

    def of(self, event) -> Iterator[dict]:
        r, result = self.reply, event.result
        if self._held(event):
            if result is not None:
                calls = r.tools.parse(result.text)
                if calls:
                    yield schema.chunk(r.id, r.model, r.chat, None, None, calls=calls)
                else:  # cut short by the token limit: the text as it is
                    yield schema.chunk(r.id, r.model, r.chat, result.text, None)
                reason = schema.finish_reason(result.finish_reason, calls)
                yield schema.chunk(r.id, r.model, r.chat, None, reason)
                if self.include_usage:
                    yield schema.usage_chunk(r.id, r.model, r.chat, result)
            return
        text = event.text
        if result is not None:  # the rest of the whole text (what the detokenizer held)
            text = result.text[self.sent :]
        elif self.held:  # a text answer's start, held while it could have been a call
            text, self.held = self.held, ""
        self.sent += len(text)
        self.sent_bytes += len(text.encode("utf-8"))
        items = self._ready(event)
        budget = None
        if result is not None:
            budget = schema.stop_budget(result, result.text)
            budget = None if budget is None else budget - self.item_bytes
        lp = schema.logprobs(r.chat, items, self.token_text, self.offset, budget) if items else None
        if items:
            self.items += len(items)
        if lp is not None and not r.chat:
            self.offset += sum(len(t) for t in lp["tokens"])
        if text or lp:
            yield schema.chunk(r.id, r.model, r.chat, text, None, lp=lp)
        if result is not None:
            yield schema.chunk(r.id, r.model, r.chat, None, schema.finish_reason(result.finish_reason))
            if self.include_usage:
                yield schema.usage_chunk(r.id, r.model, r.chat, result)
