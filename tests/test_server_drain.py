"""A server process shut down (SIGTERM) while a long prompt prefills, on a random model with an 8192-token
window (no checkpoint to load): the prefill goes in chunk by chunk, so the cut reaches every stream at once
(an error event, then [DONE]), the generation thread ends within a chunk, and the process exits 0. It used to
abort ("terminate called without an active exception", exit -6) with every stream cut short."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

# the server: 24 layers of width 256, so a prompt of 8k tokens takes seconds to prefill on a CPU
SERVER = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from entmtp.engine import Engine
from entmtp.random_model import IdTokenizer
from entmtp.server.app import create_app
from entmtp.server.run import bind, serve
from entmtp.server.thread import TorchThread

def build():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=24, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192, eos_token_id=None)
    return Engine(LlamaForCausalLM(config).eval(), IdTokenizer(1000), graphs=False)

sock = bind("127.0.0.1", int(sys.argv[1]))
thread = TorchThread()
app = create_app(thread.call(build), "random", max_batch=4, thread=thread)
serve(app, sock, drain_timeout=0.5)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, prompt: list[int], max_tokens: int, lines: list[str], started: threading.Event):
    """A streamed completion at T=0.8; its data lines go into `lines` (and `started` is set at the first)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.8}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        lines.append(f"cut short: {e!r}")
    started.set()


def test_sigterm_during_a_long_prefill_ends_every_stream_with_an_error_and_exits_0(tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        requests = [([5, 6, 7], 4000), ([8, 9], 4000), (list(range(1, 900)) * 9, 40)]  # the last: 8091 tokens
        streams = []
        for prompt, max_tokens in requests:
            lines, started = [], threading.Event()
            thread = threading.Thread(target=_stream, args=(url, prompt, max_tokens, lines, started))
            thread.start()
            streams.append((thread, lines, started))
            if len(streams) < 3:
                assert started.wait(60)  # decoding before the long prompt comes
        time.sleep(1.0)  # the long prompt is prefilling
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    for thread, lines, _ in streams:
        thread.join(10)
        assert lines[-1] == "[DONE]", lines[-2:]
        assert json.loads(lines[-2])["error"]["code"] == "shutdown"
    assert "terminate called" not in log.read_text()
