"""The server's CPU threads, chosen live from its own steps (issue #67 item 5; docs/results/busy-neighbour).

A server is seldom alone on its machine. With one of two cores taken by another process, two threads decode
3-4x slower than one (a thread that spins waiting for its partner holds the free core while the partner waits
for the busy one), while on an idle machine two threads are faster (1.08x on transformers, 1.6x on llama.cpp
on the 2-core EPYC). No fixed count serves both, so a batch worker measures: it keeps the configured count
(`--threads`, else torch's default) unless fewer threads decode faster now.

`ThreadChooser.observe` hears every batched decode step: its seconds over what the batch's cost surface prices
it at (`step_measure`: steps of different trees then compare; the prefill chunk a step may carry is not in
them), with its rows. Once `PERIOD_S` has passed since the last decision, it runs the next `WINDOW` steps at
one thread fewer (or, below the configured count, one more) and compares their median against the median of
the `WINDOW` steps before, on the same rows (a row that joins or leaves voids the trial). A trial also starts
early, at most every `EARLY_GAP_S`, when the steps slow by `SLOWDOWN` against the best window at this count
(a neighbour came), or, below the configured count, when the machine had a core idle over the last window
(Linux's /proc/stat: a neighbour left). Fewer threads take over only for steps `DOWN` times faster; more
threads, back towards the configured count, whenever they are no slower. A trial that loses doubles the wait
before the next periodic one, up to `MAX_PERIOD_S`. `serve --fixed-threads` turns the choice off.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable

log = logging.getLogger("entmtp.server")

WINDOW = 8  # steps measured at each count
PERIOD_S = 20.0  # seconds between trials while the last one won (or at the start)
MAX_PERIOD_S = 80.0  # ... doubling after each that lost, up to this
SLOWDOWN = 1.5  # steps this much slower than the best window at this count start a trial early
DOWN = 1.25  # fewer threads must run a step this many times faster to take over
IDLE_CORES = 0.5  # CPUs idle on average over a window below the configured count: more threads may pay
EARLY_GAP_S = 5.0  # seconds from one trial to the next that a slowdown or idle CPUs start


def step_measure(step, priced=None) -> tuple[float, Hashable]:
    """(what a batched step's time says of the threads, the workload it is compared within): with `priced` (rows
    -> the batch's cost surface's `LatencyModel` at that many rows: `priced_by`), its seconds over what the
    surface prices that step at, so steps of different trees compare, within steps of the same rows; without,
    its seconds, within steps of the same rows and tokens per row."""
    if priced is None:
        return step.seconds, (step.rows, step.padded)
    return step.seconds / (float(priced(step.rows)(step.padded - 1)) / 1000), step.rows


def priced_by(costs):
    """`step_measure`'s `priced` for the cost surface `costs` (None without one): one latency model per rows."""
    return None if costs is None else functools.lru_cache(maxsize=64)(costs.latency)


