"""The routes and error handlers `create_app` registers. A completion is read and validated (`read_request`),
turned into the prompt ids and `Engine.stream` arguments off the event loop (`prepare`), queued on the worker,
and answered whole or streamed (responses.py). Each route finds the server's state on `app.state.server`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..accept import GenerationOptions, Sampling, check_gumbel_seed
from ..backends import describe_weights
from ..constraints import Constraint, grammar_tokenizer
from ..engine import Engine
from ..errors import EntMTPError, FieldError
from ..model import check_request, encode_prompt
from ..prediction import prediction_ids
from ..tools import Tools, history
from . import responses, schema
from .responses import Reply, error
from .state import BODY_TIMEOUT_S, ServerState
from .worker import Job, QueueFull

log = logging.getLogger("entmtp.server")


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def models(request: Request):  # no return annotation: FastAPI would take it as a response model
    card = {
        "id": _state(request).model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "entmtp",
    }
    return {"object": "list", "data": [card]}


async def health(request: Request):
    state = _state(request)
    waiting, running = state.worker.counts()
    body = {
        "status": "ok",
        "model": state.model_name,
        "weights": describe_weights(
            getattr(state.engine, "model", None)
        ),  # what every request decodes (one engine)
        "queue": waiting,
        "running": running,
    }
    if state.replica is not None:  # which of a Ray deployment's replicas answered
        body["replica"] = state.replica
    if state.draining:  # a load balancer sends no more requests here
        return JSONResponse({**body, "status": "draining"}, status_code=503)
    return body


async def prometheus(request: Request) -> Response:
    state = _state(request)
    waiting, running = state.worker.counts()
    state.metrics.queue.set(waiting)
    state.metrics.running.set(running)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404, 405: still OpenAI's shape."""
    return error(exc.status_code, str(exc.detail), kind="invalid_request_error")


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Never a traceback to the client."""
    log.exception("internal error (request_id=%s)", request.state.request_id, exc_info=exc)
    return error(500, f"internal error: {type(exc).__name__}", kind="server_error")


async def _complete(request: Request, chat: bool) -> Response:
    """/v1/chat/completions and /v1/completions: read, tokenize, queue, then answer whole or streamed."""
    state = _state(request)
    kind = schema.ChatRequest if chat else schema.CompletionRequest
    req, bad = await read_request(request, kind, state.max_body_bytes, state.body_timeout)
    if bad is not None:
        return bad
    if state.draining:
        return responses.shutting_down()
    bad = _bad_seed(req, state.acceptance)
    if bad is not None:  # before the stream starts: a 400, never a 200 then an error event
        return bad
    prompt = history([m.rendered() for m in req.messages]) if chat else req.prompt
    loop = asyncio.get_running_loop()
    try:  # a 10k-message chat template takes most of a second: not on the event loop
        ids, kwargs, tools = await loop.run_in_executor(
            state.tokenizer_lane(_chars(prompt)), prepare, state.engine, req, prompt, chat, state.acceptance
        )
    except FieldError as e:
        return error(400, str(e), e.field)
    except EntMTPError as e:
        return error(400, str(e), "messages" if chat else "prompt")
    job = Job(ids, kwargs, loop)
    try:
        state.worker.submit(job)
    except QueueFull:
        return responses.busy(state.worker.max_queue, state.worker.retry_after())
    # the model that answers is reported, whatever the request named (one model per server)
    reply = Reply(schema.new_id("chatcmpl" if chat else "cmpl"), state.model_name, chat, tools)
    if req.stream:
        return responses.streamed(job, reply, state.token_text, req.include_usage)
    return await responses.whole(request, job, reply, state.token_text)


def _bad_seed(req: schema._Params, acceptance: str) -> Response | None:
    """A 400 for a seed the request's sampling rule cannot take (gumbel: a negative seed), else None."""
    temperature = req.temperature or 0.0
    if temperature > 0 and Sampling(temperature, acceptance).rule.needs_noise:
        try:
            check_gumbel_seed(req.seed)
        except EntMTPError as e:
            return error(400, str(e), "seed")
    return None


async def read_request(
    request: Request, model: type[schema._Params], max_body_bytes: int, body_timeout: float = BODY_TIMEOUT_S
):
    """(validated request, None) or (None, error response): every client-caused failure is a 4xx here."""
    body = await read_body(request, max_body_bytes, body_timeout)
    if isinstance(body, Response):
        return None, body
    encoding = json.detect_encoding(body) if body else "utf-8"
    if encoding not in ("utf-8", "utf-8-sig"):
        return None, error(400, f"the request body is {encoding.upper()}: send JSON as UTF-8 (RFC 8259)")
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


