"""Suffix drafts across requests: what the engine has written before, as drafts (SuffixDecoding).

Agents, extraction jobs and retries repeat long spans across requests: the same JSON keys, the same tool
call, the same refusal. A `SuffixCache` keeps a suffix tree of the outputs of earlier generations (and of each
live generation's prompt and output so far) and, at a step, offers the continuation of the longest suffix of
the text that occurred there, with its empirical probability per token (Snowflake's arctic-inference
`suffix_decoding`, the C++ tree vLLM runs as `method: suffix`; chosen over a tree of our own because it is
the one serving engines use, builds on a CPU, and answers a query in microseconds: docs/results/suffix-drafts).

The drafts enter the step like prompt lookup's: a generation's `lookup.NgramIndex` asks its `cross` source
for a node's candidates where its own n-grams have none, so the lookup branch of the hybrid policy copies from
earlier requests where the text itself has no match, sized per step on the machine's curve
(scheduler/hybrid.py): at the cache's own rates, learned apart from the text's, each step starting from the
cache's empirical probability of each token of its chain, so a chain runs as far as earlier outputs agree (a
JSON key every earlier output wrote) and stops where they part (the value after it). They are verified like
any draft: the output is the output without the cache, token for token in greedy decoding, in distribution when
sampling losslessly. Typical acceptance ignores them, as it ignores predictions (it would copy).

The cache is bounded: after each generation the oldest outputs are evicted until the tree's estimated memory is
under `max_bytes`. One cache per engine (a server's: every request it serves; a router's two lanes share one,
routing.py); `SuffixCaches` keeps one per key, for a server that separates its callers.

A cache also remembers which prompt each output it holds answered (`answered`): a retry of a prompt it has seen
promises, before it runs, about as many tokens from the cache as the earlier answer had, which is what a router
prices it by (routing.Promise).
"""

from __future__ import annotations

import array
import hashlib
import itertools
import threading
import weakref
from collections.abc import Hashable, Sequence

from .drafts import SUFFIX, Draft
from .errors import EntMTPError

MAX_DEPTH = 64  # longest suffix matched and longest continuation kept (arctic's max_tree_depth)
SPEC_FACTOR = 2.0  # a draft is at most SPEC_FACTOR x the matched length (arctic's max_spec_factor)
MIN_PROB = 0.1  # a drafted token's least empirical probability (arctic's min_token_prob)
MAX_BYTES = 64 * 2**20  # the default memory cap of one cache
HINT = "pip install arctic-inference (builds from source on a CPU, ~3 minutes; `make setup` installs it)"


class SuffixError(EntMTPError):
    """Suffix drafts were asked for and cannot be given: the message names the fix."""


def arctic():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise SuffixError(f"suffix drafts need arctic-inference: {HINT}") from e
    return SuffixDecodingCache


def available() -> bool:
    try:
        arctic()
    except SuffixError:
        return False
    return True


class SuffixCache:
    """Earlier outputs as a suffix tree, bounded by `max_bytes` (FIFO eviction of whole outputs); a draft source
    (drafts.DraftSource) whose sessions draft each token at its empirical continuation probability."""

    name = SUFFIX

    def __init__(self, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
        if max_bytes < 1 or max_depth < 1:
            raise SuffixError(
                f"a suffix cache needs max_bytes >= 1 and max_depth >= 1, got {max_bytes}, {max_depth}"
            )
        self.max_bytes, self.max_depth = max_bytes, max_depth
        self._cache = arctic()(max_tree_depth=max_depth, max_cached_requests=-1)
        self._ids = itertools.count()
        # request -> (its prompt's digest, tokens written); a prompt's digest -> the latest cached request
        # answering it
        self._prompts: dict[Hashable, tuple[bytes, int]] = {}
        self._answers: dict[bytes, Hashable] = {}
        self._lock = (
            threading.Lock()
        )  # a server's generations begin and end on its loop, drafts on its stepper

    def begin(self, prompt: Sequence[int]) -> Session:
        """A generation's session: its prompt joins its own tree, its output the shared one as it is written."""
        req = next(self._ids)
        prompt = [int(t) for t in prompt]
        with self._lock:
            self._cache.start_request(req, prompt)
            self._prompts[req] = (_digest(prompt), 0)
        session = Session(self, req)
        session._finalizer = weakref.finalize(session, self._end, req)  # an abandoned generation ends too
        return session

    def memory(self) -> int:
        """Bytes the shared tree holds, as arctic estimates them."""
        with self._lock:
            return int(self._cache._global_tree.estimate_memory())

    def cached(self) -> int:
        """Earlier (and live) outputs the shared tree holds."""
        return len(self._cache.cached_requests)

    def answered(self, prompt: Sequence[int]) -> int:
        """How many tokens the latest output the cache still holds for this very prompt has (0: none)."""
        with self._lock:
            req = self._answers.get(_digest(prompt))
            return self._prompts[req][1] if req is not None else 0

    def _end(self, req: Hashable) -> None:
        with self._lock:
            if req in self._cache.active_requests:
                self._cache.stop_request(req)
                prompt, written = self._prompts[req]
                if written:
                    self._answers[prompt] = req
                else:  # nothing cached: nothing to answer with, nothing to evict
                    del self._prompts[req]
            self._evict()

    def _evict(self) -> None:
        """Oldest outputs out until the shared tree is under the cap (a live one stays)."""
        tree, cache = self._cache._global_tree, self._cache
        while tree.estimate_memory() > self.max_bytes:
            done = next((r for r in cache.cached_requests if r not in cache.active_requests), None)
            if done is None:
                return
            cache.evict_cached_response(done)
            prompt, _ = self._prompts.pop(done, (b"", 0))
            if self._answers.get(prompt) == done:
                del self._answers[prompt]


def _digest(prompt: Sequence[int]) -> bytes:
    """A prompt's 16-byte digest (what the cache keeps of it)."""
    return hashlib.blake2b(array.array("q", [int(t) for t in prompt]).tobytes(), digest_size=16).digest()


class Session:
    """One generation's view of a `SuffixCache` (a drafts.Session): `extend` with emitted tokens, `draft` a
    continuation."""

    def __init__(self, owner: SuffixCache, req: Hashable):
        self.owner, self.req = owner, req
        self._finalizer: weakref.finalize | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            owner = self.owner
            with owner._lock:
                if self.req in owner._cache.active_requests:
                    owner._cache.add_active_response(self.req, [int(t) for t in tokens])
                    prompt, written = owner._prompts[self.req]
                    owner._prompts[self.req] = (prompt, written + len(tokens))

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        """The continuation of the longest suffix of `context` found in the prompt or in earlier outputs."""
        owner = self.owner
        with owner._lock:
            if self.req not in owner._cache.active_requests:
                return Draft((), (), 0)
            d = owner._cache.speculate(
                self.req, [int(t) for t in context[-owner.max_depth :]], max_spec_tokens=max_tokens,
                max_spec_factor=SPEC_FACTOR, min_token_prob=MIN_PROB,
            )  # fmt: skip
        return Draft(tuple(d.token_ids), tuple(d.probs), int(d.match_len))

    def end(self) -> None:
        """The generation is over: its output stays for later requests (until evicted), its prompt goes."""
        if self._finalizer is not None:
            self._finalizer()


class SuffixCaches:
    """One `SuffixCache` per key (a server's callers, where it separates them: None = everyone)."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self._caches: dict[Hashable, SuffixCache] = {}

    def for_key(self, key: Hashable = None) -> SuffixCache:
        if key not in self._caches:
            self._caches[key] = SuffixCache(self.max_bytes)
        return self._caches[key]
