"""`entmtp serve --ray` on a local Ray cluster the module starts and stops itself (2 CPUs, no dashboard): two
engine replicas of one thread each (float32) behind the front. Replies, streamed and not, under concurrency,
equal those of `entmtp serve`'s own app on the same engine; a replica killed under the load of 8 streaming
clients ends the streams it held in OpenAI's shape, hangs none, and the cluster serves again at once while Ray
restarts the replica."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
RECOVERY_BOUND_S = 15  # after a replica is killed, the live one must serve again within this (generous)
openai = pytest.importorskip("openai")
from starlette.testclient import TestClient  # noqa: E402

from entmtp.build import EngineSpec, build  # noqa: E402
from entmtp.lookup import Lookup  # noqa: E402
from entmtp.server.app import create_app  # noqa: E402
from entmtp.server.ray_config import APP_NAME, LOCAL_CLUSTER_ENV, RayServeConfig  # noqa: E402
from entmtp.server.ray_serve import build_app  # noqa: E402

pytestmark = pytest.mark.slow
SPEC = EngineSpec(dtype="float32", heads="hydra", tree="tree_4", lookup=Lookup(), threads=1)
# a batch of 6: the live replica has a row free for a new request while it carries its share of the 8 clients
CONFIG = RayServeConfig(spec=SPEC, max_batch=6, max_queue=4, replicas=2, drain_timeout=2.0)
CHAT = [{"role": "user", "content": "Name three colors, one per line."}]
ENGINE = "EntmtpEngine"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """The URL of the application on a local Ray cluster, shut down (Serve, then Ray) however the tests end."""
    port = _free_port()
    before = {name: os.environ.get(name) for name in LOCAL_CLUSTER_ENV}
    os.environ.update(
        LOCAL_CLUSTER_ENV
    )  # the settings `entmtp serve --ray` gives the local cluster it starts
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(CONFIG.to_dict()), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in before.items():  # as they were: other modules start no Ray cluster with them
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def reference():
    """`entmtp serve`'s app, in this process, on the same engine: what the cluster must answer."""
    built = build(SPEC)
    app = create_app(built.engine, CONFIG.model_name, max_batch=CONFIG.max_batch, max_queue=CONFIG.max_queue)
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


def _answer(body: dict) -> tuple:
    """What a reply says: its text, finish reason, token counts, and the tokens of its logprobs (their values
    apart: a batch's rows are padded differently, so they agree to 1e-4, not to the bit)."""
    (choice,) = body["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    usage = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    lp = choice.get("logprobs") or {}
    tokens = [c["token"] for c in lp["content"]] if "content" in lp else lp.get("tokens")
    return text, choice["finish_reason"], usage, tokens


def _logprob_values(body: dict) -> list[float]:
    lp = body["choices"][0].get("logprobs") or {}
    return [c["logprob"] for c in lp["content"]] if "content" in lp else lp.get("token_logprobs", [])


ASKS = [
    ("/v1/chat/completions", dict(messages=CHAT, max_tokens=20, logprobs=True, top_logprobs=2)),
    ("/v1/completions", dict(prompt="The capital of France is", max_tokens=16, stop=[" Paris"])),
    ("/v1/completions", dict(prompt="def fib(n):", max_tokens=24, logprobs=1)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Count to five."}], max_tokens=16)),
]


def test_replies_under_concurrency_equal_entmtp_serves(cluster, reference):
    def ask(path_body):
        path, body = path_body
        return httpx.post(f"{cluster}{path}", json={"model": "m", "temperature": 0, **body}, timeout=120)

    with ThreadPoolExecutor(len(ASKS)) as pool:  # at once: both replicas, batches of several rows
        got = list(pool.map(ask, ASKS))
    for (path, body), response in zip(ASKS, got, strict=True):
        want = reference.post(path, json={"model": "m", "temperature": 0, **body})
        assert response.status_code == want.status_code == 200
        assert _answer(response.json()) == _answer(want.json())
        assert _answer(response.json())[3] or "logprobs" not in body  # the logprobs asked for came back
        got_lp, want_lp = _logprob_values(response.json()), _logprob_values(want.json())
        assert max((abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)), default=0) < 1e-4


def test_a_stream_equals_the_whole_reply_and_the_request_id_comes_back(cluster, client, reference):
    whole = reference.post("/v1/chat/completions", json=dict(model="m", messages=CHAT, max_tokens=20))
    pieces, finish = [], None
    stream = client.chat.completions.with_raw_response.create(
        model="m",
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_headers={"X-Request-Id": "rq-7"},
    )
    assert stream.headers.get_list("x-request-id") == ["rq-7"]
    for chunk in stream.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    choice = whole.json()["choices"][0]
    assert "".join(pieces) == choice["message"]["content"] and finish == choice["finish_reason"]


def test_health_errors_and_metrics_are_the_servers(cluster):
    health = httpx.get(f"{cluster}/health", timeout=30).json()
    assert health["status"] == "ok" and health["model"] == CONFIG.model_name
    bad = httpx.post(
        f"{cluster}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": -1}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(f"{cluster}/v1/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "entmtp_generated_tokens_total" in httpx.get(f"{cluster}/metrics", timeout=30).text


def test_streams_whose_clients_leave_free_their_rows_on_every_replica(cluster):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    for _ in range(4):  # over both replicas: each stream leaves after its first event
        with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 20
    idle: dict[str, bool] = {}  # replica -> idle at its latest answer
    while time.monotonic() < deadline:  # /health answers from either replica: both must answer, idle
        for p in (httpx.get(f"{cluster}/health", timeout=30).json() for _ in range(8)):
            idle[p["replica"]] = p["running"] == 0 and p["queue"] == 0
        if len(idle) == 2 and all(idle.values()):
            break
        time.sleep(0.5)
    assert len(idle) == 2, f"only replicas {sorted(idle)} answered /health"
    assert all(idle.values()), idle  # 400 tokens each would take far longer


def test_print_config_passes_rays_own_schema(capsys):
    from ray.serve.schema import ServeDeploySchema

    from entmtp.cli import main

    assert main(["serve", "--ray", "--print-config", "--min-replicas", "1", "--max-replicas", "3"]) == 0
    deploy = ServeDeploySchema.model_validate(yaml.safe_load(capsys.readouterr().out))
    assert deploy.applications[0].import_path == "entmtp.server.ray_serve:build_app"


def _engine_replicas() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if ENGINE in a["name"]}


def _stream(cluster: str, outcomes: list, started: list) -> None:
    """One client's streamed completion, recorded as how it ended: ("done", text), ("error", message) for an
    error event then [DONE], ("status", code) for a JSON error, or ("broken", ...) for anything else."""
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "stream": True}
    text, error, events = "", None, []
    try:
        with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                r.read()
                try:
                    outcomes.append(("status", r.status_code, r.json()["error"]["type"]))
                except (ValueError, KeyError):  # not OpenAI's shape
                    outcomes.append(("broken", r.status_code, r.text[:300]))
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if events[-1] == "[DONE]":
                    break
                obj = json.loads(events[-1])
                if "error" in obj:
                    error = obj["error"]
                else:
                    if len(events) == 1:  # its first event: the answer is under way
                        started.append(1)
                    text += obj["choices"][0]["text"]
    except (httpx.HTTPError, ValueError) as e:  # a cut connection, an event that is not JSON
        outcomes.append(("broken", repr(e), events[-2:]))
        return
    if events[-1:] != ["[DONE]"]:
        outcomes.append(("broken", events[-2:]))
    else:
        outcomes.append(("error", error) if error else ("done", text))


