"""Acceptance: which drafted tree path does the base model keep?

Glossary (one verification step):
  root      node 0, the token the base model already chose at the end of the previous step (already emitted)
  draft     a head's guess at a tree node (nodes 1..N)
  accepted  the drafts on the kept root-to-node path (0 or more)
  bonus     the base model's own token after the last accepted node: always emitted, it is the next root
Tokens per step = accepted drafts + 1 (the bonus); this is the convention of every metric here.

Four rules:
  greedy   keep the longest path whose every draft equals the base argmax at its parent. Lossless.
  sample   recursive rejection sampling over the tree (SpecInfer / EAGLE-2 style) at temperature T. Drafts are
           deterministic (top-k ranks), so child c of a node is accepted with probability p'(c) under the
           node's residual distribution p', which then has c removed and is renormalised; if every child is
           rejected the bonus is drawn from the residual. Lossless: outputs follow the base model's
           temperature-T distribution exactly.
  gumbel   Gumbel-max sampling with one noise vector per token position, fixed by (seed, position)
           (`GumbelNoise`): the token at position t is argmax(logits / T + g_t), a draw from the temperature-T
           distribution. Verification is greedy's against those targets, and the heads draft with the same
           noise (the top-k of their log-probabilities + T g_t), so a draft is right when the perturbed
           choices agree, which is likelier than the base model sampling a fixed top-ranked draft. Lossless in
           the strongest sense: a seed writes the same tokens whatever the tree, the policy or the batch,
           plain decoding's included (in float32; bf16 rounds differently per tree, as for greedy).
  typical  Medusa-2's typical acceptance: keep draft x if p(x) > min(eps, alpha * exp(-H(p))); the bonus is
           drawn from p restricted to tokens passing the same test. Faster at high temperature, not lossless.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np
import torch

from .errors import EntMTPError
from .settings import setting
from .tree import Tree


class Rule(StrEnum):
    """An acceptance rule: its name (it compares, hashes and serialises as that string: a profile's section,
    a cost key, a request's `acceptance`) and what the rest of the code asks of it, declared here once."""

    GREEDY = "greedy"
    SAMPLE = "sample"
    TYPICAL = "typical"
    GUMBEL = "gumbel"

    def __repr__(self) -> str:
        return repr(self.value)  # 'typical' in messages, as the string it stands for

    @property
    def sampled(self) -> bool:
        """Whether it runs at temperature > 0 (greedy is T = 0's only rule)."""
        return self is not Rule.GREEDY

    @property
    def lossless(self) -> bool:
        """Whether its output follows plain decoding's (greedy: token for token; the sampled: in distribution)."""
        return self is not Rule.TYPICAL

    @property
    def tree_invariant(self) -> bool:
        """Whether its (seeded) tokens do not depend on the trees verified: greedy's argmax, gumbel's noise fixed
        by (seed, position); a batch may then change a row's trees without changing its text."""
        return self in (Rule.GREEDY, Rule.GUMBEL)

    @property
    def needs_noise(self) -> bool:
        """Whether it draws from `GumbelNoise` (seeded by position), which the heads draft with too."""
        return self is Rule.GUMBEL

    @property
    def exclusive(self) -> bool:
        """Whether at most one child of a node is accepted, so the expected accepted tokens of a tree add up its
        nodes' path probabilities; typical acceptance tests each child on its own (siblings overlap: a union
        of events, and traces that record which nodes passed)."""
        return self is not Rule.TYPICAL

    def accept(self, tree: Tree, tokens, logits, sampling: Sampling, generator=None, noise=None) -> Accepted:
        """The path kept and the bonus token (see `accept`)."""
        if self is Rule.GREEDY:
            return accept_greedy(tree, tokens, logits)
        if self is Rule.GUMBEL:
            if noise is None:
                raise EntMTPError(
                    "gumbel acceptance needs the noise of the positions after each depth (GumbelNoise)"
                )
            return accept_targets(tree, tokens, gumbel_targets(tree, logits, noise, sampling.temperature))
        # Random draws use the caller's CPU generator (seeded runs repeat on any device): sample on the CPU.
        tokens = tokens.cpu()
        probs = _Rows(logits, sampling.temperature)
        if self is Rule.TYPICAL:
            return accept_typical(
                tree, tokens, probs, sampling.typical_eps, sampling.typical_alpha, generator
            )
        return accept_sample(tree, tokens, probs, generator)


ACCEPTANCE = tuple(Rule)
SAMPLED = tuple(r for r in Rule if r.sampled)  # the rules at temperature > 0
TREE_INVARIANT = tuple(r for r in Rule if r.tree_invariant)
SAMPLED_CHOICES = ("auto", *SAMPLED)  # what a server may apply to requests at T > 0 (auto: lossless sample)
# temperatures below this decode greedily: logits / T overflows float32 near T = 1e-37 (1e-40 wrote
# "ectableectable..."), and under 1e-5 every sampled rule already keeps the argmax unless two logits tie
# within 1e-4 (vLLM's cut-off too). The server's schema reads it (server/schema.py), so both agree.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Sampling:
    """A generation's sampling: its temperature and acceptance rule. A temperature in (0, GREEDY_BELOW) is
    greedy decoding, whatever the rule (each sampled rule's limit as T -> 0): it is stored as 0."""

    temperature: float = 0.0  # 0 = greedy
    acceptance: str = "auto"  # auto: greedy at T=0, lossless "sample" otherwise
    typical_eps: float = 0.09  # Medusa-2 defaults
    typical_alpha: float = 0.3

    def __post_init__(self):
        if not self.temperature >= 0:
            raise EntMTPError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.acceptance not in ("auto", *ACCEPTANCE):
            raise EntMTPError(f"unknown acceptance {self.acceptance!r}: use auto, {', '.join(ACCEPTANCE)}")
        if self.acceptance in SAMPLED and self.temperature == 0:
            raise EntMTPError(f"acceptance {self.acceptance!r} needs a temperature > 0")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # frozen: set once, here

    @property
    def rule(self) -> Rule:
        if self.acceptance == "auto" or self.temperature == 0:
            return Rule.GREEDY if self.temperature == 0 else Rule.SAMPLE
        return Rule(self.acceptance)


@dataclass(frozen=True)
class GenerationOptions:
    """One generation's options: how many tokens, how they are sampled, where the text stops, what each token
    reports. `Engine.stream` and `generate` take them as one object or as keywords; `entmtp generate` and
    `chat` make their flags from these fields (settings.py), `bench` some of them, and the server maps each
    request onto them (server/routes.py)."""

    max_new_tokens: int = setting(256, help="most new tokens (default %(default)s)")
    temperature: float = setting(0.0, help="0 = greedy")
    acceptance: str = setting(
        "auto",
        choices=("auto", *ACCEPTANCE),
        help="how drafts are accepted (auto: greedy at temperature 0, else lossless tree rejection sampling "
        "`sample`; gumbel: lossless Gumbel-max sampling whose seeded output does not depend on the tree; "
        "typical: Medusa's, not lossless)",
    )
    seed: int | None = setting(None, help="sampling seed (default: none, another draw each run)")
    stop: list[str] | None = setting(None, repeat=True, help="stop string (repeatable)")
    logprobs: int | None = None  # top tokens per emitted token's log-probability record (the server's)
    # the output the caller expects (a text, or token ids): drafts for a lossless rule (prediction.py)
    prediction: str | tuple[int, ...] | list[int] | None = None
    # a grammar the output follows: an OpenAI response_format object or a constraints.Constraint (kept as the
    # latter); `entmtp generate` takes it as --json-schema, --json-object, --regex or --grammar (generate.py)
    response_format: object = None
    logit_bias: dict | None = setting(
        None, repeat=True, type=lambda v: _bias_item(v), metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )  # fmt: skip
    presence_penalty: float = setting(0.0, help="minus this (-2..2) for every token generated already")
    frequency_penalty: float = setting(0.0, help="minus this (-2..2) times how often a token was generated")
    repetition_penalty: float = setting(
        1.0,
        help="divide (multiply, if negative) the logits of tokens seen in prompt or output by this (1 = none)",
    )

    def __post_init__(self):
        self.sampling  # noqa: B018 (a bad temperature or rule fails here, before anything decodes)
        if isinstance(self.logit_bias, list | tuple):  # the flag's (id, bias) pairs
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self.penalties  # noqa: B018 (a bad penalty or bias too)
        from .constraints import Constraint

        object.__setattr__(self, "response_format", Constraint.of(self.response_format))  # frozen: set once

    @property
    def penalties(self):
        """The sampling controls (penalties.Penalties), checked (token ids against a vocabulary: `penalties_for`)."""
        return self.penalties_for(None)

    def penalties_for(self, vocab_size: int | None):
        """The sampling controls, `logit_bias`'s ids checked against a `vocab_size` vocabulary."""
        from .penalties import Penalties

        return Penalties.of(
            self.logit_bias,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            vocab_size,
        )

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.acceptance)

    @classmethod
    def of(cls, options: GenerationOptions | None = None, **fields) -> GenerationOptions:
        """`options` (default: the defaults) with `fields` replaced: what `Engine.stream`'s keywords mean."""
        return replace(options if options is not None else cls(), **fields)


