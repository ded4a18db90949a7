"""Routing by prompt length and by draft: each request runs on the backend with the least expected time for it.

Backends differ in prefill and in decode, and not in the same direction: on a 2-core EPYC (avx512_bf16, no
AMX) llama.cpp decodes the embedded Q4_1 model at ~10 ms a step against transformers bf16's ~37 ms, while
PyTorch's bf16 prefill of a long prompt is several times faster than llama.cpp's. So where `build` measured
both backends and both fit in memory (`auto`), the engine it returns is a `Router` over two engines, one per
backend, and each request goes to the lane with the least

    expected ms = prefill(prompt tokens) + max_new_tokens * 1000 / expected decode tokens/s

where prefill is the lane's measured `PrefillCost` (costs/prefill.py) and the decode speed the composed
policy's expected tokens/s on that backend's cost curve (trees and lookup drafts priced in). Ties go to the
first lane (the backend `auto` chose by decode speed).

A request that brings its own drafts (a prediction: OpenAI's Predicted Outputs, prediction.py) promises long,
nearly certain chains, and the backends price those differently: llama.cpp's verification is compute-bound on a CPU
(8 drafted nodes cost 3-6 plain steps), transformers' in bf16 much flatter. Such a request is priced by its
`Promise`: it is expected to write about as many tokens as its prediction holds (an edit returns the file it edits;
at most its new tokens), each at the least expected ms per token of a chain on the lane's own cost curve at the
request's middle (its prompt and half its output: a drafted token costs a larger share of a step after a short
context than after a long one on llama.cpp) (`chain_ms_per_token`: k drafted tokens each right with the promise's
rate emit (1 - rate^(k+1)) / (1 - rate) tokens for the curve's ms at k nodes; k = 0 is a plain step). The rate
starts at the edits task's (`prediction.PREDICTED_RATE`) and is learned from the router's own predicted requests as
they finish (`CopyRate`), so a stream of edits that keep nearly all of their text moves to the backend where long
chains are cheapest. A retry of a prompt the suffix cache has answered before (suffix.py: agents, extraction jobs
and retries that repeat their requests) promises the same way: about as many tokens as that earlier answer, copied
from the cache at a rate learned from the router's own such requests, apart from the predictions' (the two copy at
different rates) and per weights decoded (the cache holds what the lanes wrote: a lane that decodes other weights
writes other text, so it copies the other lane's answers less often). The two lanes share the first lane's suffix
cache, so a request drafts from what either lane wrote.

The lanes share one tokenizer (the caller checks), so a prompt is encoded once, and a routed request's output is
exactly what the chosen engine gives alone. `build` routes only between lanes that decode the same weights (with
`--dtype float32`: transformers in float32 and llama.cpp on an F32 GGUF), unless `--mixed-weights` lets a Q4_1
lane and a bf16 one share the requests.

A `Router` has the `Engine` faces that `generate`, `chat` and the bench use: `generate`, `stream`, `encode`,
`tokenizer`, `window`. The server batches requests on one engine (batch.py) and builds without routing, so it
neither routes by length nor by draft (docs/llama-cpp.md says why).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from .accept import GenerationOptions
from .costs.curves import LatencyModel
from .costs.prefill import PrefillCost
from .drafts import COPIED, PREDICTION, SUFFIX
from .errors import EntMTPError
from .prediction import PREDICTED_RATE, prediction_ids
from .prediction import PREDICTION as PREDICTED_BRANCH
from .records import Result, TokenEvent

PLAN_NEW_TOKENS = 256  # the request size the plan states the rule at (`Router.describe`)
PRIOR_STEPS = 4  # chains the prior copy rate is worth (`CopyRate`): a few predicted requests outweigh it


@dataclass
class CopyRate:
    """The chance that a copied draft (the lookup kinds: the text's, a prediction's, the suffix cache's, drafts.py)
    is right, learned from finished predicted requests: the maximum-likelihood rate of a geometric run, censored
    where a chain was right to its end, `right / (right + wrong)` over their steps (a step's accepted copies are
    right tokens; one that stopped short of its chain is one wrong token), from a prior of `PREDICTED_RATE` worth
    `PRIOR_STEPS` chains."""

    right: float = PREDICTED_RATE * PRIOR_STEPS
    wrong: float = (1 - PREDICTED_RATE) * PRIOR_STEPS

    @property
    def value(self) -> float:
        return self.right / (self.right + self.wrong)

    def observe(self, steps) -> None:
        for s in steps:
            drafted = sum(s.drafts.drafted.get(k, 0) for k in COPIED)
            if drafted:
                accepted = sum(s.drafts.accepted.get(k, 0) for k in COPIED)
                self.right += accepted
                self.wrong += accepted < drafted  # the chain stopped short: one of its tokens was wrong


@dataclass(frozen=True)
class Promise:
    """The drafts a request brings before it runs: up to `tokens` of its output drafted from its `source` (its
    prediction, or the suffix cache's earlier answer to its prompt), each right with probability `rate` (the
    module docstring)."""

    tokens: int
    rate: float = PREDICTED_RATE
    source: str = PREDICTION

    @classmethod
    def of(
        cls, tokenizer, options: GenerationOptions, window: int, rates: dict[str, float], ids=(), suffix=None
    ) -> Promise | None:
        """The promise of a request of prompt `ids` under `options`, at the copy `rates` by source (None: it brings
        no drafts, or its acceptance rule ignores them: typical acceptance would copy, prediction.py): its
        prediction's, else the `suffix` cache's earlier answer to the same prompt's."""
        if not options.sampling.rule.lossless:
            return None
        if options.prediction is not None:
            n = len(prediction_ids(tokenizer, options.prediction, window))
            return cls(n, rates[PREDICTION]) if n else None
        n = suffix.answered(ids) if suffix is not None else 0
        return cls(n, rates[SUFFIX], SUFFIX) if n else None


def chain_ms_per_token(latency: LatencyModel, rate: float, most: int) -> tuple[float, int]:
    """(the least expected ms per emitted token of a chain of k <= `most` drafted tokens, each right with
    probability `rate`, on `latency`; that k). A step emits the chain's right prefix and one token more."""
    k = np.arange(most + 1)
    emitted = k + 1.0 if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)
    per_token = np.asarray(latency(k), dtype=float) / emitted
    best = int(np.argmin(per_token))
    return float(per_token[best]), best


