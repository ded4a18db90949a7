"""Acceptance rules on hand-made logits: greedy picks the longest agreeing path; lossless sampling follows
the target distribution (checked on many draws, not one); typical acceptance applies its threshold."""

from __future__ import annotations

import math

import pytest
import torch

from entmtp.accept import (
    GREEDY_BELOW,
    GumbelNoise,
    Sampling,
    accept,
    accept_greedy,
    accept_targets,
    gumbel_targets,
    tree_targets,
)
from entmtp.errors import EntMTPError
from entmtp.tree import Tree

V = 6
TREE = Tree.from_paths([(0,), (1,), (0, 0), (1, 0), (1, 1)])  # nodes: 0 root, 1 (0,), 2 (1,), 3, 4, 5


def onehot_logits(targets):
    logits = torch.full((len(targets), V), -10.0)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 10.0
    return logits


def test_greedy_takes_the_longest_agreeing_path_through_a_side_branch():
    tokens = torch.tensor([9 % V, 1, 2, 3, 4, 5])  # root, (0,)=1, (1,)=2, (0,0)=3, (1,0)=4, (1,1)=5
    # base argmax after root is 2 (node 2 right), after node 2 is 5 (node 5 right), after node 5 is 0
    targets = [2, 0, 5, 0, 0, 0]
    acc = accept_greedy(TREE, tokens, onehot_logits(targets))
    assert acc.path == [0, 2, 5] and acc.bonus == 0


def test_greedy_rejects_everything_and_keeps_the_bonus():
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    acc = accept_greedy(TREE, tokens, onehot_logits([4, 0, 0, 0, 0, 0]))
    assert acc.path == [0] and acc.bonus == 4


def test_root_only_tree():
    acc = accept_greedy(Tree.root_only(), torch.tensor([3]), onehot_logits([1]))
    assert acc.path == [0] and acc.bonus == 1


def test_a_chain_is_accepted_as_any_tree_is():
    """A chain (a lookup's, a grammar's forced one) is walked in Python, a plain step read off numpy: the same
    path and bonus as the tensor walk of any tree, on random chains of every depth with every first miss, and
    on float32 logits greedy's argmax (the first maximum on ties)."""
    g = torch.Generator().manual_seed(0)
    for depth in range(0, 9):
        chain = Tree(f"c{depth}", tuple((0,) * d for d in range(1, depth + 1))) if depth else Tree.root_only()
        for miss in range(depth + 2):  # the first wrong draft's depth (depth + 1: none wrong)
            target = torch.randint(0, 5, (depth + 1,), generator=g)
            tokens = torch.cat([torch.tensor([7]), target[:-1]])  # each draft the target at its parent
            if miss <= depth and miss > 0:
                tokens[miss] = (target[miss - 1] + 1) % 5
            got, want = accept_targets(chain, tokens, target), tree_targets(chain, tokens, target)
            assert (got.path, got.bonus) == (want.path, want.bonus)
            assert len(got.path) == (miss if 0 < miss <= depth else depth + 1)
            logits = torch.randn(depth + 1, V, generator=g)
            logits[:, 2] = logits[:, 4] = 50.0  # a tie: the first maximum
            got = accept_greedy(chain, tokens, logits)
            want = tree_targets(chain, tokens, logits.argmax(-1))
            assert (got.path, got.bonus) == (want.path, want.bonus) and got.bonus == 2


def _target_probs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(TREE.size, V, generator=g) * 1.5, dim=-1)  # [N+1, V]


@pytest.mark.parametrize("drafts", [[2, 3, 4, 5], [1, 2, 2, 3], [4, 0, 1, 2]])
def test_sampling_is_lossless_first_token_and_conditional_second_token(drafts):
    probs = _target_probs()
    top = int(probs[0].argmax())  # node 1 drafts the likeliest token: many draws condition on it
    tokens = torch.tensor([0, top, *drafts])
    logits = torch.log(probs)  # temperature 1
    g = torch.Generator().manual_seed(123)
    n = 20000
    first = torch.zeros(V)
    second_given = torch.zeros(
        V
    )  # second token when node 1's token was accepted (node 2's too if it repeats it)
    n_given = 0
    sampling = Sampling(temperature=1.0)
    for _ in range(n):
        acc = accept(TREE, tokens, logits, sampling, g)
        emitted = tokens[acc.path[1:]].tolist() + [acc.bonus]
        first[emitted[0]] += 1
        if len(acc.path) > 1 and emitted[0] == top:
            n_given += 1
            second_given[emitted[1]] += 1
    tv = 0.5 * (first / n - probs[0]).abs().sum()
    assert tv < 0.02, f"first-token distribution off by TV {tv:.3f}"
    tv2 = 0.5 * (second_given / n_given - probs[1]).abs().sum()
    tol = 1.5 * math.sqrt(V / n_given)  # ~3x the expected TV of n_given multinomial draws
    assert n_given > 2000 and tv2 < tol, f"second-token distribution off by TV {tv2:.3f} ({n_given} draws)"


