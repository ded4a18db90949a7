"""The Ray Serve application's HTTP ingress (ray_serve.py says why there is one): a FastAPI app whose one route
takes every path, reads the body under `entmtp serve`'s limits, hands the request to an engine replica through
Ray's router, and relays the answer (relay.py: a replica's failure still ends in OpenAI's shape). ray_serve.py
mounts it with `serve.ingress`, built by each front replica once it holds the engines' handle (a class-based
FastAPI view would do without the build, but Ray's does not register with FastAPI >= 0.16x's routers).

A shutdown's cut is told from a replica's failure by asking Ray's controller, once a relayed answer fails,
whether the application is being deleted: Ray gives a replica no hook when its graceful shutdown begins (it
calls `__del__` only once the replica's open requests are done, and kills it at its
graceful_shutdown_timeout_s), so what is still open at the drain time dies with the replica, and the front
names the cause (relay.py)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request

from .ray_config import RayServeConfig
from .relay import Stopping, relay, request_data, unbatched
from .routes import read_body

log = logging.getLogger("entmtp.server")

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class Front:
    """The ingress deployment: `engine` is the engine deployment's handle, `args` the application's."""

    def __init__(self, engine, args: dict):
        self.engine = engine.options(stream=True)  # the answer comes back as it is sent
        self.config = RayServeConfig.from_dict(args)
        from ray import serve

        self.app_name = serve.get_replica_context().app_name  # APP_NAME, or a `serve deploy` YAML's name

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The app `serve.ingress()` mounts, once this replica is constructed."""
        stopping = app_deleting(self.app_name)
        return front_app(self.engine, self.config.max_body, self.config.body_timeout, stopping)


def app_deleting(app_name: str) -> Stopping:
    """Whether Ray Serve is deleting the application `app_name` (`serve.delete`, SIGTERM to
    `entmtp serve --ray`, `serve shutdown`): one call to Ray's controller, off the event loop."""

    async def deleting() -> bool:
        from ray import serve

        try:
            status = await asyncio.to_thread(serve.status)
        except Exception as e:  # noqa: BLE001 - the controller unreachable: call it a failure, not a shutdown
            log.warning("could not ask Ray Serve for the application's status: %s", type(e).__name__)
            return False
        app = status.applications.get(app_name)
        return app is None or app.status == "DELETING"

    return deleting


def front_app(engine, max_body: int, body_timeout: float, stopping: Stopping) -> FastAPI:
    """The front's app relaying every request to `engine` (a streaming handle of the engine deployment)."""
    app = FastAPI(title="entmtp on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(request: Request, path: str):
        body = await read_body(request, max_body, body_timeout)
        if not isinstance(body, bytes):  # a 413, 408 or 499: answered here, as `entmtp serve` does
            return body
        # Ray's proxy put one in: the client's, or its own (and adds it to the response)
        rid = request.headers.get("x-request-id", "")
        batches = engine.answer.remote(request_data(request, body, rid))  # lists of messages (asgi_batches)
        return await relay(unbatched(batches), batches.cancel, rid, stopping)

    return app