async def read_body(request: Request, max_body_bytes: int, timeout: float) -> bytes | Response:
    """The body; a 413 as soon as it is known to be over `max_body_bytes` (declared or as read); a 408 when it
    has not all come within `timeout` s (a client that declares more than it sends held the connection
    forever); a 499, logged as the request's one line, when the client leaves before sending it all."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body_bytes:
        return error(413, f"request body of {size} bytes is over the limit of {max_body_bytes} bytes")
    try:
        return await asyncio.wait_for(_gather(request, max_body_bytes), timeout)
    except asyncio.TimeoutError:
        declared = f" ({size} bytes declared)" if size else ""
        message = (
            f"the request body did not arrive within {timeout:g} s of its headers{declared}: send it at once"
        )
        return error(408, message, Connection="close")  # the rest of the body will not be read
    except ClientDisconnect:  # nobody hears the answer: the access log line says 499
        return Response(status_code=499)


async def _gather(request: Request, max_body_bytes: int) -> bytes | Response:
    """The body's parts joined (a bytearray: adding to bytes copied the whole body per part, and a body sent
    in 1-byte parts took the event loop for seconds), or a 413 once over `max_body_bytes`."""
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_body_bytes:
            return error(413, f"request body is over the limit of {max_body_bytes} bytes")
    return bytes(body)


def _chars(prompt) -> int:
    """The characters a prompt's tokenizer reads: its text, or its messages' texts (token ids: none)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt if isinstance(m, dict))


def _constraint(req: schema._Params, tools: Tools | None):
    """The grammar the output follows: `response_format`'s, or the tools' (not both), or None."""
    try:
        constraint = Constraint.of(req.response_format)
    except EntMTPError as e:
        raise FieldError(str(e), "response_format") from e
    if tools is None:
        return constraint
    if constraint is not None:
        raise FieldError(
            'send response_format or tools (with a tool_choice other than "none"), not both',
            "response_format",
        )
    return tools.constraint()


def prepare(
    engine: Engine, req: schema._Params, prompt, chat: bool, acceptance: str = "auto"
) -> tuple[list[int], dict, Tools | None]:
    """(prompt ids, Engine.stream kwargs: the request's `GenerationOptions`, its functions) or raise
    EntMTPError naming the problem (FieldError: a field's). `acceptance`: the server's rule for requests at
    temperature > 0."""
    tools = _tools(req) if chat else None
    ids = list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None
    if ids is None:
        template = {}
        if tools is not None:  # the functions shown to the model (tools.py)
            prompt, template = tools.messages(prompt, engine.tokenizer)
        ids = encode_prompt(engine.tokenizer, prompt, chat=chat, template=template)
    vocab = engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise EntMTPError(f"prompt token ids must be in 0..{vocab - 1}")
    window = engine.window
    limit = req.limit if req.limit is not None else min(schema.DEFAULT_MAX_TOKENS, window - len(ids))
    check_request(len(ids), limit, window, name="max_tokens")  # a PromptError: a 400 in _complete
    temperature = req.temperature or 0.0
    prediction = None
    if req.prediction is not None:  # encoded and checked here: a bad one is a 400, not a failed stream
        try:
            prediction = prediction_ids(engine.tokenizer, req.prediction.text(), window, vocab)
        except EntMTPError as e:
            raise FieldError(str(e), "prediction") from e
    constraint = _constraint(req, tools)
    try:
        options = GenerationOptions(
            max_new_tokens=limit,
            temperature=temperature,
            acceptance=acceptance if temperature > 0 else "auto",  # the server's rule is for T > 0
            seed=req.seed,
            stop=req.stop,
            logprobs=req.top_k,
            prediction=prediction,
            response_format=constraint,
            logit_bias=req.logit_bias,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        )
        options.penalties_for(vocab)
    except FieldError:
        raise  # a control's, its field named (penalties.py)
    except EntMTPError as e:
        raise FieldError(str(e), None) from e
    if (
        constraint is not None
    ):  # its tokenizer built once here, off the worker's thread (~0.3 s the first time)
        grammar_tokenizer(engine.tokenizer, engine.base.vocab_size, sorted(engine.eos_ids))
    # the options' own fields (not dataclasses.asdict: the constraint stays one object)
    return ids, {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}, tools


def _tools(req) -> Tools | None:
    try:
        return Tools.of(req.tools, req.tool_choice, req.parallel_tool_calls)
    except FieldError as e:  # tool_choice's are named as such; a function's schema is the tools'
        raise FieldError(str(e), e.field or "tools") from e
