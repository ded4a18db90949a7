"""`entmtp serve --ray` without Ray: its arguments and their errors, the deployments' options, the `serve deploy`
YAML of --print-config, the one-line error when Ray is not installed, the relay between the front and an
engine replica (a replica that fails mid-answer still ends in OpenAI's shape), and the metrics mirror."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import yaml

pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: E402

from entmtp.build import EngineSpec  # noqa: E402
from entmtp.cli import build_parser, engine_spec, main  # noqa: E402
from entmtp.errors import EntMTPError  # noqa: E402
from entmtp.server.ray_config import (  # noqa: E402
    LOCAL_CLUSTER_ENV,
    RayServeConfig,
    check_ray_arguments,
    config_from_args,
)
from entmtp.server.ray_metrics import Mirror  # noqa: E402
from entmtp.server.relay import asgi_batches, asgi_messages, coalesce, relay, unbatched  # noqa: E402


def _config(*argv: str) -> RayServeConfig:
    args = build_parser().parse_args(["serve", "--ray", *argv])
    check_ray_arguments(args)
    return config_from_args(args, engine_spec(args))


def test_each_replica_reserves_its_threads_and_takes_its_batch_and_queue():
    config = _config("--replicas", "3", "--threads", "2", "--max-batch", "4", "--max-queue", "2")
    opts = config.engine_options()
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2}
    assert opts["max_ongoing_requests"] == 4 + 2
    assert config.spec.threads == 2  # the torch threads the replica runs: what it reserved
    assert config.front_options()["ray_actor_options"] == {"num_cpus": 0}
    assert config.front_options()["max_ongoing_requests"] >= 3 * (4 + 2)
    # the front's drain outlasts the engines': a stream cut at their drain timeout still gets its last event
    assert config.front_options()["graceful_shutdown_timeout_s"] > opts["graceful_shutdown_timeout_s"]


@pytest.mark.parametrize("flag", ["--batch-invariant", "--api-docs"])
def test_server_flags_the_replicas_do_not_take_are_refused_with_ray(flag):
    with pytest.raises(EntMTPError, match=f"{flag} apply to `entmtp serve` without --ray only"):
        _config(flag)


def test_a_gpu_replica_reserves_a_gpu():
    opts = _config("--device", "cuda").engine_options()
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}


def test_autoscaling_bounds_and_target():
    opts = _config("--min-replicas", "1", "--max-replicas", "4", "--max-batch", "6").engine_options()
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 6}
    opts = _config("--min-replicas", "2", "--max-replicas", "2", "--target-ongoing", "3").engine_options()
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 3


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--min-replicas", "2"], "autoscaling needs both --min-replicas and --max-replicas"),
        (["--min-replicas", "3", "--max-replicas", "2"], "need 1 <= min <= max"),
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--target-ongoing", "4"], "--target-ongoing needs --min-replicas/--max-replicas"),
    ],
)
def test_bad_replica_settings_are_named(argv, message):
    with pytest.raises(EntMTPError, match=message):
        _config(*argv)


def test_ray_arguments_without_ray_are_an_error(capsys):
    assert main(["serve", "--replicas", "2", "--print-config"]) == 2
    assert "--replicas, --print-config only apply to Ray Serve: add --ray" in capsys.readouterr().err


def test_engine_options_pass_through_the_config_round_trip():
    config = _config(
        "--heads", "hydra", "--tree", "tree_4", "--lookup", "--lookup-tokens", "5", "--dtype", "float32"
    )
    again = RayServeConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.spec.lookup.tokens == 5 and again.spec.tree == "tree_4" and again.spec.dtype == "float32"


def test_unknown_keys_of_a_config_are_named():
    d = RayServeConfig(spec=EngineSpec()).to_dict()
    d["spec"]["treee"] = "tree_4"
    with pytest.raises(EntMTPError, match=r"unknown key\(s\) treee in the application's args.spec"):
        RayServeConfig.from_dict(d)


def test_print_config_is_a_serve_deploy_yaml_of_the_same_application(capsys):
    argv = ["serve", "--ray", "--print-config", "--replicas", "2", "--port", "8100", "--host", "0.0.0.0"]
    assert main([*argv, "--dtype", "float32", "--max-batch", "4"]) == 0
    deploy = yaml.safe_load(capsys.readouterr().out)
    assert deploy["http_options"] == {"host": "0.0.0.0", "port": 8100}
    (app,) = deploy["applications"]
    assert app["import_path"] == "entmtp.server.ray_serve:build_app" and app["route_prefix"] == "/"
    config = RayServeConfig.from_dict(app["args"])
    assert config.replicas == 2 and config.max_batch == 4 and config.spec.dtype == "float32"


def test_ray_not_installed_is_one_line_naming_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is absent
    assert main(["serve", "--ray"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "entmtp: error: `entmtp serve --ray` needs Ray Serve, which is not installed: pip install 'entmtp[ray]'"
    ]


# the relay: an app's answer carried as ASGI messages (replica side) and answered again (front side)


def _tiny_app() -> FastAPI:
    app = FastAPI()

    @app.post("/whole")
    async def whole():
        return JSONResponse({"ok": True}, headers={"x-request-id": "from-the-app"})

    @app.get("/stream")
    async def stream():
        async def parts():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(parts(), media_type="text/event-stream")

    return app


def _data(method: str, path: str, body: bytes = b"") -> dict:
    return {"method": method, "path": path, "query_string": b"", "headers": [], "client": None, "body": body}


async def _body(response) -> bytes:
    if hasattr(response, "body_iterator"):
        return b"".join([p if isinstance(p, bytes) else p.encode() async for p in response.body_iterator])
    return response.body


def test_a_relayed_answer_is_the_apps_whole_or_streamed():
    async def run():
        app = _tiny_app()
        whole = await relay(asgi_messages(app, _data("POST", "/whole")), lambda: None, "rid")
        streamed = await relay(asgi_messages(app, _data("GET", "/stream")), lambda: None, "rid")
        return whole, await _body(whole), streamed, await _body(streamed)

    whole, whole_body, streamed, streamed_body = asyncio.run(run())
    assert whole.status_code == 200 and json.loads(whole_body) == {"ok": True}
    assert "x-request-id" not in whole.headers  # Ray's proxy writes the one the replica was given
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed_body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_events_sent_at_once_cross_as_one_message_in_order_and_none_is_lost():
    """A replica sends what its app had ready as one batch, body parts joined (one Ray message, not one per
    event); parts sent apart go apart (nothing waits for more); the front reads the same bytes in order."""
    gate = None

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await gate.wait()  # the next events come later, all at once: a stream's last text, finish, [DONE]
        for part in (b"data: 2\n\n", b"data: 3\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def run():
        nonlocal gate
        gate = asyncio.Event()
        batches = []
        async for batch in asgi_batches(app, _data("GET", "/")):
            batches.append(batch)
            gate.set()
        relayed = await relay(unbatched(_replay(batches)), lambda: None, "rid")
        return batches, await _body(relayed)

    batches, body = asyncio.run(run())
    assert [[m["type"].rsplit(".", 1)[1] for m in b] for b in batches] == [["start", "body"], ["body"]]
    assert batches[0][1] == {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}
    assert batches[1] == [
        {"type": "http.response.body", "body": b"data: 2\n\ndata: 3\n\ndata: [DONE]\n\n", "more_body": False}
    ]
    assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"


async def _replay(batches: list[list[dict]]):
    for b in batches:
        yield b


def test_coalesce_joins_only_runs_of_body_parts():
    start = {"type": "http.response.start", "status": 200, "headers": []}
    a = {"type": "http.response.body", "body": b"a", "more_body": True}
    b = {"type": "http.response.body", "body": b"b", "more_body": False}
    assert coalesce([start, a, b]) == [
        start,
        {"type": "http.response.body", "body": b"ab", "more_body": False},
    ]
    assert coalesce([a]) == [a] and coalesce([]) == []


class ActorDiedError(Exception):
    """Stands for Ray's: the replica's process is gone."""


class BackPressureError(Exception):
    """Stands for Ray's: every replica's batch and queue, and the router's queue, are full."""