def _served_again(cluster: str, since: float):
    """A future of the seconds from `since` until a new request is answered 200 (tried every 0.2 s)."""

    def probe() -> tuple[float, list]:
        body = {"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        refused = []  # what the tries before the first 200 got
        while (r := httpx.post(f"{cluster}/v1/completions", json=body, timeout=60)).status_code != 200:
            refused.append((round(time.monotonic() - since, 1), r.status_code, r.text[:120]))
            time.sleep(0.2)
        return time.monotonic() - since, refused

    return ThreadPoolExecutor(1).submit(probe)


def test_a_replica_killed_under_load_ends_its_requests_cleanly_and_the_cluster_serves_on(cluster, reference):
    want = reference.post(
        "/v1/completions",
        json={"model": "m", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0},
    ).json()["choices"][0]["text"]
    before = _engine_replicas()
    outcomes, started = [], []
    clients = [threading.Thread(target=_stream, args=(cluster, outcomes, started)) for _ in range(8)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60  # most streams under way: the killed replica is mid-answer on some
    while len(started) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = sorted(before)[0]
    under_way = len(started)  # streams whose first event had come, on either replica
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    served_again = _served_again(cluster, killed_at)  # new requests go to the live replica
    for c in clients:
        c.join(timeout=90)
    assert not any(c.is_alive() for c in clients), "a client hung"
    kinds = [o[0] for o in outcomes]
    assert len(outcomes) == 8 and "broken" not in kinds, outcomes
    assert all(o[1] == want for o in outcomes if o[0] == "done")  # no answer ran twice or got mixed
    for o in outcomes:
        if o[0] == "error":
            assert o[1]["type"] == "server_error" and o[1]["code"] == "replica_failed"
        if o[0] == "status":
            assert o[1] == 503 and o[2] in ("server_error", "server_busy")
    assert kinds.count("error") + kinds.count("status") >= 1, outcomes  # the killed replica held some
    assert "done" in kinds, outcomes  # the live one's
    recovered_s, refused = served_again.result(timeout=60)
    # generous, named as such: served again within ~1-3 s here; a router that kept sending to the dead
    # replica would never serve again
    assert recovered_s < RECOVERY_BOUND_S, f"served again only {recovered_s:.1f} s after the kill: {refused}"
    # and Ray starts a replica in the dead one's place
    deadline = time.monotonic() + 30
    while not (_engine_replicas() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _engine_replicas() - before, "Ray did not replace the killed replica"
    replaced_s = time.monotonic() - killed_at  # its actor exists (its model may still be loading)
    print(  # the fault figures: `pytest -s -k killed tests/test_ray_serve.py` prints them
        f"fault: 8 streaming clients, {under_way} streams under way at the kill; ended: "
        f"{kinds.count('done')} complete 200, {kinds.count('error')} error event + [DONE], "
        f"{kinds.count('status')} 5xx ({', '.join(str(o[1:]) for o in outcomes if o[0] == 'status') or '-'}), "
        f"0 hung; served again {recovered_s:.1f} s after the kill (refused before: {refused}); "
        f"a replacement replica within {replaced_s:.1f} s"
    )


def test_a_stream_open_past_the_drain_time_of_a_shutdown_ends_with_shutdown_and_done(cluster):
    """Last (it deletes the application): `serve.delete`, as on SIGTERM to `entmtp serve --ray`, waits
    --drain-timeout (2 s here) for a 400-token stream, then stops its replica; the stream's last event says
    `shutdown` (as `entmtp serve`'s do past its drain time), then [DONE]."""
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    deleting = None
    events = []
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if deleting is None:  # the answer is under way: shut down now
                    deleting = ThreadPoolExecutor(1).submit(serve.delete, APP_NAME)
    deleting.result(timeout=60)
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "shutdown"), error
    assert events[-1] == "[DONE]" and len(events) > 3  # some text came before the cut
