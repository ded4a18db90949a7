"""The decode loop: prefill, then per step choose a tree, draft, verify, accept, commit, record.

Everything else plugs into `decode`: heads draft (heads.py), prompt lookup drafts (lookup.py), trees are
data (tree.py), acceptance rules (accept.py), the KV cache and the verification forward (cache.py), the tree
policy (policy.py; lookup branches: scheduler/hybrid.py). With no heads and no lookup the same loop is plain
decoding: the root-only tree, one token per step.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import torch

from .accept import Sampling, accept
from .cache import BaseModel
from .costs import CostCorrector, CostCurve
from .errors import EntMTPError
from .lookup import Lookup, NgramIndex, draft_lookup, source_depths
from .model import check_request, context_window, encode_prompt, eos_token_ids
from .packing import PackedLinear, pack_linears
from .policy import StaticPolicy, TreePolicy
from .records import Result, Step, StepContext, TokenEvent
from .text import Detokenizer, find_end
from .tree import Tree, load_tree, prune


class Engine:
    """Self-speculative decoding with Medusa/Hydra heads over a frozen Hugging Face causal LM.

    `tree` is a tree name, a `Tree` (hybrid trees with lookup nodes too), or a `TreePolicy` choosing a tree
    per step. `lookup` (a `Lookup`, or True for the defaults) adds a prompt-lookup branch to every step's tree,
    its length chosen per step (scheduler.hybrid). `heads=None` and no lookup is plain decoding (one token per
    step), the baseline for speed and equality; `heads=None` with `lookup` is prompt lookup decoding.

    `kv="auto"` keeps keys and values in a preallocated cache where the model allows it (cache.py);
    `kv="dynamic"` uses transformers' DynamicCache. On CUDA, `graphs=True` replays one captured graph per
    tree size for verification (graphs.py). `costs`: this machine's cost curve (costs.py) that the policy was
    built on; the lookup branch is sized on it, and measured steps that disagree with it correct the cached
    curve for later engines. `build_engine` (build.py) assembles all of this from names.
    """

    def __init__(
        self,
        model,
        tokenizer,
        heads=None,
        tree: str | Tree | TreePolicy | None = None,
        lookup: Lookup | bool | None = None,
        *,
        kv: str = "auto",
        graphs: bool = True,
        costs: CostCurve | None = None,
    ):
        self.model, self.tokenizer, self.heads = model, tokenizer, heads
        self.lookup = Lookup() if lookup is True else (lookup or None)
        if tree is None:  # the default: tree_8 with heads, else the root alone
            tree = "tree_8" if heads is not None else Tree.root_only()
        if isinstance(tree, str):
            tree = load_tree(tree)
        policy: TreePolicy = StaticPolicy(tree) if isinstance(tree, Tree) else tree
        master = policy.master
        trees = [*policy.trees, *([master] if master is not None else [])]
        if heads is None:
            if (t := next((t for t in trees if t.heads_tree.num_nodes), None)) is not None:
                raise EntMTPError(
                    f"tree {t.name!r} has head nodes but no heads were given: pass heads, or use a tree of "
                    'lookup nodes only (like [["L0"], ["L0", "L0"]]) or lookup=True for prompt lookup'
                )
        else:
            heads.bind(model)
            heads.to(device=model.device, dtype=model.dtype)
            if any(isinstance(m, PackedLinear) for m in model.modules()):
                pack_linears(heads)  # the heads follow the model (packing.py): same drafts, faster
            for t in trees:
                t.check_fits(heads.config.num_heads, require_contiguous=heads.config.kind == "hydra")
        if self.lookup is not None:
            from .scheduler.hybrid import HybridPolicy

            latency, share = (costs.latency(), costs.draft_share) if costs is not None else (None, None)
            policy = HybridPolicy(policy, self.lookup, latency, draft_cost=share)
        self.policy = policy
        self.costs = costs  # the machine's cost curve the policy was built on (costs.py), if any
        self._corrector = CostCorrector.for_curve(costs) if costs is not None else None
        self.uses_lookup = self.lookup is not None or any(t.num_lookup for t in trees)
        self.max_ngram = self.lookup.max_ngram if self.lookup is not None else Lookup.max_ngram
        offset = heads.config.hidden_state_offset if heads is not None else 0
        self.base = BaseModel(model, hidden_state_offset=offset, kv=kv)
        self.window = context_window(model)
        # scratch slots a step may need past the committed tokens: the largest tree, with a lookup chain
        self.scratch = max(t.size for t in trees) + (self.lookup.tokens if self.lookup is not None else 0)
        self.graphs = None
        if graphs and self.base.preallocate and self.base.device.type == "cuda":
            from .graphs import VerifyGraphs

            self.graphs = VerifyGraphs(self.base)
        self.eos_ids = eos_token_ids(model, tokenizer)

    # -- public API --------------------------------------------------------------------------------------

    def generate(self, prompt, **kwargs) -> Result:
        """Generate a completion. `prompt`: a string (chat-templated as one user turn when the tokenizer has
        a template and chat=True), a list of chat messages, or a list of token ids."""
        events = list(self.stream(prompt, **kwargs))
        return events[-1].result

    def stream(
        self,
        prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        acceptance: str = "auto",
        seed: int | None = None,
        stop: list[str] | None = None,
        chat: bool = True,
    ) -> Iterator[TokenEvent]:
        """Yield a `TokenEvent` per step; the last one carries `finish_reason` and `result`."""
        ids = list(prompt) if _is_ids(prompt) else encode_prompt(self.tokenizer, prompt, chat=chat)
        check_request(len(ids), max_new_tokens, self.window)
        sampling = Sampling(temperature=temperature, acceptance=acceptance)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        out: list[int] = []
        steps: list[Step] = []
        detok = Detokenizer(self.tokenizer, stop or [])
        t0 = time.perf_counter()
        prefill_seconds = 0.0
        finish = "length"
        with _open_cache(self, len(ids) + max_new_tokens) as (cache, graphs):
            for step, new in decode(self, ids, max_new_tokens, sampling, generator, cache, graphs):
                if step is None:
                    prefill_seconds = time.perf_counter() - t0
                else:
                    steps.append(step)
                new = new[: max_new_tokens - len(out)]
                cut, reason = find_end(new, self.eos_ids, detok)
                new = new[:cut]
                if reason is None and len(out) + cut == max_new_tokens:
                    reason = "length"
                if step is not None and cut < step.tokens:  # only what was emitted counts
                    step.tokens, step.token_ids = cut, step.token_ids[:cut]
                    step.accepted = min(step.accepted, cut)
                    step.lookup_path = step.lookup_path[:cut]
                    step.lookup_accepted = sum(step.lookup_path)
                out += new
                text = detok.push(new)
                if reason is not None:
                    finish = reason
                    break
                yield TokenEvent(new, text, step)
        seconds = time.perf_counter() - t0
        # decode() stops only past max_new_tokens, which sets reason "length" first: the loop always breaks,
        # and its last (unyielded) tokens go out with the result.
        result = Result(detok.final_text(), out, len(ids), steps, seconds, prefill_seconds, finish)
        if self._corrector is not None:
            self._corrector.observe(steps)
        yield TokenEvent(new, text, step, finish_reason=finish, result=result)


@contextlib.contextmanager
def _open_cache(engine: Engine, tokens: int):
    """The generation's KV cache (room for its tokens and the largest tree's scratch) and, on CUDA, the
    verification graphs that write into it: one generation at a time replays them, others run eagerly."""
    need, graphs = min(engine.window, tokens + engine.scratch), engine.graphs
    if graphs is None or graphs.in_use:
        yield engine.base.new_cache(need), None
        return
    graphs.in_use = True
    try:
        yield graphs.cache_for(need, engine.window), graphs
    finally:
        graphs.in_use = False


@torch.inference_mode()
def decode(
    engine: Engine, ids: list[int], max_new_tokens: int, sampling: Sampling, generator, cache, graphs
) -> Iterator[tuple[Step | None, list[int]]]:
    """Yield (None, [first token]) after the prefill, then (Step, new tokens) per speculative step."""
    base, heads, policy = engine.base, engine.heads, engine.policy
    dev = base.device
    prompt = torch.tensor(ids, device=dev)
    fwd = base.forward(prompt, None, cache, logits_to_keep=1)  # logits [1, V]: the last position only
    base.commit(cache, list(range(len(ids))))
    # the first token: the acceptance rule on the root-only tree draws it from the last prompt position
    root = accept(Tree.root_only(), prompt[-1:], fwd.logits[-1:], sampling, generator).bonus
    if heads is not None:
        heads.reset()
        heads.extend(fwd.hidden)  # [P, H]
    root_logits = fwd.logits[-1].clone()  # [V] base distribution the root was drawn from (a scheduler signal)
    yield None, [root]
    emitted, plain = 1, Tree.root_only()
    limit = min(engine.window, cache.capacity)
    master = policy.master if heads is not None else None
    index = NgramIndex([*ids, root], engine.max_ngram) if engine.uses_lookup else None  # prompt + output
    policy.reset()
    for step_i in itertools.count():
        if emitted >= max_new_tokens:
            return
        clock = _Clock(dev)
        # (1) choose a tree: the policy reads the base distribution at the root and, when it has a master
        #     tree, the heads' probe of it (what all its subtrees draft first); never past the context window
        root_t = torch.tensor([root], device=dev)
        probe = heads.probe(master, root_t) if master is not None else None
        times = {"probe": clock.lap()}
        pos = cache.length
        ctx = StepContext(step_i, pos, max_new_tokens - emitted, root_logits, probe, lookup=index)
        tree = policy.choose(ctx)
        if pos + tree.size > limit:
            tree = plain
        times["choose"] = clock.lap()
        # (2) draft: one token per tree node from the heads (the probed ones are reused) and the lookup
        #     index; lookup nodes the context has no continuation for are dropped from the tree
        tree, tokens = _draft(heads, tree, root_t, probe, index)  # tokens [N+1]
        times["draft"] = clock.lap()
        # (3) verify every node in ONE forward: tree mask over the cache, positions = pos + depth (on CUDA
        #     the replay of the graph captured for this tree size)
        fwd = graphs.forward(tokens, tree) if graphs is not None else None
        if fwd is None:
            fwd = base.forward(tokens, tree, cache)
        times["verify"] = clock.lap()
        # (4) accept: the longest path the base model agrees with, plus its bonus token
        acc = accept(tree, tokens, fwd.logits, sampling, generator)
        times["accept"] = clock.lap()
        # (5) commit: keep the accepted path in the KV cache and feed its hidden states to the heads
        base.commit(cache, acc.path)
        path = torch.tensor(acc.path, device=dev)
        if heads is not None:
            heads.extend(fwd.hidden[path])  # [a, H]
        new = tokens[path[1:]].tolist() + [acc.bonus]
        if index is not None:
            index.extend(new)
        times["commit"] = clock.lap()
        # (6) record
        emitted += len(new)
        root, root_logits = acc.bonus, fwd.logits[acc.path[-1]].clone()  # a graph's output is overwritten
        times["total"] = clock.total()
        signals = dict(policy.last_signals)
        step = Step(tree.name, tree.num_nodes, len(acc.path) - 1, len(new), new, times, signals)
        if tree.num_lookup:  # which drafts were copies, and how far each source alone was right
            step.lookup_path = tree.lookup[acc.path[1:]].tolist()
            step.lookup_nodes, step.lookup_accepted = tree.num_lookup, sum(step.lookup_path)
            step.sources = source_depths(tree, tokens.tolist(), new)
        policy.observe(step)
        yield step, new


def _draft(
    heads, tree: Tree, root_t: torch.Tensor, probe, index: NgramIndex | None
) -> tuple[Tree, torch.Tensor]:
    """The step's tree (lookup nodes without a proposal dropped) and its tokens [N+1], root first."""
    if tree.num_lookup == 0:
        tokens = torch.cat([root_t, heads.draft(tree, root_t, probe).tokens]) if tree.num_nodes else root_t
        return tree, tokens
    toks: list[int | None] = [int(root_t)] + [None] * tree.num_nodes
    if tree.heads_tree.num_nodes:
        drafted = heads.draft(tree.heads_tree, root_t, probe).tokens.tolist()
        for node, t in zip(tree.head_nodes[1:].tolist(), drafted, strict=True):
            toks[node] = t
    keep = draft_lookup(tree, toks, index)
    return prune(tree, tuple(keep)), torch.tensor([toks[0], *(toks[i] for i in keep)], device=root_t.device)


class _Clock:
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
