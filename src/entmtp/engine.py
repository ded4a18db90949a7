"""The decode loop: prefill, then per step choose a tree, draft, verify, accept, commit, record.

Everything else plugs into `decode`: heads draft (heads/drafting.py), prompt lookup drafts (lookup.py), trees are
data (tree.py), acceptance rules (accept.py), the KV cache and the verification forward (cache.py), the tree
policy (policy.py; lookup branches: scheduler/hybrid.py). With no heads and no lookup the same loop is plain
decoding: the root-only tree, one token per step. A step's phases are `prepare` (1-2: `choose`, `draft`),
the forward (3) and `conclude` (4-6), after which the policy observes the step, so a continuous batch
(batch.py, which this module never imports) runs each row through the very same code, with one forward for
all its rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .accept import ACCEPTANCE, GenerationOptions, GumbelNoise, Sampling, accept
from .backends import base_for
from .constraints import one_token
from .costs.curves import CostCurve, LatencyModel, relative_cost
from .drafts import COPIED, FORCED, HEADS, SUFFIX, Session, SourceCounts
from .errors import EntMTPError
from .heads import Drafter, LazyProbe, Probe, taken
from .interrupt import Interrupt
from .lookup import Lookup, NgramIndex, TextLookup, draft_lookup, source_depths
from .model import check_request, context_window, encode_prompt, eos_token_ids
from .policy import Choice, TreePolicy, require_policy, static
from .prediction import PREDICTION, Prediction, prediction_ids, prediction_usage, with_prediction
from .records import MAX_TOP_LOGPROBS, Result, Step, StepContext, TokenEvent, TokenLogprob
from .shaping import Shaping, forced_chain
from .shipped import bind_heads
from .suffix import SuffixCache
from .text import Detokenizer, find_end
from .tree import Tree, prune


class GenerationObserver(Protocol):
    """Told each finished generation's steps (a stream's, in order)."""

    def observe(self, steps: list[Step]) -> object: ...


class Engine:
    """Self-speculative decoding with Medusa/Hydra heads over a frozen Hugging Face causal LM.

    `policy` is the `TreePolicy` choosing a tree per step (policy.py): `policy.static("tree_8")` one tree
    every step, a scheduler's policy, `scheduler.hybrid.hybrid(inner, Lookup())` with a prompt-lookup branch
    sized per step. The engine runs exactly the objects it is given and converts nothing: a tree name or a
    `Tree` is refused with the fix (`static(...)`). None is plain decoding, the root alone (one token per
    step, the baseline for speed and equality), with or without heads: given heads draft only for generations
    handed a policy of their own (`new_state(policy=...)`, a batch row's). `hybrid(None, Lookup())` without
    heads is prompt lookup decoding. Every tree a policy may verify is checked against the heads up front
    (`checked`).

    `policies`: other acceptance rules' own policies (`{"sample": ..., "typical": ...}`, a profile's sections:
    build/ fills it), so a server's requests at T=0 and T > 0 each get the policy calibrated for their rule;
    a generation under a rule not in it runs `policy`.

    `kv="auto"` keeps keys and values in a preallocated cache where the model allows it (cache.py);
    `kv="dynamic"` uses transformers' DynamicCache. On CUDA, `graphs=True` replays one captured graph per
    tree size for verification (graphs.py). `costs`: this machine's cost curve (costs/curves.py) that the policy was
    built on. `observers` are told each finished generation's steps (`build.compose` attaches the curve's
    corrector, costs.CostCorrector: measured steps that disagree with the curve correct the cached one for
    later engines). The heads are
    made ready for the model (`shipped.bind_heads`: bound, moved, packed; `build.load` does it before it
    measures the costs). `build.build` assembles all of this from names: `load` then `compose`, which hands
    the engine its policies ready.
    """

    def __init__(
        self,
        model,
        tokenizer,
        heads=None,
        policy: TreePolicy | None = None,
        *,
        policies: Mapping[str, TreePolicy] | None = None,
        kv: str = "auto",
        graphs: bool = True,
        costs: CostCurve | None = None,
        observers: Sequence[GenerationObserver] = (),
        suffix: SuffixCache | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.suffix = (
            suffix  # earlier outputs as drafts (suffix.py): every generation's lookup branch copies them
        )
        self.heads = bind_heads(heads, model) if heads is not None else None  # a no-op for `build`'s heads
        policy = self.checked(policy if policy is not None else static(Tree.root_only()))
        self.policy = policy  # each generation runs its own `policy.fresh()`
        self.policies = {
            r: self.checked(p, f"Engine's policies[{r!r}]") for r, p in _check_rules(policies or {}).items()
        }
        self.costs = costs  # the machine's cost curve the policy was built on (costs/curves.py), if any
        # a step's cost in plain steps by drafted nodes, on that curve (else another machine's): forced chains'
        self.relative_cost = relative_cost(costs.latency() if costs is not None else None)
        self.observers = tuple(observers)  # told every finished generation's steps
        offset = heads.config.hidden_state_offset if heads is not None else 0
        norm = heads.config.hidden_state_norm if offset else True
        full_hidden = (
            heads is not None and getattr(heads.config, "head_arch", None) == "prefix-mlp"
        )  # reads every position
        self.base = base_for(
            model, offset, kv, full_hidden=full_hidden, hidden_state_norm=norm
        )  # transformers or llama.cpp
        self.window = context_window(model)
        every = (policy, *self.policies.values())
        self._predicted: dict[
            int, TreePolicy
        ] = {}  # id(policy) -> it with a prediction's branch (policy_for)
        # room for a prediction's lookup branch beside the largest tree (prediction.PREDICTION)
        self.scratch = max(max(scratch(p) for p in every), max_tree(every) + PREDICTION.tokens)
        self.graphs = None
        if graphs and self.base.preallocate and self.base.device.type == "cuda":
            from .graphs import VerifyGraphs

            self.graphs = VerifyGraphs(self.base)
        self.eos_ids = eos_token_ids(model, tokenizer)

    def checked(self, policy: TreePolicy, where: str = "Engine") -> TreePolicy:
        """`policy` itself, once checked: a policy (not a tree name or a `Tree`) whose every tree these heads
        can draft (else an error with the fix, `where` naming the argument)."""
        require_policy(policy, where)
        heads = self.heads
        for t in _trees(policy):
            if heads is None and t.heads_tree.num_nodes:
                raise EntMTPError(
                    f"tree {t.name!r} has head nodes but no heads were given: pass heads, or use a tree of "
                    'lookup nodes only (like [["L0"], ["L0", "L0"]]) or scheduler.hybrid.hybrid(None, Lookup()) '
                    "for prompt lookup"
                )
            if heads is not None:
                t.check_fits(heads.config.num_heads, require_contiguous=heads.config.kind == "hydra")
        return policy

    def policy_for(self, sampling: Sampling, predicted: bool = False) -> TreePolicy:
        """The policy a generation under `sampling` runs: its acceptance rule's own, else the engine's; with
        `predicted` (the request gave a prediction, or the engine drafts from its suffix cache) that policy with
        the prediction's lookup branch, except under a rule that ignores predictions (prediction.py)."""
        policy = self.policies.get(sampling.rule, self.policy)
        if not predicted or not sampling.rule.lossless:  # a rule that is not would copy the prediction
            return policy
        wrapped = self._predicted.get(id(policy))
        if wrapped is None:
            wrapped = self._predicted[id(policy)] = with_prediction(policy, self.costs)
        return wrapped

    # -- public API --------------------------------------------------------------------------------------

    def generate(self, prompt, options: GenerationOptions | None = None, **kwargs) -> Result:
        """Generate a completion. `prompt`: a string (chat-templated as one user turn when the tokenizer has
        a template and chat=True), a list of chat messages, or a list of token ids; the rest: `stream`'s."""
        events = list(self.stream(prompt, options, incremental_text=False, **kwargs))
        return events[-1].result

    def stream(
        self,
        prompt,
        options: GenerationOptions | None = None,
        *,
        chat: bool = True,
        incremental_text: bool = True,
        **fields,
    ) -> Iterator[TokenEvent]:
        """Yield a `TokenEvent` per step; the last one carries `finish_reason` and `result`. `options` and/or
        its fields as keywords (`GenerationOptions`: max_new_tokens, temperature, acceptance, seed, stop,
        logprobs). `logprobs=k`: every event carries each new token's base log-probability and the k most
        likely tokens there. `incremental_text` False: without stop strings, events carry no text but the
        last, which carries all of it (`Detokenizer`: for callers that read only the result)."""
        options = GenerationOptions.of(options, **fields)
        ids = self.encode(prompt, options.max_new_tokens, chat=chat, logprobs=options.logprobs)
        t0 = time.perf_counter()
        with _open_cache(self, len(ids) + options.max_new_tokens) as (cache, graphs):
            state = self.new_state(ids, cache, graphs, options, incremental_text=incremental_text)
            events = decode(self, state)
            event = next(events)  # the prefill's token
            prefill_seconds = time.perf_counter() - t0
            steps: list[Step] = []
            while event.finish_reason is None:
                yield event
                event = next(events)
                steps.append(event.step)
        result = state.result(steps, time.perf_counter() - t0, prefill_seconds, event.finish_reason)
        for observer in self.observers:
            observer.observe(steps)
        yield dataclasses.replace(event, result=result)

    def encode(
        self, prompt, max_new_tokens: int, *, chat: bool = True, logprobs: int | None = None
    ) -> list[int]:
        """The prompt's token ids, checked against the context window (and `logprobs` against its range)."""
        ids = list(prompt) if _is_ids(prompt) else encode_prompt(self.tokenizer, prompt, chat=chat)
        check_request(len(ids), max_new_tokens, self.window)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise EntMTPError(
                f"logprobs must be 0..{MAX_TOP_LOGPROBS} (top tokens per position), got {logprobs}"
            )
        return ids

    def new_state(
        self,
        ids: list[int],
        cache,
        graphs=None,
        options: GenerationOptions | None = None,
        *,
        policy: TreePolicy | None = None,
        incremental_text: bool = True,
        **fields,
    ) -> DecodeState:
        """A generation's fresh state over `cache` (room for the prompt `ids`, the output and `scratch(policy)`),
        under `options` and/or its fields as keywords (`stream`'s). `policy`: this generation's own
        (`checked` already; a batch's rows may differ), else `policy_for` its sampling; `incremental_text`:
        `stream`'s."""
        options = GenerationOptions.of(options, **fields)
        sampling, seed, temperature = options.sampling, options.seed, options.temperature
        predicted = prediction_ids(self.tokenizer, options.prediction, self.window, self.base.vocab_size)
        drafted = predicted if sampling.rule.lossless else []  # what the lookup index copies from
        crossed = self.suffix is not None and sampling.rule.lossless  # earlier outputs as drafts
        policy = self.policy_for(sampling, bool(predicted) or crossed) if policy is None else policy
        lookup = policy.lookup
        uses_lookup = lookup is not None or any(t.num_lookup for t in _trees(policy))
        # the copied sources' sessions the text's index reads (drafts.py)
        foreseen = Prediction(drafted).begin(ids) if uses_lookup and drafted else None
        cross = self.suffix.begin(ids) if uses_lookup and crossed else None
        max_ngram = lookup.max_ngram if lookup is not None else Lookup.max_ngram
        text = TextLookup(max_ngram, foreseen, {SUFFIX: cross} if cross is not None else None)
        drafts = any(t.heads_tree.num_nodes for t in _trees(policy))  # plain or lookup-only: no heads' state
        noise = None
        if sampling.rule.needs_noise:  # without a seed, one from the global RNG (a seeded torch repeats it)
            seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
            noise = GumbelNoise(seed, self.base.vocab_size, self.base.device)
        shaping = Shaping.of(
            options.response_format, options.penalties_for(self.base.vocab_size), tokenizer=self.tokenizer,
            vocab_size=self.base.vocab_size, eos_ids=self.eos_ids, prompt=ids,
        )  # fmt: skip
        return DecodeState(
            prompt=ids,
            max_new_tokens=options.max_new_tokens,
            sampling=sampling,
            generator=torch.Generator().manual_seed(seed) if seed is not None else None,
            cache=cache,
            graphs=graphs,
            policy=policy.fresh(),
            drafter=self.heads.drafter(noise, temperature) if self.heads is not None and drafts else None,
            index=text.begin(ids) if uses_lookup else None,
            sessions=tuple(s for s in (foreseen, cross) if s is not None),
            text=Detokenizer(self.tokenizer, options.stop or [], incremental_text),
            logprobs=options.logprobs,
            noise=noise,
            prediction=predicted if options.prediction is not None else None,
            shaping=shaping,
        )


