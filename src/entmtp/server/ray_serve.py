"""`entmtp serve --ray`: the server as a Ray Serve application, engine replicas placed on a cluster's nodes behind
one OpenAI-compatible endpoint (settings and their checks: ray_config.py).

Two deployments:
- `EngineReplica` (EntmtpEngine): one engine with its own continuous batch, built and run on its own torch
  thread (thread.py), serving `entmtp serve`'s app itself (create_app: the same routes, validation, errors,
  streaming, stop strings, logprobs, request ids, metrics), called in-process with each request (relay.py).
  It reserves --threads CPUs (or a GPU), takes --max-batch + --max-queue requests, and measures its own
  node's step costs and batch surface through the machine's cache, as `entmtp serve` does.
- `Front` (EntmtpFront): the HTTP ingress, a FastAPI app mounted with `serve.ingress`. It reads the body
  (size and time limits as `entmtp serve`), hands the request to an engine replica through Ray's router, and
  relays the answer as it comes. Why a front: a replica that dies cannot write its own error, and Ray's proxy
  answers a dead replica's request with a bare 500 or a cut stream. The front turns that into OpenAI's
  shape: a 503 before the answer started, an error event and [DONE] during a stream. It never retries a
  request (Ray's router does not either, once a replica took it): a request never runs twice.

Ray restarts a replica that died (its health check: every HEALTH_CHECK_S s); until then the router sends new
requests to the live replicas. On shutdown (`serve.delete`) each replica drains: Ray sends it no new requests
and waits up to --drain-timeout for its open ones; what is still open then is cut when Ray stops the replica,
and the front, whose own drain lasts CUT_GRACE_S longer, ends those streams with an error event (code
`shutdown`, as `entmtp serve` past its drain time) and [DONE]. The replica cannot cut them itself: Ray calls
its `__del__` only once its open requests are done, and gives it no hook when its drain begins.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
from dataclasses import replace

from ..errors import EntMTPError
from .ray_config import (
    APP_NAME,
    INSTALL_HINT,
    LOCAL_CLUSTER_ENV,
    RayServeConfig,
    config_from_args,
    deploy_yaml,
)

log = logging.getLogger("entmtp.server")


def require_ray():
    """(ray, ray.serve), imported when first needed (seconds: --print-config does without), or an
    EntMTPError of one line saying how to install Ray Serve."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise EntMTPError(
            f"`entmtp serve --ray` needs Ray Serve, which is not installed: {INSTALL_HINT}"
        ) from None
    return ray, serve


def _build_engine(config: RayServeConfig):
    """(the replica's engine, its batches' cost surface or None), built on its torch thread as `entmtp serve`
    builds them: a batch steps eagerly, without CUDA graphs (batch.py). Its plan (backend, dtype, policy, each
    with its reason) goes to the replica's log: nodes may choose apart."""
    from ..build import build

    spec = config.spec
    spec = replace(spec, threads=config.threads, graphs=spec.graphs and config.max_batch == 1)
    max_batch = config.max_batch if config.max_batch > 1 else None
    # one engine: batches step it (routing.py routes `generate`'s requests)
    built = build(spec, route=False, max_batch=max_batch)
    for line in built.plan.describe().splitlines():
        log.info("engine plan: %s", line)
    return built.engine, built.loaded.surface


