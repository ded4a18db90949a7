"""Lossless sampling through the engine: the first K generated tokens of speculative sampling follow the base
model's temperature-T distribution (under a grammar and penalties: the shaped one, shaping.py), computed exactly
by enumerating every prefix of a small-vocabulary model.

Each check draws `DRAWS` generations of K tokens and compares them with the exact joint distribution (V**K
outcomes, too many cells for the draws) through its projections: each position's token (V cells) and each pair
of consecutive tokens (V**2 cells), by Pearson's chi-square (cells expected fewer than 5 times pooled); the
check's p-value is the smallest of the 2K-1 p-values times 2K-1 (Bonferroni), rejected under `ALPHA`. K = 5
tokens are the prefill's and those of one to four speculative steps (a step that accepts nothing leaves the
next positions to later steps). Draws are seeded, so a run repeats exactly.

Power. The checks have teeth: on the same draws' count the same statistic rejects the engine with one line of
its acceptance broken (the mutation tests at the end), and typical acceptance, which is lossy by design. The
subtlest mutant, rejection sampling that forgets to take a rejected sibling's mass out of the residual (`mass
-= p` dropped: the next sibling is accepted with p' instead of p' / (1 - p), a shift of about p1 p2 in its
probability, ~0.05 here), passed the earlier 400-draw checks (p 0.15-3.7, three seeds) and was caught in one
seed of three at 4,000 draws on the "deep" tree, whose second ranks draft unlikely tokens. On the "wide" tree
(four candidates at the root) 2,000 draws reject it at p < 1e-20 and 4,000 at p < 1e-50 in each of three
seeds, while the correct engine passed (p 0.017-4.1): the tree, not only the draws' count, makes a check
powerful, so each rule is checked on it. Every check draws `DRAWS` = 4,000 generations: against a one-token
marginal off by a total variation of 0.05 spread over two cells the statistic's non-centrality is ~10x
that of the earlier 400 draws."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

import entmtp.accept as accept_mod
import entmtp.engine as engine_mod
import entmtp.shaping as shaping_mod
from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.batch import generate_batch
from entmtp.constraints import Constraint
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, random_heads
from entmtp.policy import static
from entmtp.tree import Tree

V = 8  # vocabulary: V**K outcomes, few enough for the exact distribution and a powerful test
K = 5  # tokens per draw: the prefill's, then steps whose trees reach depth 3
PROMPT = [1, 2, 3, 3, 1, 2, 3, 3, 1, 2]  # repeats: lookup proposes, often what the heads draft too
DRAWS = 4000
ROWS = 16  # rows per batch in the batched checks (DRAWS / ROWS batches)
ALPHA = 1e-4  # a correct engine fails a check this rarely (and never: the draws are seeded)

TREES = {
    # depth 3 with side branches at every depth
    "deep": Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]),
    # a head chain beside a lookup chain: where they draft the same token, duplicate siblings
    "duplicates": Tree.from_paths([[0], ["L0"], [0, 0], ["L0", "L0"], [0, 0, 0], ["L0", "L0", "L0"]]),
    # heads and lookup mixed: lookup below head nodes, two head ranks at the root
    "hybrid": Tree.from_paths([[0], [1], ["L0"], [0, 0], [0, "L0"], [0, 0, "L0"], [1, 0]]),
    # four candidates at the root: after a rejection the next ones are tried against the residual (the power)
    "wide": Tree.from_paths([[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [0, 0, 0]]),
}
# a grammar whose mask depends on each node's own path: tokens 1..7, never one twice in a row (at least 8 of
# them, so the end of the sequence, token 0, is never allowed within K) ...
NO_REPEAT = Constraint.lark(
    "start: T\nT: /[\\x01-\\x07]{8,}/ & ~/(?s:.*)("
    + "|".join(f"\\x0{t}\\x0{t}" for t in range(1, 8))
    + ")(?s:.*)/\n"
)
# ... and every control at once, strong enough to move most of the distribution
CONTROLS = dict(
    presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.6, logit_bias={3: 1.5, 6: -1.0}
)
SHAPED = {"controls": CONTROLS, "both": dict(response_format=NO_REPEAT, **CONTROLS)}


@pytest.fixture(scope="module")
def model():
    """A 2-layer random Llama over 8 tokens, its logits scaled so that T=1 has ~1.5 nats of entropy (a random
    model's are near uniform, where every rule looks right); one thread (its ops are too small for two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = tiny_model("llama", seed=5, vocab=V)
    m.lm_head.weight.mul_(10.0)
    yield m
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engines(model):
    """Per tree, an engine whose heads draft the base model's greedy continuation at rank 0 (by position, so
    likely drafts, often what the lookup proposes beside them) and wrong tokens at the other ranks; "hybrid" has
    random Hydra heads (the real drafting code)."""
    return engines_for(model)


def engines_for(model, **shaping) -> dict:
    """`engines`' engines over `model`, the oracle drafting the greedy continuation under `shaping` (generation
    options: a grammar, controls)."""
    plain = Engine(model, ByteTokenizer())
    greedy = plain.generate(PROMPT, max_new_tokens=K + 4, **shaping).token_ids
    oracle = OracleHeads(PROMPT + greedy, num_heads=3, rank_mod=1)
    out = {"plain": plain}
    for name, tree in TREES.items():
        heads = oracle
        if name == "hybrid":
            heads = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=3), seed=0)
        out[name] = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree))
    return out


