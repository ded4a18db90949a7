"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics.

Bodies are read and validated here (not by FastAPI's automatic parsing) so that every client-caused failure
gets OpenAI's error shape with a 4xx status before any work starts: malformed or too deeply nested JSON, fields
of the wrong type or range, text that is not valid Unicode, OpenAI fields entmtp does not implement, empty
messages, max_tokens past the context window, a body over the size limit. Prompts are tokenized off the event
loop. Streaming uses server-sent events; a client that disconnects, streaming or not, cancels its generation
between two decode steps. On shutdown (`drain`) new requests get 503, open ones may finish until the drain
timeout, and those still open then are cut: a stream ends with an error event in OpenAI's shape and [DONE].

Every response carries X-Request-Id (the client's, when it sent a sane one, or a new one), and each request
is logged once at info level (logger "entmtp.server": client, method, path, status, seconds, request id).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..errors import EntMTPError
from ..model import check_request, encode_prompt
from . import schema
from .metrics import Metrics
from .worker import Cut, Job, QueueFull, Worker

log = logging.getLogger("entmtp.server")
PING_S = 15.0  # an SSE comment this often while a stream waits (queued): proxies keep the connection
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # echoed as given; anything else gets a new id


class _RequestLog:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide the client's disconnect from the routes): the
    X-Request-Id header, the per-request access log line, and the request counter by route template."""

    def __init__(self, app, metrics: Metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        status = 500  # what the client gets when the app raises before answering

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope["path"]
            # unknown paths share one label: a scan of random paths must not add a series per path
            self.metrics.requests.labels(
                endpoint=path if path in self.routes else "unmatched", status=str(status)
            ).inc()
            host, port = scope.get("client") or ("-", 0)
            log.info(
                '%s:%s "%s %s" %d %.3fs request_id=%s',
                host,
                port,
                scope["method"],
                path,
                status,
                time.perf_counter() - t0,
                rid,
            )


def create_app(
    engine: Engine, model_name: str, *, max_queue: int = 8, max_body_bytes: int = 1 << 20
) -> FastAPI:
    metrics = Metrics()
    worker = Worker(engine, max_queue, on_finish=metrics.finished)
    tokenize = ThreadPoolExecutor(1, thread_name_prefix="entmtp-tokenize")  # off the event loop
    token_text = schema.TokenText(engine.tokenizer)

    async def lifespan(app: FastAPI):
        yield
        worker.close()
        tokenize.shutdown(wait=False)

    app = FastAPI(title="entmtp", version="1", lifespan=lifespan)
    window = engine.window
    app.state.worker, app.state.metrics, app.state.draining = worker, metrics, False

    def error(
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        **headers,
    ):
        return JSONResponse(
            schema.error_body(message, kind, param, code), status_code=status, headers=headers or None
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: still OpenAI's shape
        return error(exc.status_code, str(exc.detail), kind="invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # never a traceback to the client
        log.exception("internal error (request_id=%s)", request.state.request_id, exc_info=exc)
        return error(500, f"internal error: {type(exc).__name__}", kind="server_error")

    async def read(request: Request, model: type[schema._Params]):
        """(validated request, None) or (None, error response)."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return None, error(
                413, f"request body of {size} bytes is over the limit of {max_body_bytes} bytes"
            )
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                return None, error(413, f"request body is over the limit of {max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except RecursionError:
            return None, error(400, "the request body is nested too deeply to be a request: flatten it")
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, an integer of 4300+ digits
            return None, error(400, f"the request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            return None, error(400, "the request body must be a JSON object")
        bad = schema.unsupported(data)
        if bad is not None:
            return None, error(400, *bad)
        try:
            return model.model_validate(data), None
        except ValidationError as e:
            message, param = schema.validation_message(e)
            return None, error(400, message, param)

    def prepare(req: schema._Params, prompt, chat: bool):
        """(prompt ids, Engine.stream kwargs) or raise EntMTPError naming the problem."""
        ids = list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None
        if ids is None:
            ids = encode_prompt(engine.tokenizer, prompt, chat=chat)
        if any(not 0 <= t < engine.model.config.vocab_size for t in ids):
            raise EntMTPError(f"prompt token ids must be in 0..{engine.model.config.vocab_size - 1}")
        limit = req.limit if req.limit is not None else min(schema.DEFAULT_MAX_TOKENS, window - len(ids))
        check_request(len(ids), limit, window, name="max_tokens")  # a PromptError: a 400 below
        kwargs = dict(max_new_tokens=limit, temperature=req.temperature or 0.0, seed=req.seed, stop=req.stop)
        if req.top_k is not None:
            kwargs["logprobs"] = req.top_k
        return ids, kwargs

    def shutting_down():
        return error(
            503,
            "the server is shutting down: retry on another instance",
            kind="server_error",
            code="shutdown",
        )

    async def complete(request: Request, chat: bool):
        req, bad = await read(request, schema.ChatRequest if chat else schema.CompletionRequest)
        if bad is not None:
            return bad
        if app.state.draining:
            return shutting_down()
        prompt = [{"role": m.role, "content": m.text()} for m in req.messages] if chat else req.prompt
        loop = asyncio.get_running_loop()
        try:  # a 10k-message chat template takes most of a second: not on the event loop
            ids, kwargs = await loop.run_in_executor(tokenize, prepare, req, prompt, chat)
        except EntMTPError as e:
            return error(400, str(e), "messages" if chat else "prompt")
        job = Job(ids, kwargs, loop)
        try:
            worker.submit(job)
        except QueueFull:
            wait = worker.retry_after()
            return error(
                503,
                f"the server is busy: {worker.max_queue} requests are already waiting; retry in {wait} s",
                kind="server_busy",
                **{"Retry-After": str(wait)},
            )
        rid = schema.new_id("chatcmpl" if chat else "cmpl")
        # the model that answers is reported, whatever the request named (one model per server)
        if req.stream:
            events = stream(job, rid, model_name, chat, req.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return await collect(request, job, rid, model_name, chat)

    async def watch_disconnect(request: Request, job: Job):
        """Cancel `job` when its client goes away (the body is read: the next message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()

    async def collect(request: Request, job: Job, rid: str, name: str, chat: bool):
        watcher = asyncio.create_task(watch_disconnect(request, job))
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
        return JSONResponse(schema.response(rid, name, chat, result, token_text))

    async def stream(job: Job, rid: str, name: str, chat: bool, include_usage: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        sent = offset = 0  # characters streamed; characters of the tokens streamed (completions' text_offset)
        try:
            if chat:
                yield sse(schema.chunk(rid, name, True, None, None, first=True))
            while True:
                try:
                    event = await asyncio.wait_for(job.next(), timeout=PING_S)
                except asyncio.TimeoutError:
                    yield ": ping\n\n"
                    continue
                if event is None:
                    break
                text = event.text
                if event.result is not None:  # the rest of the whole text (what the detokenizer held)
                    text = event.result.text[sent:]
                sent += len(text)
                lp = schema.logprobs(chat, event.logprobs, token_text, offset)
                if lp is not None and not chat:
                    offset += sum(len(t) for t in lp["tokens"])
                if text or lp:
                    yield sse(schema.chunk(rid, name, chat, text, None, lp=lp))
                if event.result is not None:
                    reason = schema.finish_reason(event.result.finish_reason)
                    yield sse(schema.chunk(rid, name, chat, None, reason))
                    if include_usage:
                        yield sse(schema.usage_chunk(rid, name, chat, event.result))
        except Cut as e:
            yield sse(schema.error_body(str(e), "server_error", code="shutdown"))
        except EntMTPError as e:
            yield sse(schema.error_body(str(e)))
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the stream still ends in OpenAI's shape
            log.exception("internal error in a stream (%s)", rid)
            yield sse(schema.error_body(f"internal error: {type(e).__name__}", "server_error"))
        finally:  # the client disconnected (the task is cancelled) or the stream ended
            job.cancel.set()
        yield "data: [DONE]\n\n"

    async def drain(timeout: float) -> None:
        """Stop taking requests; let open generations finish for up to `timeout` s; cut the rest."""
        app.state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not worker.idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not worker.idle:
            reason = f"the server is shutting down: generation cut after the drain timeout of {timeout:g} s"
            log.warning("cutting %d open generation(s) after the %g s drain", worker.cut_all(reason), timeout)

    app.state.drain = drain

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "entmtp"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        body = {"status": "ok", "model": model_name, "queue": worker.waiting, "running": worker.running}
        if app.state.draining:  # a load balancer sends no more requests here
            return JSONResponse({**body, "status": "draining"}, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus():
        metrics.queue.set(worker.waiting)
        metrics.running.set(worker.running)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_RequestLog, metrics=metrics, routes={r.path for r in app.routes})
    return app
