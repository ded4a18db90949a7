"""`entmtp serve`: its parser and its run. The engine's flags are `EngineSpec`'s (engine_args.py); the
server's own come in groups, each added by one function, so another way of serving adds its group with one
call in `add_serve_arguments`."""

from __future__ import annotations

import argparse
import sys

from ..accept import SAMPLED_CHOICES
from ..engine_args import add_engine_arguments, built_from_args
from ..errors import EntMTPError


def register(sub) -> None:
    """`serve` on the subcommand parsers `sub`."""
    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (chat, completions, streaming, metrics)"
    )
    add_serve_arguments(sv)
    # the profile's greedy section picks the engine's policy; requests at T > 0 run their rule's section's
    sv.set_defaults(func=run_serve, temperature=0.0)


def add_serve_arguments(sv: argparse.ArgumentParser) -> None:
    add_engine_arguments(sv)
    add_http_arguments(sv)
    add_batch_arguments(sv)
    add_request_arguments(sv)
    from .ray_config import add_ray_arguments

    add_ray_arguments(sv)  # Ray Serve: replicas of the engine on a cluster (ray_serve.py)


def add_http_arguments(sv: argparse.ArgumentParser) -> None:
    """Where the server listens, what it accepts and how long it waits."""
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="the port to listen on")
    sv.add_argument(
        "--model-name", default=None, help="the model id clients see (default: the --model value)"
    )
    sv.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes")
    sv.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds open requests may still run before they are cut (default 30)",
    )
    sv.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="close a connection that sends no complete request headers within this many seconds",
    )
    sv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="answer 408 and close a connection whose request body has not all arrived this many seconds "
        "after its headers (default 30)",
    )
    sv.add_argument("--no-access-log", action="store_true", help="no log line per request on stderr")
    sv.add_argument(
        "--api-docs",
        action="store_true",
        help="also serve FastAPI's /docs, /redoc and /openapi.json (default: not served)",
    )


def add_batch_arguments(sv: argparse.ArgumentParser) -> None:
    """How many requests generate together, and how many may wait."""
    sv.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests generating together as one continuous batch, every row's tree verified in one forward "
        "(default 8); requests join and leave between steps. Above 1 the engine runs without CUDA graphs and "
        "weighs trees by this machine's batched step costs (measured once, ~20-30 s; not with --no-probe). "
        "1: one request at a time, as before",
    )
    sv.add_argument(
        "--max-queue", type=int, default=8, help="requests that may wait past --max-batch; more get 503"
    )
    sv.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every request decodes in a cache of its own (on llama.cpp a context of its own), so a greedy "
        "reply never depends on what else the server runs, at about one request at a time's throughput "
        "(requests still take turns step by step). Default off: on llama.cpp a batch-mate's KV cells move "
        "a row's logits, and a greedy reply can change with what runs beside it (transformers in float32: "
        "none seen); seeded sampled requests get their own cache either way",
    )
    sv.add_argument(
        "--fixed-threads",
        action="store_true",
        help="keep --threads (or torch's default, the cores) whatever the load. Default: with --max-batch > 1 "
        "the server tries one thread fewer now and then, and whenever its steps slow down, and keeps the "
        "faster (beside a busy process on 2 cores, 1 thread decodes 3-4x faster than 2)",
    )


def add_request_arguments(sv: argparse.ArgumentParser) -> None:
    """What the server applies to requests (the rest of a request's options are its own: schema.py)."""
    sv.add_argument(
        "--acceptance",
        dest="request_acceptance",
        default="auto",
        choices=SAMPLED_CHOICES,
        help="the acceptance rule of requests at temperature > 0 (default auto: lossless tree rejection "
        "sampling, the output distribution of plain sampling; typical: Medusa's typical acceptance, which "
        "accepts more drafts but is not lossless: its text repeats itself more, see docs/results/sampling; gumbel: "
        "lossless Gumbel-max sampling with the heads drafting under the same noise, a seed's text the same "
        "with or without speculation); "
        "each rule runs its profile section's policy",
    )


def check_serve_arguments(args) -> None:
    """Refuse impossible limits before anything binds or loads."""
    if args.max_queue < 0 or args.max_body < 1:
        raise EntMTPError("--max-queue must be >= 0 and --max-body >= 1")
    if args.max_batch < 1:
        raise EntMTPError(f"--max-batch must be >= 1 (1: one request at a time), got {args.max_batch}")
    if args.drain_timeout < 0 or args.header_timeout <= 0 or args.body_timeout <= 0:
        raise EntMTPError("--drain-timeout must be >= 0, --header-timeout and --body-timeout > 0 (seconds)")


def run_serve(args) -> int:
    check_serve_arguments(args)
    from .ray_config import check_ray_arguments

    check_ray_arguments(args)
    if args.ray:  # Ray Serve: replicas of the engine on a cluster (ray_serve.py)
        from ..engine_args import engine_spec
        from .ray_serve import serve_ray

        return serve_ray(args, engine_spec(args))
    try:
        from .run import Loading, bind, serve  # light: the port is bound before the model loads

        sock = bind(args.host, args.port)  # a busy port fails at once, not after the model loads
        from . import app as app_module
    except ImportError as e:
        raise EntMTPError(
            f"`entmtp serve` needs the server extra ({e.name} is missing): pip install 'entmtp[server]'"
        ) from e
    from ..backends import describe_weights

    with Loading(sock):  # until the app is ready, every request gets a 503 "loading" at once
        engine, app = _ready_app(args, app_module)
    weights = describe_weights(engine.model)  # every request decodes these: a server builds one engine
    print(
        f"entmtp: serving {model_name(args)} ({weights}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    serve(
        app,
        sock,
        drain_timeout=args.drain_timeout,
        header_timeout=args.header_timeout,
        access_log=not args.no_access_log,
        verbose=args.verbose,
    )
    return 0


def model_name(args) -> str:
    """The model id clients see."""
    return args.model_name or args.model or "smollm2-135m-instruct"


def _ready_app(args, app_module):
    """(engine, app) of `entmtp serve`'s flags: the engine built on the server's torch thread, its batch costs,
    the app."""
    from .thread import TorchThread

    batched = args.max_batch > 1
    thread = TorchThread()  # every torch call of the server on one thread (thread.py says why)
    # a batch steps eagerly (batch.py); batching steps one engine, so no routing by prompt length (routing.py)
    # the cost surface (costs/: ms of a batched step by rows and nodes per row, measured once per machine and
    # cached) that a batch's policies weigh their trees by: None for one row at a time, under --no-probe, or
    # where the backend steps no batch (the server then says why and serves one request at a time)
    graphs = not args.no_graphs and not batched
    built = thread.call(
        built_from_args, args, route=False, max_batch=args.max_batch if batched else None, graphs=graphs
    )
    engine, costs = built.engine, built.loaded.surface
    if batched and not args.no_graphs and engine.base.device.type == "cuda":
        print(
            f"entmtp: --max-batch {args.max_batch}: batched steps run without CUDA graphs, so a request "
            "alone decodes slower than with them; --max-batch 1 serves one request at a time with graphs",
            file=sys.stderr,
        )
    app = app_module.create_app(
        engine,
        model_name(args),
        max_queue=args.max_queue,
        max_body_bytes=args.max_body,
        max_batch=args.max_batch,
        costs=costs,
        thread=thread,
        acceptance=args.request_acceptance,
        body_timeout=args.body_timeout,
        api_docs=args.api_docs,
        batch_invariant=args.batch_invariant,
        live_threads=not args.fixed_threads,
    )
    return engine, app
