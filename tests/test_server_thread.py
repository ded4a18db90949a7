"""The server's torch thread (server/thread.py): the engine is built, and every request decoded, on one
thread, since on a CPU torch runs slower once a second thread has run its parallel operations."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from entmtp.server.thread import TorchThread
from entmtp.server.worker import Job, Worker


def test_calls_run_one_after_another_on_the_same_thread_and_return_or_raise_what_they_did():
    thread = TorchThread(name="entmtp-test")
    assert thread.call(lambda a, b=0: a + b, 2, b=3) == 5
    ran_on = {thread.call(threading.current_thread) for _ in range(3)}
    assert ran_on == {thread.thread} and thread.thread is not threading.current_thread()
    with pytest.raises(ValueError, match="bad input"):
        thread.call(int, "bad input")
    assert thread.call(lambda: "still serving") == "still serving"  # an error does not end the thread


def test_the_last_call_ends_the_thread_and_later_calls_are_refused():
    thread, finished, release = TorchThread(), threading.Event(), threading.Event()
    thread.finish(lambda: release.wait(5) and finished.set())
    with pytest.raises(RuntimeError, match="has finished"):  # at once, not queued behind the last call
        thread.call(lambda: None)
    release.set()
    thread.thread.join(5)
    assert finished.is_set() and not thread.thread.is_alive()
    with pytest.raises(RuntimeError, match="has finished"):
        thread.call(lambda: None)


class _ThreadNoting:
    """An engine whose every generation notes the thread it ran on and emits one final event."""

    def __init__(self):
        self.built_on, self.ran_on = threading.current_thread(), []

    def stream(self, prompt, **kwargs):
        self.ran_on.append(threading.current_thread())
        yield SimpleNamespace(result=SimpleNamespace(text=prompt), token_ids=[1])


def test_the_worker_decodes_on_the_thread_that_built_the_engine():
    thread = TorchThread()
    engine = thread.call(_ThreadNoting)
    worker = Worker(engine, max_queue=2, thread=thread)

    async def run(prompt):
        job = Job(prompt, {}, asyncio.get_running_loop())
        worker.submit(job)
        events = [await job.next()]
        assert await job.next() is None
        return events[0].result.text

    assert asyncio.run(run("a")) == "a" and asyncio.run(run("b")) == "b"
    worker.close()
    thread.thread.join(5)
    assert engine.ran_on == [thread.thread, thread.thread] and engine.built_on is thread.thread
