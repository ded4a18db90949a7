"""Prompt-lookup drafts: copy what already followed the current text's last n-gram in the context.

Heads guess what the model would write; lookup copies what is already in the prompt and output (a document
being summarised, code being edited, a list being repeated). The index maps every n-gram (n = 1..max_ngram)
of the context to the positions where it ends, and grows by O(max_ngram) dictionary updates per new token,
so a query never rescans the context.

A query takes the tokens just before a tree node (the context plus the drafted branch above it) and ranks the
tokens that followed earlier occurrences of their longest matching suffix: the longest n first, then by how
often each continuation occurred, then by recency; shorter matches add candidates the longer ones lack. Node
"L<r>" of a tree (tree.py) gets the rank-r candidate; a node with no candidate is dropped from the step's tree
(`tree.prune`), so a lookup branch costs nothing where the context has no match.

As a draft source (drafts.py) the text's own lookup is a `TextLookup`, whose session is the generation's index;
the index also reads the other copied sources' sessions (a prediction as its prefix, the suffix cache as its
`cross` source) and gives each one's estimates of its chain (`NgramIndex.estimates`).
"""

from __future__ import annotations

import argparse
import bisect
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .drafts import LOOKUP, PREDICTION, SUFFIX, Draft, Session
from .errors import EntMTPError
from .settings import add_arguments, from_args, setting
from .tree import Tree

MAX_OCCURRENCES = 64  # most recent occurrences of an n-gram read per query (bounds a query on long contexts)
MAX_CROSS_TOKENS = 32  # longest chain a `cross` source is asked for per step (a prediction's branch length)


@dataclass(frozen=True)
class Lookup:
    """How the engine drafts lookup nodes, and (for `--lookup`) the branch it adds to every step's tree.

    max_ngram: longest suffix matched (transformers' prompt lookup uses 2, vLLM's n-gram drafter up to 4)
    tokens: most lookup tokens per step (the branch length; transformers' default is 10)
    branches: distinct first tokens the branch may start with (1 = prompt lookup's single continuation)
    adaptive: choose the branch length per step from the match and the acceptance so far (scheduler.hybrid);
        False = always `tokens` nodes, as prompt lookup decoding does
    node_cost: None = the adaptive rule costs a step by measured latencies (the profile's curve when the
        policy comes from one, else one measured on a 2-core CPU: costs.CPU_COST); a number c =
        a step of n drafted tokens costs 1 + c n one-token steps (~0.01 on a GPU, where verifying up to ~64
        tokens is nearly free)
    typical: also under typical acceptance, where the engine has heads. Off by default: a copied token passes
        the typical test whenever the model finds it likely enough, so typical acceptance with lookup drafts
        copies the text into itself (on WritingPrompts a fifth of its 4-grams repeat, twice typical
        acceptance's without them: docs/results/sampling/). Greedy decoding and lossless sampling, whose
        output lookup drafts cannot change, always get them.
    caution: the adaptive rule sizes a branch on the rate that a chain starts right less this many standard
        errors of it (0: on the rate itself; scheduler/hybrid.py says why 1)
    """

    max_ngram: int = setting(3, flag="--lookup-ngram", help="longest n-gram matched (default %(default)s)")
    tokens: int = setting(
        10, flag="--lookup-tokens", help="most lookup tokens per step (default %(default)s)"
    )
    branches: int = 1
    adaptive: bool = setting(
        True,
        flag="--lookup-fixed",
        help="always draft --lookup-tokens lookup tokens when there is a match (default: sized per step)",
    )
    node_cost: float | None = setting(
        None,
        flag="--lookup-node-cost",
        help="sizing the lookup branch, a step of n drafted tokens costs 1 + C*n one-token steps (~0.01 on a "
        "GPU; default: measured step latencies, the profile's or a 2-core CPU's)",
    )
    typical: bool = False  # on the command line: --lookup said (`lookup_from_args`)
    caution: float = 1.0

    def __post_init__(self):
        if self.max_ngram < 1 or self.tokens < 1 or self.branches < 1:
            raise EntMTPError(
                f"lookup needs max_ngram >= 1, tokens >= 1 and branches >= 1, got {self.max_ngram}, "
                f"{self.tokens} and {self.branches}"
            )
        if not self.caution >= 0:
            raise EntMTPError(f"lookup caution must be >= 0 (standard errors), got {self.caution}")
        if self.node_cost is not None and not self.node_cost >= 0:
            raise EntMTPError(
                f"lookup node_cost must be >= 0 (a fraction of a one-token step), got {self.node_cost}"
            )


