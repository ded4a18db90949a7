"""Predicted Outputs: text the caller expects the answer to repeat (OpenAI's `prediction`), as drafts.

An edit's answer is mostly the file being edited: the caller knows it before the model writes it. The
prediction's tokens join the generation's prompt-lookup index ahead of the prompt (`lookup.NgramIndex`'s
`prefix`: no n-gram or continuation crosses from the prediction into the text), so every lookup node can copy
from it: a branch follows the prediction from the current match and, after a rejected stretch (an inserted or
deleted line), re-aligns at the next n-gram the output shares with it. A request with a prediction runs its
acceptance rule's policy with a lookup branch of up to `PREDICTION.tokens` tokens (`with_prediction`), sized
per step on this machine's cost curve like any lookup branch (scheduler/hybrid.py): long where the prediction
keeps being right and verifying is cheap, none where it is wrong. Drafts are verified like any others, so the
output is the output without a prediction: token for token in greedy decoding, in distribution when sampling
losslessly. Typical acceptance, which is not lossless, would copy the prediction into the text: it ignores it.

Usage, as OpenAI's `completion_tokens_details` defines it: `accepted` = the prediction's tokens that appear in
the completion (the matching blocks of the two token sequences, in order), `rejected` = the rest of the
prediction's tokens.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import EntMTPError
from .lookup import Lookup

# the lookup drafts of a request with a prediction: longer chains than prompt lookup's 10, since a prediction
# is usually right for long stretches; the hybrid sizes each step's chain on the measured costs
PREDICTION = Lookup(tokens=32)
# the chance that a token drafted from a prediction is right, as the router prices a request's prediction
# before it runs (routing.Promise): on the edits task (docs/results/predicted-outputs/) chains of up to 32 tokens
# on transformers emitted 3.65-3.84 tokens a step, 1 / (1 - q) for q ~ 0.73-0.74
PREDICTED_RATE = 0.75


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
