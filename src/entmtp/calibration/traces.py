"""Calibration traces: what the heads would have drafted at every position of real greedy generations.

For greedy acceptance, whether a tree accepts a path at a step depends only on one thing per depth: the rank,
among head d's candidates, of the base model's own token d places after the root, given that the drafts
before it were right (Hydra's heads read their branch; on an accepted branch those are the true tokens).
So one forward of the base model over prompt + greedy output, and one teacher-forced pass of the heads, give
at EVERY position the rank vector that decides every tree's accepted length there: scoring a tree is a
lookup, simulating a whole decode with any tree or policy is exact, and no union-tree rollout (with its
optimistic bias, and one decode per search round) is needed. Positions are indexed by the step's root:
position j is a step whose root is tokens[j] (the base model's token drawn from the logits at j - 1).

At T > 0 the two sampling rules (accept.py) differ in what a trace of one sampled generation can tell:

  sample   lossless tree rejection sampling with deterministic drafts is exactly "sample the next token x from
           the base model; if x is a child of the current node, move there, else x is the bonus": a child c is
           accepted with probability p'(c) under the residual p' that excludes the siblings rejected before
           it, which is p(c) overall, and the bonus never equals a rejected child. So at every step the
           accepted path is the longest tree path that matches the emitted tokens, whatever the tree, and the
           emitted tokens are a sample of the base model at T whatever the tree. A trace of one sampled
           generation (its rank vectors, as for greedy) therefore replays any tree or policy exactly, step by
           step, for that random outcome, and a set of them in distribution (tests/test_sampling_replay.py).
  gumbel   the same as sample, with the noise the generation was drawn with (GumbelNoise, from its seed): a
           tree accepts the longest path that matches the emitted tokens, which no tree changes, and the heads'
           candidates at a position are ranked by log-probability + T g there. So the ranks are taken under
           that perturbation, and a trace replays any tree or policy exactly, as for greedy.
  typical  keeps the longest path whose drafts pass the typical test; several siblings may pass and the output
           depends on the tree. At every root of the sampled trajectory the heads draft a whole union tree
           (`union_passes`: every tree the search may grow is a subtree of it) and the base model verifies it
           there, as a decode's step would: `passes` records which of its drafts pass at their parent's
           distribution, so any subtree's accepted length at that root is exact. What is approximate: the
           replay then advances along the trajectory, whose tokens a decode with another tree need not have
           emitted (typical acceptance is not lossless: its output depends on the tree).

A profile keeps its traces beside its JSON, in `<profile>.traces.safetensors` (`save_traces`, `load_traces`):
tensors `{i}.ranks`, `{i}.probe`, `{i}.raw` (and `{i}.passmask`, `{i}.tokens` when the trace has them) for the
greedy traces, the same under `{rule}.{i}.` for a sampled section's (`sample.`, `typical.`, which also has
`{i}.passes`; its union tree is the section's `trace_tree`); the JSON records each trace's prompt_len and
length and the file's sha256, so a changed or truncated sidecar is refused.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import Progress
from safetensors.torch import load_file

from ..accept import GumbelNoise, Rule, Sampling, typical_ok
from ..backends.transformers import BaseModel
from ..errors import EntMTPError
from ..files import save_tensors_atomic
from ..scheduler.profiles import Profile, ProfileError, TraceMeta
from ..scheduler.signals import raw_signals, root_stats
from ..tree import Tree

TOPK = 10  # candidates per head recorded; ranks >= TOPK count as misses (no tree here drafts that wide)
MISS = TOPK  # rank recorded for a token outside the heads' top TOPK (or past the end)
TYPICAL = Sampling(temperature=0.7, acceptance="typical")  # the paper's setting (eps 0.09, alpha 0.3)
SAMPLE = Sampling(temperature=0.7, acceptance="sample")  # lossless, at the paper's temperature
GUMBEL = Sampling(temperature=0.7, acceptance="gumbel")  # lossless, tree-invariant per seed
# the T > 0 sections `entmtp calibrate` makes; gumbel runs the sample section's policies (Profile.mode_for:
# the same temperature and exclusive acceptance, and replays found their accepted lengths within a few %)
SAMPLED = (SAMPLE, TYPICAL)


@dataclass
class Trace:
    """One generation, teacher-forced. Rows are step roots j = prompt_len .. len(tokens) - 1."""

    prompt_len: int
    length: int  # prompt + output tokens
    ranks: torch.Tensor  # [R, D] int64: rank of tokens[j + d] under head d at root j; MISS if not in top-k
    probe: torch.Tensor  # [R, Dp, TOPK] float32: top-k log-probabilities the online probe would see
    raw: torch.Tensor  # [R, 4] float32: raw signals (entropy, p0, chain sum, max g_d) at root j
    # the generation itself (prompt + output): what replays of prompt-lookup drafts copy from
    tokens: torch.Tensor | None = None  # [length] int64
    # typical acceptance only: [j, i] is True when node i + 1 of `union`, drafted at root j, passes the typical
    # test at its parent's base distribution there (its ancestors' passes aside)
    passes: torch.Tensor | None = None  # [R, union.num_nodes] bool
    union: Tree | None = None
    seed: int | None = None  # gumbel only: the generation's seed, which fixed its noise (and its drafts')

    @property
    def output_tokens(self) -> int:
        return self.length - self.prompt_len


def probe_depth(heads) -> int:
    """Depths an online probe covers: all for independent (Medusa) heads, 1 for grounded Hydra heads."""
    return 1 if getattr(heads, "grounded", False) else heads.config.num_heads


@torch.inference_mode()
def trace_generation(
    base: BaseModel,
    heads,
    tokens: list[int],
    prompt_len: int,
    sampling: Sampling | None = None,
    union: Tree | None = None,
    seed: int | None = None,
    noise: GumbelNoise | None = None,
) -> Trace:
    """Teacher-force `heads` over one finished generation `tokens` (prompt + output). Greedy or lossless
    `sampling` (the output sampled with it): the rank vectors are all a replay needs (module docstring). Typical
    `sampling` needs `union`, the tree drafted and verified at every root (`union_passes`); gumbel `sampling`
    the generation's `seed` (or its `noise` itself, e.g. drawn from the posterior given the tokens)."""
    if len(tokens) <= prompt_len + 1:
        raise EntMTPError("a calibration generation needs at least two output tokens")
    dev = base.device
    ids = torch.tensor(tokens, device=dev)
    L, D, dp = len(tokens), heads.config.num_heads, probe_depth(heads)
    fwd = base.forward(ids, None, base.new_cache(L))
    feats = heads.features(fwd.hidden[None].to(heads.dtype), ids[None])  # D x [1, L, H]
    roots = torch.arange(prompt_len, L, device=dev)  # [R] step roots j; the heads read position j - 1
    t = roots - 1
    ranks = torch.full((len(roots), D), MISS, dtype=torch.int64)
    probe = torch.zeros(len(roots), dp, TOPK)
    typical = sampling is not None and not sampling.rule.exclusive  # which nodes passed, not one path
    if typical and union is None:
        raise EntMTPError("a trace of typical acceptance needs the union tree to verify at every root")
    noise = _noise(sampling, seed, noise, base.vocab_size, dev)
    col_of = _draft_columns(heads, base.vocab_size, dev)
    for d in range(D):  # head d+1 at t predicts tokens[t + d + 2] = tokens[j + d + 1]
        lp = F.log_softmax(heads.draft_logits(d, feats[d][0, t]).float(), dim=-1)  # [R, Vd]
        target = t + d + 2
        valid = target < L
        col = col_of[ids[target.clamp(max=L - 1)]]  # [R]
        valid &= col >= 0
        score = lp  # what the heads rank their candidates by (gumbel: + T g of the target's position)
        if noise is not None:
            g = noise.at(target.clamp(max=L - 1).tolist())  # [R, V]
            g = g if heads.draft_vocab is None else g[:, heads.draft_vocab.to(dev)]
            score = lp + sampling.temperature * g
        true_score = score.gather(1, col.clamp(min=0)[:, None])  # [R, 1]
        rank = (score > true_score).sum(dim=1)  # [R]
        rank = torch.where(valid & (rank < TOPK), rank, torch.full_like(rank, MISS))
        ranks[:, d] = rank.cpu()
        top = score.topk(TOPK, dim=-1).indices  # [R, K]
        if d < dp:
            probe[:, d] = lp.gather(1, top).cpu()
    raw = raw_signals(root_stats(fwd.logits[t]).cpu(), probe)  # [R, 4]
    trace = Trace(prompt_len, L, ranks, probe, raw, ids.cpu(), seed=seed if noise is not None else None)
    if typical:
        trace.passes = union_passes(base, heads, ids, prompt_len, fwd.hidden, union, sampling)
        trace.union = union
    return trace