def _check_rules(policies: Mapping) -> Mapping:
    unknown = sorted(set(policies) - set(ACCEPTANCE))
    if unknown:
        raise EntMTPError(
            f"policies are keyed by acceptance rule ({', '.join(ACCEPTANCE)}), got {', '.join(map(repr, unknown))}"
        )
    return policies


def _trees(policy: TreePolicy) -> list[Tree]:
    """Every tree `policy` may verify, its master included."""
    return [*policy.trees, *([policy.master] if policy.master is not None else [])]


def max_tree(policies) -> int:
    """The most tokens one tree of any of `policies` verifies."""
    return max(t.size for p in policies for t in _trees(p))


def scratch(policy: TreePolicy) -> int:
    """Slots a step of `policy` may need past the committed tokens: its largest tree, with a lookup chain."""
    lookup = policy.lookup
    return max(t.size for t in _trees(policy)) + (lookup.tokens if lookup is not None else 0)


@contextlib.contextmanager
def _open_cache(engine: Engine, tokens: int):
    """The generation's KV cache (room for its tokens and the largest tree's scratch) and, on CUDA, the
    verification graphs that write into it: one generation at a time replays them, others run eagerly."""
    need, graphs = min(engine.window, tokens + engine.scratch), engine.graphs
    if graphs is None or graphs.in_use:
        cache = engine.base.new_cache(need)
        try:
            yield cache, None
        finally:
            cache.release()  # llama.cpp: the sequence id and its KV cells go back at once
        return
    graphs.in_use = True
    try:
        yield graphs.cache_for(need, engine.window), graphs
    finally:
        graphs.in_use = False


