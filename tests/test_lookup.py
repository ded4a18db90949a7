"""Prompt-lookup drafts: the n-gram index, hybrid trees, and lossless decoding with lookup nodes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, ProbeReadingPolicy, tiny_model
from entmtp import engine as engine_module
from entmtp.accept import Sampling, _typical_threshold
from entmtp.engine import Engine
from entmtp.errors import EntMTPError, TreeError
from entmtp.heads import HeadsConfig, LazyProbe, random_heads
from entmtp.lookup import Lookup, NgramIndex, draft_lookup, source_depths
from entmtp.policy import static
from entmtp.scheduler.hybrid import HybridPolicy, hybrid
from entmtp.scheduler.policies import LatencyModel
from entmtp.tree import Tree, load_tree, prune, with_lookup

# step latency (ms) by drafted nodes where nodes are dear (a 2-core CPU in float32): heads that miss cannot pay
COSTLY = LatencyModel([0, 1, 2, 4, 8, 16, 64], [36.8, 44.5, 49.5, 56.6, 67.0, 85.4, 187.1])

# ---- the n-gram index -------------------------------------------------------------------------------------


def test_longest_match_wins_over_shorter_and_more_frequent_ones():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 9, 5, 3, 7, 5, 3, 7, 2, 3]
    index = NgramIndex(seq, max_ngram=3)
    # tail (2, 3): the bigram occurred at 1-2, followed by 9; the unigram 3 is followed by 7 more often
    cands, match = index.candidates([2, 3], k=3)
    assert match == 2
    assert cands == [9, 7]  # the longest match first, then the unigram's other continuations
    cands, match = index.candidates([5, 3], k=1)
    assert (cands, match) == ([7], 2)


def test_no_match_proposes_nothing_and_the_last_occurrence_has_no_continuation():
    index = NgramIndex([4, 5, 6], max_ngram=2)
    assert index.candidates([7], k=4) == ([], 0)
    assert index.candidates([5, 6], k=4) == ([], 0)  # (5, 6) ends the sequence: nothing followed it yet
    assert index.candidates([4], k=4) == ([5], 1)


def test_ties_in_frequency_go_to_the_most_recent_continuation():
    index = NgramIndex([8, 1, 8, 2, 8, 3, 0], max_ngram=1)
    assert index.candidates([8], k=3)[0] == [3, 2, 1]
    index.extend([8, 2])
    assert index.candidates([8], k=3)[0] == [2, 3, 1]  # 2 now follows 8 twice


def test_index_updates_incrementally():
    seq = torch.randint(0, 6, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = NgramIndex(seq, max_ngram=3)
    grown = NgramIndex(seq[:10], max_ngram=3)
    for i in range(10, 300, 7):
        grown.extend(seq[i : i + 7])
    assert grown.tokens == whole.tokens and grown.ends == whole.ends
    grown = NgramIndex(seq[:50], max_ngram=3)
    before = grown.candidates(seq[:50][-3:], k=4)
    grown.extend(seq[50:])
    assert grown.candidates(seq[-3:], k=4) == whole.candidates(seq[-3:], k=4)
    assert before == NgramIndex(seq[:50], max_ngram=3).candidates(seq[:50][-3:], k=4)


def test_bad_lookup_settings_are_named():
    with pytest.raises(EntMTPError, match="max_ngram >= 1"):
        Lookup(max_ngram=0)
    with pytest.raises(EntMTPError, match="node_cost must be >= 0"):
        Lookup(node_cost=-1)


# ---- hybrid trees -----------------------------------------------------------------------------------------


def test_hybrid_tree_syntax_order_and_head_part():
    tree = Tree.from_paths([["L0", "L0"], [0], ["L0"], [1], [0, "L0"], [0, 0], ["L1"]], "h")
    assert tree.paths == ((0,), (1,), ("L0",), ("L1",), (0, 0), (0, "L0"), ("L0", "L0"))
    assert tree.lookup.tolist() == [False, False, False, True, True, False, True, True]
    assert tree.heads_tree.paths == ((0,), (1,), (0, 0))
    assert tree.head_nodes.tolist() == [0, 1, 2, 5]
    assert tree.num_lookup == 4 and tree.depth == 2 and tree.topk == 2
    tree.check_fits(num_heads=2, require_contiguous=True)
    deep = Tree.from_paths([[0], [0, "L0"], [0, "L0", "L0"], [0, "L0", "L0", "L0"]])
    deep.check_fits(num_heads=1)  # lookup depth is not bounded by the heads


@pytest.mark.parametrize(
    "paths, message",
    [
        ([["L0", 0]], "head rank after a lookup rank"),
        ([["X1"]], 'a lookup rank is written "L" and a number'),
        ([["L"]], 'a lookup rank is written "L" and a number'),
        ([["L-1"]], 'a lookup rank is written "L" and a number'),
        ([["L0", "L0"]], r"needs its parent \('L0',\)"),
        ([[0.5]], "not a non-empty list of ranks"),
        ([["L0"], ["L0"]], "appears twice"),
    ],
)
def test_malformed_hybrid_paths_get_clear_errors(paths, message):
    with pytest.raises(TreeError, match=message):
        Tree.from_paths(paths)


def test_hybrid_tree_files_load_and_bad_ones_name_the_file(tmp_path):
    good = tmp_path / "hyb.json"
    good.write_text(json.dumps([[0], [0, "L0"], ["L0"], ["L0", "L0"]]))
    assert load_tree(str(good)).num_lookup == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([["L0"], ["L0", 1]]))
    with pytest.raises(TreeError, match=r"bad\.json.*head rank after a lookup rank"):
        load_tree(str(bad))


def test_with_lookup_and_prune():
    base = load_tree("tree_8")
    hyb = with_lookup(base, 4, branches=2)
    assert hyb.name == "tree_8+L2x4" and hyb.num_lookup == 8
    assert hyb.heads_tree is base  # the heads' per-tree plans are shared
    assert with_lookup(base, 0) is base
    keep = tuple(hyb.head_nodes[1:].tolist()) + tuple(
        i for i in range(1, hyb.size) if hyb.paths[i - 1] == ("L0",)
    )
    small = prune(hyb, tuple(sorted(keep)))
    assert small.num_lookup == 1 and small.heads_tree is base and small.name == hyb.name
    assert prune(hyb, tuple(hyb.head_nodes[1:].tolist())) is base
    assert prune(with_lookup(Tree.root_only(), 3), ()).num_nodes == 0


def test_draft_lookup_fills_chains_and_drops_nodes_without_a_proposal():
    index = NgramIndex([1, 2, 3, 4, 1, 2], max_ngram=2)  # the root is the last token, 2
    tree = Tree.from_paths([["L0"], ["L0", "L0"], ["L0", "L0", "L0"], ["L1"], ["L1", "L0"]])
    tokens = [2] + [None] * tree.num_nodes
    keep = draft_lookup(tree, tokens, index)
    # after (1, 2) came 3, then (2, 3) -> 4, then (3, 4) -> 1; (2,) has one continuation only: no rank 1
    assert [tree.paths[i - 1] for i in keep] == [("L0",), ("L0", "L0"), ("L0", "L0", "L0")]
    assert [tokens[i] for i in keep] == [3, 4, 1]


def test_lookup_below_head_nodes_continues_the_heads_branch():
    index = NgramIndex([7, 8, 9, 5, 7], max_ngram=2)  # root 7
    tree = Tree.from_paths([[0], [0, "L0"], [0, "L0", "L0"]])
    tokens = [7, 8, None, None]  # head 1 drafted 8 after the root
    keep = draft_lookup(tree, tokens, index)
    assert keep == [1, 2, 3] and tokens == [7, 8, 9, 5]


def test_source_depths_are_what_each_source_alone_would_accept():
    tree = Tree.from_paths([[0], [0, 0], ["L0"], ["L0", "L0"], ["L0", "L0", "L0"]])
    #        root  0   L0  00  L0L0 L0L0L0
    tokens = [5, 6, 6, 1, 7, 9]
    assert source_depths(tree, tokens, [6, 7, 8]) == {"heads": 1, "lookup": 2}
    assert source_depths(tree, tokens, [3]) == {"heads": 0, "lookup": 0}


# ---- lossless decoding ------------------------------------------------------------------------------------

REPEATING = [5, 17, 99, 3, 250, 7, 64, 5, 17, 99, 3, 250, 7, 64, 5, 17]
DISTINCT = list(range(100, 124))


def plain_greedy(model, ids, n):
    return Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=n).token_ids


@pytest.mark.parametrize("ids", [REPEATING, DISTINCT], ids=["repeating", "distinct"])
@pytest.mark.parametrize(
    "lookup", [Lookup(), Lookup(adaptive=False, tokens=6), Lookup(max_ngram=1, branches=2)]
)
def test_lookup_only_decoding_equals_plain_greedy(ids, lookup):
    model = tiny_model("llama", seed=3)
    n = 64
    ref = plain_greedy(model, ids, n)
    result = Engine(model, ByteTokenizer(), policy=hybrid(None, lookup)).generate(ids, max_new_tokens=n)
    assert result.token_ids == ref
    assert sum(result.tokens_per_step) + 1 == len(result.token_ids)
    assert all(s.lookup_accepted <= s.accepted for s in result.steps)


def test_lookup_copies_long_runs_when_the_output_repeats():
    """A random tiny model falls into a loop; once it does, lookup drafts accept several tokens per step."""
    model = tiny_model("llama", seed=3)
    ref = plain_greedy(model, REPEATING, 96)
    assert len(set(ref[-40:])) < 20  # the test's premise: the greedy output repeats itself
    result = Engine(model, ByteTokenizer(), policy=hybrid(None, Lookup(adaptive=False, tokens=8))).generate(
        REPEATING, max_new_tokens=96
    )
    assert result.token_ids == ref
    assert result.num_steps < 60 and max(s.lookup_accepted for s in result.steps) >= 4


def test_a_step_cut_at_max_new_tokens_counts_only_the_lookup_drafts_it_emitted():
    """The last step of a long copied run is cut at max_new_tokens: its record keeps only what was emitted,
    so the lookup share of a generation can never pass 100%."""
    model = tiny_model("llama", seed=3)
    engine = Engine(model, ByteTokenizer(), policy=hybrid(None, Lookup(adaptive=False, tokens=8)))
    full = engine.generate(REPEATING, max_new_tokens=96)
    # cut inside the first step that copies several tokens
    start = 1 + sum(
        s.tokens for s in full.steps[: next(i for i, s in enumerate(full.steps) if s.lookup_accepted >= 4)]
    )
    result = engine.generate(REPEATING, max_new_tokens=start + 2)
    last = result.steps[-1]
    assert last.tokens == 2 and last.lookup_path == [True, True]
    assert last.accepted == last.lookup_accepted == 2
    assert sum(s.lookup_accepted for s in result.steps) <= len(result.token_ids)
    assert all(s.lookup_accepted == sum(s.lookup_path) <= s.accepted <= s.tokens for s in result.steps)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("ids", [REPEATING, DISTINCT], ids=["repeating", "distinct"])
def test_hybrid_trees_with_random_heads_equal_plain_greedy(kind, ids):
    model = tiny_model("llama", seed=4)
    n = 48
    ref = plain_greedy(model, ids, n)
    heads = random_heads(HeadsConfig.for_model(model, kind, num_heads=3), seed=0)
    for policy in (
        hybrid(static("tree_8")),
        static(Tree.from_paths([[0], [1], [0, 0], [0, "L0"], [0, 0, "L0"], ["L0"], ["L0", "L0"]])),
    ):
        engine = Engine(model, ByteTokenizer(), heads=heads, policy=policy)
        assert engine.generate(ids, max_new_tokens=n).token_ids == ref


def test_hybrid_with_oracle_heads_side_branches_and_lookup_equals_plain_greedy():
    """Oracle heads put the truth on rank 1 half the time: accepted paths move KV entries, lookup competes."""
    model = tiny_model("qwen2", seed=1)
    ids = REPEATING
    ref = plain_greedy(model, ids, 64)
    heads = OracleHeads(ids + ref, rank_mod=2, wrong_every=3)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=hybrid(static("mc_sim_7b_63"))).generate(
        ids, max_new_tokens=64
    )
    assert result.token_ids == ref


def test_steps_that_skip_the_heads_never_compute_their_probe_and_stay_lossless(monkeypatch):
    """Random heads miss, the text repeats: on steps with a match the hybrid drops heads that cannot pay
    without asking its inner policy, so the engine's lazy probe is never computed; the output is plain greedy
    decoding all the same. Counted, not timed (a step's probe phase also holds the time to offer the lazy
    probe, which a loaded machine stretches)."""
    computed = []

    class CountingProbe(LazyProbe):
        def _get(self):
            if self.probe is None:
                computed.append(self)
            return super()._get()

    monkeypatch.setattr(engine_module, "LazyProbe", CountingProbe)
    model = tiny_model("llama", seed=4)
    n = 48
    heads = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=3), seed=0)
    policy = HybridPolicy(ProbeReadingPolicy(load_tree("tree_8")), Lookup(), COSTLY)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=policy).generate(REPEATING, max_new_tokens=n)
    assert result.token_ids == plain_greedy(model, REPEATING, n)
    skipped = [s for s in result.steps if s.signals.get("probed") == 0.0]
    probed = [s for s in result.steps if "probed" not in s.signals]
    assert skipped and probed and len(skipped) + len(probed) == len(result.steps)  # both kinds of step ran
    assert len(computed) == len(probed)  # one probe computed per probed step, none on a skipped one
    assert all(s.tree_nodes == s.lookup_nodes for s in skipped)


@pytest.mark.parametrize("acceptance", ["sample", "typical"])
def test_hybrid_trees_sample(acceptance):
    """Sampling through a hybrid tree (heads and a lookup branch): near T=0 either rule is greedy decoding, so
    its tokens are plain greedy's, with lookup drafts accepted where the text repeats; at T=0.8 a seeded run
    repeats, and typical acceptance emits only tokens that pass its test at their context under the base model.
    (That `sample` follows the base distribution at T > 0: test_lossless.py.)"""
    model = tiny_model("llama", seed=3)
    model.lm_head.weight.mul_(8.0)  # peaked: many tokens fall under the typical bar (none of a uniform's do)
    heads = random_heads(HeadsConfig.for_model(model, "hydra", num_heads=3), seed=0)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=hybrid(static("tree_4")))
    n = 40
    cold = engine.generate(REPEATING, max_new_tokens=n, temperature=1e-4, acceptance=acceptance, seed=7)
    assert cold.token_ids == plain_greedy(model, REPEATING, n)
    assert sum(s.lookup_accepted for s in cold.steps) > 0
    a = engine.generate(REPEATING, max_new_tokens=n, temperature=0.8, acceptance=acceptance, seed=7)
    b = engine.generate(REPEATING, max_new_tokens=n, temperature=0.8, acceptance=acceptance, seed=7)
    assert a.token_ids == b.token_ids and len(a.token_ids) == n
    if acceptance == "typical":
        with torch.inference_mode():
            logits = model(torch.tensor([REPEATING + a.token_ids])).logits[0, len(REPEATING) - 1 : -1]
        probs = torch.softmax(logits / 0.8, dim=-1)  # [n, V]: each token's distribution at its context
        bar = _typical_threshold(probs, Sampling().typical_eps, Sampling().typical_alpha)[:, 0]
        chosen = probs[torch.arange(n), torch.tensor(a.token_ids)]
        assert (chosen > bar * 0.999).all(), f"tokens under the typical bar at {(chosen <= bar).nonzero()}"
        assert (probs <= bar[:, None]).float().mean() > 0.5  # the premise: most tokens fail the test
        assert a.num_steps < n - 1  # drafts were accepted


def test_head_nodes_without_heads_get_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(EntMTPError, match="has head nodes but no heads"):
        Engine(model, ByteTokenizer(), policy=static("tree_4"))
    lookup_only = Tree.from_paths([["L0"], ["L0", "L0"]])
    out = Engine(model, ByteTokenizer(), policy=static(lookup_only)).generate(REPEATING, max_new_tokens=20)
    assert out.token_ids == plain_greedy(model, REPEATING, 20)
