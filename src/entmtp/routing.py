"""Routing by prompt length: each request runs on the backend with the least expected time for it.

Backends differ in prefill and in decode, and not in the same direction: on a 2-core EPYC (avx512_bf16, no
AMX) llama.cpp decodes the embedded Q4_1 model at ~10 ms a step against transformers bf16's ~37 ms, while
PyTorch's bf16 prefill of a long prompt is several times faster than llama.cpp's. So where `build` measured
both backends and both fit in memory (`auto`), the engine it returns is a `Router` over two engines, one per
backend, and each request goes to the lane with the least

    expected ms = prefill(prompt tokens) + max_new_tokens * 1000 / expected decode tokens/s

where prefill is the lane's measured `PrefillCost` (costs/prefill.py) and the decode speed the composed
policy's expected tokens/s on that backend's cost curve (trees and lookup drafts priced in). Ties go to the
first lane (the backend `auto` chose by decode speed). The lanes share one tokenizer (the caller checks), so
a prompt is encoded once, and a routed request's output is exactly what the chosen engine gives alone. `build`
routes only between lanes that decode the same weights (with `--dtype float32`: transformers in float32 and
llama.cpp on an F32 GGUF), unless `--mixed-weights` lets a Q4_1 lane and a bf16 one share the requests.

A `Router` has the `Engine` faces that `generate`, `chat` and the bench use: `generate`, `stream`, `encode`,
`tokenizer`, `window`. The server batches requests on one engine (batch.py) and builds without routing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from .accept import GenerationOptions
from .costs.prefill import PrefillCost
from .errors import EntMTPError
from .records import Result, TokenEvent

PLAN_NEW_TOKENS = 256  # the request size the plan states the rule at (`Router.describe`)


@dataclass(frozen=True)
class Lane:
    """One backend's engine and what a request costs on it."""

    backend: str  # transformers | llama-cpp
    engine: object  # engine.Engine
    prefill: PrefillCost
    tokens_per_second: float  # expected decode speed of the engine's policy on this backend's curve
    weights: str = ""  # the weights it decodes, in words (backends.describe_weights): the log names them

    def expected_ms(self, prompt_tokens: int, new_tokens: int) -> float:
        return self.prefill(prompt_tokens) + 1000 * new_tokens / self.tokens_per_second


class Router:
    """Two lanes: `first` (ties go to it) and `second`; each request runs on the one expected to finish
    it sooner (the module docstring). `log(str)`, when set, is told each request's lane and why (`-v`)."""

    def __init__(self, first: Lane, second: Lane, log=None):
        for lane in (first, second):
            if not lane.tokens_per_second > 0:
                raise EntMTPError(f"lane {lane.backend} has no expected decode speed: measure its cost curve")
        self.lanes = (first, second)
        self.tokenizer = first.engine.tokenizer
        self.window = min(first.engine.window, second.engine.window)
        self.log = log

    def lane_for(self, prompt_tokens: int, new_tokens: int) -> Lane:
        first, second = self.lanes
        faster = second.expected_ms(prompt_tokens, new_tokens) < first.expected_ms(prompt_tokens, new_tokens)
        return second if faster else first

    def encode(self, prompt, max_new_tokens: int, *, chat: bool = True, logprobs: int | None = None):
        """The prompt's token ids (`Engine.encode`), checked against the smaller window of the two."""
        ids = self.lanes[0].engine.encode(prompt, max_new_tokens, chat=chat, logprobs=logprobs)
        return self.lanes[1].engine.encode(ids, max_new_tokens, logprobs=logprobs)

    def stream(
        self, prompt, options: GenerationOptions | None = None, *, chat: bool = True, **fields
    ) -> Iterator[TokenEvent]:
        """`Engine.stream` on the lane this request's length favours."""
        options = GenerationOptions.of(options, **fields)
        ids = self.encode(prompt, options.max_new_tokens, chat=chat, logprobs=options.logprobs)
        lane = self.lane_for(len(ids), options.max_new_tokens)
        if self.log is not None:
            expected = " vs ".join(
                f"{x.backend} {x.expected_ms(len(ids), options.max_new_tokens) / 1000:.2f} s"
                for x in self.lanes
            )
            weights = f" ({lane.weights})" if lane.weights else ""
            self.log(
                f"routed to {lane.backend}{weights}: {len(ids)} prompt tokens, {options.max_new_tokens} new "
                f"(expected {expected})"
            )
        yield from lane.engine.stream(ids, options)

    def generate(self, prompt, options: GenerationOptions | None = None, **kwargs) -> Result:
        """`Engine.generate` on the lane this request's length favours."""
        return list(self.stream(prompt, options, **kwargs))[-1].result

    def threshold(self, new_tokens: int) -> int | None:
        """The fewest prompt tokens that go to the second lane at `new_tokens` new tokens (None: none do,
        within the window). Both costs are lines in the prompt's length, so it is where they cross."""
        first, second = self.lanes
        b1, b2 = first.prefill.ms_per_token, second.prefill.ms_per_token
        gap = second.expected_ms(0, new_tokens) - first.expected_ms(0, new_tokens)  # at 0 prompt tokens
        if b1 <= b2:
            return 0 if gap < 0 else None
        n = max(0, math.floor(gap / (b1 - b2)) + 1)
        while n > 0 and self.lane_for(n - 1, new_tokens) is second:  # float rounding at the edge
            n -= 1
        while n < self.window and self.lane_for(n, new_tokens) is first:
            n += 1
        return n if n < self.window else None

    def describe(self, new_tokens: int = PLAN_NEW_TOKENS) -> str:
        """The rule in one line, for the plan."""
        first, second = self.lanes
        n = self.threshold(new_tokens)
        costs = (
            f"prefill {first.prefill.ms_per_token:.2f} vs {second.prefill.ms_per_token:.2f} ms/token, decode "
            f"{first.tokens_per_second:.1f} vs {second.tokens_per_second:.1f} tokens/s"
        )
        if n is None:
            where = f"every prompt to {first.backend}"
        elif n == 0:
            where = f"every prompt to {second.backend}"
        else:
            where = f"prompts of >= {n} tokens to {second.backend}, shorter to {first.backend}"
        return f"{where} (at {new_tokens} new tokens; {first.backend} vs {second.backend}: {costs})"
