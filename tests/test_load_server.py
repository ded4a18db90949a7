"""scripts/load_server.py's own parts that decide whether a run is right, without a server: which engine each
configuration decoded with (from its log, Ray's relayed replica lines included), that nothing a server
started outlives it, and the overhead table's arithmetic."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load_server.py"


@pytest.fixture(scope="module")
def load_server():
    spec = importlib.util.spec_from_file_location("load_server", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_server"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["load_server"]


def _log(text: str):
    log = tempfile.TemporaryFile()
    log.write(text.encode())
    return log


def test_the_engine_of_entmtp_serve_is_read_from_its_plan(load_server):
    log = _log(
        "backend: llama-cpp (auto: the most expected tokens/s here)\n"
        "dtype: bfloat16 (auto: bf16 12.1, float32 9.0 tokens/s)\npolicy: greedy (the profile's)\n"
    )
    assert load_server.engine_plans(log) == [
        {
            "backend": "llama-cpp",
            "backend_reason": "auto: the most expected tokens/s here",
            "dtype": "bfloat16",
            "dtype_reason": "auto: bf16 12.1, float32 9.0 tokens/s",
            "policy": "greedy",
            "policy_reason": "the profile's",
        }
    ]


def test_each_ray_replicas_engine_is_read_from_the_lines_ray_relays(load_server):
    """Ray prefixes a replica's lines with its name, colours them and folds repeats of other replicas."""
    prefix = "\x1b[36m(ServeReplica:entmtp:EntmtpEngine pid=16478)\x1b[0m 2026-12-03 09:00:02 entmtp: engine plan: "
    log = _log(
        f"{prefix}backend: transformers (as asked)\n{prefix}dtype: float32 (as asked)\n"
        f"{prefix}policy: plain (no tree beats a plain step)\n"
        f"{prefix}backend: transformers (as asked) [repeated 2x across cluster]\n"
        f"{prefix}dtype: float32 (as asked) [repeated 2x across cluster]\n"
        f"{prefix}policy: dynamic (the profile's) [repeated 2x across cluster]\n"
    )
    plans = load_server.engine_plans(log)
    assert len(plans) == 2 and all(p["backend"] == "transformers" and p["dtype"] == "float32" for p in plans)
    assert [p["policy"] for p in plans] == ["plain", "dynamic"]  # two replicas that chose apart: both told
    assert load_server.describe_engines(plans) == (
        "transformers (as asked), float32 (as asked), dynamic (the profile's); "
        "transformers (as asked), float32 (as asked), plain (no tree beats a plain step)"
    )
    assert load_server.describe_engines([]) == "unknown (no plan in the server's log)"


def test_a_process_the_server_left_running_is_named_and_killed(load_server):
    """As a Ray cluster's raylet would be: a child in the server's session that outlives it."""
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(load_server._session_processes(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = load_server.stop_server(proc, "test")
    assert len(leftovers) == 1 and "time.sleep(60)" in leftovers[0]
    time.sleep(0.5)
    assert load_server._session_processes(proc.pid) == []  # killed, nothing left


def test_the_overhead_is_each_configurations_p50_latency_less_the_firsts(load_server, capsys):
    def level(latencies):
        answers = [
            {"error": None, "latency_s": s, "ttft_s": s, "completion_tokens": 1, "prompt": i}
            for i, s in enumerate(latencies)
        ]
        return load_server.summarize(1, answers, len(answers), sum(latencies))

    results = [
        {"name": "serve", "overhead": level([0.020, 0.022, 0.024])},
        {"name": "ray-1x2", "overhead": level([0.030, 0.035, 0.040])},
    ]
    load_server.print_overhead(results, width=8)
    lines = capsys.readouterr().out.splitlines()
    assert "3 requests of 1 token(s)" in lines[1]
    assert lines[-2].split()[-1] == "+0.0ms" and lines[-1].split()[-1] == "+13.0ms"
