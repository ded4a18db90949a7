"""One generation thread serving a bounded queue: requests run one at a time on the device (batching is a later
step), each with its own decode state (`Engine.stream` resets the heads, the policy and the lookup index per
call), and each can be cancelled between steps (a client that disconnects stops its generation; a shutdown
past its drain time cuts every job still open)."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine import Engine


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
    """`submit` a job (QueueFull past `max_queue` waiting); the thread streams its events back to its loop."""

    def __init__(self, engine: Engine, max_queue: int, on_finish=None):
        self.engine, self.max_queue, self.on_finish = engine, max_queue, on_finish
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._open: set[Job] = set()  # accepted and not finished
        self._service: deque[float] = deque(maxlen=16)  # seconds the device spent on recent jobs
        self.waiting = 0  # accepted jobs not yet started
        self.running = 0
        self._thread = threading.Thread(target=self._run, name="entmtp-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            # one job runs and max_queue wait: count the accepted jobs the thread has not picked up yet as
            # waiting for the free slot too, or a burst on an idle server is refused before the thread wakes
            if self.waiting + self.running >= self.max_queue + 1:
                raise QueueFull
            self.waiting += 1
            self._open.add(job)
        self._jobs.put(job)

    def retry_after(self, default: float = 2.0) -> int:
        """Seconds until the jobs accepted now are likely done: (waiting + running) x the recent mean time
        per job (`default` per job before any finished), at least 1 s and at most 10 minutes."""
        with self._lock:
            per_job = sum(self._service) / len(self._service) if self._service else default
            ahead = self.waiting + self.running
        return int(min(600, max(1, math.ceil(ahead * per_job))))

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

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self.waiting -= 1
                self.running = 1
            t0 = time.perf_counter()
            result, stopped = None, job.cancel.is_set()  # the client may have left while it waited
            try:
                if not stopped:
                    for event in self.engine.stream(job.prompt, **job.kwargs):
                        self._emit(job, event)
                        result = event.result
                        if result is None and job.cancel.is_set():  # stop after this step
                            stopped = True
                            break
                self._emit(job, Cut(job.cut) if stopped and job.cut else _DONE)
            except Exception as e:  # noqa: BLE001 - handed to the request, which answers with an error
                self._emit(job, e)
            finally:
                with self._lock:
                    self.running = 0
                    self._open.discard(job)
                    if result is not None:  # only whole generations measure the time a job takes
                        self._service.append(time.perf_counter() - t0)
                if self.on_finish is not None:
                    self.on_finish(result, stopped)