def _bias_item(value: str) -> tuple[int, float]:
    """`--logit-bias ID=BIAS` as (id, bias)."""
    token, sep, bias = value.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give --logit-bias as ID=BIAS (like 1234=-100), got {value!r}"
        ) from None


def check_gumbel_seed(seed: int | None) -> None:
    """Raise EntMTPError for a seed the gumbel rule cannot take (its noise is seeded by (seed, position))."""
    if seed is not None and seed < 0:
        raise EntMTPError(
            f"the gumbel rule needs a seed >= 0 (or none), got {seed}: use a seed from 0 to 2**64-1"
        )


class GumbelNoise:
    """The gumbel rule's random stream: Gumbel(0, 1) noise [V] per absolute token position (0 = the prompt's
    first token), a function of (seed, position) alone, so the token at a position is the same whichever
    step, tree or batch decides it, and the heads draft with the noise the base model will sample with.
    `at(positions)` -> [n, V] float32 on `device`; rows are kept until an earlier position than every one
    asked for is past (a decode asks for positions in increasing order)."""

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu"):
        check_gumbel_seed(seed)
        self.seed, self.vocab_size, self.device = int(seed), int(vocab_size), torch.device(device)
        self._rows: dict[int, torch.Tensor] = {}
        self._generator = torch.Generator()

    def row(self, position: int) -> torch.Tensor:
        """[V] the noise of one position (computed on the CPU, so every device draws the same)."""
        row = self._rows.get(position)
        if row is None:
            key = int(np.random.SeedSequence([self.seed, position]).generate_state(1, np.uint64)[0]) >> 1
            u = torch.rand(self.vocab_size, generator=self._generator.manual_seed(key), dtype=torch.float64)
            row = self._rows[position] = u.log_().neg_().log_().neg_().float().to(self.device)  # -log(-log u)
        return row

    def at(self, positions) -> torch.Tensor:
        positions = [int(p) for p in positions]
        first = min(positions)
        self._rows = {p: r for p, r in self._rows.items() if p >= first}
        return torch.stack([self.row(p) for p in positions])


