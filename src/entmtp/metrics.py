"""The speed metrics, defined once: tokens per step, tokens per second, speedup.

Every report of entmtp (a `Result`, `entmtp bench`, `entmtp evaluate`, the scheduler's replays) computes its
numbers with these functions, so that "tokens/s" means the same thing wherever it is printed.

* Tokens per step: a verification step emits its accepted drafts + 1 bonus token (`Step.tokens`). The first
  token of a generation comes from the prefill and belongs to no step, so a generation's mean is
  sum(Step.tokens) / steps = (generated tokens - 1) / steps (`step_tokens`). Plain decoding: exactly 1.
* Tokens per second: generated tokens (the prefill's first token included) over the whole generation's wall
  time (prefill included): what a user waits for (`Result.tokens_per_second`, the bench's `tokens_per_second`).
  Over many prompts the totals are pooled (all tokens / all seconds), not the per-prompt rates averaged.
* Decode tokens per second (bench): the steps' tokens over the steps' summed wall time, prefill left out.
* Replay tokens per second (calibration/replay.py): the replayed steps' tokens over the sum of the latencies
  charged to them from a profile, in ms: decode steps only, since the prefill is the same for every policy.
* Speedup: tokens/s over a baseline's tokens/s (plain decoding in the bench, the baseline heads in
  `entmtp evaluate`), both measured the same way.

One exception, kept so that earlier reports stay comparable: `entmtp evaluate`'s tokens_per_second counts the
steps' tokens (not the prefill's) over the whole wall time. It is only read as a ratio of two heads decoding
the same greedy outputs, where the token counts are equal and the difference cancels.

A rate with nothing to divide by (no steps, no time, a baseline of 0 tokens/s) is 0.0, never an error: an
empty generation is reported, not crashed on.
"""

from __future__ import annotations


def step_tokens(tokens: int, generations: int = 1) -> int:
    """Tokens emitted by verification steps: every generation's first token comes from its prefill."""
    return tokens - generations


def mean_tokens_per_step(tokens: int, steps: int) -> float:
    """Mean tokens per verification step (accepted drafts + 1 bonus token); `tokens` are the steps' own
    (`step_tokens`), not counting the prefill's. 0.0 when no step ran (the prefill's token ended it)."""
    return tokens / steps if steps else 0.0


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Generated tokens over the wall time they took; 0.0 when no time was measured."""
    return tokens / seconds if seconds > 0 else 0.0


def replay_tokens_per_second(tokens: float, ms: float) -> float:
    """Tokens over decode-step milliseconds (the prefill left out): a replay's tokens over the summed step
    latencies charged to it, or one tree's expected tokens per step over its ms per step."""
    return 1000.0 * tokens / ms if ms else 0.0


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    """How many times faster than the baseline (tokens/s over tokens/s); 0.0 against a baseline of 0."""
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s else 0.0
