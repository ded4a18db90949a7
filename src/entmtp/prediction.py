"""Predicted Outputs: text the caller expects the answer to repeat (OpenAI's `prediction`), as drafts.

An edit's answer is mostly the file being edited: the caller knows it before the model writes it. The
prediction's tokens join the generation's prompt-lookup index ahead of the prompt (`lookup.NgramIndex`'s
`prefix`: no n-gram or continuation crosses from the prediction into the text), so every lookup node can copy
from it: a branch follows the prediction from the current match and, after a rejected stretch (an inserted or
deleted line), re-aligns at the next n-gram the output shares with it. Where the prediction's own alignment
(up to `MAX_ALIGN` tokens) is longer than the text's n-gram match, its continuation ranks first, as a cross
source's does (lookup.NgramIndex): the n-grams of a list's items or a table's rows recur with every item, and
the most frequent continuation of the last three tokens is rarely the next item. A request with a prediction runs its
acceptance rule's policy with a lookup branch of up to `PREDICTION.tokens` tokens (`with_prediction`), sized
per step on this machine's cost curve like any lookup branch (scheduler/hybrid.py): long where the prediction
keeps being right and verifying is cheap, none where it is wrong. Drafts are verified like any others, so the
output is the output without a prediction: token for token in greedy decoding, in distribution when sampling
losslessly. Typical acceptance, which is not lossless, would copy the prediction into the text: it ignores it.

As a draft source (drafts.py) a prediction is a `Prediction`: its session offers the prediction's continuation
after the longest stretch of a context found in it (`MAX_ALIGN` tokens at most), each token estimated right at
`PREDICTED_RATE`, the rate predictions are copied at on edits, where the stretch is long enough to say the text
follows the prediction (`MIN_ALIGN`), so the hybrid prices a branch from the prediction from its first step on
that rate (learning the request's own from there) rather than on the text's prior by match length. Where the
stretch is the whole `MAX_ALIGN` (`FOLLOWED`: the text has kept to the prediction for that long, not just
re-aligned on it after an edit), the session estimates each token at the rate the text has kept to the
prediction from such stretches in this generation: copying is bursty, and a followed prediction is right far
more often than the flat rate says (`PredictionSession.followed`).

Usage, as OpenAI's `completion_tokens_details` defines it: `accepted` = the prediction's tokens that appear in
the completion (the matching blocks of the two token sequences, in order), `rejected` = the rest of the
prediction's tokens.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from .drafts import PREDICTION as NAME
from .drafts import Draft
from .errors import EntMTPError
from .lookup import Lookup

# the lookup drafts of a request with a prediction: longer chains than prompt lookup's 10, since a prediction
# is usually right for long stretches; the hybrid sizes each step's chain on the measured costs
PREDICTION = Lookup(tokens=32)
# the chance that a token drafted from a prediction is right, as the router prices a request's prediction
# before it runs (routing.Promise): on the edits task (docs/results/predicted-outputs/) chains of up to 32 tokens
# on transformers emitted 3.65-3.84 tokens a step, 1 / (1 - q) for q ~ 0.73-0.74
PREDICTED_RATE = 0.75
MAX_ALIGN = 8  # the longest stretch of the context a prediction's session aligns on
# where the text's last MAX_ALIGN tokens lie in the prediction the text is taken to follow it (not just to have
# re-aligned on it after an edit), and a chain from there is priced at the rate the text kept to the prediction
# from such alignments so far in this generation, from `rate` at FOLLOWED_WEIGHT pseudo-tokens. Copying is bursty:
# replayed on llama.cpp's greedy outputs of the edits' 20 calibration prompts, such a chain was right at its first
# token 97% of the time and ~18 tokens deep on average, where the flat rate priced it to ~4 tokens
# (docs/results/predicted-outputs/followed/)
FOLLOWED = MAX_ALIGN
FOLLOWED_WEIGHT = 2.0
# the shortest stretch whose alignment says the text follows the prediction (a shorter one, a newline or a
# common word, is no such evidence: its chain comes without an estimate, priced on the prior by match length)
MIN_ALIGN = 3


class Prediction:
    """A request's predicted output as a draft source (drafts.DraftSource); `rate`: the chance each of its
    drafted tokens is right (its estimate where the text has not been seen to follow it)."""

    name = NAME

    def __init__(self, tokens: Sequence[int], rate: float = PREDICTED_RATE):
        if not 0.0 <= rate <= 1.0:
            raise EntMTPError(f"a prediction's copy rate is a probability in [0, 1], got {rate}")
        self.tokens, self.rate = [int(t) for t in tokens], rate
        # each stretch of up to MAX_ALIGN tokens -> where its earliest occurrence ends (the order an edit keeps)
        self.ends: dict[tuple[int, ...], int] = {}
        for end in range(len(self.tokens)):
            for n in range(1, min(MAX_ALIGN, end + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[end + 1 - n : end + 1]), end)

    def begin(self, prompt: Sequence[int]) -> PredictionSession:
        """The generation's session: it learns how often the text keeps to the prediction where it follows it."""
        return PredictionSession(self, prompt)

    def align(self, context: Sequence[int]) -> tuple[int, int]:
        """(n, end): the longest stretch ending `context` (at most MAX_ALIGN tokens) that the prediction holds
        with a continuation, and where its earliest occurrence ends; (0, -1) where it holds none."""
        for n in range(min(MAX_ALIGN, len(context)), 0, -1):
            end = self.ends.get(tuple(context[len(context) - n :]))
            if end is not None and end + 1 < len(self.tokens):
                return n, end
        return 0, -1

    def draft(self, context: Sequence[int], max_tokens: int, followed: float | None = None) -> Draft:
        """The prediction's tokens after the longest stretch ending `context` that it holds (the earliest such),
        each estimated at its `rate` given the ones before it where the stretch is `MIN_ALIGN` tokens or more
        (else no estimate), at `followed` where given and the stretch is `FOLLOWED`; nothing where it holds no
        stretch of it."""
        n, end = self.align(context)
        if not n:
            return Draft((), (), 0)
        chain = tuple(self.tokens[end + 1 : end + 1 + max_tokens])
        q = followed if followed is not None and n >= FOLLOWED else self.rate
        probs = tuple(q ** (j + 1) for j in range(len(chain))) if n >= MIN_ALIGN else ()
        return Draft(chain, probs, n)

    def extend(self, tokens: Sequence[int]) -> None:
        """Read as a session itself, a prediction holds no state of the generation: every chain at `rate`
        (`begin` opens one that learns where the text follows it)."""

    def end(self) -> None:
        pass