def _noise(sampling: Sampling | None, seed: int | None, noise: GumbelNoise | None, vocab: int, dev):
    """The gumbel noise a trace's heads rank by (None for a rule without noise): `noise`, else the seed's."""
    if sampling is None or not sampling.rule.needs_noise:
        return None
    if noise is None and seed is None:
        raise EntMTPError("a trace of gumbel sampling needs the generation's seed (its noise)")
    return noise if noise is not None else GumbelNoise(seed, vocab, dev)


def _draft_columns(heads, vocab: int, dev) -> torch.Tensor:
    """[V] token id -> its column in the heads' draft logits (-1: not draftable, outside a draft vocabulary)."""
    col_of = torch.arange(vocab, device=dev)
    if heads.draft_vocab is not None:
        col_of = torch.full_like(col_of, -1)
        col_of[heads.draft_vocab.to(dev)] = torch.arange(heads.draft_vocab.numel(), device=dev)
    return col_of


UNION_CHUNK = 8  # roots whose union trees one forward verifies


@torch.inference_mode()
def union_passes(
    base: BaseModel,
    heads,
    ids: torch.Tensor,  # [L] prompt + output
    prompt_len: int,
    hidden: torch.Tensor,  # [L, H] the base model's hidden states over `ids` (what the heads read)
    union: Tree,
    sampling: Sampling,
) -> torch.Tensor:
    """[R, N] bool: at every root j of the generation, the heads draft `union` as a decode's step would (their
    feature after positions < j, the root token ids[j]) and the base model verifies it at positions j + depth,
    attending to ids[:j] and each node's ancestors; node i passes when its token passes the typical test at
    its parent's distribution. UNION_CHUNK roots per forward, over a cache of the prefix they share: a forward
    with an explicit mask across several roots (`BaseModel.run`), which only the transformers backend has."""
    if not isinstance(base, BaseModel):
        raise EntMTPError(
            "typical acceptance's traces verify several roots in one forward under an explicit mask, which only "
            "the transformers backend offers: calibrate on transformers (what `entmtp calibrate` loads)"
        )
    L, N, size = len(ids), union.num_nodes, union.size
    drafter = heads.drafter()
    drafter.extend(hidden[:prompt_len])
    drafts = []
    for j in range(prompt_len, L):
        if j > prompt_len:
            drafter.extend(hidden[j - 1 : j])
        drafts.append(drafter.draft(union, ids[j : j + 1]).tokens.to(ids.device))  # [N]
    parents = union.parents[1:].to(ids.device)  # [N] node i + 1's parent (0: the root)
    out = torch.zeros(L - prompt_len, N, dtype=torch.bool)
    for start in range(0, L - prompt_len, UNION_CHUNK):
        rows = range(start, min(start + UNION_CHUNK, L - prompt_len))
        past = prompt_len + rows[0]  # every root of the chunk sees ids[:past]; later ones also a few more
        cache = base.new_cache(prompt_len + rows[-1] + len(rows) * size)
        base.forward(ids[:past], None, cache, logits_to_keep=1)
        base.commit(cache, list(range(past)))
        extra = rows[-1] - rows[0]  # ids[past : past + extra] go in front of the trees: roots after the first
        tokens = torch.cat(
            [ids[past : past + extra], *(torch.cat([ids[prompt_len + r][None], drafts[r]]) for r in rows)]
        )
        n = len(tokens)
        positions = torch.cat(
            [torch.arange(past, past + extra), *(prompt_len + r + union.depths for r in rows)]
        ).to(ids.device)
        mask = torch.zeros(n, past + n, dtype=torch.bool)
        mask[:, :past] = True
        mask[:extra, past : past + extra] = torch.ones(extra, extra, dtype=torch.bool).tril()
        for i, r in enumerate(rows):
            block = slice(extra + i * size, extra + (i + 1) * size)
            mask[block, past : past + r - rows[0]] = True  # the chain tokens before this root
            mask[block, past + block.start : past + block.stop] = union.mask
        cache.begin(n)
        fwd = base.run(tokens, positions, mask.to(ids.device), cache)
        for i, r in enumerate(rows):
            logits = fwd.logits[extra + i * size : extra + (i + 1) * size]  # [size, V]
            probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
            passing = typical_ok(probs, sampling.typical_eps, sampling.typical_alpha)  # [size, V]
            out[r] = passing[parents, drafts[r]].cpu()
    return out


