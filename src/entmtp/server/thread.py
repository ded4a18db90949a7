"""The server's one torch thread: it loads the model, measures the step costs, builds the batch, and then
runs the generation loop (worker.py), so that every torch operation of the process runs on the same thread.

Why one thread: torch's CPU builds for Linux parallelize with GNU OpenMP (libgomp), and each thread that
starts a parallel region gets its own team of worker threads. Once two threads have done so (the model
loaded on the main thread, decoding on another), libgomp manages more threads than there are CPUs and its
idle workers stop spinning (GOMP's throttled spin count): every parallel region then waits for its workers
to wake. On a 2-core Xeon (avx512_bf16, amx) the same bf16 step took ~1.7x as long on a second thread
(`scripts/torch_thread_check.py`, `docs/results/server-batching/thread-check.txt`). The event loop
thread never runs a parallel torch operation (tokenization is the tokenizer's own Rust code)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class TorchThread:
    """A daemon thread that runs the calls handed to it, one after another: `call` waits for a result;
    `finish` hands it its last call (the worker's loop), after which the thread ends and takes no more."""

    def __init__(self, name: str = "entmtp-generate"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._finished = False  # `finish` was called: a later call would wait behind the last one forever
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def call(self, fn, /, *args, **kwargs):
        """Run `fn(*args, **kwargs)` on the thread; what it returns, or raise what it raised."""
        if self._finished:
            raise RuntimeError(f"the thread {self.thread.name} has finished; it runs no more calls")
        future: Future = Future()
        self._calls.put((fn, args, kwargs, future))
        return future.result()

    def finish(self, fn) -> None:
        """Hand the thread its last call `fn()` (not waited for); the thread ends when it returns."""
        self._finished = True
        self._calls.put((fn, (), {}, None))

    def _loop(self) -> None:
        while True:
            fn, args, kwargs, future = self._calls.get()
            if future is None:
                fn()
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller of `call` raises it
                future.set_exception(e)