class PredictionSession:
    """One generation's view of a prediction (drafts.Session): its drafts, a chain where the text follows the
    prediction (`FOLLOWED`) estimated at `followed`, the rate the text has kept to it from such alignments."""

    name = NAME

    def __init__(self, prediction: Prediction, prompt: Sequence[int]):
        self.prediction, self.tokens = prediction, prediction.tokens
        self.tail = [int(t) for t in prompt[-MAX_ALIGN:]]
        # tokens emitted where the text followed the prediction, and those of them it predicted
        self.followed_tokens = self.kept = 0

    @property
    def followed(self) -> float:
        return (self.kept + FOLLOWED_WEIGHT * self.prediction.rate) / (self.followed_tokens + FOLLOWED_WEIGHT)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            n, end = self.prediction.align(self.tail)
            if n >= FOLLOWED:
                self.followed_tokens += 1
                self.kept += self.tokens[end + 1] == t
            self.tail = [*self.tail[1 - MAX_ALIGN :], int(t)]  # the last MAX_ALIGN tokens

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        return self.prediction.draft(context, max_tokens, self.followed)

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class PredictionUsage:
    """OpenAI's accepted and rejected prediction tokens of one completion (the module docstring)."""

    accepted: int
    rejected: int


def prediction_ids(
    tokenizer, prediction: str | Sequence[int] | None, window: int, vocab_size: int | None = None
) -> list[int]:
    """The prediction's token ids (a text is encoded as it is, no special tokens; ids are taken as given, each
    in 0..vocab_size-1), at most `window` of them; a bad prediction raises EntMTPError naming the fix."""
    if prediction is None:
        return []
    if isinstance(prediction, str):
        ids = tokenizer.encode(prediction, add_special_tokens=False) if prediction else []
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in prediction):
        ids = list(prediction)
    else:
        raise EntMTPError(
            "a prediction is a text (or a list of token ids): give the expected output as a string"
        )
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise EntMTPError(f"prediction token ids must be in 0..{vocab_size - 1}")
    if len(ids) > window:
        raise EntMTPError(
            f"the prediction is {len(ids)} tokens, more than the model's context window ({window}): predict "
            "the part of the output you expect, within the window"
        )
    return ids


def prediction_usage(prediction: Sequence[int], output: Sequence[int]) -> PredictionUsage:
    """How many of the prediction's tokens appear in `output`, in order (difflib's matching blocks), and how
    many do not."""
    if not prediction:
        return PredictionUsage(0, 0)
    matcher = difflib.SequenceMatcher(None, list(prediction), list(output), autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return PredictionUsage(accepted, len(prediction) - accepted)


def with_prediction(policy, costs=None):
    """`policy` with a prediction's lookup branch (`PREDICTION`): its inner policy where it has a lookup branch
    already (a hybrid), wrapped once more with the longer branch, sized on `costs` (this machine's curve)."""
    from .scheduler.hybrid import HybridPolicy, hybrid

    inner = policy.inner if isinstance(policy, HybridPolicy) else policy
    lookup = PREDICTION if policy.lookup is None else _longer(policy.lookup)
    return hybrid(inner, lookup, costs)


def _longer(lookup: Lookup) -> Lookup:
    from dataclasses import replace

    return replace(lookup, tokens=max(lookup.tokens, PREDICTION.tokens), adaptive=True)
