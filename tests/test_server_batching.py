"""The server's batched generation thread (server/batching.py) on a tiny model, without HTTP: each job gets
what it gets alone, token for token, while rows join and leave; cancelled and cut jobs leave between steps and
free their row; an error reaches the jobs it concerns; engines that cannot be batched fall back to one job at
a time. The HTTP side with the embedded model is in test_server.py."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import ByteTokenizer, tiny_model
from entmtp.batch import Batch, BatchStep
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, random_heads
from entmtp.lookup import Lookup
from entmtp.policy import static
from entmtp.scheduler.hybrid import hybrid
from entmtp.server.batching import BatchWorker, start_worker
from entmtp.server.worker import Cut, Job, QueueFull, Worker

PROMPTS = [
    list(range(100, 112)),
    list(b"abcabcabcabcabc"),
    list(range(30, 33)),
    list(b"the cat sat on the mat; the cat sat on the"),
]


@pytest.fixture(scope="module")
def engine():
    """Random heads under a lookup hybrid: rows may draft trees of different sizes."""
    cfg = HeadsConfig(kind="medusa", num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    return Engine(
        tiny_model("llama", seed=4), ByteTokenizer(), heads=heads, policy=hybrid(static("tree_8"), Lookup())
    )


class _Finished:
    """What `on_finish` and `on_step` heard."""

    def __init__(self):
        self.finished: list[tuple[object, bool]] = []
        self.steps: list[tuple[BatchStep, int]] = []

    def on_finish(self, result, stopped):
        self.finished.append((result, stopped))

    def on_step(self, step, tokens):
        self.steps.append((step, tokens))


def _worker(
    engine, slots: int, heard: _Finished, max_queue: int = 8, batch: Batch | None = None
) -> BatchWorker:
    batch = batch if batch is not None else Batch(engine)
    return BatchWorker(batch, slots, max_queue, heard.on_finish, heard.on_step)


async def _read(job: Job, cancel_after: int | None = None) -> list:
    """`job`'s events, then what ended it (None: done; else the exception); cancels it after `cancel_after`."""
    events: list = []
    try:
        while (event := await job.next()) is not None:
            events.append(event)
            if cancel_after is not None and len(events) == cancel_after:
                job.cancel.set()
        return [*events, None]
    except Exception as e:  # noqa: BLE001 - what ended the job is the test's subject
        return [*events, e]


def _run(worker: Worker, requests, cancel_after=None, cancelled=()) -> list[list]:
    """Submit every (prompt, kwargs) at once (those at the indices in `cancelled` already cancelled) and read
    them all concurrently."""
    cancel_after = cancel_after or {}

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(prompt, kwargs, loop) for prompt, kwargs in requests]
        for i, job in enumerate(jobs):
            if i in cancelled:
                job.cancel.set()
            worker.submit(job)
        return await asyncio.gather(*(_read(job, cancel_after.get(i)) for i, job in enumerate(jobs)))

    return asyncio.run(main())


def _tokens(events) -> list[int]:
    return [t for e in events if e is not None and not isinstance(e, Exception) for t in e.token_ids]


def _close(worker: Worker) -> None:
    worker.close()
    worker._thread.join(10)
    assert not worker._thread.is_alive()


def test_batched_jobs_each_get_exactly_what_they_get_alone(engine):
    """Four jobs in two rows (two wait and join as rows leave): different prompt lengths, one ended by its
    first token, one by a stop string; each job's tokens, text and finish reason are its own generation's."""
    first = engine.generate(PROMPTS[3], max_new_tokens=30)
    stop = first.text[8:10]  # ends that generation early, inside a later step
    requests = [
        (PROMPTS[0], dict(max_new_tokens=40)),
        (PROMPTS[1], dict(max_new_tokens=1)),
        (PROMPTS[2], dict(max_new_tokens=25)),
        (PROMPTS[3], dict(max_new_tokens=30, stop=[stop])),
    ]
    heard = _Finished()
    worker = _worker(engine, 2, heard)
    got = _run(worker, requests)
    _close(worker)
    for (prompt, kwargs), events in zip(requests, got, strict=True):
        want = engine.generate(prompt, **kwargs)
        assert events[-1] is None, events[-1]
        assert _tokens(events) == want.token_ids and events[-2].result.token_ids == want.token_ids
        assert (
            "".join(e.text for e in events[:-1]) == want.text
            and events[-2].finish_reason == want.finish_reason
        )
    assert got[3][-2].finish_reason == "stop" and len(got[1]) == 2  # the first token, then done
    assert max(step.rows for step, _ in heard.steps) == 2
    assert sum(tokens for _, tokens in heard.steps) + len(requests) == sum(len(_tokens(e)) for e in got)
    assert [stopped for _, stopped in heard.finished] == [False] * 4 and worker.running == worker.waiting == 0