@torch.inference_mode()
def exact_distribution(model, temperature: float, shaped: str | None = None) -> torch.Tensor:
    """[V**K] the probability of every K-token continuation of PROMPT at `temperature` (index: the tokens as
    base-V digits, first token most significant), from one forward over all V**(K-1) prefixes; `shaped`: under
    SHAPED[shaped] ("controls", or "both": the grammar too), written here from their definitions (`shape`)."""
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (K - 1))  # [V**(K-1), K-1]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    logits = model(ids).logits[:, len(PROMPT) - 1 :].double()  # [V**(K-1), K, V]
    if shaped:
        logits = shape(logits, prefixes, grammar=shaped == "both")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    prefix_logp = logp[:, : K - 1].gather(-1, prefixes.unsqueeze(-1)).squeeze(-1).sum(-1)  # [V**(K-1)]
    return (prefix_logp[:, None] + logp[:, K - 1]).exp().flatten()  # [V**K]


def shape(logits: torch.Tensor, prefixes: torch.Tensor, grammar: bool) -> torch.Tensor:
    """`logits` [M, K, V] of each prefix's positions under CONTROLS (float64): at position j the prefix's first j
    tokens are the generated ones. Repetition (prompt and generated tokens), frequency and presence (generated),
    the biases; then, with `grammar`, NO_REPEAT: tokens 1..7, not the previous one."""
    out = logits.clone()
    for m, prefix in enumerate(prefixes.tolist()):
        for j in range(K):
            generated = prefix[:j]
            row = out[m, j]
            for t in set(PROMPT + generated):
                r = CONTROLS["repetition_penalty"]
                row[t] = row[t] / r if row[t] > 0 else row[t] * r
            for t in set(generated):
                row[t] -= CONTROLS["frequency_penalty"] * generated.count(t) + CONTROLS["presence_penalty"]
            for t, b in CONTROLS["logit_bias"].items():
                row[t] += b
            if grammar:
                row[[0] + ([generated[-1]] if generated else [])] = float("-inf")
    return out