def add_lookup_arguments(p: argparse.ArgumentParser, changes: dict | None = None) -> None:
    """--lookup / --no-lookup and `Lookup`'s flags (`generate`, `chat` and `serve`; `EngineSpec.lookup`)."""
    p.add_argument(
        "--no-lookup",
        dest="lookup",
        action="store_false",
        default=None,
        help="no prompt-lookup drafts in the scheduled default's trees (they are on unless --heads none or --tree, "
        "except under typical acceptance)",
    )
    p.add_argument(
        "--lookup",
        action="store_true",
        default=None,
        help="add prompt-lookup drafts (copies from the prompt and output) to every step's tree, typical "
        "acceptance's too; with --heads none: prompt lookup decoding for any model",
    )
    add_arguments(p, Lookup, changes=changes)


def lookup_from_args(args: argparse.Namespace) -> Lookup | None:
    """--lookup / --no-lookup and the lookup flags -> a `Lookup` or None. Unsaid, lookup drafts go with the
    scheduled default (heads and no --tree) except under typical acceptance; `--heads none` stays plain
    decoding, a --tree that tree. Said, they go into every step's tree, typical acceptance's too."""
    on = args.lookup
    if on is None:
        on = args.heads != "none" and args.tree is None
    if not on:
        return None
    return from_args(Lookup, args, typical=args.lookup is True)  # said: typical acceptance too


@dataclass(frozen=True)
class TextLookup:
    """The text's own n-grams as a draft source (drafts.DraftSource): a generation's session is its `NgramIndex`
    over the prompt, reading the generation's `prediction` session (its tokens the index's prefix) and its
    `cross` sessions (the suffix cache's, by source name), where it has them."""

    max_ngram: int = 3
    prediction: Session | None = None  # a prediction.Prediction session
    cross: Mapping[str, Session] | None = None  # {drafts.SUFFIX: a suffix.Session}
    name = LOOKUP

    def begin(self, prompt: Sequence[int]) -> NgramIndex:
        prefix = self.prediction.tokens if self.prediction is not None else ()
        return NgramIndex(prompt, self.max_ngram, prefix=prefix, cross=self.cross, prediction=self.prediction)


@dataclass(frozen=True)
class Candidates:
    """A query's ranked next tokens (best first), the longest suffix matched, and each token's source."""

    tokens: list[int]
    match: int
    origins: list[str]  # drafts.LOOKUP, PREDICTION or SUFFIX per token