def generate_traces(
    engine,
    heads,
    prompts: list[list[int]],
    max_new_tokens: int,
    progress: Progress | None = None,
    outputs: list[list[int]] | None = None,
    sampling: Sampling | None = None,
    union: Tree | None = None,
) -> tuple[list[Trace], list[list[int]]]:
    """Generations of `prompts` (token ids) with `engine` (greedy, whose output does not depend on the tree;
    or `sampling`, seeded by prompt index), then a teacher-forced trace of each through `heads` (typical
    `sampling`: verified on `union` at every root). `outputs` reuses earlier generations."""
    task = progress.add_task("calibration traces", total=len(prompts)) if progress else None
    traces, outs = [], []
    for i, ids in enumerate(prompts):
        if outputs is not None:
            out = outputs[i]
        elif sampling is None:
            out = engine.generate(ids, max_new_tokens=max_new_tokens).token_ids
        else:
            out = engine.generate(
                ids,
                max_new_tokens=max_new_tokens,
                temperature=sampling.temperature,
                acceptance=sampling.acceptance,
                seed=i,
            ).token_ids
        outs.append(out)
        if len(out) >= 2:
            traces.append(
                trace_generation(engine.base, heads, list(ids) + list(out), len(ids), sampling, union, seed=i)
            )
        if progress:
            progress.advance(task)
    return traces, outs


