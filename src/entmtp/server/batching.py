"""The generation thread of `serve --max-batch B` (B > 1): up to B jobs decode together as the rows of one
continuous batch (batch.py), every row's tree verified in one forward per step.

The loop, between two steps: admit waiting jobs into free rows (a job cancelled while it waited never
starts), drop the rows whose client left or which the server cut, then step the batch once (every decoding
row, and one chunk of the prompt going in with the fewest tokens left: a long prompt never stalls the others
for its whole prefill) and route each row's event to its job. A job submitted while a row is free raises the
batch's interrupt: a prefill chunk in flight stops part way (interrupt.py) and the newcomer's prompt goes in
at the next step, so a short request's first token never waits for a chunk of somebody's long prompt (a
chunk deep in an 8k-token prompt takes seconds on two cores). Rows join and leave between steps, so nobody waits for the
slowest; each row decodes what `Engine.stream` gives it alone (token for token in float32 greedy decoding;
bit for bit for seeded sampling: batch.py). An error in one row's part of a step (its prompt, its drafting,
its verification) ends that row's job only; an error of the batch itself ends every row's job and the next
jobs start on a fresh batch. The queue, the accounting and the job protocol are the `Worker`'s."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..batch import Batch, BatchOptions, Row
from ..costs.curves import CostSurface
from ..engine import Engine
from ..errors import EntMTPError
from ..interrupt import Interrupt
from .thread import TorchThread
from .threads import ThreadChooser, priced_by, step_measure
from .worker import Job, Worker

log = logging.getLogger("entmtp.server")


def start_worker(
    engine: Engine,
    max_queue: int,
    max_batch: int,
    costs: CostSurface | None = None,
    on_finish=None,
    on_step=None,
    thread: TorchThread | None = None,
    invariant: bool = False,
    live_threads: bool = False,
) -> Worker:
    """The generation thread: a `BatchWorker` of `max_batch` rows, or one job at a time when `max_batch` is 1
    or the engine cannot step a batch (CUDA graphs, no preallocated cache: one log line says which). With
    `thread` (the one that built the engine: thread.py says why), the batch is built and the loop runs there.
    `invariant`: every row in a cache of its own (BatchOptions.invariant). `live_threads`: the batch worker
    chooses its CPU threads, 1 up to the engine's, by its steps' times (threads.py)."""
    if max_batch > 1:
        try:
            options = BatchOptions(max_batch=max_batch, costs=costs, invariant=invariant)
            batch = thread.call(Batch, engine, options) if thread else Batch(engine, options)
        except EntMTPError as e:
            log.warning("serving one request at a time, not %d together: %s", max_batch, e)
        else:
            chooser = None
            if live_threads:  # the count of the thread that runs the forwards (before its loop takes it)
                top = thread.call(engine.base.threads) if thread else engine.base.threads()
                chooser = ThreadChooser(top, engine.base.set_threads)
            return BatchWorker(batch, max_batch, max_queue, on_finish, on_step, thread, chooser)
    return Worker(engine, max_queue, on_finish, thread)


@dataclass(eq=False)
class _Running:
    """A job decoding in a row of the batch, since `t0`."""

    job: Job
    row: Row
    t0: float


class BatchWorker(Worker):
    """Up to `slots` jobs generating together (see the module docstring). `on_step(record, tokens)` hears of
    every step: its `BatchStep` and the tokens it emitted over all rows."""

    def __init__(
        self,
        batch: Batch,
        slots: int,
        max_queue: int,
        on_finish=None,
        on_step=None,
        thread: TorchThread | None = None,
        threads: ThreadChooser | None = None,
    ):
        # set before Worker.__init__, which starts the loop that reads them
        self.batch, self.slots, self.on_step = batch, slots, on_step
        self._rows: dict[int, _Running] = {}  # row id -> its job
        self.interrupt = Interrupt()  # `submit` raises it while a row is free: a prefill chunk stops
        self.threads = threads  # the live choice of CPU threads (threads.py), if any
        self._priced = priced_by(batch.options.costs)  # what the surface prices a step at (threads.py)
        super().__init__(batch.engine, max_queue, on_finish, thread)

    def submit(self, job: Job) -> None:
        with self._lock:
            super().submit(job)
            if len(self._rows) < self.slots:  # it can start at the next step: no chunk need delay it
                self.interrupt.set()

    def _run(self) -> None:
        while not self._closed or self._rows:  # after `close`, the rows still open run to their end
            self._admit()
            self._drop_cancelled()
            if self._rows:
                self._step()

    def _admit(self) -> None:
        """Start waiting jobs in the free rows, one prefill at a time; wait for one when no row runs. Then the
        interrupt is down unless a job still waits for a row that is free (one submitted meanwhile)."""
        while len(self._rows) < self.slots and not self._closed:
            job = self._next(block=not self._rows)
            if job is None:
                break
            self._start(job)
        with self._lock:
            if not self._queue or len(self._rows) >= self.slots:
                self.interrupt.clear()

    def _start(self, job: Job) -> None:
        """Give `job` a new row, its prompt to be prefilled by the steps (a job already ended there ends now)."""
        t0 = time.perf_counter()
        if job.cancel.is_set():  # the client left, or the server cut it, since it left the queue
            self._end(job, None, True, t0)
            return
        try:
            row = self.batch.start(job.prompt, **job.kwargs)
        except Exception as e:  # noqa: BLE001 - this job's own failure (its prompt, its arguments)
            self._end(job, None, False, t0, e)
            return
        self._rows[row.id] = _Running(job, row, t0)

    def _drop_cancelled(self) -> None:
        """Rows whose job was cancelled (its client left, or the server cut it) leave before the next step."""
        for rid, running in list(self._rows.items()):
            if running.job.cancel.is_set():
                self.batch.cancel(running.row)
                del self._rows[rid]
                self._end(running.job, None, True, running.t0)

    def _step(self) -> None:
        """One step of the batch (every decoding row, and a chunk of the oldest prompt going in): each event to
        its job; finished rows end their job, and so do rows that failed (with their error), alone."""
        try:
            out = self.batch.step(self.interrupt)
        except Exception as e:  # noqa: BLE001 - the batch's own state is unknown: each row's job gets the error
            self._fail_all(e)
            return
        for row, event in out:
            running = self._rows[row.id]
            self._emit(running.job, event)
            if event.result is not None:
                del self._rows[row.id]
                self._end(running.job, event.result, False, running.t0)
        for row, error in self.batch.failed:
            log.error("a row failed; ending its request alone: %r", error)
            running = self._rows.pop(row.id)
            self._end(running.job, None, False, running.t0, error)
        if (
            self.threads is not None and self.batch.last is not None
        ):  # on this thread, which runs the forwards
            self.threads.observe(*step_measure(self.batch.last, self._priced))
        if self.on_step is not None and self.batch.last is not None:  # a prefill's first token is no step's
            self.on_step(self.batch.last, sum(len(e.token_ids) for _, e in out if e.step is not None))

    def _fail_all(self, error: Exception) -> None:
        """End every row's job with `error` and start over on a fresh batch (the old one's state is unknown)."""
        log.error("a batched step failed; ending its %d request(s): %r", len(self._rows), error)
        old, failed = self.batch, list(self._rows.values())
        self.batch = Batch(old.engine, old.options)  # before any job hears of it
        self._rows.clear()
        for running in failed:
            self._end(running.job, None, False, running.t0, error)
