"""The generation thread behind a bounded queue, one request at a time: each job runs `Engine.stream` alone
(with its own decode state: the heads, the policy and the lookup index are fresh per call) and can be
cancelled between steps (a client that disconnects stops its generation; a shutdown past its drain time cuts
every job still open). `serve --max-batch B` with B > 1 steps up to B jobs together instead (batching.py,
a `Worker` with another loop: the queue, the accounting and the job protocol here are shared)."""

from __future__ import annotations

import asyncio
import math
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
    queued: float = 0.0  # when it was accepted (perf_counter)

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
    built the engine) when given, else on a new one.

    A waiting job whose client left (or that the server cut) leaves the queue as soon as anyone looks at the
    queue (`submit`, `counts`, the thread), not when the thread gets to it: a burst of clients that gave up
    while they waited never holds the queue full. A cut job hears of it at once (`cut_all`), even while the
    thread is inside a long step."""

    slots = 1  # jobs generating at once

    def __init__(self, engine: Engine, max_queue: int, on_finish=None, thread: TorchThread | None = None):
        self.engine, self.max_queue, self.on_finish = engine, max_queue, on_finish
        self._lock = threading.Condition(threading.RLock())  # the queue and the counts; wakes the thread
        self._queue: deque[Job] = deque()  # accepted jobs not yet started, oldest first
        self._open: set[Job] = set()  # accepted and not finished
        self._service: deque[float] = deque(maxlen=16)  # seconds recent jobs took from start to end
        self._waits: deque[float] = deque(maxlen=16)  # seconds recent jobs waited in the queue
        self._closing = False  # `close` was called: the thread ends once the queue is empty ...
        self._closed = False  # ... and has seen it: it admits no more jobs
        self.running = 0  # jobs started and not ended (0..slots)
        thread = thread or TorchThread()  # the server's: the one that built the engine (thread.py says why)
        self._thread = thread.thread
        thread.finish(self._run)

    @property
    def waiting(self) -> int:
        """Accepted jobs not yet started (cancelled ones included until the queue is next looked at)."""
        return len(self._queue)

    def submit(self, job: Job) -> None:
        with self._lock:
            self._withdraw_cancelled()
            # `slots` jobs run and max_queue wait: count the accepted jobs the thread has not picked up yet as
            # waiting for a free slot too, or a burst on an idle server is refused before the thread wakes
            if len(self._queue) + self.running >= self.max_queue + self.slots:
                raise QueueFull
            job.queued = time.perf_counter()
            self._queue.append(job)
            self._open.add(job)
            self._lock.notify()

    def counts(self) -> tuple[int, int]:
        """(waiting, running), read together: never a job counted in both or in neither."""
        with self._lock:
            self._withdraw_cancelled()
            return len(self._queue), self.running

    def retry_after(self, default: float = 2.0) -> int:
        """Seconds a refused client should wait: what waiting in the queue measures now, the larger of the
        recent jobs' mean wait from `submit` to their start and the oldest waiting job's wait so far; before
        any job waited, (waiting + running) / slots x the recent mean time per job (`default` per job before
        any finished). At least 1 s and at most 10 minutes."""
        with self._lock:
            oldest = time.perf_counter() - self._queue[0].queued if self._queue else 0.0
            if self._waits:
                wait = max(sum(self._waits) / len(self._waits), oldest)
            else:
                per_job = sum(self._service) / len(self._service) if self._service else default
                wait = max(oldest, (len(self._queue) + self.running) / self.slots * per_job)
        return int(min(600, max(1, math.ceil(wait))))

    def cut_all(self, reason: str) -> int:
        """Cut every open job, each told at once (its stream ends with the reason now); a waiting one leaves
        the queue now, a running one leaves its row after the thread's current step. How many."""
        with self._lock:
            jobs, waiting = list(self._open), set(self._queue)
            for job in jobs:
                job.cut = reason
                job.cancel.set()
            self._withdraw_cancelled()  # the waiting ones: ended now
            for job in jobs:
                if job not in waiting:  # the running ones: told now; the thread's own last word comes later
                    self._emit(job, Cut(reason))
        return len(jobs)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._open

    def close(self) -> None:
        """No more jobs: the thread ends once the jobs accepted before are done (`join` waits for it)."""
        with self._lock:
            self._closing = True
            self._lock.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s for the thread to end (after `close`); whether it has. A process must not
        exit while the thread is inside a torch call: its C++ runtime aborts ("terminate called without an
        active exception")."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _emit(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # its loop is closed (a job cut, and its server gone): nobody reads it
            pass

    def _next(self, block: bool = True) -> Job | None:
        """The next accepted job, counted as running from now; None when none waits (`block=False`) or after
        `close` (once the queue is empty)."""
        with self._lock:
            while True:
                self._withdraw_cancelled()
                if self._queue:
                    job = self._queue.popleft()
                    self.running += 1
                    self._waits.append(time.perf_counter() - job.queued)
                    return job
                if self._closing:
                    self._closed = True
                    return None
                if not block:
                    return None
                self._lock.wait()

    def _withdraw_cancelled(self) -> None:
        """End the waiting jobs that were cancelled (their client left, or the server cut them): they never
        start and hold no place in the queue. Called with the lock held."""
        if not any(job.cancel.is_set() for job in self._queue):
            return
        left = [job for job in self._queue if job.cancel.is_set()]
        self._queue = deque(job for job in self._queue if not job.cancel.is_set())
        for job in left:
            self._finish(job, None, True)

    def _end(self, job: Job, result, stopped: bool, t0: float, error: BaseException | None = None) -> None:
        """`job`, started at `t0`, is over: its slot freed, its time recorded when it ran to its end (`result`),
        then `_finish`."""
        with self._lock:
            self.running -= 1
            if result is not None:  # only whole generations measure the time a job takes
                self._service.append(time.perf_counter() - t0)
        self._finish(job, result, stopped, error)

    def _finish(self, job: Job, result, stopped: bool, error: BaseException | None = None) -> None:
        """`job` is no longer open: its last item sent (the error; Cut when the server cut it; else _DONE: a
        client that hears it finds the server's counts already without it), and `on_finish` told."""
        with self._lock:
            self._open.discard(job)
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