async def _dies_after(messages: list[dict], error: Exception):
    for m in messages:
        yield m
    raise error


START_SSE = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done():
    cancelled = []
    part = {"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True}

    async def run():
        messages = _dies_after([START_SSE, part], ActorDiedError("gone"))
        response = await relay(messages, lambda: cancelled.append(True), "rid")
        return await _body(response)

    events = asyncio.run(run()).decode().split("\n\n")
    assert events[0] == 'data: {"x": 1}'
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_failed"
    assert "ActorDiedError" in error["message"] and "not retried" in error["message"]
    assert events[2] == "data: [DONE]" and cancelled == [True]


def test_a_replica_that_dies_before_answering_is_a_503_in_openais_shape():
    async def run(error):
        response = await relay(_dies_after([], error), lambda: None, "rid")
        return response.status_code, json.loads(response.body), response.headers

    status, body, _ = asyncio.run(run(ActorDiedError("gone")))
    assert status == 503 and body["error"]["code"] == "replica_failed"
    status, body, headers = asyncio.run(run(BackPressureError("full")))
    assert status == 503 and body["error"]["type"] == "server_busy" and headers["retry-after"] == "1"


def test_a_stream_cut_by_a_shutdown_ends_with_the_shutdown_error_event_and_done():
    """A replica stopped past its drain time while the application is deleted: the stream's last event says
    `shutdown`, as `entmtp serve`'s do when its drain time is over, not `replica_failed`."""
    part = {"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True}
    asked = []

    async def stopping() -> bool:
        asked.append(True)
        return True

    async def run():
        messages = _dies_after([START_SSE, part], ActorDiedError("killed"))
        return await _body(await relay(messages, lambda: None, "rid", stopping))

    events = asyncio.run(run()).decode().split("\n\n")
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "shutdown"
    assert "shutting down" in error["message"] and "send it again" in error["message"]
    assert events[2] == "data: [DONE]" and asked == [True]


def test_a_request_cut_by_a_shutdown_before_its_answer_is_the_shutdown_503():
    async def stopping() -> bool:
        return True

    async def run():
        response = await relay(_dies_after([], ActorDiedError("killed")), lambda: None, "rid", stopping)
        return response.status_code, json.loads(response.body)["error"]

    status, error = asyncio.run(run())
    assert status == 503 and error["code"] == "shutdown" and error["type"] == "server_error"


def test_a_local_cluster_is_a_new_one_even_where_ray_start_runs_one(monkeypatch, capsys):
    """Ray's ray.init(address=None) joins a cluster `ray start` left on the machine: `--ray` without
    --ray-address asks for "local", a cluster of its own (which it also stops)."""
    from entmtp.server import ray_serve

    calls = []

    class Stop(Exception):
        pass

    class FakeRay:
        def init(self, **kw):
            calls.append(("init", kw["address"]))

        def shutdown(self):
            calls.append(("shutdown",))

    class FakeServe:
        def start(self, **kw):
            raise Stop  # nothing deployed: what follows is the cleanup

        def shutdown(self):
            calls.append(("serve.shutdown",))

    monkeypatch.setattr(ray_serve, "require_ray", lambda: (FakeRay(), FakeServe()))
    for name in LOCAL_CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "1")  # one the user set: it stays
    args = build_parser().parse_args(["serve", "--ray", "--dtype", "float32"])
    args.argv = []
    with pytest.raises(Stop):
        ray_serve.serve_ray(args, engine_spec(args))
    assert calls == [("init", "local"), ("serve.shutdown",), ("shutdown",)]
    # the local cluster's processes inherit Ray Serve's throughput settings, less those the user set
    assert os.environ["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "1"
    # and slower clocks: the controller's loop and the metrics export wake its processes less often
    assert float(os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]) >= 0.5
    assert int(os.environ["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]) >= 1000
    for name in LOCAL_CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["serve", "--ray", "--ray-address", "10.0.0.1:6379"])
    args.argv, calls[:] = [], []
    with pytest.raises(Stop):
        ray_serve.serve_ray(args, engine_spec(args))
    assert calls == [("init", "10.0.0.1:6379")]  # a cluster it joined is left running
    assert not any(name in os.environ for name in LOCAL_CLUSTER_ENV)  # its processes are not ours


def test_a_failed_call_whose_cancel_raises_its_error_again_is_still_a_503():
    """Ray's DeploymentResponseGenerator.cancel() raises the call's error again when the call failed."""

    def cancel():
        raise BackPressureError("full")

    async def run():
        response = await relay(_dies_after([], BackPressureError("full")), cancel, "rid")
        return response.status_code, json.loads(response.body)["error"]["type"]

    assert asyncio.run(run()) == (503, "server_busy")


def test_closing_the_relay_tells_the_app_its_client_left():
    seen = []

    async def app(scope, receive, send):
        await receive()  # the body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append((await receive())["type"])  # what the app hears once the front has gone

    async def run():
        messages = asgi_messages(app, _data("GET", "/"))
        assert (await anext(messages))["type"] == "http.response.start"
        await anext(messages)
        await messages.aclose()

    asyncio.run(run())
    assert seen == ["http.disconnect"]


def test_the_metrics_mirror_sets_one_gauge_per_sample_with_its_labels():
    registry = CollectorRegistry()
    requests = Counter("entmtp_requests", "r", ["endpoint", "status"], registry=registry)
    rows = Histogram("entmtp_batch_rows", "rows", buckets=(1, 2), registry=registry)
    requests.labels(endpoint="/v1/completions", status="200").inc(3)
    rows.observe(2)
    set_to = {}

    class Gauge:
        def __init__(self, name, description, tag_keys):
            self.name, self.keys = name, tag_keys

        def set(self, value, tags):
            assert tuple(sorted(tags)) == self.keys
            set_to[self.name, tuple(sorted(tags.items()))] = value

    Mirror(registry, Gauge).export()
    assert set_to["entmtp_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))] == 3
    assert set_to["entmtp_batch_rows_bucket", (("le", "1.0"),)] == 0
    assert set_to["entmtp_batch_rows_bucket", (("le", "2.0"),)] == 1
    assert set_to["entmtp_batch_rows_count", ()] == 1
    assert not any(name.endswith("_created") for name, _ in set_to)