@dataclass
class DecodeState:
    """One generation's state: everything `decode` reads or changes besides the engine's weights and settings,
    so generations on one engine share nothing mutable."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    generator: torch.Generator | None  # None: the global RNG
    cache: object  # the KV cache (cache.py), room for the prompt, the output and the largest tree's scratch
    graphs: object | None  # the verification graphs writing into `cache` (graphs.py, CUDA), if any
    policy: TreePolicy  # the engine's policy, fresh for this generation (its own trackers)
    drafter: Drafter | None  # the heads' drafting state (None: no heads)
    index: NgramIndex | None  # n-grams of prompt + output (None: no lookup drafts)
    text: Detokenizer  # the output's text so far, and the stop strings
    logprobs: int | None = None  # top tokens per emitted token's log-probability record (None: none)
    noise: GumbelNoise | None = None  # the gumbel rule's noise per position, shared with `drafter`
    out: list[int] = field(default_factory=list)  # emitted tokens
    all_logprobs: list[TokenLogprob] = field(default_factory=list)
    root: int = -1  # the base model's next token (the next tree's root), once the prefill ran
    root_logits: torch.Tensor | None = None  # [V] the distribution `root` was drawn from
    steps: int = 0  # steps verified so far
    prediction: list[int] | None = None  # the request's predicted output's ids (None: none given)
    shaping: Shaping | None = None  # its grammar and sampling controls (shaping.py; None: the model's own)
    sessions: tuple[Session, ...] = ()  # the draft sources' sessions `index` reads, closed with the result

    @property
    def reads_hidden(self) -> bool:
        """Whether this generation's forwards must return the base model's hidden states: only for heads that
        draft from them (a drafter can say it reads none: the probe's random drafts). Without, a backend that
        can skip them (llama.cpp) computes and copies none."""
        return self.drafter is not None and getattr(self.drafter, "reads_hidden", True)

    def result(self, steps: list[Step], seconds: float, prefill_seconds: float, reason: str) -> Result:
        for session in self.sessions:  # the suffix cache keeps the output for later requests
            session.end()
        return Result(
            self.text.final_text(),
            self.out,
            len(self.prompt),
            steps,
            seconds,
            prefill_seconds,
            reason,
            self.all_logprobs if self.logprobs is not None else None,
            self.sampling.rule,
            prediction_usage(self.prediction, self.out) if self.prediction is not None else None,
        )


@torch.inference_mode()
def decode(engine: Engine, state: DecodeState) -> Iterator[TokenEvent]:
    """Yield the prefill's token, then one event per speculative step; the last has a `finish_reason`."""
    event = prefill(engine, state)
    yield event
    while event.finish_reason is None:
        step = prepare(engine, state)  # (1) choose a tree, (2) draft it
        # (3) verify every node in ONE forward: tree mask over the cache, positions = pos + depth (on CUDA
        #     the replay of the graph captured for this tree size; batch.py verifies many rows at once)
        fwd = state.graphs.forward(step.tokens, step.tree) if state.graphs is not None else None
        if fwd is None:
            outputs = step.outputs(state.logprobs is not None)
            fwd = engine.base.forward(
                step.tokens, step.tree, state.cache, hidden=state.reads_hidden, outputs=outputs
            )
        step.times["verify"] = step.clock.lap()
        event = conclude(engine, state, step, fwd)  # (4) accept, (5) commit, (6) finish the step
        if step.chosen:  # ... and the policy observes the step it chose (not a grammar's forced chain)
            state.policy.observe(event.step)
        yield event


PREFILL_CHUNK = 256  # prompt tokens per prefill forward: a batch (batch.py) steps its other rows between two
# chunks, so a long prompt stalls them one chunk at a time (~0.5 s on 2 CPU cores for a 135M model), not for
# its whole prefill; `Engine.stream` prefills in the same chunks, so a row computes the same numbers alone


def prefill(engine: Engine, state: DecodeState) -> TokenEvent:
    """The prompt into the cache, the heads and the lookup index, chunk by chunk; the event of the first token."""
    while (event := prefill_chunk(engine, state)) is None:
        pass
    return event


def prefill_chunk(
    engine: Engine, state: DecodeState, interrupt: Interrupt | None = None
) -> TokenEvent | None:
    """The next `PREFILL_CHUNK` prompt tokens into the cache and the heads; after the prompt's last chunk, the
    first token drawn: its event (None before). `interrupt` raised: `Preempted` part way, nothing changed (the
    chunk's boundaries do not move: it runs again whole)."""
    base, cache = engine.base, state.cache
    start = cache.length
    end = min(len(state.prompt), start + PREFILL_CHUNK)
    chunk = torch.tensor(state.prompt[start:end], device=base.device)  # [end - start]
    fwd = base.forward(
        chunk, None, cache, logits_to_keep=1, hidden=state.reads_hidden, interrupt=interrupt
    )  # logits [1, V]
    base.commit(cache, list(range(end - start)))
    if state.reads_hidden:
        state.drafter.extend(fwd.hidden)  # [end - start, H]
    if end < len(state.prompt):
        return None
    # the first token: the acceptance rule on the root-only tree draws it from the last prompt position
    noise = state.noise.at([len(state.prompt)]) if state.noise is not None else None  # the first token's
    logits = fwd.logits[-1:]  # [1, V]
    if state.shaping is not None:  # the grammar's and the controls' distribution (shaping.py)
        logits = state.shaping.logits(logits, Tree.root_only(), chunk[-1:], state.shaping.root_masks())
    root = accept(Tree.root_only(), chunk[-1:], logits, state.sampling, state.generator, noise).bonus
    state.root, state.root_logits = root, logits[-1].clone()  # [V] the root's distribution (a signal)
    return _emit(engine, state, None, [root], fwd.logits[-1:])


@dataclass
class Pending:
    """A step chosen and drafted, waiting for its verification forward."""

    tree: Tree
    tokens: torch.Tensor  # [N+1] root first
    signals: dict[str, float]
    times: dict[str, float]
    clock: Clock
    masks: np.ndarray | None = None  # [N+1, V/32] each node's allowed tokens under a grammar (shaping.py)
    forced: bool = False  # the tree is the grammar's forced chain (`forced_step`), not the policy's choice
    origins: tuple[str, ...] = ()  # [N] each drafted node's source (drafts.py)

    @property
    def chosen(self) -> bool:
        """Whether the policy chose this step's tree (and so observes the step)."""
        return not self.forced

    def outputs(self, logprobs: bool) -> list[bool] | None:
        """The nodes whose logits verification reads (None: every node's): under a grammar, not those whose mask
        allows one token (the next token there is that one under every acceptance rule, whatever the logits),
        unless log-probabilities are asked for (they are the model's own, read off every emitted token's row)."""
        if self.masks is None or logprobs:
            return None
        read = ~one_token(self.masks)
        return None if read.all() else read.tolist()


def prepare(engine: Engine, state: DecodeState) -> Pending:
    """Phases (1) and (2) of a step: the grammar's forced chain where it pays, else the policy's tree."""
    clock, times = Clock(engine.base.device), {}
    if (forced := forced_step(engine, state, clock, times)) is not None:
        return forced
    choice, probe = choose(engine, state, clock, times)
    return draft(engine, state, choice, probe, clock, times)


def forced_step(engine: Engine, state: DecodeState, clock: Clock, times: dict[str, float]) -> Pending | None:
    """Phases (1) and (2) when a grammar forces the next tokens (a JSON key, a closing brace): a chain of them,
    as long as pays best on this machine's cost curve (shaping.Shaping.forced), drafted with no head and no
    choice of the policy (which neither chooses nor observes the step). None: nothing forced, or no chain
    beats a plain step."""
    if state.shaping is None or state.shaping.matcher is None:
        return None
    room = (
        min(engine.window, state.cache.capacity, state.cache.length + engine.scratch) - state.cache.length - 1
    )
    remaining = state.max_new_tokens - len(state.out)
    forced = state.shaping.forced(engine.relative_cost, min(room, remaining))
    times["probe"] = times["choose"] = 0.0
    if not forced:
        return None
    tree = forced_chain(len(forced))
    tokens = torch.tensor([state.root, *forced], device=engine.base.device)  # [k+1]
    tree, tokens, masks, origins = state.shaping.draft(tree, tokens, (FORCED,) * len(forced))
    times["choose"] = clock.lap()
    times["draft"] = 0.0
    signals = {"forced": float(len(forced))}
    return Pending(tree, tokens, signals, times, clock, masks, forced=True, origins=origins)


def choose(
    engine: Engine,
    state: DecodeState,
    clock: Clock,
    times: dict[str, float],
    *,
    probe: Probe | None = None,
    latency: LatencyModel | None = None,
) -> tuple[Choice, Probe | None]:
    """Phase (1): the policy's choice and the heads' probe it read (None: it read none), its seconds in `times`.
    `probe`: the probe of the policy's master computed already (a batch probes its rows together); `latency`:
    ms of this step by drafted nodes, when not the policy's own curve (a batched step's, costs/curves.py)."""
    # the policy reads the base distribution at the root and, when it has a master tree, the heads' probe of
    # it (what all its subtrees draft first; computed when first read, so a choice made without the heads
    # costs none of their work)
    drafter, device = state.drafter, engine.base.device
    master = state.policy.master if drafter is not None else None
    offered = (
        probe
        if probe is not None or master is None
        else LazyProbe(lambda: drafter.probe(master, torch.tensor([state.root], device=device)))
    )
    times["probe"] = clock.lap()
    remaining = state.max_new_tokens - len(state.out)
    ctx = StepContext(
        state.steps, state.cache.length, remaining, state.root_logits, offered, lookup=state.index,
        latency=latency,
    )  # fmt: skip
    choice = state.policy.choose(ctx)
    times["choose"] = clock.lap()
    if isinstance(offered, LazyProbe):  # the probe's time is its own phase, wherever the policy read it
        times["probe"] += offered.seconds
        times["choose"] -= offered.seconds
    return choice, taken(offered)


def draft(
    engine: Engine, state: DecodeState, choice: Choice, probe, clock: Clock, times: dict[str, float]
) -> Pending:
    """Phase (2): the chosen tree (the root alone where it would run past the context window or the cache)
    drafted: one token per tree node from the heads (the probed ones are reused) and the lookup index; lookup
    nodes the context has no continuation for are dropped from the tree. Its seconds add to `times`."""
    limit = min(engine.window, state.cache.capacity)
    tree = choice.tree if state.cache.length + choice.tree.size <= limit else Tree.root_only()
    root_t = torch.tensor([state.root], device=engine.base.device)
    tree, tokens, origins = draft_tree(state.drafter, tree, root_t, probe, state.index)  # tokens [N+1]
    masks = None
    if state.shaping is not None:  # drafts the grammar forbids pruned; each node's mask (shaping.py)
        tree, tokens, masks, origins = state.shaping.draft(tree, tokens, origins)
    times["draft"] = times.get("draft", 0.0) + clock.lap()
    return Pending(tree, tokens, choice.signals, times, clock, masks, origins=origins)


def conclude(engine: Engine, state: DecodeState, step: Pending, fwd) -> TokenEvent:
    """Phases (4) to (6) of a step verified by `fwd` (its logits and hidden states [N+1, .]); the caller has
    the policy observe the step (`decode`; a batch's plain steps are the policy's to neither ask nor tell)."""
    tree, tokens, times, clock = step.tree, step.tokens, step.times, step.clock
    # (4) accept: the longest path the base model agrees with, plus its bonus token
    noise = None
    if state.noise is not None:  # a depth-d node's next token sits at the root's position + d + 1
        start = state.cache.length + 1
        noise = state.noise.at(range(start, start + tree.depth + 1))
    logits = fwd.logits  # [N+1, V]
    if state.shaping is not None:  # the grammar's and the controls' distribution at each node (shaping.py)
        logits = state.shaping.logits(logits, tree, tokens, step.masks)
    acc = accept(tree, tokens, logits, state.sampling, state.generator, noise)
    times["accept"] = clock.lap()
    # (5) commit: keep the accepted path in the KV cache and feed its hidden states to the heads
    engine.base.commit(state.cache, acc.path)
    if state.reads_hidden:
        state.drafter.extend(fwd.hidden[torch.tensor(acc.path, device=tokens.device)])  # [a, H]
    drafted = tokens.tolist() if len(acc.path) > 1 else []  # a plain step's path is the root alone
    new = [drafted[i] for i in acc.path[1:]] + [acc.bonus]
    times["commit"] = clock.lap()
    # (6) finish the step (cut at max tokens, EOS or a stop string)
    root_logits = logits[acc.path[-1]]  # [V]
    # a graph's output is reused by its next replay: keep a copy (an eager forward's logits are the step's own,
    # and a clone of 49k floats is one of the costliest things in a llama.cpp plain step, ~0.1 ms or more)
    state.root, state.root_logits = (
        acc.bonus,
        root_logits.clone() if state.graphs is not None and logits is fwd.logits else root_logits,
    )
    times["total"] = clock.total()
    rows = fwd.logits[acc.path] if state.logprobs is not None else None  # [len(new), V] when asked for
    verified = (tree, tokens, acc, times, step.signals, step.forced, step.origins)
    event = _emit(engine, state, verified, new, rows)
    state.steps += 1
    return event


def _emit(
    engine: Engine, state: DecodeState, verified, new: list[int], logits: torch.Tensor | None
) -> TokenEvent:
    """The event of `new` tokens (predicted by `logits` [len(new), V], given when log-probabilities are asked
    for) cut where the generation ends, with its text, log-probabilities and (`verified`: the step's tree,
    tokens, acceptance, times, signals, forced, origins) its Step."""
    new = new[: state.max_new_tokens - len(state.out)]
    if state.shaping is not None:  # up to the token that completes the grammar (shaping.py)
        new = new[: state.shaping.consume(new, engine.eos_ids)]
    cut, reason = find_end(new, engine.eos_ids, state.text)
    new = new[:cut]
    if reason is None and state.shaping is not None and state.shaping.stopped:
        reason = "stop"  # the grammar is complete: only the end of the sequence could follow
    if reason is None and len(state.out) + cut == state.max_new_tokens:
        reason = "length"
    logprobs = None
    if state.logprobs is not None:
        logprobs = token_logprobs(logits[:cut], new, state.logprobs)
    if reason == "stop":  # of this step's tokens, those that write text before the stop string
        # (earlier steps' tokens were streamed already: they stay, so a stream's tokens add up to the result's)
        keep = max(0, state.text.tokens_before_stop(state.out + new) - len(state.out))
        new = new[:keep]
        logprobs = logprobs[:keep] if logprobs is not None else None
    state.out += new
    if state.index is not None:  # the emitted tokens: what the drafts copy from (and the suffix cache keeps)
        state.index.extend(new)
    if logprobs is not None:
        state.all_logprobs += logprobs
    step = None if verified is None else step_record(*verified, new)
    text = state.text.push(new, final=reason is not None)
    return TokenEvent(new, text, step, finish_reason=reason, logprobs=logprobs)


def step_record(
    tree: Tree,
    tokens: torch.Tensor,
    acc,
    times: dict[str, float],
    signals,
    forced: bool,
    origins: Sequence[str],
    emitted: list[int],
) -> Step:
    """The record of a verified step whose emitted tokens (after the cut) are `emitted`; `forced`: its tree was
    a grammar's forced chain; `origins`: each drafted node's source (drafts.py)."""
    kept = acc.path[1 : 1 + len(emitted)]  # accepted drafts that were emitted
    drafts = SourceCounts.of(origins, kept)
    if forced:
        return Step(
            tree.name,
            tree.num_nodes,
            len(kept),
            len(emitted),
            emitted,
            times,
            dict(signals),
            forced=len(kept),
            drafts=drafts,
        )
    lookup_path = [origins[i - 1] in COPIED for i in kept] if tree.num_lookup else []  # copied, from a source
    return Step(
        tree=tree.name,
        tree_nodes=tree.num_nodes,
        accepted=len(kept),
        tokens=len(emitted),
        token_ids=emitted,
        seconds=times,
        signals=dict(signals),
        lookup_nodes=tree.num_lookup,
        lookup_accepted=sum(lookup_path),
        sources=source_depths(tree, tokens.tolist(), emitted) if tree.num_lookup else {},
        lookup_path=lookup_path,
        drafts=drafts,
    )


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row of `logits` [n, V] (float32 log-softmax), with the k most
    likely tokens of that row."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, device=lp.device)].tolist()
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), top_lp.tolist(), strict=True)]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops, strict=True)]


