"""`entmtp serve` as a real process for the HTTP tests: started on a free port, ready once /health answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

MAX_BODY = 2_000_000  # room for a 10k-message chat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    tmp_path,
    *extra: str,
    port: int | None = None,
    seen: list | None = None,
    dtype: str | None = "float32",
    probe: bool = False,
):
    """(process, url, stderr file) of `entmtp serve` on the embedded model, once /health answers 200; `seen`
    collects the (status, body) of the /health answers before it. `probe`: this machine's costs measured (the
    tests otherwise read the profiles' stored latencies, conftest.py), so `auto` chooses between backends."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "entmtp.cli", "serve", "--port", str(port)]
    cmd += ["--dtype", dtype] if dtype else []  # None: the GGUF as given on llama.cpp
    cmd += ["--heads", "hydra", "--tree", "tree_4", "--lookup", "--max-body", str(MAX_BODY), *extra]
    env = dict(os.environ, ENTMTP_TEST_THREADS="2")
    if probe:
        env.pop("ENTMTP_NO_PROBE", None)
    log = tmp_path / f"serve-{port}.log"  # a file, not a pipe: the access log must never block the server
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + (600 if probe else 180)  # a first measurement of both backends: minutes
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()}")
        try:
            r = httpx.get(f"{url}/health", timeout=1)
            if r.status_code == 200:
                return proc, url, log
            if seen is not None:
                seen.append((r.status_code, r.json(), r.headers.get("retry-after")))
            time.sleep(0.1)
        except httpx.HTTPError:
            time.sleep(0.1 if seen is not None else 0.5)
    proc.kill()
    raise RuntimeError("server did not start in 180 s")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
