"""An HTTP request carried between two processes as plain data, and its answer as ASGI messages: how the Ray Serve
front hands a request to an engine replica (ray_serve.py), without Ray.

Replica side: `asgi_messages` runs `entmtp serve`'s own app (create_app) on a request and yields the messages
it sends (the response's start, then its body parts) as they come, so a stream stays a stream. Closing the
generator (the front went away) tells the app its client disconnected, which cancels the generation.

Front side: `relay` turns those messages back into a response. When they stop with an error (the replica
died, or Ray could not reach one), the client still gets OpenAI's error shape: before the answer started, a
503 JSON error; during a stream, an error event and [DONE]. Nothing is retried: a request never runs twice.
The error's code says why: `shutdown` when the application was shutting down (its replica was stopped past
its drain time, as `entmtp serve` cuts what is open past its own), else `replica_failed`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import schema
from .responses import error, shutting_down

log = logging.getLogger("entmtp.server")
HOP_HEADERS = {b"x-request-id", b"content-length", b"transfer-encoding", b"connection"}  # not relayed back
CUT_MESSAGE = (  # a stream the shutdown cut: `entmtp serve`'s reason, and what the client can do
    "the server is shutting down: this request was still open past the drain time and was cut, not "
    "completed; send it again"
)
Stopping = Callable[[], Awaitable[bool]]  # whether the application is shutting down (asked after a failure)


async def _never() -> bool:
    return False


def request_data(request: Request, body: bytes, request_id: str) -> dict:
    """What the engine replica needs of `request` to run it through its app: plain, picklable data. The
    request id goes with it, so the replica's log line and metrics name the id the client sees."""
    headers = [(k, v) for k, v in request.scope["headers"] if k not in (b"x-request-id", b"content-length")]
    headers += [(b"x-request-id", request_id.encode()), (b"content-length", str(len(body)).encode())]
    client = request.scope.get("client")
    return {
        "method": request.method,
        "path": request.url.path,
        "query_string": request.scope.get("query_string", b""),
        "headers": headers,
        "client": list(client) if client else None,
        "body": body,
    }


