"""The server's CPU threads, chosen live (server/threads.py): beside a busy neighbour it moves to fewer threads
and back when the neighbour leaves; on an idle machine it keeps the configured count; trials that lose come
less often; a workload that changes voids a trial. The machine is simulated: a step's seconds are a function of
the threads, the rows and whether a neighbour is busy; the clock is the steps' own."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.engine import Engine
from entmtp.server import threads as T
from entmtp.server.batching import BatchWorker, start_worker
from entmtp.server.threads import ThreadChooser
from entmtp.server.worker import Job


class Machine:
    """2 cores: a step takes `ms[threads]` idle and `busy_ms[threads]` with a neighbour on one core (the
    2-core EPYC's llama.cpp figures: 2 threads 1.6x faster idle, 1 thread 3.7x faster busy), times the rows."""

    def __init__(self, ms=None, busy_ms=None):
        self.ms = ms or {2: 10.0, 1: 16.0}
        self.busy_ms = busy_ms or {2: 37.0, 1: 16.3}
        self.now, self.busy, self.threads, self.applied = 0.0, False, 2, []
        self.idle_s = 0.0  # CPU-seconds idle: the cores neither the server's threads nor the neighbour take

    def apply(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def clock(self) -> float:
        return self.now

    def idle(self) -> float:
        return self.idle_s

    def steps(self, chooser: ThreadChooser, n: int, rows: int = 4) -> list[int]:
        """Run `n` steps; the threads each ran on."""
        ran = []
        for _ in range(n):
            seconds = (self.busy_ms if self.busy else self.ms)[self.threads] * (1 + rows / 8) / 1000
            self.now += seconds
            self.idle_s += max(0, 2 - self.threads - self.busy) * seconds
            ran.append(self.threads)
            chooser.observe(seconds, rows)
        return ran


def chooser_on(machine: Machine, top: int = 2) -> ThreadChooser:
    return ThreadChooser(top, machine.apply, clock=machine.clock, idle=machine.idle)


def test_beside_a_busy_neighbour_it_moves_to_one_thread_and_back_when_the_neighbour_leaves():
    m = Machine()
    c = chooser_on(m)
    m.steps(c, 2000)  # ~30 s idle: trials of 1 thread lose, 2 threads stay
    assert c.threads == 2 and c.trials >= 1 and c.switches == 0
    m.busy = True
    ran = m.steps(c, 3 * T.WINDOW)  # the slowdown starts a trial at once, not a period later
    assert c.threads == 1 and ran[-1] == 1
    m.steps(c, 4000)  # trials of 2 threads lose while the neighbour stays
    assert c.threads == 1 and m.threads == 1
    m.busy = False
    ran = m.steps(
        c, 400
    )  # ~7 s: a core idle starts a trial of 2 threads, within EARLY_GAP_S of the last trial
    assert c.threads == 2 and m.threads == 2 and ran[-50:] == [2] * 50


def test_on_an_idle_machine_where_threads_are_level_it_keeps_the_configured_count():
    """Threads about level (1 thread 1.06x faster): a count fewer must be DOWN times faster to take over."""
    m = Machine(ms={2: 36.0, 1: 34.0})  # 1 thread even 1.06x faster
    c = chooser_on(m)
    ran = m.steps(c, 20_000)
    assert c.threads == 2 and c.switches == 0 and c.trials >= 3
    assert ran.count(1) <= 0.01 * len(ran)  # trials cost ~1% of steps at most


def test_trials_that_lose_come_less_often_up_to_the_longest_period():
    m = Machine()
    c = chooser_on(m)
    starts = []
    apply = m.apply
    m.apply = lambda n: (starts.append(m.now) if n == 1 else None, apply(n))
    c._apply = m.apply
    m.steps(c, 60_000)
    gaps = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert gaps[0] == pytest.approx(2 * T.PERIOD_S, rel=0.05)
    assert max(gaps) == pytest.approx(T.MAX_PERIOD_S, rel=0.05)
    assert all(
        b > a - 0.1 for a, b in zip(gaps[:-1], gaps[1:], strict=True)
    )  # never sooner than the one before


def test_a_row_that_joins_during_a_trial_voids_it():
    m = Machine()
    c = chooser_on(m)
    m.busy = True  # 1 thread would win
    m.steps(c, T.WINDOW)  # the first window: the decision's reference
    m.now += T.PERIOD_S  # a trial is due when the next window is measured
    m.steps(c, T.WINDOW + 2)  # it starts, and runs 2 steps at 1 thread
    assert m.threads == 1 and c.trials == 1 and c.switches == 0
    m.steps(c, 1, rows=5)  # a row joins
    assert m.threads == 2 and c.threads == 2 and c.switches == 0


def test_without_idle_figures_a_neighbour_that_left_is_found_by_the_next_periodic_trial():
    m = Machine()
    c = ThreadChooser(2, m.apply, clock=m.clock, idle=lambda: None)
    m.steps(c, 100)
    m.busy = True
    m.steps(c, 3 * T.WINDOW)
    assert c.threads == 1
    m.busy = False
    m.steps(c, 400)  # ~7 s: no trial yet (the period is 20 s)
    assert c.threads == 1
    m.steps(c, 6000)
    assert c.threads == 2


def test_steps_that_slow_for_every_count_start_one_trial_not_one_a_window():
    """Steps twice as slow at any count (longer contexts, say) start a trial, which loses; the slower steps
    are then the reference, so no trial follows until the period."""
    m = Machine()
    c = chooser_on(m)
    m.steps(c, 200)
    m.ms = {2: 20.0, 1: 32.0}
    m.steps(c, 300)  # ~9 s, within the period after the trial
    assert c.trials == 1 and c.threads == 2


def test_a_step_is_measured_against_its_price_so_that_steps_of_different_trees_compare():
    """With the batch's cost surface, a step's measure is its time over the surface's price of it (its rows,
    its nodes per row); steps of different trees at the same speed measure alike, compared within their rows.
    Without a surface, the raw seconds, compared within steps of the same rows and tokens per row."""
    from entmtp.batch import BatchStep
    from entmtp.costs import CostSurface
    from entmtp.server.threads import priced_by, step_measure

    surface = CostSurface((1, 4), (0, 8), ((10.0, 14.0), (20.0, 40.0)))
    priced = priced_by(surface)
    plain = BatchStep(rows=4, nodes=(0,) * 4, padded=1, seconds=0.030, verify_seconds=0.02)
    tree = BatchStep(rows=4, nodes=(8,) * 4, padded=9, seconds=0.060, verify_seconds=0.05)
    assert step_measure(plain, priced) == (pytest.approx(1.5), 4)
    assert step_measure(tree, priced) == (pytest.approx(1.5), 4)
    assert step_measure(tree) == (0.060, (4, 9)) and priced_by(None) is None


def test_one_configured_thread_never_tries_another_count():
    m = Machine()
    m.threads = 1
    c = chooser_on(m, top=1)
    m.busy = True
    m.steps(c, 5000)
    assert m.applied == [] and c.trials == 0


@pytest.mark.parametrize("surface", [False, True])
def test_a_batch_worker_sets_the_threads_on_the_thread_that_runs_the_forwards(monkeypatch, surface):
    """`start_worker(live_threads=True)` gives the batch worker a chooser up to the engine's threads, fed by
    every batched step (priced by the batch's cost surface when it has one); its choice is torch's thread
    count on the worker's own thread."""
    from entmtp.costs import CostSurface

    monkeypatch.setattr(T, "PERIOD_S", 0.0)  # a trial as soon as a window is measured
    torch.set_num_threads(2)
    engine = Engine(tiny_model("llama", seed=4), ByteTokenizer())
    costs = CostSurface((1, 4), (0, 8), ((10.0, 14.0), (20.0, 40.0))) if surface else None
    worker = start_worker(engine, 8, 2, costs, live_threads=True)
    assert isinstance(worker, BatchWorker) and worker.threads.top == 2
    seen = []
    observe = worker.threads.observe
    worker.threads.observe = lambda s, rows: (seen.append(torch.get_num_threads()), observe(s, rows))

    async def main():
        job = Job(list(range(100, 112)), dict(max_new_tokens=3 * T.WINDOW), asyncio.get_running_loop())
        worker.submit(job)
        while await job.next() is not None:
            pass

    asyncio.run(main())
    worker.close()
    assert worker.join(10)
    assert worker.threads.trials >= 1 and 1 in seen  # the trial's steps ran on 1 thread
    torch.set_num_threads(2)


def test_without_live_threads_a_worker_has_no_chooser():
    engine = Engine(tiny_model("llama", seed=4), ByteTokenizer())
    worker = start_worker(engine, 8, 2)
    assert worker.threads is None
    worker.close()
    assert worker.join(10)


def test_the_llama_cpp_backend_sets_its_contexts_threads():
    pytest.importorskip("llama_cpp")
    from entmtp.backends.llama_cpp import embedded_f32_gguf, load_gguf

    model, _ = load_gguf(embedded_f32_gguf(), dtype=torch.float32, threads=2)
    base = model.entmtp_base()
    rt = base.runtime
    base.set_threads(1)
    assert base.threads() == 1 and rt.lib.llama_n_threads(rt.ctx) == 1
    assert rt.private(64).threads == 1  # a context made later takes the count too
    base.set_threads(2)
    assert rt.lib.llama_n_threads(rt.ctx) == 2