# ---- the traces sidecar of a profile ---------------------------------------------------------------------


def sidecar_path(profile_path: str | os.PathLike[str]) -> Path:
    """Where a profile's traces live: `P.json` -> `P.traces.safetensors`."""
    path = Path(profile_path)
    return path.with_name(path.stem + ".traces.safetensors")


def save_traces(
    profile: Profile,
    path: str | os.PathLike[str],
    traces: list[Trace],
    sampled: Mapping[str, list[Trace]] | None = None,
) -> Profile:
    """Write the sidecar of the profile to be saved at `path` atomically (greedy traces, and each sampled
    section's, by rule: {"sample": [...], "typical": [...]}), and return `profile` recording what it holds and
    its sha256. Save the profile's JSON after it (`save_traces(...).save(path)`), so a reader never finds a
    JSON whose sidecar is not there yet."""
    sampled = dict(sampled or {})
    for rule in sampled:
        if rule not in profile.modes or not Rule(rule).sampled:
            raise ProfileError(f"traces of a {rule!r} section that the profile does not have")
    side = sidecar_path(path)
    side.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for prefix, trs in (("", traces), *((f"{rule}.", trs) for rule, trs in sampled.items())):
        for i, tr in enumerate(trs):
            tensors[f"{prefix}{i}.ranks"] = tr.ranks.to(torch.int16)
            tensors[f"{prefix}{i}.probe"] = tr.probe.to(torch.float16)
            tensors[f"{prefix}{i}.raw"] = tr.raw.float()
            if tr.passes is not None:
                tensors[f"{prefix}{i}.passes"] = tr.passes.to(torch.uint8)
            if tr.tokens is not None:
                tensors[f"{prefix}{i}.tokens"] = tr.tokens.to(torch.int32)
            if tr.seed is not None:
                tensors[f"{prefix}{i}.seed"] = torch.tensor([tr.seed], dtype=torch.int64)
    save_tensors_atomic(side, tensors)
    modes = dict(profile.modes)
    for rule, trs in sampled.items():
        union = profile.mode(rule).trace_tree
        if any(tr.union is not None and (union is None or tr.union.paths != union.paths) for tr in trs):
            raise ProfileError(f"the {rule} traces were verified on another union tree than the section's")
        modes[rule] = replace(profile.mode(rule), traces=_metas(trs))
    return replace(profile, modes=modes, traces=_metas(traces), traces_sha256=_sha256(side))


def load_traces(profile: Profile, mode: str = "greedy") -> list[Trace]:
    """The calibration traces of a profile's mode from its sidecar file (checked against the recorded sha256)."""
    side = None if profile.path is None else sidecar_path(profile.path)
    if side is None or not side.exists():
        raise ProfileError(f"profile {profile.where} has no traces file {side}: calibrate again (full run)")
    digest = _sha256(side)
    if digest != profile.traces_sha256:
        raise ProfileError(
            f"traces file {side} does not match its profile (sha256 {digest[:12]}...): "
            "it was changed or truncated; calibrate again"
        )
    t = load_file(str(side))
    sampled = Rule(mode).sampled
    prefix = f"{mode}." if sampled else ""  # the greedy section's tensors are unprefixed
    named = profile.mode(mode).trace_tree if sampled else None
    union = None if named is None else named.tree()  # one Tree for every trace of the section
    if not Rule(mode).exclusive and (union is None or f"{prefix}0.passmask" in t):
        raise ProfileError(
            f"the typical traces of {profile.where} were made by an older entmtp (they know paths off the "
            "sampled trajectory one level deep only): calibrate again"
        )
    out = []
    for i, meta in enumerate(profile.trace_metas(mode)):
        key = f"{prefix}{i}"
        passes, toks, seed = t.get(f"{key}.passes"), t.get(f"{key}.tokens"), t.get(f"{key}.seed")
        out.append(
            Trace(
                meta.prompt_len,
                meta.length,
                t[f"{key}.ranks"].long(),
                t[f"{key}.probe"].float(),
                t[f"{key}.raw"].float(),
                None if toks is None else toks.long(),
                None if passes is None else passes.bool(),
                None if passes is None else union,
                None if seed is None else int(seed[0]),
            )
        )
    return out


def _metas(traces: list[Trace]) -> tuple[TraceMeta, ...]:
    return tuple(TraceMeta(tr.prompt_len, tr.length) for tr in traces)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