class NgramIndex:
    """The n-grams of a growing token sequence (n = 1..max_ngram) -> the positions where they end.

    `prefix`: tokens indexed ahead of the text but not part of it (a request's predicted output, prediction.py):
    their n-grams are found like the text's, and no n-gram or continuation crosses from them into the text.
    `cross`: sessions of sources of continuations from outside the text (drafts.Session; by source name, or one
    session, taken as the suffix cache's: earlier requests' outputs), each asked once per step; the token of
    the one that continues the longest context ranks first where that is longer than the text's own n-gram match
    (the text's candidates follow it); each is told every token the text grows by. `prediction`: the session
    whose tokens are the prefix (prediction.Prediction), read for its estimates of a chain it offers."""

    def __init__(
        self,
        tokens: Iterable[int] = (),
        max_ngram: int = 3,
        prefix: Iterable[int] = (),
        cross: Session | Mapping[str, Session] | None = None,
        prediction: Session | None = None,
    ):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.start = 0  # where the text begins in `tokens` (after the prefix)
        self.cross: dict[str, Session] = {}
        # (source, size) -> the chain it offered then: (its next token and context length by its depth and the
        # tokens before it, the source's estimate that each of its tokens is right given the ones before it)
        self._crossed: dict[
            tuple[str, int], tuple[dict[tuple[int, tuple[int, ...]], tuple[int, int]], list[float]]
        ] = {}
        self.extend(prefix)
        self.start = len(self.tokens)
        self.extend(tokens)
        # told of the tokens from here on (each holds the prompt already)
        self.cross = (
            dict(cross) if isinstance(cross, Mapping) else {SUFFIX: cross} if cross is not None else {}
        )
        self.prediction = prediction
        # the prediction's own alignment (up to prediction.MAX_ALIGN tokens) ranks as a cross source's does
        if prediction is not None:
            self.cross = {PREDICTION: prediction, **self.cross}

    def tail(self, n: int, size: int | None = None) -> list[int]:
        """The text's last `n` tokens (fewer where it is shorter: never the prefix's); `size`: of its first
        `size` tokens (the index as it was then)."""
        size = len(self.tokens) if size is None else size
        return self.tokens[max(self.start, size - n) : size]

    def extend(self, new: Iterable[int]) -> None:
        toks, ends = self.tokens, self.ends
        if self.cross:
            new = list(new)
            for session in self.cross.values():
                session.extend(new)
        for t in new:
            toks.append(int(t))
            i = len(toks)
            first = self.start if i > self.start else 0  # an n-gram lies wholly in the prefix or the text
            for n in range(1, min(self.max_ngram, i - first) + 1):
                key = tuple(toks[i - n : i])
                hit = ends.get(key)
                if hit is None:
                    ends[key] = [i - 1]
                else:
                    hit.append(i - 1)

    def candidates(self, tail: Sequence[int], k: int, size: int | None = None) -> tuple[list[int], int]:
        """Up to k distinct next tokens after ``tail`` (the last tokens before the node, most recent last),
        best first, and the length of the longest suffix of ``tail`` that occurred with a continuation.
        `size`: as the index answered when it held its first `size` tokens (what a step's choice read)."""
        found = self.ranked(tail, k, size)
        return found.tokens, found.match

    def ranked(
        self, tail: Sequence[int], k: int, size: int | None = None, depth: int | None = None
    ) -> Candidates:
        """`candidates`, with the source each token came from (drafts.py): the prediction where its most recent
        occurrence under the longest match lies in the prefix, a `cross` source's where that ranks it, else the
        text's own lookup. `depth`: how many of `tail`'s last tokens are drafted ones past the text (a node's
        depth below the step's root), which places a cross source's chain where its tokens repeat (the items of
        a list); None: the earliest place in the chain that `tail` ends."""
        out: list[int] = []
        origins: list[str] = []
        match = 0
        now = size is None or size == len(self.tokens)
        size = len(self.tokens) if size is None else size
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            ends = self.ends.get(tuple(tail[len(tail) - n :]))
            if not ends:
                continue
            if not now:  # the positions it held then: those ending at or before `size - 1`
                ends = ends[: bisect.bisect_right(ends, size - 1)]
            counts: dict[int, int] = {}
            where: dict[int, str] = {}  # token -> the source of its most recent occurrence
            for e in reversed(ends[-MAX_OCCURRENCES:]):  # most recent first: dict order breaks count ties
                if e + 1 < size and e + 1 != self.start:  # the prefix's last token continues nothing
                    t = self.tokens[e + 1]
                    counts[t] = counts.get(t, 0) + 1
                    where.setdefault(t, PREDICTION if e + 1 < self.start else LOOKUP)
            if not counts:
                continue
            match = max(match, n)
            for t in sorted(counts, key=counts.__getitem__, reverse=True):  # stable: recency within a count
                if t not in out:
                    out.append(t)
                    origins.append(where[t])
            if len(out) >= k:
                break
        best, longest = None, match
        for name in self.cross:
            crossed = self._cross_candidate(name, tail, size, depth)
            if crossed is not None and crossed[1] > longest:  # a longer context than the text's own n-grams
                best, longest = (name, crossed[0]), crossed[1]
        if best is not None:
            name, t = best
            rest = [(c, o) for c, o in zip(out, origins, strict=True) if c != t]
            tokens, sources = [t, *(c for c, _ in rest)], [name, *(o for _, o in rest)]
            return Candidates(tokens[:k], min(longest, self.max_ngram), sources[:k])
        return Candidates(out[:k], match, origins[:k])

    def estimates(self, size: int | None = None, source: str = SUFFIX) -> list[float]:
        """A copied `source`'s own estimate, per token of the chain it offers after the text (as it was at
        `size` tokens), that the token is right given the ones before it: a `cross` source's (the suffix
        cache's empirical continuation probabilities, the prediction's copy rate); empty for the text's own
        n-grams, a source the index does not read, or no chain."""
        size = len(self.tokens) if size is None else size
        if source in self.cross:
            return self._cross_chain(source, size)[1]
        return []

    def draft(self, context: Sequence[int], max_tokens: int, size: int | None = None) -> Draft:
        """The chain a run of lookup nodes drafts after `context` (each token the top-ranked continuation of the
        tokens before it, the drafted ones included: draft_lookup), and the match it starts from; the index gives
        no estimate of its own (the hybrid prices the text's chains on its prior by match length and its learned
        rates). `size`: as `ranked`'s."""
        tail, chain, match = list(context[-self.max_ngram :]), [], 0
        while len(chain) < max_tokens:
            found = self.ranked(tail[-self.max_ngram :], 1, size, depth=len(chain))
            if not found.tokens:
                break
            match = match if chain else found.match
            chain.append(found.tokens[0])
            tail.append(found.tokens[0])
        return Draft(tuple(chain), (), match)

    def end(self) -> None:
        """The text's index holds nothing past its generation (the sessions it reads end on their own)."""

    def _cross_candidate(
        self, source: str, tail: Sequence[int], size: int, depth: int | None = None
    ) -> tuple[int, int] | None:
        """(the `cross` source's next token after `tail`, the length of the context it continues), where `tail`
        ends the text as it was at `size` tokens followed by the first `depth` tokens of the chain the source
        offered there (asked once per size; `depth` None: the first stretch of it that `tail` ends): the chain's
        j-th token continues a context of its match + j tokens."""
        chain = self._cross_chain(source, size)[0]
        key = tuple(tail[-self.max_ngram :])
        if depth is not None:
            return chain.get((depth, key))
        return next((found for (_, k), found in chain.items() if k == key), None)

    def _cross_chain(
        self, source: str, size: int
    ) -> tuple[dict[tuple[int, tuple[int, ...]], tuple[int, int]], list[float]]:
        found = self._crossed.get((source, size))
        if found is None:
            text = self.tokens[self.start : size]
            draft = self.cross[source].draft(text, MAX_CROSS_TOKENS)
            chain, seq = {}, text[-self.max_ngram :]
            for j, t in enumerate(draft.tokens):  # (depth, the tokens before it) -> the chain's j-th token
                chain[j, tuple(seq[-self.max_ngram :])] = (t, draft.match + j)
                seq = seq + [t]
            found = self._crossed[source, size] = (chain, conditional(draft.probs))
            for old in [key for key in self._crossed if key[1] < size - 8]:  # the sizes a step may ask about
                del self._crossed[old]
        return found