def draft_tree(
    drafter: Drafter | None, tree: Tree, root_t: torch.Tensor, probe, index: NgramIndex | None
) -> tuple[Tree, torch.Tensor, tuple[str, ...]]:
    """The step's tree (lookup nodes without a proposal dropped), its tokens [N+1], root first, and each drafted
    node's source [N] (drafts.py)."""
    if tree.num_lookup == 0:
        tokens = torch.cat([root_t, drafter.draft(tree, root_t, probe).tokens]) if tree.num_nodes else root_t
        return tree, tokens, (HEADS,) * tree.num_nodes
    toks: list[int | None] = [int(root_t)] + [None] * tree.num_nodes
    origins: list[str | None] = [None] * tree.size
    if tree.heads_tree.num_nodes:
        drafted = drafter.draft(tree.heads_tree, root_t, probe).tokens.tolist()
        for node, t in zip(tree.head_nodes[1:].tolist(), drafted, strict=True):
            toks[node], origins[node] = t, HEADS
    keep = draft_lookup(tree, toks, index, origins)
    tokens = torch.tensor([toks[0], *(toks[i] for i in keep)], device=root_t.device)
    return prune(tree, tuple(keep)), tokens, tuple(origins[i] for i in keep)


class Clock:
    """Phase timer: lap() = seconds since the previous lap, total() = since start. Synchronises CUDA first so
    each phase is charged its own kernels (on the CPU there is nothing to wait for)."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.start = self.last = time.perf_counter()

    def _now(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        elapsed, self.last = now - self.last, now
        return elapsed

    def total(self) -> float:
        return self._now() - self.start


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list | tuple) and len(prompt) > 0 and all(isinstance(t, int) for t in prompt)
