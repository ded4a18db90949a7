"""A policy that switches trees every step (root-only, chain, big tree, small tree, ...): greedy output stays
identical to plain decoding, so the KV commit and the heads' state stay right across any tree sequence, the
root-only tree included. This is what a per-step scheduler relies on."""

from __future__ import annotations

import pytest

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.engine import Engine
from entmtp.heads import HeadsConfig, random_heads
from entmtp.policy import Choice, StepContext
from entmtp.records import Step
from entmtp.tree import Tree, load_tree

CYCLE = ["none", "chain_3", "mc_sim_7b_63", "tree_4"]


class CyclingPolicy:
    """Cycles through root-only, chain_3, mc_sim_7b_63, tree_4 and back, one tree per step."""

    master = None  # no probe
    lookup = None  # its hybrid trees' lookup nodes are drafted with Lookup()'s n-grams

    def __init__(self):
        self.trees = [Tree.root_only()] + [load_tree(n) for n in CYCLE[1:]]
        self.contexts: list[StepContext] = []
        self.observed: list[Step] = []

    def fresh(self) -> CyclingPolicy:
        self.contexts, self.observed = [], []  # one generation at a time: the test reads what it saw
        return self

    def choose(self, ctx: StepContext) -> Choice:
        self.contexts.append(ctx)
        return Choice(self.trees[ctx.step % len(self.trees)], {})

    def observe(self, step: Step) -> None:
        self.observed.append(step)


def plain_greedy(model, ids, n):
    return Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=n).token_ids


def check_cycle(result, policy, prompt_len, n):
    trees = [s.tree for s in result.steps]
    assert len(trees) >= 8
    assert trees[:8] == CYCLE * 2
    assert trees == [CYCLE[i % len(CYCLE)] for i in range(len(trees))]
    for s in result.steps:
        if s.tree == "none":
            assert s.tree_nodes == 0 and s.accepted == 0
    # the policy saw every step, in order, with the right cache position and budget
    assert [c.step for c in policy.contexts] == list(range(len(trees)))
    pos, emitted = prompt_len, 1
    for ctx, step in zip(policy.contexts, policy.observed, strict=True):
        assert (ctx.position, ctx.remaining) == (pos, n - emitted)
        pos += step.accepted + 1
        emitted += step.accepted + 1


@pytest.mark.parametrize("seed", [1, 2])
def test_oracle_heads_cycling_trees_identical_output(seed):
    model = tiny_model("llama", seed=seed)
    ids = [5, 17, 99, 3, 250, 7, 7, 64]
    n = 64
    ref = plain_greedy(model, ids, n)
    heads = OracleHeads(ids + ref, rank_mod=2)  # the truth sits on rank 1 half the time: side branches
    policy = CyclingPolicy()
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=policy)
    result = engine.generate(ids, max_new_tokens=n)
    assert result.token_ids == ref
    check_cycle(result, policy, len(ids), n)
    # the tree steps really accept drafts (so root-only steps commit after multi-token steps and vice versa)
    by_tree = {name: [s.accepted for s in result.steps if s.tree == name] for name in CYCLE}
    assert max(by_tree["mc_sim_7b_63"]) >= 2 and max(by_tree["chain_3"]) >= 1
    # a second generation on the same engine starts the cycle again (reset) and gives the same output
    again = engine.generate(ids, max_new_tokens=n)
    assert again.token_ids == ref and [s.tree for s in again.steps] == [s.tree for s in result.steps]


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_random_heads_cycling_trees_identical_output(kind):
    model = tiny_model("llama", seed=4)
    cfg = HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    ids = list(range(100, 120))
    n = 32
    ref = plain_greedy(model, ids, n)
    policy = CyclingPolicy()
    result = Engine(model, ByteTokenizer(), heads=heads, policy=policy).generate(ids, max_new_tokens=n)
    assert result.token_ids == ref
    check_cycle(result, policy, len(ids), n)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_shipped_heads_cycling_trees_equal_plain_greedy(embedded, kind):
    from entmtp.prompts import load_prompts
    from entmtp.shipped import resolve_heads

    model, tok = embedded
    plain = Engine(model, tok)
    policy = CyclingPolicy()
    spec = Engine(model, tok, heads=resolve_heads(kind, model), policy=policy)
    accepted = 0
    for i, prompt in enumerate(load_prompts("gsm8k", "calib", n=3)):
        ref = plain.generate(prompt, max_new_tokens=32)
        out = spec.generate(prompt, max_new_tokens=32)
        assert out.token_ids == ref.token_ids, f"{kind} heads, gsm8k calib prompt {i}"
        assert out.text == ref.text
        trees = [s.tree for s in out.steps]
        assert trees == [CYCLE[j % len(CYCLE)] for j in range(len(trees))]
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0  # trained heads: drafts were accepted between the root-only steps


class HybridCyclingPolicy(CyclingPolicy):
    """Cycles through root-only, heads + lookup chain, lookup alone, lookup below head nodes, a heads tree."""

    def __init__(self):
        from entmtp.tree import with_lookup

        super().__init__()
        below = Tree.from_paths([[0], [1], [0, 0], [0, "L0"], [0, 0, "L0"], [0, 0, "L0", "L0"]], "below")
        self.trees = [
            Tree.root_only(),
            with_lookup(load_tree("tree_4"), 4),
            with_lookup(Tree.root_only(), 6, branches=2),
            below,
            load_tree("chain_3"),
        ]


@pytest.mark.parametrize("seed", [1, 2])
def test_cycling_hybrid_and_lookup_trees_identical_output(seed):
    model = tiny_model("llama", seed=seed)
    ids = [5, 17, 99, 3, 250, 7, 64, 5, 17, 99, 3, 250, 7, 64, 5, 17]  # repeats: the lookup finds matches
    n = 64
    ref = plain_greedy(model, ids, n)
    heads = OracleHeads(ids + ref, rank_mod=2, wrong_every=3)
    policy = HybridCyclingPolicy()
    result = Engine(model, ByteTokenizer(), heads=heads, policy=policy).generate(ids, max_new_tokens=n)
    assert result.token_ids == ref
    assert [c.step for c in policy.contexts] == list(range(len(result.steps)))
    assert sum(s.lookup_accepted for s in result.steps) > 0  # copied drafts were kept between the others