def conditional(cumulative: Sequence[float]) -> list[float]:
    """Per token, the chance it is right given the ones before it, from the chance the chain is right to it."""
    out, before = [], 1.0
    for p in cumulative:
        out.append(min(1.0, p / before) if before > 0 else 0.0)
        before = p
    return out


def draft_lookup(
    tree: Tree, tokens: list[int | None], index: NgramIndex, origins: list[str | None] | None = None
) -> list[int]:
    """Fill the lookup nodes of ``tokens`` ([N+1], root and head drafts set, lookup nodes None) in place, and of
    ``origins`` ([N+1], when given) with each one's source (drafts.py); return the ids (ascending, root
    excluded) of the nodes that have a token, parents before children."""
    parents, ranks, lookup = tree.parents.tolist(), tree.ranks.tolist(), tree.lookup.tolist()
    widths = _widths(tree)
    n_tail = index.max_ngram
    context = index.tail(n_tail)  # ends with the root: it is emitted and indexed before the step
    branch: list[list[int]] = [[]] + [None] * tree.num_nodes  # type: ignore[list-item]  # tokens below root
    found: dict[int, Candidates] = {}  # parent node -> its ranked lookup candidates
    keep = []
    for i in range(1, tree.size):
        p = parents[i]
        if branch[p] is None:  # parent dropped: so is the node
            continue
        if lookup[i]:
            cands = found.get(p)
            if cands is None:
                tail = (context + branch[p])[-n_tail:]
                cands = found[p] = index.ranked(tail, widths[p], depth=len(branch[p]))
            if ranks[i] >= len(cands.tokens):
                continue
            tokens[i] = cands.tokens[ranks[i]]
            if origins is not None:
                origins[i] = cands.origins[ranks[i]]
        branch[i] = branch[p] + [tokens[i]]  # type: ignore[list-item]
        keep.append(i)
    return keep


def source_depths(tree: Tree, tokens: Sequence[int], new: Sequence[int]) -> dict[str, int]:
    """How far each draft source was right this step: "heads", the depth of the deepest head node whose whole
    branch matches the emitted tokens ``new``; "lookup", the most lookup nodes on such a branch. Both are
    exact counterfactuals for greedy decoding: what a tree of that source alone would have accepted."""
    parents, lookup, depths = tree.parents.tolist(), tree.lookup.tolist(), tree.depths.tolist()
    right = [True] + [False] * tree.num_nodes
    run = [0] * tree.size  # lookup nodes on the branch
    best = {"heads": 0, "lookup": 0}
    for i in range(1, tree.size):
        d = depths[i]
        if not right[parents[i]] or d > len(new) or tokens[i] != new[d - 1]:
            continue
        right[i] = True
        run[i] = run[parents[i]] + lookup[i]
        if lookup[i]:
            best["lookup"] = max(best["lookup"], run[i])
        else:
            best["heads"] = max(best["heads"], d)
    return best


@functools.lru_cache(maxsize=256)
def _widths(tree: Tree) -> dict[int, int]:
    """Per parent node: how many lookup candidates its lookup children need (max rank + 1)."""
    out: dict[int, int] = {}
    for i in range(1, tree.size):
        if tree.lookup[i]:
            p = int(tree.parents[i])
            out[p] = max(out.get(p, 0), int(tree.ranks[i]) + 1)
    return out
