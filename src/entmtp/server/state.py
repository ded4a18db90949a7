"""What the routes of one server share (held on `app.state.server`): the engine, its worker and metrics, the
settings, and whether the server is draining."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..costs.curves import CostSurface
from ..engine import Engine
from . import schema
from .batching import start_worker
from .metrics import Metrics
from .thread import TorchThread
from .worker import Worker

log = logging.getLogger("entmtp.server")
BODY_TIMEOUT_S = 30.0  # `serve --body-timeout`'s default: a 1 MB body at 35 kB/s
LONG_PROMPT_CHARS = 20_000  # prompts longer than this (about 5k tokens) are tokenized in the long lane
CLOSE_WAIT_S = 30.0  # at exit, the longest wait for the generation thread's current step (a prefill chunk)


@dataclass(eq=False)
class ServerState:
    """One server's engine, generation thread, metrics and settings; `drain` and `close` end it."""

    engine: Engine
    model_name: str  # reported in every response, whatever the request named (one model per server)
    worker: Worker
    metrics: Metrics
    max_body_bytes: int
    token_text: schema.TokenText
    acceptance: str = "auto"  # the acceptance rule of requests at temperature > 0 (accept.Sampling)
    body_timeout: float = BODY_TIMEOUT_S  # seconds a request's body may take to arrive, from its headers
    # a 10k-message chat template takes most of a second: off the loop. Two lanes: prompts of up to
    # LONG_PROMPT_CHARS characters, and longer ones (a 1 MB prompt takes ~0.6 s), so a short chat never waits
    # behind a dozen long uploads (the tokenizer's Rust code runs without the GIL: both lanes run at once)
    tokenize: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="entmtp-tokenize")
    )
    tokenize_long: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="entmtp-tokenize-long")
    )
    draining: bool = False  # set by `drain`: new requests get 503, /health answers "draining"
    replica: str | None = None  # under Ray Serve: this replica's id, which /health reports (ray_serve.py)

    @classmethod
    def start(
        cls,
        engine: Engine,
        model_name: str,
        max_queue: int,
        max_body_bytes: int,
        max_batch: int = 1,
        costs: CostSurface | None = None,
        thread: TorchThread | None = None,
        acceptance: str = "auto",
        body_timeout: float = BODY_TIMEOUT_S,
        invariant: bool = False,
        live_threads: bool = False,
    ) -> ServerState:
        """A state with its generation loop started (`max_batch` rows at once, batching.py) on `thread`, the
        one that built the engine (thread.py says why), or on a new thread."""
        metrics = Metrics()
        worker = start_worker(
            engine,
            max_queue,
            max_batch,
            costs,
            on_finish=metrics.finished,
            on_step=metrics.stepped,
            thread=thread,
            invariant=invariant,
            live_threads=live_threads,
        )
        token_text = schema.TokenText(engine.tokenizer)
        return cls(
            engine,
            model_name,
            worker,
            metrics,
            max_body_bytes,
            token_text,
            acceptance=acceptance,
            body_timeout=body_timeout,
        )

    def tokenizer_lane(self, chars: int) -> ThreadPoolExecutor:
        """The tokenizing thread of a prompt of `chars` characters (the long lane past LONG_PROMPT_CHARS)."""
        return self.tokenize_long if chars > LONG_PROMPT_CHARS else self.tokenize

    async def drain(self, timeout: float) -> None:
        """Stop taking requests; let open generations finish for up to `timeout` s; cut the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.worker.idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.worker.idle:
            reason = f"the server is shutting down: generation cut after the drain timeout of {timeout:g} s"
            log.warning(
                "cutting %d open generation(s) after the %g s drain", self.worker.cut_all(reason), timeout
            )

    def cut(self) -> None:
        """Cut every open generation now (a second signal: no drain): streams end with an error event."""
        self.draining = True
        cut = self.worker.cut_all("the server is shutting down: generation cut by a second signal")
        log.warning("a second signal: quitting at once, %d open generation(s) cut", cut)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Cut what is still open (after `drain`, nothing), then wait up to `timeout` s for the generation
        thread to end: the process must not exit while it is inside a torch call (worker.py, `join`)."""
        cut = self.worker.cut_all("the server is shutting down")
        if cut:
            log.warning("cutting %d open generation(s): the server is closing", cut)
        self.worker.close()
        if not self.worker.join(timeout):
            log.error("the generation thread is still running after %g s", timeout)
        self.tokenize.shutdown(wait=False)
        self.tokenize_long.shutdown(wait=False)