def test_sampling_follows_every_sibling_that_drafted_the_accepted_token():
    """A hybrid tree's lookup branch may repeat a head's draft: once that token is accepted, the walk goes on
    below both nodes, so the deeper copy's continuation is not lost (node 1 and node 2 both draft 3; only node
    2 has the right child)."""
    tokens = torch.tensor([0, 3, 3, 1, 5, 2])  # root, (0,)=3, (1,)=3, (0,0)=1, (1,0)=5, (1,1)=2
    logits = onehot_logits([3, 5, 5, 0, 0, 0])  # after the root: 3, surely; after a 3: 5, surely
    acc = accept(TREE, tokens, logits, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    assert acc.path == [0, 2, 4] and acc.bonus == 0


def test_typical_acceptance_threshold():
    # root distribution: entropy-based threshold min(0.09, 0.3 * exp(-H))
    p = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    h = -(p[p > 0] * p[p > 0].log()).sum().item()
    threshold = min(0.09, 0.3 * math.exp(-h))
    probs = p.repeat(TREE.size, 1)
    logits = torch.log(probs.clamp_min(1e-30))
    sampling = Sampling(temperature=1.0, acceptance="typical")
    g = torch.Generator().manual_seed(0)
    for tok in range(V):
        tokens = torch.tensor([0, tok, (tok + 1) % V, 0, 0, 0])
        acc = accept(TREE, tokens, logits, sampling, g)
        assert (len(acc.path) > 1 and acc.path[1] == 1) == bool(p[tok] > threshold)
        assert p[acc.bonus] > threshold  # the bonus is drawn from the passing set


def test_sampling_settings_are_validated():
    with pytest.raises(EntMTPError, match="temperature must be >= 0"):
        Sampling(temperature=-0.5)
    with pytest.raises(EntMTPError, match="needs a temperature > 0"):
        Sampling(temperature=0.0, acceptance="sample")
    with pytest.raises(EntMTPError, match="unknown acceptance"):
        Sampling(temperature=1.0, acceptance="beam")


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 9.9e-6])
@pytest.mark.parametrize("acceptance", ["auto", "sample", "typical", "gumbel"])
def test_a_temperature_below_greedy_below_is_greedy_decoding(temperature, acceptance):
    """logits / 1e-40 overflowed float32: such a request wrote degenerate text. Under GREEDY_BELOW every rule
    keeps the argmax (its limit as T -> 0), so it decodes greedily, stored as T = 0."""
    sampling = Sampling(temperature=temperature, acceptance=acceptance)
    assert sampling.temperature == 0.0 and sampling.rule == "greedy"
    assert Sampling(temperature=GREEDY_BELOW, acceptance=acceptance).rule != "greedy"


def test_gumbel_noise_is_a_function_of_seed_and_position_alone():
    """The same (seed, position) gives the same noise whatever was asked before or with it, so a position's
    token does not depend on the step that decides it; another seed or position gives other noise."""
    a = GumbelNoise(seed=7, vocab_size=50)
    first = a.at([3, 4, 5])
    later = a.at([5, 6])  # asked again after the decode moved on
    fresh = GumbelNoise(seed=7, vocab_size=50).at([5])
    assert torch.equal(first[2], later[0]) and torch.equal(later[0], fresh[0])
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(GumbelNoise(seed=8, vocab_size=50).at([5])[0], fresh[0])
    with pytest.raises(EntMTPError, match="seed >= 0"):
        GumbelNoise(seed=-1, vocab_size=50)


def test_gumbel_targets_are_draws_from_the_temperature_distribution():
    """argmax(logits / T + g) over positions (fresh noise each) samples softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temperature, n = 0.7, 20000
    noise = GumbelNoise(seed=0, vocab_size=V).at(range(n))  # [n, V]
    root = Tree.root_only()
    draws = torch.cat([gumbel_targets(root, logits, noise[i : i + 1], temperature) for i in range(n)])
    freq = torch.bincount(draws, minlength=V).float() / n
    tv = 0.5 * (freq - torch.softmax(logits[0] / temperature, dim=-1)).abs().sum()
    assert tv < 0.02, f"gumbel draws off the temperature-T distribution by TV {tv:.3f}"


def test_gumbel_acceptance_is_greedy_against_the_perturbed_targets():
    """Each node's target is argmax(logits / T + the noise row of its depth): here the noise overrules the
    logits after the root (token 2 wins), after the depth-1 nodes (token 5) and after the depth-2 ones (token
    3), so the path is the one greedy would keep for those targets."""
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    logits = torch.zeros(TREE.size, V)
    logits[:, 0] = 1.0  # the argmax is 0 everywhere: greedy would keep nothing
    noise = torch.zeros(TREE.depth + 1, V)
    noise[0, 2] = noise[1, 5] = noise[2, 3] = 5.0
    acc = accept(TREE, tokens, logits, Sampling(temperature=1.0, acceptance="gumbel"), noise=noise)
    assert acc.path == [0, 2, 5] and acc.bonus == 3
    with pytest.raises(EntMTPError, match="needs the noise"):
        accept(TREE, tokens, logits, Sampling(temperature=1.0, acceptance="gumbel"))
