"""One generation thread serving a bounded queue: requests run one at a time on the device (batching is a later
step), each with its own decode state (`Engine.stream` resets the heads, the policy and the lookup index per
call), and each can be cancelled between steps (a client that disconnects stops its generation)."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from ..engine import Engine


class QueueFull(Exception):
    """Too many requests waiting: answer 503 with Retry-After."""


_DONE = object()


@dataclass
class Job:
    prompt: object  # chat messages, text or token ids (Engine.stream's prompt)
    kwargs: dict  # Engine.stream's keyword arguments
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenEvent ..., then _DONE or an exception
    cancel: threading.Event = field(default_factory=threading.Event)

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
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _emit(self, job: Job, item) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self.waiting -= 1
                self.running = 1
            result, stopped = None, job.cancel.is_set()  # the client may have left while it waited
            try:
                if not stopped:
                    for event in self.engine.stream(job.prompt, **job.kwargs):
                        self._emit(job, event)
                        result = event.result
                        if result is None and job.cancel.is_set():  # the client left: stop after this step
                            stopped = True
                            break
                self._emit(job, _DONE)
            except Exception as e:  # noqa: BLE001 - handed to the request, which answers with an error
                self._emit(job, e)
            finally:
                with self._lock:
                    self.running = 0
                if self.on_finish is not None:
                    self.on_finish(result, stopped)
