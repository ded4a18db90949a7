"""The app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics.

Bodies are read and validated by the routes (routes.py, not by FastAPI's automatic parsing) so that every
client-caused failure gets OpenAI's error shape with a 4xx status before any work starts: malformed or too deeply
nested JSON, fields of the wrong type or range, text that is not valid Unicode, OpenAI fields entmtp does not
implement, empty messages, max_tokens past the context window, a body over the size limit (413) or not all
arrived within the body timeout (408), a negative seed under the gumbel rule. Control tokens written in a
message's text are encoded as text (model.encode_prompt). Prompts are tokenized off the event loop, long ones
in a lane of their own. Streaming uses server-sent events (responses.py); a client that disconnects, streaming or
not, cancels its generation between two decode steps. On shutdown (`ServerState.drain`) new requests get 503,
open ones may finish until the drain timeout, and those still open then are cut: a stream ends with an error
event in OpenAI's shape and [DONE].

Every response carries X-Request-Id (the client's, when it sent a sane one, or a new one), and each request
is logged once at info level (logger "entmtp.server": client, method, path, status, seconds, request id), its
path's control characters escaped (`printable`); a client that leaves before its body is sent is a 499 there.
"""

from __future__ import annotations

import logging
import re
import time
import unicodedata
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..accept import SAMPLED_CHOICES
from ..costs.curves import CostSurface
from ..engine import Engine
from ..errors import EntMTPError
from . import routes
from .metrics import Metrics
from .state import BODY_TIMEOUT_S, ServerState
from .thread import TorchThread

log = logging.getLogger("entmtp.server")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # echoed as given; anything else gets a new id


def create_app(
    engine: Engine,
    model_name: str,
    *,
    max_queue: int = 8,
    max_body_bytes: int = 1 << 20,
    max_batch: int = 1,
    costs: CostSurface | None = None,
    thread: TorchThread | None = None,
    acceptance: str = "auto",
    body_timeout: float = BODY_TIMEOUT_S,
    api_docs: bool = False,
    batch_invariant: bool = False,
    live_threads: bool = False,
) -> FastAPI:
    """The app serving `engine` as `model_name`: up to `max_batch` requests generate together (one continuous
    batch, weighing trees by the cost surface `costs` when given; 1: one at a time, CUDA graphs allowed) and
    up to `max_queue` more wait. Give the `thread` that built the engine (thread.py: on a CPU, torch runs
    ~1.7x slower on a second thread); without one, generation runs on a new thread. `acceptance`: the rule of
    requests at temperature > 0 (auto: lossless sampling; sample; typical: not lossless). `body_timeout`: seconds
    a request's body may take to arrive once its headers did (then a 408). `api_docs`: also serve FastAPI's
    /docs, /redoc and /openapi.json (off: a production server shows no schema browser). `batch_invariant`: every
    request decodes in a cache of its own, so its reply never depends on what else runs (batch.BatchOptions).
    `live_threads`: a batch worker chooses its CPU threads (up to the engine's) by its steps' times
    (server/threads.py)."""
    if max_batch < 1:
        raise EntMTPError(f"max_batch must be >= 1 (1: one request at a time), got {max_batch}")
    if acceptance not in SAMPLED_CHOICES:
        raise EntMTPError(
            f"acceptance {acceptance!r} for requests at T > 0: use one of {', '.join(SAMPLED_CHOICES)}"
        )
    docs = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="entmtp", version="1", lifespan=_lifespan, **docs)
    state = app.state.server = ServerState.start(
        engine, model_name, max_queue, max_body_bytes, max_batch, costs, thread, acceptance, body_timeout,
        batch_invariant, live_threads,
    )  # fmt: skip
    app.add_exception_handler(StarletteHTTPException, routes.http_error)
    app.add_exception_handler(Exception, routes.internal_error)
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
    app.add_middleware(_RequestLog, metrics=state.metrics, routes={r.path for r in app.routes})
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    app.state.server.close()  # the generation thread and the tokenizer's


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
            self._record(scope, status, time.perf_counter() - t0, rid)

    def _record(self, scope, status: int, seconds: float, rid: str) -> None:
        """Count the request and log its line."""
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
            printable(path),
            status,
            seconds,
            rid,
        )


def printable(text: str) -> str:
    """`text` safe for a log line: control characters (a decoded %0a, %1b ...), line and paragraph separators,
    quotes and backslashes escaped as \\xNN / \\uNNNN, so a path can neither forge a line nor a field, nor
    write terminal escapes."""
    return "".join(_escape(c) if c in '"\\' or unicodedata.category(c) in _UNPRINTABLE else c for c in text)


_UNPRINTABLE = ("Cc", "Zl", "Zp")  # control characters (C0, DEL, C1), line and paragraph separators


def _escape(c: str) -> str:
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