async def asgi_batches(app, data: dict) -> AsyncIterator[list[dict]]:
    """The ASGI messages `app` sends answering the request `data` (request_data's), in batches: each batch is
    what the app had sent by the time the previous one was taken, its consecutive body parts joined into one
    (`coalesce`), so a replica that falls behind its app sends one Ray message for several events, never
    waiting for more. Ends with the last body part. Closed early, the app sees its client disconnect, and its
    task is cancelled."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": data["method"],
        "scheme": "http",
        "path": data["path"],
        "raw_path": data["path"].encode(),
        "root_path": "",
        "query_string": data["query_string"],
        "headers": data["headers"],
        "client": tuple(data["client"]) if data["client"] else None,
        "server": None,
    }
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()  # set when this generator closes: the app's next receive is a disconnect
    body = [{"type": "http.request", "body": data["body"], "more_body": False}]

    async def receive() -> dict:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # the app returned (or raised): no more messages
    try:
        ended = False
        while not ended:
            batch, ended = _ready(await sent.get(), sent)
            if batch:
                yield coalesce(batch)
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=1.0)  # the app's own cleanup on the disconnect
            task.cancel()


def _ready(message: dict | None, sent: asyncio.Queue) -> tuple[list[dict], bool]:
    """`message` and those already waiting in `sent` after it (none is waited for), up to the answer's end;
    and whether the answer ended (its last body part, or None: the app returned)."""
    batch = []
    while message is not None:
        batch.append(message)
        if _is_last(message):
            return batch, True
        if sent.empty():
            return batch, False
        message = sent.get_nowait()
    return batch, True


def _is_last(message: dict) -> bool:
    return message["type"] == "http.response.body" and not message.get("more_body", False)


def coalesce(messages: list[dict]) -> list[dict]:
    """`messages` with each run of consecutive body parts joined into one body part (the bytes in order, the
    last part's more_body): the same bytes reach the client, in fewer messages. A stream's server-sent events
    stay whole (each part holds whole events), so a client reads the same events."""
    out: list[dict] = []
    for m in messages:
        if out and m["type"] == out[-1]["type"] == "http.response.body":
            joined = out[-1].get("body", b"") + m.get("body", b"")
            out[-1] = {"type": m["type"], "body": joined, "more_body": m.get("more_body", False)}
        else:
            out.append(m)
    return out


async def unbatched(batches: AsyncIterator[list[dict]]) -> AsyncIterator[dict]:
    """The messages of `batches` (asgi_batches's, through Ray), one by one: what `relay` reads. Closing it
    closes `batches` where they can be closed (Ray's response generator is stopped by its `cancel`)."""
    try:
        async for batch in batches:
            for message in batch:
                yield message
    finally:
        if hasattr(batches, "aclose"):
            await batches.aclose()


def asgi_messages(app, data: dict) -> AsyncIterator[dict]:
    """The ASGI messages of `app`'s answer to `data`, one by one (asgi_batches's, unbatched)."""
    return unbatched(asgi_batches(app, data))


async def relay(
    messages: AsyncIterator[dict], cancel: Callable[[], None], request_id: str, stopping: Stopping = _never
) -> Response:
    """The response to the client of the replica's `messages` (asgi_messages's, through Ray). `cancel()`
    stops the replica's side (the client left, or the answer ended early); `stopping()`, asked only when the
    messages fail, tells a shutdown's cut from a replica's failure."""
    cancel = _quiet(cancel)
    try:
        start = await anext(messages)
        first = await anext(messages)
    except asyncio.CancelledError:
        cancel()
        raise
    except Exception as e:  # noqa: BLE001 - Ray's errors: a dead replica, none reachable, a full queue
        cancel()
        return shutting_down() if await stopping() else failed_before_answer(e, request_id)
    status, headers = start["status"], _headers(start)
    if not first.get("more_body", False):  # a whole reply (JSON, an error): one part
        return Response(first.get("body", b""), status_code=status, headers=headers)
    is_sse = headers.get("content-type", "").startswith("text/event-stream")
    parts = _parts(first, messages, cancel, request_id, is_sse, stopping)
    return StreamingResponse(parts, status_code=status, headers=headers)


async def _parts(first: dict, messages: AsyncIterator[dict], cancel, request_id: str, is_sse: bool, stopping):
    """The body parts of a streamed reply; a replica's failure mid-stream ends it in OpenAI's shape."""
    ended = False
    try:
        yield first.get("body", b"")
        async for message in messages:
            yield message.get("body", b"")
            ended = not message.get("more_body", False)
        ended = True
    except Exception as e:  # noqa: BLE001 - the 200 is sent: the stream still ends in OpenAI's shape
        cut = await stopping()
        why = "was stopped by the shutdown" if cut else "failed"
        log.warning("request_id=%s: the replica %s during the stream: %s", request_id, why, _name(e))
        if is_sse:
            yield _last_event(e, cut)
    finally:
        if not ended:
            cancel()


def _last_event(e: Exception, cut: bool) -> bytes:
    """The error event and [DONE] that end a stream whose replica stopped: a shutdown's cut, or a failure."""
    if cut:
        body = schema.error_body(CUT_MESSAGE, "server_error", code="shutdown")
    else:
        body = schema.error_body(_failure_message(e), "server_error", code="replica_failed")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def failed_before_answer(e: Exception, request_id: str) -> JSONResponse:
    """A 503 in OpenAI's shape for a request that Ray could not run to its answer's start: the router's
    queue was full (Retry-After), no replica was up, or the replica died before answering."""
    log.warning("request_id=%s: no answer from a replica: %s", request_id, _name(e))
    if type(e).__name__ == "BackPressureError":
        message = "the server is busy: every replica's batch and queue are full; retry in 1 s"
        return error(503, message, kind="server_busy", **{"Retry-After": "1"})
    return error(503, _failure_message(e), kind="server_error", code="replica_failed")


def _quiet(cancel: Callable[[], None]) -> Callable[[], None]:
    """`cancel` that raises nothing: Ray's DeploymentResponseGenerator.cancel raises the call's own error
    again (a BackPressureError, a dead replica's) when the call failed, which is already being answered."""

    def quiet() -> None:
        try:
            cancel()
        except Exception as e:  # noqa: BLE001 - nothing is left to cancel
            log.debug("cancelling a failed call: %s", _name(e))

    return quiet


def _failure_message(e: Exception) -> str:
    return (
        f"the replica serving this request stopped ({_name(e)}: it died, or was shut down past its drain "
        "timeout); the request was not completed and not retried: send it again"
    )


def _name(e: Exception) -> str:
    return type(e).__name__


def _headers(start: dict) -> dict[str, str]:
    """The replica's response headers, less those the front's HTTP layer writes itself: the length, and
    X-Request-Id, which Ray's proxy adds to every response (the id the front passed on to the replica)."""
    return {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in start.get("headers", [])
        if k.lower() not in HOP_HEADERS
    }