def gumbel_targets(tree: Tree, logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N+1] the token after each node of `tree`: argmax(logits / T + g) per row (logits [N+1, V]), g the row of
    `noise` [D+1, V] of the node's depth (the nodes of one depth are contiguous, root first)."""
    scores = logits.to(torch.float32, copy=True)  # [N+1, V]; argmax(logits / T + g) = argmax(logits + T g)
    noise = noise.to(scores.device)
    for depth, rows in enumerate((slice(0, 1), *tree.level_slices)):
        scores[rows].add_(noise[depth], alpha=temperature)
    return scores.max(dim=-1).indices


@dataclass(frozen=True)
class Accepted:
    path: list[int]  # node ids root..last accepted node (path[0] == 0)
    bonus: int  # the base model's token after the last accepted node


def accept(
    tree: Tree,
    tokens: torch.Tensor,  # [N+1] root + drafts
    logits: torch.Tensor,  # [N+1, V] base logits at every node
    sampling: Sampling,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,  # gumbel: [D+1, V] row d: the noise of the position after depth d
) -> Accepted:
    """The path `sampling`'s rule keeps and the bonus token after it (`Rule.accept`)."""
    return sampling.rule.accept(tree, tokens, logits, sampling, generator, noise)


class _Rows:
    """The temperature-T distributions [V] of the nodes an acceptance walk visits (rejection sampling's or
    typical acceptance's: often one or two of a tree's rows), each computed on the CPU when first read."""

    def __init__(self, logits: torch.Tensor, temperature: float):
        self.logits, self.temperature, self._rows = logits, temperature, {}

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self._rows:
            self._rows[node] = torch.softmax(self.logits[node].float().cpu() / self.temperature, dim=-1)
        return self._rows[node]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to `weights` [V] (>= 0, not all 0): the inverse CDF at one
    uniform, in float64 (torch.multinomial costs ~15x more over a 49k vocabulary on a CPU)."""
    cdf = weights.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=cdf.numel() - 1))


def accept_greedy(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> Accepted:
    if tree.num_nodes == 0 and logits.device.type == "cpu" and logits.dtype == torch.float32:
        # a plain step on the CPU: its row's argmax, no tensor op (after a forward, each op runs on cold caches)
        return Accepted([0], int(logits.detach().numpy()[0].argmax()))
    return accept_targets(tree, tokens, argmax_rows(logits))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximum on ties) of `logits` [N+1, V]. float32 on the CPU (llama.cpp's
    logits, transformers' float32): numpy's argmax, a single-threaded scan ~10x cheaper than torch's reduction
    over a 49k vocabulary, which also wakes torch's OpenMP threads (on a CPU whose cores llama.cpp's threads
    use, they contend). Else max().indices: the same index, ~4x faster than argmax() on bf16 CPU tensors."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(-1))  # [N+1] int64
    return logits.max(dim=-1).indices


def accept_targets(tree: Tree, tokens: torch.Tensor, target: torch.Tensor) -> Accepted:
    """Greedy acceptance against `target` [N+1], the token that must follow each node (the base argmax there;
    a replay's recorded continuation)."""
    if tree.num_nodes == 0:
        return Accepted([0], int(target[0]))
    if tree.num_nodes == tree.depth and target.device.type == "cpu":
        # a chain (lookup's, a grammar's forced one): node d at depth d, its parent d - 1; walked in Python,
        # as the tensor ops below cost ~0.4 ms after a llama.cpp decode (every op on cold caches)
        drafted, wanted = tokens.tolist(), target.tolist()
        a = 0
        while a < tree.num_nodes and drafted[a + 1] == wanted[a]:
            a += 1
        return Accepted(list(range(a + 1)), wanted[a])
    return tree_targets(tree, tokens, target)


def tree_targets(tree: Tree, tokens: torch.Tensor, target: torch.Tensor) -> Accepted:
    """`accept_targets` for any tree, in tensor ops (on the device of `target`)."""
    # A draft is right when it equals the target at its parent; a path is kept up to its first miss.
    dev = target.device  # tree tensors live on the CPU; .to() is a no-op there
    right = tokens == target[tree.parents.to(dev).clamp(min=0)]  # [N+1] (root compared to itself: ignored)
    right[0] = True
    rows = tree.retrieve_indices.to(dev)  # [L, D+1], -1 padded
    ok = right[rows.clamp(min=0)] & (rows >= 0)  # [L, D+1]
    lengths = ok.int().cumprod(dim=1).sum(dim=1)  # [L] accepted nodes incl. root
    best = int(lengths.argmax())
    path = rows[best, : int(lengths[best])]
    return Accepted(path.tolist(), int(target[path[-1]]))


@functools.lru_cache(maxsize=64)  # per tree, built once: trees are frozen and few
def _children(tree: Tree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            kids[parent].append(node)
    for k in kids:  # try candidates in rank order (higher-ranked drafts are likelier)
        k.sort(key=lambda n: int(tree.ranks[n]))
    return kids


def accept_sample(tree: Tree, tokens: torch.Tensor, probs, generator: torch.Generator | None) -> Accepted:
    """Recursive rejection sampling over the tree; `probs[i]` is node i's temperature-T distribution [V] (a
    [N+1, V] tensor, or `_Rows` computing the visited ones). Siblings that draft the same token (a hybrid
    tree's lookup branch can repeat a head's draft) are one candidate: once the token is accepted, the walk
    goes on below every node that drafted it, so a draft is never lost to a duplicate beside it; the path kept
    is the first of the deepest nodes reached (all have the same tokens, hence the same distributions, up to
    rounding)."""
    kids, tok = _children(tree), tokens.tolist()
    nodes = [0]  # every node whose branch drafted exactly the tokens accepted so far
    while True:
        below = [c for n in nodes for c in kids[n]]
        residual = probs[nodes[0]]  # [V], unnormalised once a child is rejected: `mass` is what it sums to
        if not below:
            return Accepted(_path(tree, nodes[0]), _draw(residual, generator))
        mass, nxt, owned = 1.0, None, False
        for t in dict.fromkeys(tok[c] for c in sorted(below, key=lambda c: int(tree.ranks[c]))):
            p = float(residual[t])
            if p > 0 and float(torch.rand((), generator=generator)) * mass < p:  # p / mass: the residual's
                nxt = t
                break
            if not owned:  # the node's distribution itself stays as it is
                residual, owned = residual.clone(), True
            residual[t] = 0.0  # rejected: the next child is tried against what is left
            mass -= p
            if mass <= 0:
                break
        if nxt is None:
            return Accepted(_path(tree, nodes[0]), _draw(residual, generator))
        nodes = [c for c in below if tok[c] == nxt]


def _path(tree: Tree, node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def _typical_threshold(probs: torch.Tensor, eps: float, alpha: float) -> torch.Tensor:
    """[.., 1] the typical test's bar for distributions [.., V]: min(eps, alpha * exp(-H(p)))."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-20))).sum(dim=-1, keepdim=True)
    return torch.minimum(torch.full_like(entropy, eps), alpha * torch.exp(-entropy))


def typical_ok(probs: torch.Tensor, eps: float, alpha: float) -> torch.Tensor:
    """[.., V] bool: tokens passing p(x) > min(eps, alpha * exp(-H(p)))."""
    return probs > _typical_threshold(probs, eps, alpha)


def accept_typical(
    tree: Tree, tokens: torch.Tensor, probs, eps: float, alpha: float, generator: torch.Generator | None
) -> Accepted:
    """The longest path whose drafts pass the typical test at their parent's distribution (`probs[i]`, [V]:
    a [N+1, V] tensor or `_Rows`); only the distributions of nodes the passing drafts reach are read."""
    parents, tok = tree.parents.tolist(), tokens.tolist()
    threshold: dict[int, torch.Tensor] = {}  # per reached node: its bar (`_typical_threshold`)
    right = [True] + [False] * tree.num_nodes  # node passes (its parent reached); the rest never matter
    for c in range(1, tree.size):  # parents come before their children
        p = parents[c]
        if not right[p]:
            continue
        if p not in threshold:
            threshold[p] = _typical_threshold(probs[p], eps, alpha)
        right[c] = bool(probs[p][tok[c]] > threshold[p])
    rows = tree.retrieve_indices  # [L, D+1], -1 padded
    ok = torch.tensor(right)[rows.clamp(min=0)] & (rows >= 0)
    lengths = ok.int().cumprod(dim=1).sum(dim=1)
    best = int(lengths.argmax())
    path = rows[best, : int(lengths[best])].tolist()
    last = probs[path[-1]]
    last = last * typical_ok(last, eps, alpha)
    if last.sum() <= 0:  # nothing passes (cannot happen: the argmax always passes); fall back to argmax
        return Accepted(path, int(probs[path[-1]].argmax()))
    return Accepted(path, _draw(last, generator))
