"""What a prompt's prefill costs on this machine, by its length: measured once per (model, heads), cached.

The cost curve (curves.py) prices decode steps; a request also pays its prompt's prefill, and backends differ
there more than in decode: on a 2-core EPYC (avx512_bf16) llama.cpp decodes the embedded Q4_1 model ~3.7x
faster than transformers in bf16, but PyTorch's bf16 prefill of a long prompt is several times faster than
llama.cpp's. So a router (routing.py) needs both. `prefill_for` times the engine's own prefill (a generation
of one token over random prompt ids: the first token is the prefill's) at a few prompt lengths, within a
budget, and fits `ms(n) = a + b * n` by least squares. It is a sibling record of the curve in the cost cache:
its own key (`cost_key` with the lengths measured and `prefill`), its own file, so older caches load as they
were.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ..machine import record
from .cache import cached_or_measured, cost_key, cost_path
from .curves import CostRecord, CostsError

PREFILL_FORMAT, PREFILL_VERSION = "entmtp-prefill", 1
LENGTHS = (64, 256, 1024)  # prompt tokens timed: short, medium and a RAG-like prompt (longer ones: the fit)
PREFILL_BUDGET_S = 10.0  # a length whose predicted time would pass it is skipped (the first is always timed)
REPS = 2  # timed prefills per length (the fastest kept), after one untimed warm-up prefill
WARMUP_TOKENS = 32


@dataclass(frozen=True)
class PrefillCost(CostRecord):
    """ms of a prompt's prefill by its tokens: the measured points and their fit `intercept_ms + ms_per_token
    * n` (least squares; one point: through the origin)."""

    FORMAT, VERSION, KIND = PREFILL_FORMAT, PREFILL_VERSION, "prefill cost"

    lengths: tuple[int, ...]  # [P] prompt tokens timed
    ms: tuple[float, ...]  # [P] fastest prefill's ms at each
    key: dict = field(default_factory=dict)
    source: str = "probe"
    seconds: float = 0.0
    machine: dict | None = None

    def __post_init__(self):
        if not self.lengths or len(self.lengths) != len(self.ms):
            raise CostsError("a prefill cost needs a time per prompt length, at least one")

    @property
    def fit(self) -> tuple[float, float]:
        """(intercept ms, ms per token), both >= 0."""
        n, ms = np.asarray(self.lengths, dtype=float), np.asarray(self.ms, dtype=float)
        if len(n) == 1:
            return 0.0, float(ms[0] / n[0])
        slope, intercept = np.polyfit(n, ms, 1)
        if intercept < 0:  # a line through the origin instead: a prefill never costs less than nothing
            return 0.0, float(ms @ n / (n @ n))
        return float(intercept), max(float(slope), 0.0)

    @property
    def ms_per_token(self) -> float:
        return self.fit[1]

    def __call__(self, tokens: int) -> float:
        """Expected ms of a prefill of `tokens` prompt tokens."""
        a, b = self.fit
        return a + b * tokens

    def summary(self) -> str:
        a, b = self.fit
        points = ", ".join(f"{n}: {m:.0f} ms" for n, m in zip(self.lengths, self.ms, strict=True))
        return f"{b:.2f} ms/token + {a:.1f} ms ({points})"


def prefill_key(model, heads) -> dict:
    return cost_key(model, heads, sizes=LENGTHS, prefill=(PREFILL_VERSION,))


def prefill_for(
    model, heads=None, *, refresh: bool = False, budget_s: float = PREFILL_BUDGET_S, progress: bool = True
) -> PrefillCost:
    """This machine's prefill cost for (model, heads): the cached one, or measured now and cached."""
    key = prefill_key(model, heads)
    timed = partial(measure_prefill, model, heads, budget_s=budget_s, progress=progress)
    return cached_or_measured(PrefillCost, cost_path(key), key, timed, refresh=refresh)


@torch.inference_mode()
def measure_prefill(
    model,
    heads=None,
    *,
    lengths: Sequence[int] = LENGTHS,
    budget_s: float = PREFILL_BUDGET_S,
    progress: bool = True,
) -> PrefillCost:
    """Time the engine's prefill (a one-token generation over random ids, with the heads' own prefill work
    when `heads`) at each of `lengths` that fits the model's window, shortest first; a length whose time,
    predicted from the last one measured, would overrun `budget_s` is skipped."""
    from ..engine import Engine  # here: the engine imports this package
    from ..policy import static
    from .probe import NoText

    t0 = time.perf_counter()
    engine = Engine(model, NoText(), heads, static("tree_8") if heads is not None else None, graphs=False)
    engine.eos_ids = set()
    gen = torch.Generator().manual_seed(0)
    fits = sorted({min(n, engine.window - 2) for n in lengths})

    def once(n: int) -> float:
        ids = torch.randint(0, engine.base.vocab_size, (n,), generator=gen).tolist()
        return 1000 * engine.generate(ids, max_new_tokens=1).prefill_seconds

    if progress:
        print("entmtp: measuring this machine's prefill costs (once)...", file=sys.stderr, flush=True)
    once(WARMUP_TOKENS)
    done: dict[int, float] = {}
    for n in fits:
        if done:
            last = max(done)
            predicted = REPS * done[last] * n / last / 1000
            if time.perf_counter() - t0 + predicted > budget_s:
                break
        done[n] = min(once(n) for _ in range(REPS))
    seconds = time.perf_counter() - t0
    cost = PrefillCost(
        tuple(done), tuple(done.values()), prefill_key(model, heads), "probe", seconds, record(model.device)
    )
    if progress:
        print(f"entmtp: prefill costs measured in {seconds:.1f} s: {cost.summary()}", file=sys.stderr)
    return cost