def idle_cpu_seconds() -> float | None:
    """CPU-seconds all CPUs have spent idle since boot (Linux's /proc/stat); None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait ...
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ThreadChooser:
    """Chooses between 1 and `top` threads as the module docstring says; `apply(n)` sets them (on the thread
    that runs the forwards). `clock`: seconds; `idle`: CPU-seconds idle so far, or None (tests pass their own)."""

    def __init__(
        self,
        top: int,
        apply: Callable[[int], None],
        clock: Callable[[], float] = time.perf_counter,
        idle: Callable[[], float | None] = idle_cpu_seconds,
    ):
        if top < 1:
            raise ValueError(f"threads must be >= 1, got {top}")
        self.top, self.threads, self._apply, self._clock, self._idle = top, top, apply, clock, idle
        self._window_start = (clock(), idle())  # (when, idle CPU-seconds) at the current window's start
        self._last_trial = float("-inf")
        self._count = 0  # steps since the rules were last weighed
        self._period = PERIOD_S
        self._due = clock() + PERIOD_S
        self._recent: deque[float] = deque(maxlen=WINDOW)  # the latest steps at `threads`, on `_key`'s rows
        self._key: Hashable = None
        # rows -> the fastest window's median step at `threads` (after a trial lost: the window before it)
        self._decided: dict[Hashable, float] = {}
        self._trial: int | None = None  # the count on trial
        self._trial_steps: list[float] = []
        self._baseline = 0.0  # the median step before the trial
        self._ups = 0  # trials so far, to alternate up and down where both are possible
        self.trials = self.switches = 0

    def observe(self, seconds: float, rows: Hashable) -> None:
        """A batched decode step took `seconds` (or its time over its price: `step_measure`) with `rows` (the
        workload: only like steps are compared)."""
        if self._trial is not None:
            self._observe_trial(seconds, rows)
            return
        if rows != self._key:
            self._recent.clear()
            self._key = rows
        self._recent.append(seconds)
        if len(self._recent) < WINDOW or self._steps_since(WINDOW):
            return
        now = statistics.median(self._recent)
        before = self._decided[rows] = min(self._decided.get(rows, now), now)  # the best window so far
        if self._clock() >= self._due or self._early(now > SLOWDOWN * before):
            self._start_trial(now)

    def _early(self, slower: bool) -> bool:
        """Whether a trial starts before its period: the steps slowed (`slower`), or a core sat idle below the
        configured count; at most every `EARLY_GAP_S` from the last trial."""
        idle = self._cores_idle()  # read every window, so that each reading covers one window
        return self._clock() - self._last_trial >= EARLY_GAP_S and (slower or idle)

    def _steps_since(self, every: int) -> bool:
        """Whether this step is not the `every`-th since the last look (the rules are weighed once a window)."""
        self._count = (self._count + 1) % every
        return self._count != 0

    def _cores_idle(self) -> bool:
        """Below the configured count, whether the machine had `IDLE_CORES` idle since the last look (which
        starts the next window)."""
        if self.threads >= self.top:
            return False
        (t0, idle0), t, idle = self._window_start, self._clock(), self._idle()
        self._window_start = (t, idle)
        if idle is None or idle0 is None or t <= t0:
            return False
        return (idle - idle0) / (t - t0) >= IDLE_CORES

    def _candidate(self) -> int | None:
        """The count to try: one more (towards the configured count) or one fewer, alternating where both are
        possible; None with one configured thread."""
        options = [n for n in (self.threads + 1, self.threads - 1) if 1 <= n <= self.top]
        if not options:
            return None
        self._ups += 1
        return options[self._ups % len(options)]

    def _start_trial(self, baseline: float) -> None:
        trial = self._candidate()
        if trial is None:
            self._due = float("inf")
            return
        self._trial, self._trial_steps, self._baseline = trial, [], baseline
        self._last_trial = self._clock()
        self.trials += 1
        self._apply(trial)

    def _observe_trial(self, seconds: float, rows: Hashable) -> None:
        if rows != self._key:  # a row joined or left: the trial compares unlike steps, so it says nothing
            self._end_trial(won=False, measured=False)
            return
        self._trial_steps.append(seconds)
        if len(self._trial_steps) < WINDOW:
            return
        trial = statistics.median(self._trial_steps)
        fewer = self._trial < self.threads
        self._end_trial(won=self._baseline >= DOWN * trial if fewer else trial <= self._baseline)

    def _end_trial(self, won: bool, measured: bool = True) -> None:
        trial, self._trial = self._trial, None
        self._recent.clear()
        self._count = 0
        self._window_start = (self._clock(), self._idle())
        if won:
            log.info(
                "decoding on %d CPU thread(s) now: %d ran a step in %.1f ms, %d in %.1f ms",
                trial, self.threads, 1000 * self._baseline, trial, 1000 * statistics.median(self._trial_steps),
            )  # fmt: skip
            self.threads, self._period = trial, PERIOD_S
            self._decided.clear()  # the old count's steps say nothing of the new one's
            self.switches += 1
        else:
            self._apply(self.threads)
            if measured:
                self._period = min(2 * self._period, MAX_PERIOD_S)
                self._decided[self._key] = self._baseline  # the steps at `threads` as they are now
        self._due = self._clock() + (self._period if measured else 0.0)