def draw(
    engine: Engine, temperature: float, rule: str, batched: bool, seed: int = 0, **extra
) -> tuple[torch.Tensor, list]:
    """(tokens [DRAWS, K]: the first K tokens of DRAWS generations, their results), from the global RNG seeded
    once (unseeded generations draw from it: each its own stream); `batched`: ROWS prompts per `generate_batch`."""
    torch.manual_seed(seed)
    kw = dict(max_new_tokens=K, temperature=temperature, acceptance=rule, **extra)
    if batched:
        results = [r for _ in range(DRAWS // ROWS) for r in generate_batch(engine, [PROMPT] * ROWS, **kw)]
    else:
        results = [engine.generate(PROMPT, **kw) for _ in range(DRAWS)]
    return torch.tensor([r.token_ids for r in results]), results


def projections(tokens: torch.Tensor, joint: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, counts, probabilities) of each position's token and of each pair of consecutive tokens: the
    draws `tokens` [n, K] against the exact `joint` [V**K] (V**K cells are too many for n draws; these are
    few, and a wrong acceptance shows in them)."""
    joint = joint.reshape([V] * K)
    out = []
    for j in range(K):
        others = [d for d in range(K) if d != j]
        out.append((f"token {j + 1}", torch.bincount(tokens[:, j], minlength=V), joint.sum(others)))
    for j in range(K - 1):
        others = [d for d in range(K) if d not in (j, j + 1)]
        pairs = tokens[:, j] * V + tokens[:, j + 1]
        out.append(
            (f"tokens {j + 1}-{j + 2}", torch.bincount(pairs, minlength=V * V), joint.sum(others).flatten())
        )
    return out


def chi_square(
    counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of `counts` [C] against `probs` [C]; the cells expected fewer
    than `min_expected` times are pooled into one (joined to the smallest other cell if still too small)."""
    counts = counts.double()
    expected = counts.sum() * probs
    order = torch.argsort(expected, descending=True)
    big = order[expected[order] >= min_expected]
    small = order[expected[order] < min_expected]
    obs, exp = list(counts[big]), list(expected[big])
    if len(small):
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
        if exp[-1] < min_expected:
            obs[-2:], exp[-2:] = [obs[-2] + obs[-1]], [exp[-2] + exp[-1]]
    obs_t, exp_t = torch.stack(obs), torch.stack(exp)
    stat = float(((obs_t - exp_t) ** 2 / exp_t).sum())
    dof = len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, dof, p


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def check(
    model, engine, temperature, rule, batched, shaped: str | None = None, **extra
) -> tuple[float, list]:
    """The p-value of `engine`'s draws against the exact distribution: the smallest of the projections'
    chi-square p-values times their number (Bonferroni), and the draws' results (`extra`: generation
    options, e.g. a prediction; `shaped`: under SHAPED[shaped])."""
    tokens, results = draw(engine, temperature, rule, batched, **SHAPED.get(shaped, {}), **extra)
    tests = projections(tokens, exact_distribution(model, temperature, shaped))
    worst = min(
        (chi_square(c, q) + (name, total_variation(c, q)) for name, c, q in tests), key=lambda t: t[2]
    )
    stat, dof, p, name, tv = worst
    print(f"{rule} T={temperature}: worst {name}: chi2 {stat:.1f} on {dof} dof, p={p:.2g}, TV {tv:.3f}")
    return min(1.0, p * len(tests)), results


def speculated(results) -> tuple[int, int]:
    """(steps that accepted a draft, steps that accepted 3): the premise that the trees were exercised."""
    steps = [s for r in results for s in r.steps]
    return sum(s.accepted > 0 for s in steps), sum(s.accepted >= 3 for s in steps)


# (temperature, tree, batched): every tree alone and as batch rows, every temperature both ways
CASES = [
    (0.5, "deep", False),
    (0.5, "hybrid", True),
    (1.0, "duplicates", False),
    (1.0, "deep", True),
    (1.0, "wide", False),
    (0.7, "wide", True),
    (1.5, "hybrid", False),
    (1.5, "duplicates", True),
]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_plain_sampling_follows_the_exact_distribution(model, engines, temperature):
    """The reference: the root-only tree (plain decoding) passes the check, so the enumeration is right."""
    p, _ = check(model, engines["plain"], temperature, "sample", batched=False)
    assert p > ALPHA, f"plain sampling rejected at T={temperature} (p={p:.2g})"


# gumbel: a seed's tokens are the same whatever the tree or batch (test_engine.py checks it token for token),
# so one case per temperature
GUMBEL_CASES = [(0.5, "duplicates", True), (1.0, "hybrid", False), (1.5, "wide", False)]


@pytest.mark.parametrize(
    "rule, temperature, tree, batched",
    [("sample", *case) for case in CASES] + [("gumbel", *case) for case in GUMBEL_CASES],
)
def test_speculative_sampling_follows_the_exact_distribution(
    model, engines, rule, temperature, tree, batched
):
    p, results = check(model, engines[tree], temperature, rule, batched)
    accepted, deep = speculated(results)
    assert accepted > DRAWS // 20 and (deep > 0 or tree == "hybrid"), (
        f"the premise failed: {accepted} steps accepted a draft, {deep} three"
    )
    assert p > ALPHA, f"{rule} on {tree} at T={temperature} {'batched' if batched else 'alone'}: p={p:.2g}"


@pytest.fixture(scope="module")
def shaped_engines():
    """The same model with an end-of-sequence token (a grammar needs one; NO_REPEAT never allows it within K),
    its engines per tree, the oracle drafting the shaped greedy continuation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = tiny_model("llama", seed=5, vocab=V, eos_token_id=0)
    m.lm_head.weight.mul_(10.0)
    yield {**engines_for(m, **SHAPED["both"]), "model": m}
    torch.set_num_threads(threads)


SHAPED_CASES = [  # (shaping, rule, temperature, tree, batched)
    (
        "both",
        "sample",
        1.0,
        "plain",
        False,
    ),  # the reference: the exact distribution's shaping is the engine's
    ("both", "sample", 1.0, "wide", False),
    ("both", "sample", 0.7, "hybrid", True),
    ("both", "sample", 1.5, "deep", False),
    ("both", "gumbel", 1.0, "duplicates", True),
    ("controls", "sample", 1.0, "plain", False),
    ("controls", "sample", 1.0, "wide", True),
]


def _shaped_engines(shaping: str, engines, shaped_engines) -> dict:
    """The engines of a shaping: the grammar's need an end-of-sequence token; without the grammar the model
    must have none (an end token would cut draws short of K)."""
    return shaped_engines if shaping == "both" else engines


@pytest.mark.parametrize("shaping, rule, temperature, tree, batched", SHAPED_CASES)
def test_sampling_under_a_grammar_and_penalties_follows_the_shaped_distribution(
    model, engines, shaped_engines, shaping, rule, temperature, tree, batched
):
    """Each node's mask and penalties are its own path's: drafts accepted or not, alone or as batch rows, the
    tokens follow the distribution plain decoding samples under the same grammar and controls."""
    e = _shaped_engines(shaping, engines, shaped_engines)
    m = shaped_engines["model"] if shaping == "both" else model
    p, results = check(m, e[tree], temperature, rule, batched, shaped=shaping)
    accepted, _ = speculated(results)
    assert tree == "plain" or accepted > DRAWS // 20, f"the premise failed: {accepted} steps accepted a draft"
    assert p > ALPHA, f"{rule} on {tree} at T={temperature} under the grammar and controls: p={p:.2g}"


@pytest.mark.parametrize(
    "rule, temperature, engine, batched",
    [("sample", 1.0, "plain", False), ("sample", 0.5, "deep", True), ("gumbel", 1.5, "plain", True)],
)
def test_sampling_with_a_prediction_follows_the_exact_distribution(
    model, engines, rule, temperature, engine, batched
):
    """A prediction (prediction.py: its tokens drafted by lookup nodes) changes nothing of what is drawn: the
    greedy continuation as the prediction, drafted on every step and often accepted, alone and beside the
    heads' tree, as rows of a batch too."""
    prediction = engines["plain"].generate(PROMPT, max_new_tokens=K + 4).token_ids
    p, results = check(model, engines[engine], temperature, rule, batched, prediction=prediction)
    assert sum(s.lookup_accepted for r in results for s in r.steps) > DRAWS // 20, "the premise failed"
    assert p > ALPHA, f"{rule} with a prediction on {engine} at T={temperature}: p={p:.2g}"


@pytest.mark.parametrize("rule, temperature, batched", [("sample", 1.0, False), ("gumbel", 0.7, True)])
def test_sampling_with_a_warm_suffix_cache_follows_the_exact_distribution(model, rule, temperature, batched):
    """Suffix drafts (suffix.py: earlier generations' outputs, drafted by lookup nodes) change nothing of what
    is drawn: every draw's output joins the cache the next draws copy from, alone and as rows of a batch."""
    pytest.importorskip(
        "arctic_inference", reason="suffix drafts need arctic-inference (make setup installs it)"
    )
    from entmtp.suffix import SuffixCache

    engine = Engine(model, ByteTokenizer(), suffix=SuffixCache())
    p, results = check(model, engine, temperature, rule, batched)
    assert sum(s.lookup_accepted for r in results for s in r.steps) > DRAWS // 20, "the premise failed"
    assert p > ALPHA, f"{rule} with a suffix cache at T={temperature}: p={p:.2g}"


def test_duplicate_siblings_are_drafted(engines, monkeypatch):
    """The premise of the "duplicates" tree: its head and lookup chains draft the same token side by side."""
    seen = []
    real = accept_mod.accept_sample

    def spy(tree, tokens, probs, generator):
        kids = {}
        for node, parent in enumerate(tree.parents.tolist()):
            kids.setdefault(parent, []).append(int(tokens[node]))
        seen.append(any(len(set(k)) < len(k) for p, k in kids.items() if p >= 0))
        return real(tree, tokens, probs, generator)

    monkeypatch.setattr(accept_mod, "accept_sample", spy)
    torch.manual_seed(0)
    for _ in range(20):
        engines["duplicates"].generate(PROMPT, max_new_tokens=K, temperature=1.0)
    assert sum(seen) > len(seen) // 10


# ---- the checks have teeth ----------------------------------------------------------------------------------


def mutant(fn, replacements: dict[str, str], module=accept_mod):
    """`fn` (a function of `module`, entmtp.accept by default) recompiled with its source's `replacements`
    applied: one rule broken."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in replacements.items():
        assert src.count(old) == 1, f"{old!r} is no longer in {fn.__name__}: update this mutation"
        src = src.replace(old, new)
    namespace = dict(vars(module))
    exec(compile(src, f"<mutant of {fn.__name__}>", "exec"), namespace)
    return namespace[fn.__name__]


MUTANTS = {
    # rejected drafts stay in the residual: the next sibling and the bonus are drawn from p itself
    "residual not subtracted": ("accept_sample", {"residual[t] = 0.0": "pass", "mass -= p": "pass"}),
    # a draft accepted with the ratio p(x) / max p (a likely draft always kept) instead of p(x)
    "wrong acceptance ratio": (
        "accept_sample",
        {"p = float(residual[t])": "p = float(residual[t] / residual.max())"},
    ),
    # every depth verified with the noise of the first position: tokens of one step correlated
    "gumbel noise of one position": ("gumbel_targets", {"noise[depth]": "noise[0]"}),
    # the subtle one: a rejected sibling's token leaves the residual, but its mass is not taken out of it
    "rejected mass kept": ("accept_sample", {"mass -= p": "pass"}),
}


@pytest.mark.parametrize(
    "name, temperature, tree, batched",
    [
        ("residual not subtracted", 1.0, "duplicates", False),
        ("wrong acceptance ratio", 1.0, "deep", False),
        ("gumbel noise of one position", 1.0, "deep", True),
        ("rejected mass kept", 1.0, "wide", False),
        ("rejected mass kept", 0.7, "wide", True),
    ],
)
def test_a_broken_acceptance_fails_the_check(model, engines, monkeypatch, name, temperature, tree, batched):
    fn_name, replacements = MUTANTS[name]
    monkeypatch.setattr(accept_mod, fn_name, mutant(getattr(accept_mod, fn_name), replacements))
    rule = "gumbel" if fn_name == "gumbel_targets" else "sample"
    p, _ = check(model, engines[tree], temperature, rule, batched)
    assert p < ALPHA, f"the check missed a broken acceptance ({name}): p={p:.2g}"


SHAPING_MUTANTS = {
    # a node penalised on its parent's prefix: its own drafted token not counted
    "penalty on the parent's prefix": (
        "node_paths",
        {"paths.append([*paths[parents[node]], tokens[node]])": "paths.append(list(paths[parents[node]]))"},
    ),
    # each node masked with its parent's mask (the grammar one token behind on the path)
    "mask of the parent's path": (
        "Shaping.logits",
        {"out = apply_masks(out, masks)": "out = apply_masks(out, masks[tree.parents.clamp(min=0).numpy()])"},
    ),
}


@pytest.mark.parametrize(
    "name, shaping, tree, batched",
    [
        ("penalty on the parent's prefix", "controls", "wide", False),
        ("mask of the parent's path", "both", "wide", True),
    ],
)
def test_a_broken_shaping_fails_the_check(
    model, engines, shaped_engines, monkeypatch, name, shaping, tree, batched
):
    """A mask one token behind lets a forbidden token through, which the grammar's matcher refuses (an error:
    caught) or the distribution shows; a penalty on the wrong prefix only the distribution can show (under
    NO_REPEAT it could not: a node's own token is masked after it, so the controls are checked alone)."""
    fn_name, replacements = SHAPING_MUTANTS[name]
    owner = shaping_mod.Shaping if "." in fn_name else shaping_mod
    fn = getattr(owner, fn_name.split(".")[-1])
    monkeypatch.setattr(owner, fn_name.split(".")[-1], mutant(fn, replacements, shaping_mod))
    e = _shaped_engines(shaping, engines, shaped_engines)
    m = shaped_engines["model"] if shaping == "both" else model
    try:
        p, _ = check(m, e[tree], 1.0, "sample", batched, shaped=shaping)
    except EntMTPError as e:
        assert "matcher failed" in str(e) and name == "mask of the parent's path"
        return
    assert p < ALPHA, f"the check missed a broken shaping ({name}): p={p:.2g}"


# the mask applied to the drawn token only: every rule reads the unmasked (penalised) logits, and a token the
# grammar forbids, once drawn, is set right by the allowed token the model likes best
DRAWN_ONLY = {
    "logits = state.shaping.logits(logits, tree, tokens, step.masks)": (
        "logits, masked = state.shaping.logits(logits, tree, tokens, None), "
        "state.shaping.logits(logits, tree, tokens, step.masks)"
    ),
    "acc = accept(tree, tokens, logits, state.sampling, state.generator, noise)": (
        "acc = accept(tree, tokens, logits, state.sampling, state.generator, noise)\n"
        "    if state.shaping is not None and not torch.isfinite(masked[acc.path[-1], acc.bonus]):\n"
        "        acc = dataclasses.replace(acc, bonus=int(masked[acc.path[-1]].argmax()))"
    ),
}


@pytest.mark.parametrize("tree", ["plain", "wide"])
def test_a_mask_applied_to_the_drawn_token_only_fails_the_check(shaped_engines, monkeypatch, tree):
    """The grammar shapes the distribution every rule draws from, not the token drawn: an engine that samples
    from the unmasked logits and mends a forbidden draw afterwards (here: with the best allowed token) writes only
    valid text, yet not plain constrained sampling's. (Mending it by a draw from the masked distribution would be
    exact: a rejection sampler of the masked distribution, so that mutant would rightly pass.)"""
    monkeypatch.setattr(engine_mod, "conclude", mutant(engine_mod.conclude, DRAWN_ONLY, engine_mod))
    p, _ = check(shaped_engines["model"], shaped_engines[tree], 1.0, "sample", False, shaped="both")
    assert p < ALPHA, f"the check missed a mask applied to the drawn token only ({tree}): p={p:.2g}"


def test_typical_acceptance_is_lossy_and_the_check_says_how_far(model, engines):
    """Typical acceptance (Medusa-2) keeps any draft the base model finds likely enough and draws the bonus
    from the likely tokens only: by design its text does not follow the base distribution. The check rejects
    it, and its distance from plain sampling is several times the draws' noise."""
    p, results = check(model, engines["deep"], 1.5, "typical", batched=False)
    tokens = torch.tensor([r.token_ids for r in results])
    _, counts, probs = projections(tokens, exact_distribution(model, 1.5))[-1]  # tokens K-1, K
    tv, noise = total_variation(counts.double(), probs), expected_tv(probs, DRAWS)
    print(f"typical T=1.5: TV {tv:.3f} from plain sampling on the last two tokens (noise {noise:.3f})")
    assert p < ALPHA and tv > 2 * noise


def expected_tv(probs: torch.Tensor, n: int) -> float:
    """An upper bound on the total variation of n exact draws: sum of each cell's standard deviation / 2."""
    return 0.5 * float((probs * (1 - probs) / n).sqrt().sum())
