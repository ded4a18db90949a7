"""Per-step records shared by the engine, policies and benchmarks: a step, a whole generation, a streamed token
event, a token's log-probabilities, and what a policy sees before a step. Convention: tokens per step = accepted drafts + 1 bonus token
(metrics.py defines every speed metric)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import metrics
from .drafts import SourceCounts

if TYPE_CHECKING:
    from .costs.curves import LatencyModel
    from .heads import LazyProbe, Probe
    from .lookup import NgramIndex


@dataclass
class Step:
    """One verification step. Convention: `tokens` = accepted drafts + 1 bonus token (after truncation)."""

    tree: str
    tree_nodes: int
    accepted: int  # drafts kept
    tokens: int  # tokens emitted by this step
    token_ids: list[int]
    seconds: dict[str, float] = field(
        default_factory=dict
    )  # probe, choose, draft, verify, accept, commit, total
    signals: dict[str, float] = field(default_factory=dict)  # what the policy read before choosing the tree
    lookup_nodes: int = 0  # drafted nodes that came from prompt lookup (hybrid trees)
    lookup_accepted: int = 0  # of the accepted drafts, how many came from prompt lookup
    sources: dict[str, int] = field(default_factory=dict)  # hybrid trees: lookup.source_depths of the step
    lookup_path: list[bool] = field(default_factory=list)  # hybrid trees: per accepted draft, a lookup copy?
    forced: int = 0  # accepted drafts of a grammar's forced chain (engine.forced_step)
    drafts: SourceCounts = field(default_factory=SourceCounts)  # drafted and accepted nodes by source


MAX_TOP_LOGPROBS = 20  # most top tokens a TokenLogprob may carry (OpenAI's limit on top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """The base model's log-probability of an emitted token: log-softmax of its raw logits (temperature 1,
    float32) at the position that predicted the token, and the `k` most likely tokens there (most likely
    first; `Engine.stream(logprobs=k)`). Under sampling this is the model's distribution, not the tempered
    or typical-filtered one the token was drawn or accepted from."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), k of them


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    steps: list[Step]
    seconds: float  # wall time of the whole generation, prefill included
    prefill_seconds: float
    finish_reason: str  # "eos", "stop", "length"
    logprobs: list[TokenLogprob] | None = None  # per token of `token_ids`, when asked for
    # the rule that accepted its drafts (accept.Sampling.rule): typical is not lossless
    acceptance: str = "greedy"
    prediction: object | None = None  # prediction.PredictionUsage when the request gave a prediction

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_step(self) -> list[int]:
        return [s.tokens for s in self.steps]

    @property
    def mean_tokens_per_step(self) -> float:
        return metrics.mean_tokens_per_step(sum(self.tokens_per_step), self.num_steps)

    @property
    def tokens_per_second(self) -> float:
        return metrics.tokens_per_second(len(self.token_ids), self.seconds)  # prefill included

    @property
    def drafts(self) -> SourceCounts:
        """Drafted nodes and accepted drafts by source over every step (drafts.py)."""
        total = SourceCounts()
        for s in self.steps:
            total.add(s.drafts)
        return total

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "num_steps": self.num_steps,
            "tokens_per_step": self.tokens_per_step,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "trees": [s.tree for s in self.steps],
            "accepted": [s.accepted for s in self.steps],
            "finish_reason": self.finish_reason,
            "acceptance": self.acceptance,
            "prediction": dataclasses.asdict(self.prediction) if self.prediction is not None else None,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "tokens_per_second": self.tokens_per_second,
            "step_seconds": [s.seconds for s in self.steps],
            "signals": [s.signals for s in self.steps],
            "lookup_accepted": [s.lookup_accepted for s in self.steps],
            "drafts": self.drafts.to_json(),
        }


@dataclass
class TokenEvent:
    """Streamed after the prefill (the first token) and after every step."""

    token_ids: list[int]  # new tokens
    text: str  # new text (may lag the tokens by an incomplete UTF-8 character)
    step: Step | None  # None for the token produced by the prefill
    finish_reason: str | None = None  # set on the last event
    result: Result | None = None  # set on the last event
    logprobs: list[TokenLogprob] | None = None  # per token of `token_ids`, when asked for


@dataclass(frozen=True)
class StepContext:
    step: int  # index of the step about to run (0 = first after the prefill)
    position: int  # tokens in the KV cache
    remaining: int  # tokens still allowed before max_new_tokens
    root_logits: torch.Tensor | None  # [V] base logits the root token was drawn from (None in replays)
    probe: Probe | LazyProbe | None = None  # the heads' probe of its master (the engine's: read lazily)
    raw_signals: list[float] | None = None  # replays: recorded (entropy, p0, chain sum, max g_d) instead
    lookup: NgramIndex | None = None  # the n-gram index of prompt + output, when the engine drafts lookups
    latency: LatencyModel | None = None  # ms of this step by drafted nodes when it shares a batch (batch.py)
