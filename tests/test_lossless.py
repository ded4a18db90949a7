"""Lossless sampling through the engine: the first K generated tokens of speculative sampling follow the base
model's temperature-T distribution, computed exactly by enumerating every prefix of a small-vocabulary model.

Each check draws `DRAWS` generations of K tokens and compares them with the exact joint distribution (V**K
outcomes, too many cells for the draws) through its projections: each position's token (V cells) and each pair
of consecutive tokens (V**2 cells), by Pearson's chi-square (cells expected fewer than 5 times pooled); the
check's p-value is the smallest of the 2K-1 p-values times 2K-1 (Bonferroni), rejected under `ALPHA`. Draws are
seeded, so a run repeats exactly. The checks have teeth: on the same draws' count the same statistic rejects
the engine with one line of its acceptance broken (the mutation tests at the end), and rejects typical
acceptance, which is lossy by design."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

import entmtp.accept as accept_mod
from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.batch import generate_batch
from entmtp.engine import Engine
from entmtp.heads import HeadsConfig, random_heads
from entmtp.policy import static
from entmtp.tree import Tree

V = 8  # vocabulary: V**K outcomes, few enough for the exact distribution and a powerful test
K = 4  # tokens per draw: the prefill's, then a step whose tree reaches depth 3
PROMPT = [1, 2, 3, 3, 1, 2, 3, 3, 1, 2]  # repeats: lookup proposes, often what the heads draft too
DRAWS = 400
ROWS = 16  # rows per batch in the batched checks (DRAWS / ROWS batches)
ALPHA = 1e-4  # a correct engine fails a check this rarely (and never: the draws are seeded)

TREES = {
    # depth 3 with side branches at every depth
    "deep": Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]),
    # a head chain beside a lookup chain: where they draft the same token, duplicate siblings
    "duplicates": Tree.from_paths([[0], ["L0"], [0, 0], ["L0", "L0"], [0, 0, 0], ["L0", "L0", "L0"]]),
    # heads and lookup mixed: lookup below head nodes, two head ranks at the root
    "hybrid": Tree.from_paths([[0], [1], ["L0"], [0, 0], [0, "L0"], [0, 0, "L0"], [1, 0]]),
}


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
    plain = Engine(model, ByteTokenizer())
    greedy = plain.generate(PROMPT, max_new_tokens=K + 4).token_ids
    oracle = OracleHeads(PROMPT + greedy, num_heads=3, rank_mod=1)
    out = {"plain": plain}
    for name, tree in TREES.items():
        heads = oracle
        if name == "hybrid":
            heads = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=3), seed=0)
        out[name] = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree))
    return out


@torch.inference_mode()
def exact_distribution(model, temperature: float) -> torch.Tensor:
    """[V**K] the probability of every K-token continuation of PROMPT at `temperature` (index: the tokens as
    base-V digits, first token most significant), from one forward over all V**(K-1) prefixes."""
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (K - 1))  # [V**(K-1), K-1]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    logits = model(ids).logits[:, len(PROMPT) - 1 :].double()  # [V**(K-1), K, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    prefix_logp = logp[:, : K - 1].gather(-1, prefixes.unsqueeze(-1)).squeeze(-1).sum(-1)  # [V**(K-1)]
    return (prefix_logp[:, None] + logp[:, K - 1]).exp().flatten()  # [V**K]


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


def check(model, engine, temperature, rule, batched, **extra) -> tuple[float, list]:
    """The p-value of `engine`'s draws against the exact distribution: the smallest of the projections'
    chi-square p-values times their number (Bonferroni), and the draws' results (`extra`: generation
    options, e.g. a prediction)."""
    tokens, results = draw(engine, temperature, rule, batched, **extra)
    tests = projections(tokens, exact_distribution(model, temperature))
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
GUMBEL_CASES = [(0.5, "duplicates", True), (1.0, "hybrid", False), (1.5, "deep", False)]


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


def mutant(fn, replacements: dict[str, str]):
    """`fn` (a function of entmtp.accept) recompiled with its source's `replacements` applied: one rule broken."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in replacements.items():
        assert src.count(old) == 1, f"{old!r} is no longer in {fn.__name__}: update this mutation"
        src = src.replace(old, new)
    namespace = dict(vars(accept_mod))
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
}


@pytest.mark.parametrize(
    "name, temperature, tree, batched",
    [
        ("residual not subtracted", 1.0, "duplicates", False),
        ("wrong acceptance ratio", 1.0, "deep", False),
        ("gumbel noise of one position", 1.0, "deep", True),
    ],
)
def test_a_broken_acceptance_fails_the_check(model, engines, monkeypatch, name, temperature, tree, batched):
    fn_name, replacements = MUTANTS[name]
    monkeypatch.setattr(accept_mod, fn_name, mutant(getattr(accept_mod, fn_name), replacements))
    rule = "gumbel" if fn_name == "gumbel_targets" else "sample"
    p, _ = check(model, engines[tree], temperature, rule, batched)
    assert p < ALPHA, f"the check missed a broken acceptance ({name}): p={p:.2g}"


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
