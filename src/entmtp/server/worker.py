"""The generation thread behind a bounded queue, one request at a time: each job runs `Engine.stream` alone
(with its own decode state: the heads, the policy and the lookup index are fresh per call) and can be
cancelled between steps (a client that disconnects stops its generation; a shutdown past its drain time cuts
every job still open). `serve --max-batch B` with B > 1 steps up to B jobs together instead (batching.py,
a `Worker` with another loop: the queue, the accounting and the job protocol here are shared)."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine import Engine
from .thread import TorchThread


class QueueFull(Exception):
    """Too many requests waiting: answer 503 with Retry-After."""


class Cut(Exception):
    """The server cut this generation short (a shutdown past its drain time); the message says why."""


_DONE = object()


@dataclass(eq=False)
class Job:
    prompt: object  # chat messages, text or token ids (Engine.stream's prompt)
    kwargs: dict  # Engine.stream's keyword arguments
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenEvent ..., then _DONE or an exception
    cancel: threading.Event = field(default_factory=threading.Event)
    cut: str | None = None  # why the server cut it (set before `cancel`); None: the client left

    async def next(self):
        """The next TokenEvent; None when the generation is over (raises what the generation raised)."""
        item = await self.events.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class Worker:
    """`submit` a job (QueueFull past `slots` running and `max_queue` waiting); the thread streams its events
    back to its loop. This one runs one job at a time (`slots` = 1). The loop runs on `thread` (the one that
    built the engine) when given, else on a new one."""

    slots = 1  # jobs generating at once

    def __init__(self, engine: Engine, max_queue: int, on_finish=None, thread: TorchThread | None = None):
        self.engine, self.max_queue, self.on_finish = engine, max_queue, on_finish
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._open: set[Job] = set()  # accepted and not finished
        self._service: deque[float] = deque(maxlen=16)  # seconds recent jobs took from start to end
        self._closed = False  # the thread took `close`'s marker: it admits no more jobs
        self.waiting = 0  # accepted jobs not yet started
        self.running = 0  # jobs started and not ended (0..slots)
        thread = thread or TorchThread()  # the server's: the one that built the engine (thread.py says why)
        self._thread = thread.thread
        thread.finish(self._run)

    def submit(self, job: Job) -> None:
        with self._lock:
            # `slots` jobs run and max_queue wait: count the accepted jobs the thread has not picked up yet as
            # waiting for a free slot too, or a burst on an idle server is refused before the thread wakes
            if self.waiting + self.running >= self.max_queue + self.slots:
                raise QueueFull
            self.waiting += 1
            self._open.add(job)
        self._jobs.put(job)

    def counts(self) -> tuple[int, int]:
        """(waiting, running), read together: never a job counted in both or in neither."""
        with self._lock:
            return self.waiting, self.running

    def retry_after(self, default: float = 2.0) -> int:
        """Seconds until the jobs accepted now are likely done: (waiting + running) / slots x the recent mean
        time per job (`default` per job before any finished), at least 1 s and at most 10 minutes."""
        with self._lock:
            per_job = sum(self._service) / len(self._service) if self._service else default
            ahead = self.waiting + self.running
        return int(min(600, max(1, math.ceil(ahead / self.slots * per_job))))

    def cut_all(self, reason: str) -> int:
        """Cut every open job (running: after its current step; waiting: before it starts); how many."""
        with self._lock:
            jobs = list(self._open)
        for job in jobs:
            job.cut = reason
            job.cancel.set()
        return len(jobs)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._open

    def close(self) -> None:
        self._jobs.put(None)

    def _emit(self, job: Job, item) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _next(self, block: bool = True) -> Job | None:
        """The next accepted job, counted as running from now; None when none waits (`block=False`) or after
        `close`."""
        try:
            job = self._jobs.get(block)
        except queue.Empty:
            return None
        if job is None:
            self._closed = True
            return None
        with self._lock:
            self.waiting -= 1
            self.running += 1
        return job

    def _end(self, job: Job, result, stopped: bool, t0: float, error: BaseException | None = None) -> None:
        """`job` is over: its slot freed, its time recorded when it ran to its end (`result`), then its last
        item sent (the error; Cut when the server cut it; else _DONE: a client that hears it finds the server's
        counts already without it), and `on_finish` told."""
        with self._lock:
            self.running -= 1
            self._open.discard(job)
            if result is not None:  # only whole generations measure the time a job takes
                self._service.append(time.perf_counter() - t0)
        self._emit(job, error if error is not None else Cut(job.cut) if stopped and job.cut else _DONE)
        if self.on_finish is not None:
            self.on_finish(result, stopped)

    def _run(self) -> None:
        while (job := self._next()) is not None:
            t0 = time.perf_counter()
            stopped = job.cancel.is_set()  # the client may have left while it waited
            result, error = None, None
            try:
                if not stopped:
                    for event in self.engine.stream(job.prompt, **job.kwargs):
                        self._emit(job, event)
                        result = event.result
                        if result is None and job.cancel.is_set():  # stop after this step
                            stopped = True
                            break
            except Exception as e:  # noqa: BLE001 - handed to the request, which answers with an error
                error = e
            finally:
                self._end(job, result, stopped, t0, error)
