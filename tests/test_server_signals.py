"""`entmtp serve`'s shutdown (server/run.py) on a stand-in app whose drain would take a minute: the first
SIGTERM / SIGINT drains, a second one of either kind cuts what is open and quits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

# a server whose drain takes 60 s and says when it starts; its port on the first line of stdout
SERVER = textwrap.dedent(
    """
    import asyncio
    from fastapi import FastAPI
    from entmtp.server.run import bind, serve

    class Draining:
        async def drain(self, timeout):
            print("draining", flush=True)
            await asyncio.sleep(timeout)

        def cut(self):
            print("cut", flush=True)

    app = FastAPI()
    app.state.server = Draining()
    sock = bind("127.0.0.1", 0)
    print(sock.getsockname()[1], flush=True)
    serve(app, sock, drain_timeout=60, access_log=False)
    print("exited", flush=True)
    """
)


def _wait_serving(port: int) -> None:
    """Once uvicorn answers (and so has its signal handlers), not just once the port is bound."""
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("the stand-in server did not answer in 30 s")


@pytest.mark.parametrize(
    "first, second",
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)],
)
def test_a_second_signal_skips_the_drain_and_quits_at_once(first, second):
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        _wait_serving(int(proc.stdout.readline()))
        proc.send_signal(first)
        assert proc.stdout.readline().strip() == "draining"
        time.sleep(0.5)
        assert proc.poll() is None  # one signal drains: still running
        t0 = time.time()
        proc.send_signal(second)
        assert proc.wait(timeout=10) == 0  # before: the 60 s drain ran on (a second SIGTERM was ignored)
        assert (
            time.time() - t0 < 5
        )  # generous: it quits at once (~0.2 s); before the fix the 60 s drain ran on
        assert proc.stdout.read().split() == ["cut", "exited"]
    finally:
        proc.kill()
        proc.wait()
