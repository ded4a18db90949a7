"""The Ray Serve application's HTTP ingress (ray_serve.py says why there is one): a FastAPI app whose one route
takes every path, reads the body under `entmtp serve`'s limits, hands the request to an engine replica through
Ray's router, and relays the answer (relay.py: a replica's failure still ends in OpenAI's shape). ray_serve.py
mounts it with `serve.ingress`, built by each front replica once it holds the engines' handle (a class-based
FastAPI view would do without the build, but Ray's does not register with FastAPI >= 0.16x's routers)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from .ray_config import RayServeConfig
from .relay import relay, request_data
from .routes import _read_body

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class Front:
    """The ingress deployment: `engine` is the engine deployment's handle, `args` the application's."""

    def __init__(self, engine, args: dict):
        self.engine = engine.options(stream=True)  # the answer comes back as it is sent
        self.config = RayServeConfig.from_dict(args)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The app `serve.ingress()` mounts, once this replica is constructed."""
        return front_app(self.engine, self.config.max_body, self.config.body_timeout)


def front_app(engine, max_body: int, body_timeout: float) -> FastAPI:
    """The front's app relaying every request to `engine` (a streaming handle of the engine deployment)."""
    app = FastAPI(title="entmtp on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(request: Request, path: str):
        body = await _read_body(request, max_body, body_timeout)
        if not isinstance(body, bytes):  # a 413, 408 or 499: answered here, as `entmtp serve` does
            return body
        # Ray's proxy put one in: the client's, or its own (and adds it to the response)
        rid = request.headers.get("x-request-id", "")
        messages = engine.answer.remote(request_data(request, body, rid))
        return await relay(messages, messages.cancel, rid)

    return app