def test_cancelled_jobs_free_their_row_and_a_waiting_cancelled_job_never_starts(engine):
    """One row: a job cancelled after its third event leaves between steps (no result), one cancelled while it
    waited never starts, and the job after them runs to its end with its own tokens."""
    heard = _Finished()
    worker = _worker(engine, 1, heard)
    requests = [
        (PROMPTS[0], dict(max_new_tokens=200)),
        (PROMPTS[1], {}),
        (PROMPTS[2], dict(max_new_tokens=12)),
    ]
    got = _run(worker, requests, cancel_after={0: 3}, cancelled={1})
    _close(worker)
    # cancelled as its third event was read (the thread may have run a step more): it ends with no result
    assert got[0][-1] is None and all(e.result is None for e in got[0][:-1]) and len(_tokens(got[0])) < 200
    assert got[1] == [None]
    assert _tokens(got[2]) == engine.generate(PROMPTS[2], max_new_tokens=12).token_ids
    assert [(r is None, stopped) for r, stopped in heard.finished] == [
        (True, True),
        (True, True),
        (False, False),
    ]
    assert all(step.rows == 1 for step, _ in heard.steps)


def test_cut_all_ends_every_open_job_with_the_reason(engine):
    heard = _Finished()
    worker = _worker(engine, 2, heard)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, dict(max_new_tokens=400), loop) for p in PROMPTS[:3]]  # two rows, one waiting
        for job in jobs:
            worker.submit(job)
        await jobs[0].next()
        assert worker.cut_all("shutting down") == 3
        return await asyncio.gather(*(_read(job) for job in jobs))

    got = asyncio.run(main())
    _close(worker)
    assert all(isinstance(events[-1], Cut) and str(events[-1]) == "shutting down" for events in got)
    assert worker.idle and worker.running == 0


def test_a_failed_prefill_ends_its_job_only(engine):
    heard = _Finished()
    worker = _worker(engine, 2, heard)
    requests = [(PROMPTS[0], dict(max_new_tokens=10)), (PROMPTS[1], dict(max_new_tokens=10**6))]
    got = _run(worker, requests)
    _close(worker)
    assert _tokens(got[0]) == engine.generate(PROMPTS[0], max_new_tokens=10).token_ids
    assert isinstance(got[1][-1], EntMTPError) and "context window" in str(got[1][-1]) and len(got[1]) == 1


def test_a_failed_step_ends_every_row_and_the_next_jobs_run_on_a_fresh_batch(engine):
    batch = Batch(engine)
    step = batch.step

    def fails_with_two_rows(interrupt=None):  # once both jobs are rows
        if len(batch) == 2:
            raise RuntimeError("device lost")
        return step(interrupt)

    batch.step = fails_with_two_rows
    heard = _Finished()
    worker = _worker(engine, 2, heard, batch=batch)
    got = _run(worker, [(PROMPTS[0], dict(max_new_tokens=60)), (PROMPTS[1], dict(max_new_tokens=60))])
    assert [str(events[-1]) for events in got] == ["device lost", "device lost"]
    assert worker.batch is not batch and len(worker.batch) == 0 and worker.running == 0
    again = _run(worker, [(PROMPTS[2], dict(max_new_tokens=15))])
    _close(worker)
    assert _tokens(again[0]) == engine.generate(PROMPTS[2], max_new_tokens=15).token_ids


