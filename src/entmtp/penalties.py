"""The sampling controls clients send: OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`, and
`repetition_penalty` (vLLM's and transformers'), applied per tree node on that node's own prefix.

A tree node's next token is drawn after the prompt, the emitted tokens and the drafted tokens on the node's
path, so each node's logits are penalised by the counts of that prefix, exactly as plain decoding would have
penalised them had it written that path. In order, on the raw logits of a node:

  repetition  a token of the prefix (prompt included): logit / r where positive, logit * r where not
  frequency   minus f x (how often the token was generated: emitted, and on the node's path)
  presence    minus p where the token was generated at all (as vLLM, the prompt does not count for these two)
  bias        plus logit_bias[token]

then the grammar's mask (constraints.py), then the acceptance rule's temperature (accept.py). Ranges are
OpenAI's: penalties in [-2, 2], biases in [-100, 100]; a repetition penalty is > 0 (1 = none).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import FieldError

PENALTY_RANGE = 2.0  # OpenAI's presence and frequency penalties lie in [-2, 2]
BIAS_RANGE = 100.0  # and logit_bias values in [-100, 100]


@dataclass(frozen=True)
class Penalties:
    """A generation's controls (the module docstring); `of` checks them."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ascending ids
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @classmethod
    def of(
        cls,
        logit_bias: Mapping | None = None,
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
        vocab_size: int | None = None,
    ) -> Penalties:
        """Checked controls (an EntMTPError names the field, its bad value and the range). `logit_bias` maps
        token ids (ints, or their decimal strings as JSON sends them) to biases."""
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not _number(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise FieldError(f"{name} must be a number from -2 to 2, got {value!r}", name)
        if not _number(repetition) or not 0 < repetition <= 1e3:
            raise FieldError(
                f"repetition_penalty must be a number > 0 (1 = none), got {repetition!r}",
                "repetition_penalty",
            )
        bias: dict[int, float] = {}
        for key, value in (logit_bias or {}).items():
            token = _token_id(key)
            if token is None or (vocab_size is not None and not 0 <= token < vocab_size):
                top = f"0..{vocab_size - 1}" if vocab_size is not None else "the vocabulary's ids"
                raise FieldError(f"logit_bias keys are token ids in {top}, got {key!r}", "logit_bias")
            if not _number(value) or not -BIAS_RANGE <= value <= BIAS_RANGE:
                raise FieldError(
                    f"logit_bias values must be numbers from -100 to 100, got {value!r} for {key!r}",
                    "logit_bias",
                )
            bias[token] = float(value)
        return cls(tuple(sorted(bias.items())), float(presence), float(frequency), float(repetition))


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _token_id(key) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return None


class Counts:
    """One generation's token counts for its penalties: how often each token was generated, and which tokens
    the prefix holds (the prompt's too, for the repetition penalty)."""

    def __init__(self, penalties: Penalties, prompt: Sequence[int], vocab_size: int):
        self.penalties, self.vocab = penalties, vocab_size
        self.generated = torch.zeros(vocab_size, dtype=torch.float32)  # [V]
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        self.seen[torch.tensor(list(prompt), dtype=torch.long)] = True
        self.bias = torch.zeros(
            vocab_size if penalties.logit_bias else 0, dtype=torch.float32
        )  # [V] or empty
        for t, b in penalties.logit_bias:
            self.bias[t] = b

    def consume(self, tokens: Sequence[int]) -> None:
        """Emitted tokens."""
        for t in tokens:
            if 0 <= t < self.vocab:
                self.generated[t] += 1
                self.seen[t] = True

    def apply(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """`logits` [n, V] float32 (changed in place and returned), row i penalised as after the emitted tokens
        and then `paths[i]` (the drafted tokens on node i's path, root excluded). The entries of a path's own
        tokens are computed again from their raw values with the path counted, by the same float32 operations
        as every other entry, so a node's row is bit for bit what plain decoding computes after that path."""
        pairs = [(i, t, k) for i, path in enumerate(paths) for t, k in Counter(path).items()]
        if pairs:
            rows, tokens, extra = (torch.tensor(c) for c in zip(*pairs, strict=True))
            raw = logits[rows, tokens]  # [m] a copy, before any change
        dev, bias = logits.device, self.bias
        logits.copy_(
            _penalised(self.penalties, logits, self.generated.to(dev), self.seen.to(dev), bias.to(dev))
        )
        if pairs:
            generated = self.generated[tokens] + extra.float()  # [m]
            seen = torch.ones(len(pairs), dtype=torch.bool)
            logits[rows.to(dev), tokens.to(dev)] = _penalised(
                self.penalties, raw.cpu(), generated, seen, bias[tokens] if bias.numel() else bias
            ).to(dev)
        return logits


def _penalised(
    p: Penalties, x: torch.Tensor, generated: torch.Tensor, seen: torch.Tensor, bias: torch.Tensor
):
    """`x` [..., K] with the controls applied, given per entry (broadcast) how often its token was generated,
    whether the prefix holds it, and its bias (empty: none): the one definition of the arithmetic."""
    if p.repetition != 1:
        x = torch.where(seen & (x > 0), x / p.repetition, torch.where(seen, x * p.repetition, x))
    if p.frequency or p.presence:
        x = x - (p.frequency * generated + p.presence * (generated > 0))
    if bias.numel():
        x = x + bias
    return x