def middle(prompt_tokens: int, written: int) -> int:
    """The context a request's chains are priced at: its prompt and half of what it writes."""
    return prompt_tokens + written // 2


@dataclass(frozen=True)
class Lane:
    """One backend's engine and what a request costs on it."""

    backend: str  # transformers | llama-cpp
    engine: object  # engine.Engine
    prefill: PrefillCost
    tokens_per_second: float  # expected decode speed of the engine's policy on this backend's curve
    weights: str = ""  # the weights it decodes, in words (backends.describe_weights): the log names them
    latency: LatencyModel | None = None  # ms of a step by drafted nodes on this backend (None: unmeasured)

    def expected_ms(self, prompt_tokens: int, new_tokens: int, promise: Promise | None = None) -> float:
        """Prefill and decode of a request; one with a `promise` writes about its prediction's length (at most
        `new_tokens`), each token at the cheaper of its chains (priced at the request's middle, `middle`) and
        the decode speed."""
        decode = 1000 / self.tokens_per_second  # ms per token without the request's own drafts
        if promise is None:
            return self.prefill(prompt_tokens) + new_tokens * decode
        written = min(promise.tokens, new_tokens)
        if self.latency is None:
            return self.prefill(prompt_tokens) + written * decode
        per_token = min(self.chain(promise, middle(prompt_tokens, written))[0], decode)
        return self.prefill(prompt_tokens) + written * per_token

    def chain(self, promise: Promise, context: int | None = None) -> tuple[float, int]:
        """(ms per token, chain length) of the promise's drafts on this lane (`chain_ms_per_token`), on its
        curve at `context` tokens (None: the mean of the measured contexts). A drafted token's share of a step
        depends on the context: on llama.cpp 1.8x a plain step after ~200 tokens against 1.45x after 768."""
        latency = self.latency if context is None else self.latency.at(context)
        return chain_ms_per_token(latency, promise.rate, PREDICTED_BRANCH.tokens)


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
        # learned from the requests it routed on a promise: a prediction's per router (the user's text, copied
        # alike on any lane); the suffix cache's per weights decoded (`copy_rate`)
        self.copy_rates: dict = {PREDICTION: CopyRate()}
        self.suffix = getattr(first.engine, "suffix", None)
        if self.suffix is not None and getattr(second.engine, "suffix", None) is not None:
            second.engine.suffix = self.suffix  # one cache: a request drafts from what either lane wrote

    def lane_for(self, prompt_tokens: int, new_tokens: int, promise: Promise | None = None) -> Lane:
        """The lane a request is expected to finish on sooner, its `promise` (if any) the same on both."""
        return self._choose(prompt_tokens, new_tokens, (promise, promise))

    def _choose(self, prompt_tokens: int, new_tokens: int, offers: tuple) -> Lane:
        first, second = self.lanes
        times = [
            lane.expected_ms(prompt_tokens, new_tokens, offer)
            for lane, offer in zip(self.lanes, offers, strict=True)
        ]
        return second if times[1] < times[0] else first

    def copy_rate(self, source: str, lane: Lane) -> CopyRate:
        """The copy rate of `source`'s promises on `lane`: a prediction's one for the router; the suffix cache's
        one per weights decoded, since the cache holds what the lanes wrote and a lane that decodes other
        weights writes other text (on the AMX Xeon transformers' bf16 retries of answers llama.cpp's Q4_1 wrote,
        priced at llama.cpp's own learned rate, went to transformers and ran at half llama.cpp's speed)."""
        key = source if source == PREDICTION else (source, lane.weights)
        return self.copy_rates.setdefault(key, CopyRate())

    def offers(self, promise: Promise | None) -> tuple:
        """`promise` on each lane, at that lane's copy rate of its source (`copy_rate`)."""
        if promise is None:
            return (None, None)
        return tuple(replace(promise, rate=self.copy_rate(promise.source, lane).value) for lane in self.lanes)

    def encode(self, prompt, max_new_tokens: int, *, chat: bool = True, logprobs: int | None = None):
        """The prompt's token ids (`Engine.encode`), checked against the smaller window of the two."""
        ids = self.lanes[0].engine.encode(prompt, max_new_tokens, chat=chat, logprobs=logprobs)
        return self.lanes[1].engine.encode(ids, max_new_tokens, logprobs=logprobs)

    def stream(
        self, prompt, options: GenerationOptions | None = None, *, chat: bool = True, **fields
    ) -> Iterator[TokenEvent]:
        """`Engine.stream` on the lane this request's length and drafts favour."""
        options = GenerationOptions.of(options, **fields)
        ids = self.encode(prompt, options.max_new_tokens, chat=chat, logprobs=options.logprobs)
        rates = dict.fromkeys((PREDICTION, SUFFIX), PREDICTED_RATE)  # each lane's own rate: `offers`
        promise = Promise.of(self.tokenizer, options, self.window, rates, ids, self.suffix)
        offers = self.offers(promise)
        lane = self._choose(len(ids), options.max_new_tokens, offers)
        if self.log is not None:
            self.log(self._why(lane, len(ids), options.max_new_tokens, offers))
        for event in lane.engine.stream(ids, options):
            if event.result is not None and promise is not None:
                self.copy_rate(promise.source, lane).observe(event.result.steps)
            yield event

    def _why(self, lane: Lane, prompt_tokens: int, new_tokens: int, offers: tuple) -> str:
        """The `-v` line of a routed request: its lane, its sizes and each lane's expected time (`offers`: its
        promise on each lane, or Nones)."""
        expected = " vs ".join(
            f"{x.backend} {x.expected_ms(prompt_tokens, new_tokens, p) / 1000:.2f} s"
            for x, p in zip(self.lanes, offers, strict=True)
        )
        weights = f" ({lane.weights})" if lane.weights else ""
        drafts, promise = "", offers[0]
        if promise is not None:
            written = min(promise.tokens, new_tokens)
            chains = ", ".join(
                f"{x.backend} chains of {k} at {ms:.1f} ms/token"
                for x, p in zip(self.lanes, offers, strict=True)
                if x.latency is not None
                for ms, k in [x.chain(p, middle(prompt_tokens, written))]
            )
            if offers[0].rate == offers[1].rate:
                rate = f"copies right {promise.rate:.2f} of the time"
            else:
                rate = "copies right " + ", ".join(
                    f"{p.rate:.2f} of the time on {x.backend}"
                    for x, p in zip(self.lanes, offers, strict=True)
                )
            what = (
                f"a prediction of {promise.tokens} tokens"
                if promise.source == PREDICTION
                else f"a prompt the suffix cache answered before in {promise.tokens} tokens"
            )
            drafts = f", {what} ({rate}{'; ' + chains if chains else ''})"
        return (
            f"routed to {lane.backend}{weights}: {prompt_tokens} prompt tokens, {new_tokens} new{drafts} "
            f"(expected {expected})"
        )

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
        predicted = self.lane_for(0, new_tokens, Promise(new_tokens))
        return (
            f"{where} (at {new_tokens} new tokens; {first.backend} vs {second.backend}: {costs}); a short prompt "
            f"whose prediction covers its output to {predicted.backend}"
        )
