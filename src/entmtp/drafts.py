"""Draft sources: where each drafted token of a step came from, and what each source gave.

A step's tree is verified as one, whatever drafted its nodes; the record says which source drafted each node,
so a user sees what paid (`Result.drafts`, the server's `entmtp_draft_tokens` metrics, the bench's report):

    heads       the model's own multi-token-prediction heads (Medusa, Hydra: heads/drafting.py)
    lookup      the text's own n-grams: prompt lookup over the prompt and the output so far (lookup.py)
    prediction  the request's predicted output (OpenAI's `prediction`, prediction.py), copied where the text
                follows it
    suffix      earlier requests' outputs (the suffix cache, suffix.py)
    forced      a grammar's forced tokens (shaping.py): the one token a JSON key or a tool call's wrapper allows

The middle three are nodes of the lookup kind ("L<r>", tree.py), and so are a grammar's forced chains: a lookup
node copies the best-ranked continuation of its branch, and `lookup.NgramIndex` says which source ranked it
(`Candidates.origins`). A token that both the text and the prediction offer is the text's (its occurrence is the
more recent: prompt lookup alone would have drafted it), so the prediction is credited with what the prompt
lacks: little in an edit whose prompt holds the file it edits (there a prediction's gain is the longer branch
its request runs, prediction.with_prediction), all of it where the prompt does not hold the expected text.

A source that drafts from tokens is a `DraftSource`: `begin(prompt)` opens a generation's `Session`, which is told
every token the text grows by (`extend`), offers the continuation it expects after a context with its own
estimate of each token (`draft` -> `Draft`: the tokens, the chance the chain is right to each, how many of the
context's last tokens it continues; no estimate: no probs) and is closed with the generation (`end`):

    lookup      lookup.TextLookup: its session is the generation's `lookup.NgramIndex` over prompt and output
    prediction  prediction.Prediction: the predicted output, each token estimated at the rate predictions copy at,
                or where the text follows it at the rate the text has kept to it (PredictionSession)
    suffix      suffix.SuffixCache: earlier outputs, each token at arctic's empirical continuation probability

The heads draft from the base model's hidden states, not from tokens: their session is `heads.Drafter` (opened
by `MTPHeads.drafter`, told the accepted path's hidden states, drafting a tree of candidates per depth), and a
grammar's forced tokens come from the generation's matcher (shaping.py), right with probability 1.

The copied sessions meet in the text's index: a lookup node copies the best-ranked continuation of its branch
whichever source holds it (the prediction's tokens are the index's prefix, the suffix cache's chain ranks first
where it continues a longer context than the text's own match: lookup.py); the index tells the sessions it
reads of every token the text grows by, names each node's source (`Candidates.origins`) and gives the estimate
of a chain from a source (`NgramIndex.estimates`). The engine opens a generation's sessions in
`Engine.new_state` and closes them with its result.

The hybrid (scheduler/hybrid.py) prices a step's branch as a branch from its source: the source of the branch's
first token (`Candidates.origins[0]`) names the acceptance rates it is sized on, learned per source (the text's
n-grams, a prediction and the suffix cache are right at different rates, and one source's misses say nothing of
another's), each starting from the source's own estimate where it gives one (the suffix cache's and a
prediction's, per token of its chain, `NgramIndex.estimates`), else from the prior by match length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

HEADS, LOOKUP, PREDICTION, SUFFIX, FORCED = "heads", "lookup", "prediction", "suffix", "forced"
SOURCES = (HEADS, LOOKUP, PREDICTION, SUFFIX, FORCED)
COPIED = (LOOKUP, PREDICTION, SUFFIX)  # the sources a lookup node copies from (lookup.NgramIndex)


@dataclass(frozen=True)
class Draft:
    """A continuation a source offers: its tokens (first first), the source's estimate that it is right to each
    token (cumulative; empty: the source gives none), and how many of the context's last tokens it continues."""

    tokens: tuple[int, ...]
    probs: tuple[float, ...]
    match: int


class Session(Protocol):
    """One generation's view of a draft source (the module docstring)."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft: ...

    def end(self) -> None: ...


class DraftSource(Protocol):
    """A source of drafts: `begin` opens a generation's session over its prompt (the module docstring)."""

    name: str  # one of `SOURCES`

    def begin(self, prompt: Sequence[int]) -> Session: ...


@dataclass
class SourceCounts:
    """Drafted nodes and accepted drafts by source (keys of `SOURCES`; a source that drafted nothing is absent).
    A step's, or summed over a generation's steps (`add`)."""

    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, origins: Sequence[str], accepted: Sequence[int]) -> SourceCounts:
        """`origins` [N]: each drafted node's source (node i + 1 of the tree); `accepted`: the accepted nodes
        that were emitted (ids 1..N)."""
        counts = cls()
        for o in origins:
            counts.drafted[o] = counts.drafted.get(o, 0) + 1
        for i in accepted:
            o = origins[i - 1]
            counts.accepted[o] = counts.accepted.get(o, 0) + 1
        return counts

    def add(self, other: SourceCounts) -> SourceCounts:
        for mine, theirs in ((self.drafted, other.drafted), (self.accepted, other.accepted)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        return self

    def describe(self) -> str:
        """ "heads 12/40, prediction 88/96": accepted of drafted, by source."""
        return ", ".join(f"{s} {n['accepted']}/{n['drafted']}" for s, n in self.to_json().items())

    def to_json(self) -> dict[str, dict[str, int]]:
        """{source: {"drafted": n, "accepted": a}} in `SOURCES`' order."""
        return {
            s: {"drafted": self.drafted.get(s, 0), "accepted": self.accepted.get(s, 0)}
            for s in SOURCES
            if s in self.drafted
        }