def test_engines_that_cannot_batch_are_served_one_job_at_a_time(engine, caplog):
    dynamic = Engine(engine.model, ByteTokenizer(), kv="dynamic")  # no preallocated cache: Batch refuses it
    with caplog.at_level(logging.WARNING, logger="entmtp.server"):
        worker = start_worker(dynamic, max_queue=2, max_batch=4)
    _close(worker)
    assert type(worker) is Worker and worker.slots == 1
    assert "one request at a time, not 4" in caplog.text and "preallocated" in caplog.text
    one = start_worker(engine, max_queue=2, max_batch=1)
    _close(one)
    assert type(one) is Worker
    batched = start_worker(engine, max_queue=2, max_batch=3)
    _close(batched)
    assert isinstance(batched, BatchWorker) and batched.slots == 3


def test_the_queue_holds_max_batch_running_and_max_queue_waiting(engine):
    worker = _worker(engine, 4, _Finished(), max_queue=2)
    _close(worker)  # the thread has ended: what is queued stays queued
    worker.running = 4
    for _ in range(2):
        worker.submit(Job([1, 2], {}, None))
    with pytest.raises(QueueFull):
        worker.submit(Job([1, 2], {}, None))
    assert worker.counts() == (2, 4)


def test_retry_after_is_the_measured_queue_wait(engine):
    """Before any job waited: jobs ahead / slots x the time per job. Then what waiting measures: the recent
    jobs' mean wait in the queue, or the oldest waiting job's wait so far when that is longer."""
    worker = _worker(engine, 4, _Finished(), max_queue=2)
    _close(worker)
    worker.running = 4
    jobs = [Job([1, 2], {}, None) for _ in range(2)]
    for job in jobs:
        worker.submit(job)
    assert worker.retry_after(default=2.0) == math.ceil(6 / 4 * 2.0)  # jobs ahead / slots x time per job
    worker._service.extend([10.0, 20.0])
    assert worker.retry_after() == math.ceil(6 / 4 * 15.0)
    worker._waits.extend([6.0, 7.5])  # queued jobs waited ~7 s lately: not 1 s
    assert worker.retry_after() == 7
    jobs[0].queued -= 29.5  # the oldest has waited 29.5 s already
    assert worker.retry_after() == 30


def test_metrics_of_a_batched_step():
    pytest.importorskip("prometheus_client")
    from entmtp.server.metrics import Metrics

    m = Metrics()
    m.stepped(BatchStep(rows=3, nodes=(4, 0, 2), padded=5, seconds=0.1, verify_seconds=0.08), tokens=7)
    m.stepped(BatchStep(rows=1, nodes=(3,), padded=4, seconds=0.05, verify_seconds=0.04), tokens=2)
    value = m.registry.get_sample_value
    assert value("entmtp_batch_size") == 1 and value("entmtp_batch_steps_total") == 2
    assert value("entmtp_batch_rows_bucket", {"le": "1.0"}) == 1 and value("entmtp_batch_rows_count") == 2
    assert value("entmtp_batch_rows_sum") == 4 and value("entmtp_batch_step_tokens_sum") == 9
    assert value("entmtp_batch_padding_tokens_total") == 15 - (5 + 1 + 3)  # 3 rows of 5, trees of 5, 1, 3