class EngineReplica:
    """One engine replica: `entmtp serve`'s app on this replica's engine, called in-process by the front."""

    def __init__(self, args: dict):
        from .app import create_app
        from .ray_metrics import Mirror
        from .thread import TorchThread

        _log_requests()
        config = RayServeConfig.from_dict(args)
        thread = TorchThread()  # every torch call of the replica on one thread (thread.py says why)
        engine, costs = thread.call(_build_engine, config)
        self.app = create_app(
            engine,
            config.model_name,
            max_queue=config.max_queue,
            max_body_bytes=config.max_body,
            max_batch=config.max_batch,
            costs=costs,
            thread=thread,
            acceptance=config.acceptance,
            body_timeout=config.body_timeout,
        )
        self.state = self.app.state.server
        self.state.replica = require_ray()[1].get_replica_context().replica_id.unique_id
        self.stop = threading.Event()
        Mirror(self.state.metrics.registry, _ray_gauge).start(self.stop)

    async def answer(self, data: dict):
        """The ASGI messages of the app's answer to `data` (relay.request_data's), as they are sent: in
        batches (relay.asgi_batches), one Ray message for all those ready at once (a stream's last text, its
        finish and usage chunks and [DONE]; the events of steps made while this replica's loop was busy)."""
        from .relay import asgi_batches

        async for batch in asgi_batches(self.app, data):
            yield batch

    def check_health(self) -> None:
        """Ray's health check: the generation thread must be alive (else Ray replaces this replica)."""
        if self.state.worker.join(0):
            raise RuntimeError("the generation thread has ended")

    def __del__(self):
        """Ray stops the replica (after its drain): cut what is left, end the generation thread."""
        if hasattr(self, "state"):  # not when the constructor failed (a bad --model): nothing to end
            self.stop.set()
            self.state.close()


def _ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]):
    from ray.serve.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


def _log_requests() -> None:
    """The replica's request log lines (logger entmtp.server) on its stderr, which Ray keeps per worker."""
    logger = logging.getLogger("entmtp.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s entmtp: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


@functools.cache
def _deployments():
    """(EngineReplica, Front) as Ray Serve deployments: made once, when Ray is known to be there."""
    _, serve = require_ray()
    from .ray_front import Front

    front = serve.deployment(name="EntmtpFront")(serve.ingress()(Front))
    return serve.deployment(name="EntmtpEngine")(EngineReplica), front


def build_app(args: dict):
    """The application of `args` (RayServeConfig.to_dict's): what `serve deploy`'s YAML imports, and what
    `entmtp serve --ray` runs."""
    config = RayServeConfig.from_dict(args)
    engine, front = _deployments()
    replicas = engine.options(**config.engine_options()).bind(config.to_dict())
    return front.options(**config.front_options()).bind(replicas, config.to_dict())


def serve_ray(args, spec) -> int:
    """`entmtp serve --ray`: deploy on a local Ray cluster (or --ray-address's) until SIGTERM / SIGINT, then
    drain and delete the application; `--print-config` prints its YAML instead."""
    config = config_from_args(args, spec)
    if args.print_config:
        print(deploy_yaml(config, args.host, args.port, " ".join(["entmtp", *args.argv])), end="")
        return 0
    ray, serve = require_ray()
    local = args.ray_address is None
    if local:  # Ray Serve's throughput settings, inherited by the cluster's processes (ray_config says why)
        for name, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(name, value)
    # "local": a new cluster, even where `ray start` runs one on this machine (Ray's None would join it)
    ray.init(address=args.ray_address or "local", log_to_driver=args.verbose)
    deployed = False
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True  # from here on, a failure or a signal still deletes what was deployed
        serve.run(build_app(config.to_dict()), name=APP_NAME, route_prefix="/")
        where = "a local Ray cluster" if local else f"the Ray cluster at {args.ray_address}"
        print(
            f"entmtp: serving {config.model_name} on http://{args.host}:{args.port}/v1 with Ray Serve "
            f"({_replicas(config)} on {where})",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_signal()
        print(f"entmtp: draining (up to {config.drain_timeout:g} s), then stopping", file=sys.stderr)
    finally:
        if deployed:  # each replica drains: Ray's graceful shutdown (ray_config.engine_options)
            serve.delete(APP_NAME)
        if local:
            serve.shutdown()
            ray.shutdown()
    return 0


def _replicas(config: RayServeConfig) -> str:
    if config.autoscaled:
        return f"{config.min_replicas}..{config.max_replicas} replicas of {config.threads} thread(s)"
    return f"{config.replicas} replica(s) of {config.threads} thread(s)"


def _wait_for_signal() -> None:
    """Until SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
