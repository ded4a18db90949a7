"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics.

Bodies are read and validated here (not by FastAPI's automatic parsing) so that every bad request gets
OpenAI's error shape with a 4xx status: malformed JSON, fields of the wrong type, empty messages, max_tokens
past the context window, a body over the size limit. Streaming uses server-sent events (sse-starlette); a
client that disconnects cancels its generation between two decode steps.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..errors import EntMTPError
from ..model import check_request, encode_prompt
from . import schema
from .metrics import Metrics
from .worker import Job, QueueFull, Worker

RETRY_AFTER_S = 2  # what a 503 tells the client to wait


def create_app(
    engine: Engine, model_name: str, *, max_queue: int = 8, max_body_bytes: int = 1 << 20
) -> FastAPI:
    metrics = Metrics()
    worker = Worker(engine, max_queue, on_finish=metrics.finished)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.close()

    app = FastAPI(title="entmtp", version="1", lifespan=lifespan)
    window = engine.window
    app.state.worker, app.state.metrics = worker, metrics

    def error(
        status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", **headers
    ):
        return JSONResponse(
            schema.error_body(message, kind, param), status_code=status, headers=headers or None
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: still OpenAI's shape
        return error(exc.status_code, str(exc.detail), kind="invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # never a traceback to the client
        return error(500, f"internal error: {type(exc).__name__}", kind="server_error")

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(endpoint=request.url.path, status=str(response.status_code)).inc()
        return response

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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, error(400, f"the request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            return None, error(400, "the request body must be a JSON object")
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
        return ids, kwargs

    async def complete(request: Request, chat: bool):
        req, bad = await read(request, schema.ChatRequest if chat else schema.CompletionRequest)
        if bad is not None:
            return bad
        prompt = [{"role": m.role, "content": m.text()} for m in req.messages] if chat else req.prompt
        try:
            ids, kwargs = prepare(req, prompt, chat)
        except EntMTPError as e:
            return error(400, str(e), "messages" if chat else "prompt")
        job = Job(ids, kwargs, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull:
            return error(
                503,
                f"the server is busy: {worker.max_queue} requests are already waiting; retry in {RETRY_AFTER_S} s",
                kind="server_busy",
                **{"Retry-After": str(RETRY_AFTER_S)},
            )
        rid = schema.new_id("chatcmpl" if chat else "cmpl")
        name = req.model or model_name
        if req.stream:
            return EventSourceResponse(stream(job, rid, name, chat, req.include_usage), ping=15)
        return await collect(request, job, rid, name, chat)

    async def collect(request: Request, job: Job, rid: str, name: str, chat: bool):
        result = None
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.next(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel.set()
                        return Response(status_code=499)
                    continue
                if event is None:
                    break
                result = event.result or result
        except EntMTPError as e:
            return error(400, str(e))
        finally:
            job.cancel.set()  # no-op when it finished; stops it when this coroutine is cancelled
        return JSONResponse(schema.response(rid, name, chat, result))

    async def stream(job: Job, rid: str, name: str, chat: bool, include_usage: bool):
        try:
            if chat:
                yield json.dumps(schema.chunk(rid, name, True, None, None, first=True))
            while (event := await job.next()) is not None:
                if event.text:
                    yield json.dumps(schema.chunk(rid, name, chat, event.text, None))
                if event.result is not None:
                    reason = schema.finish_reason(event.result.finish_reason)
                    yield json.dumps(schema.chunk(rid, name, chat, None, reason))
                    if include_usage:
                        yield json.dumps(schema.usage_chunk(rid, name, chat, event.result))
            yield "[DONE]"
        except EntMTPError as e:
            yield json.dumps(schema.error_body(str(e)))
        finally:  # the client disconnected (the task is cancelled) or the stream ended
            job.cancel.set()

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
        return {"status": "ok", "model": model_name, "queue": worker.waiting, "running": worker.running}

    @app.get("/metrics")
    async def prometheus():
        metrics.queue.set(worker.waiting)
        metrics.running.set(worker.running)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