@pytest.mark.parametrize("max_batch", [1, 2])
def test_requests_at_t_above_zero_run_the_servers_rule_and_its_policy(max_batch):
    """`serve --acceptance typical`: requests at T > 0 use typical acceptance, and so the engine's typical
    policy (its profile section's); requests at T=0 stay greedy, on the engine's own policy. Each reply's
    usage says which rule accepted its drafts."""
    testclient = pytest.importorskip("fastapi.testclient")
    from entmtp.server.app import create_app

    cfg = HeadsConfig(kind="medusa", num_heads=3, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    engine = Engine(
        tiny_model("llama", seed=4),
        ByteTokenizer(),
        heads=heads,
        policy=static("tree_8"),
        policies={"typical": static("chain_3")},
    )
    app = create_app(engine, "tiny", max_batch=max_batch, acceptance="typical")
    with testclient.TestClient(app) as client:
        for temperature, rule in ((0.0, "greedy"), (0.7, "typical")):
            body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": temperature, "seed": 1}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200
            assert (
                reply.json()["usage"]["entmtp"]["acceptance"] == rule
            )  # the client sees which rule wrote it
        deadline = time.monotonic() + 10  # the worker counts a job's steps as it ends, maybe after the reply
        while not (steps := _tree_steps(client.get("/metrics").text)).keys() >= {"tree_8", "chain_3"}:
            assert time.monotonic() < deadline, steps
            time.sleep(0.05)
    with pytest.raises(
        EntMTPError, match="acceptance 'greedy' for requests at T > 0: use one of auto, sample"
    ):
        create_app(engine, "tiny", acceptance="greedy")


@pytest.mark.parametrize("max_batch", [1, 3])
def test_gumbel_requests_reply_with_plain_samplings_text_for_their_seed(max_batch):
    """`serve --acceptance gumbel`: a seeded request at T > 0 gets the text plain sampling writes with that
    seed, whatever the tree and the batch it shared (its rows take the batch's joint budget, as greedy ones)."""
    testclient = pytest.importorskip("fastapi.testclient")
    from entmtp.server.app import create_app

    model = tiny_model("llama", seed=4)
    cfg = HeadsConfig(kind="medusa", num_heads=3, hidden_size=64, vocab_size=256)
    engine = Engine(
        model, ByteTokenizer(), heads=random_heads(cfg, seed=0, init="random"), policy=static("tree_8")
    )
    plain = Engine(model, ByteTokenizer())
    app = create_app(engine, "tiny", max_batch=max_batch, acceptance="gumbel")
    with testclient.TestClient(app) as client:
        for seed, prompt in enumerate(PROMPTS[:3]):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.7, "seed": seed}
            reply = client.post("/v1/completions", json=body).json()
            want = plain.generate(prompt, max_new_tokens=12, temperature=0.7, acceptance="gumbel", seed=seed)
            assert reply["choices"][0]["text"] == want.text
            assert reply["usage"]["entmtp"]["acceptance"] == "gumbel"


def _tree_steps(metrics: str) -> dict[str, float]:
    """Decode steps per tree from the Prometheus text."""
    return {
        line.split('"')[1]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("entmtp_tree_steps_total{")
    }


class _Held:
    """An engine whose generations each emit one event, then wait for `release` before they end."""

    def __init__(self):
        self.release = threading.Event()

    def stream(self, prompt, **kwargs):
        yield SimpleNamespace(result=None, token_ids=[1])
        self.release.wait(10)
        yield SimpleNamespace(result=SimpleNamespace(text="done"), token_ids=[2])


def test_queued_jobs_whose_clients_left_free_their_place_at_once():
    """One job runs (held) and two wait, a full queue; both waiting clients leave: the queue counts none of
    them at once (not when the thread gets to them), a new job is accepted, and the left ones hear the end."""
    engine = _Held()
    worker = Worker(engine, max_queue=2)

    async def main():
        loop = asyncio.get_running_loop()
        running, *waiting = [Job([1], {}, loop) for _ in range(3)]
        for job in (running, *waiting):
            worker.submit(job)
        await running.next()  # it runs, held
        with pytest.raises(QueueFull):
            worker.submit(Job([1], {}, loop))
        for job in waiting:
            job.cancel.set()  # their clients left
        assert worker.counts() == (0, 1)
        late = Job([1], {}, loop)
        worker.submit(late)  # not refused
        assert [await job.next() for job in waiting] == [None, None]
        engine.release.set()
        return [e.token_ids for e in [await late.next(), await late.next()]]

    assert asyncio.run(main()) == [[1], [2]]
    _close(worker)


def test_a_cut_reaches_a_running_job_at_once_while_the_thread_is_inside_a_long_step():
    """A shutdown's cut ends a running job's stream now, not when the thread's current step (a long prefill)
    returns; the thread then ends, and `join` says so."""
    engine = _Held()
    worker = Worker(engine, max_queue=2)

    async def main():
        job = Job([1], {}, asyncio.get_running_loop())
        worker.submit(job)
        await job.next()  # it runs, held inside its step
        worker.cut_all("shutting down")
        with pytest.raises(Cut, match="shutting down"):
            await asyncio.wait_for(job.next(), 5)

    asyncio.run(main())
    engine.release.set()
    worker.close()
    assert worker.join(10) and worker.running == 0 and worker.idle


def test_a_job_submitted_during_a_long_prompts_chunk_has_its_first_token_before_that_chunk_is_in():
    """A short job submitted while a chunk of a long prompt is in its forward (here: from inside the
    forward, after the decoder's first layer) raises the worker's interrupt: the chunk stops part way, the
    short prompt goes in at the next step, and its first token comes while the long prompt has no token in
    the cache yet. Both then get what they get alone. With every row taken, a submit raises nothing (the job
    could not start sooner)."""
    from entmtp.engine import PREFILL_CHUNK

    model = tiny_model("llama", seed=4, max_position_embeddings=2048)
    engine = Engine(model, ByteTokenizer())
    worker = _worker(engine, 2, _Finished())
    long_prompt = [(5 * i) % 250 + 3 for i in range(4 * PREFILL_CHUNK + 7)]
    long_in_at_short: list[int] = []  # the long prompt's tokens in the cache when the short job's token came
    emit = worker._emit

    def heard(job, item):
        if job.prompt == PROMPTS[0] and not long_in_at_short:
            long_in_at_short.extend(r.row.state.cache.length for r in worker._rows.values() if r.job is long)
        emit(job, item)

    worker._emit = heard

    async def main():
        nonlocal long
        loop = asyncio.get_running_loop()
        long, short = (
            Job(long_prompt, dict(max_new_tokens=5), loop),
            Job(PROMPTS[0], dict(max_new_tokens=5), loop),
        )

        def arrive(*_):  # the short job's client, arriving while the long prompt's first chunk runs
            handle.remove()
            worker.submit(short)

        handle = model.get_decoder().layers[0].register_forward_hook(arrive)
        worker.submit(long)
        return await asyncio.gather(_read(long), _read(short))

    long = None
    long_events, short_events = asyncio.run(main())
    assert long_events[-1] is None and short_events[-1] is None
    assert worker.batch.preemptions == 1 and long_in_at_short == [0]
    assert _tokens(long_events) == engine.generate(long_prompt, max_new_tokens=5).token_ids
    assert _tokens(short_events) == engine.generate(PROMPTS[0], max_new_tokens=5).token_ids
    _close(worker)


def test_a_submit_raises_the_interrupt_only_while_a_row_is_free(engine):
    worker = _worker(engine, 1, _Finished())

    async def main():
        loop = asyncio.get_running_loop()
        running = Job(PROMPTS[0], dict(max_new_tokens=400), loop)
        worker.submit(running)
        await running.next()
        worker.interrupt.clear()
        worker.submit(Job(PROMPTS[1], dict(max_new_tokens=2), loop))  # its one row is taken
        raised = worker.interrupt.is_set()
        worker.cut_all("test over")
        return raised

    assert asyncio.run(main()) is False
    _close(worker)


def test_running_jobs_decode_while_a_long_prompt_prefills_in_chunks():
    """A job submitted with a 5-chunk prompt beside a decoding job: the decoding job gets a token at every
    step while the long prompt goes in, one chunk per step (it used to wait for the whole prefill)."""
    from entmtp.engine import PREFILL_CHUNK

    engine = Engine(tiny_model("llama", seed=4, max_position_embeddings=2048), ByteTokenizer())
    worker = _worker(engine, 2, _Finished())
    heard: list = []  # (job, item) in the order the thread sent them, and the test's marks
    emit = worker._emit
    worker._emit = lambda job, item: (heard.append((job, item)), emit(job, item))
    long_prompt = [(5 * i) % 250 + 3 for i in range(4 * PREFILL_CHUNK + 7)]

    async def main():
        loop = asyncio.get_running_loop()
        running, long = Job(PROMPTS[0], dict(max_new_tokens=400), loop), Job(long_prompt, {}, loop)
        worker.submit(running)
        await running.next()
        heard.append((None, "submitted"))
        worker.submit(long)
        await long.next()  # its first token
        running.cancel.set()
        long.cancel.set()

    asyncio.run(main())
    _close(worker)
    start = heard.index((None, "submitted"))
    first = next(i for i, (job, _) in enumerate(heard) if job is not None and job.prompt == long_prompt)
    during = [item for job, item in heard[start:first] if job is not None and job.prompt == PROMPTS[0]]
    assert len(during) >= 4 and all(len(e.token_ids) == 1 for e in during)
