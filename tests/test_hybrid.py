"""The hybrid policy (scheduler/hybrid.py): a prompt-lookup branch sized per step over any tree policy, from the
match and the evidence so far; dropped heads judged by their probe, and not probed at all where no heads' tree
could pay."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

from conftest import ProbeReadingPolicy
from entmtp.costs.curves import CONTEXT_BUCKET
from entmtp.errors import EntMTPError
from entmtp.heads import LazyProbe, Probe
from entmtp.lookup import Lookup, NgramIndex, TextLookup
from entmtp.policy import StaticPolicy
from entmtp.prediction import Prediction
from entmtp.records import Step, StepContext
from entmtp.scheduler.hybrid import Estimates, HybridPolicy, chain_depth, copy_chain, counterfactual_depth
from entmtp.scheduler.policies import LatencyModel
from entmtp.tree import Tree, load_tree

# ---- the hybrid policy ------------------------------------------------------------------------------------

# step latency (ms) by drafted nodes on a machine where nodes are dear (~3 ms each against a 37 ms plain step:
# the 2-core Intel Xeon the first shipped profiles were measured on), so the tests do not depend on CPU_COST
COSTLY = LatencyModel(
    [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 90],
    [36.8, 44.5, 49.5, 52.2, 56.6, 61.3, 67.0, 75.6, 85.4, 102.4, 121.6, 162.4, 187.1, 240.6],
)

# a llama.cpp-like curve on the 2-core EPYC: one drafted node costs 1.84x a plain step, so a lookup chain at
# the prior rates never pays and every step is plain
DEAR = LatencyModel([0, 1, 2, 4, 8, 16, 32], [9.0, 16.6, 20.1, 29.6, 45.0, 75.6, 133.1])


def _ctx(index):
    return StepContext(0, len(index.tokens), 100, None, lookup=index)


def _step(tree, heads_depth, lookup_run, lookup_nodes):
    return Step(
        tree.name,
        tree.num_nodes,
        max(heads_depth, lookup_run),
        max(heads_depth, lookup_run) + 1,
        [0],
        {},
        {},
        lookup_nodes,
        0,
        {"heads": heads_depth, "lookup": lookup_run},
    )


def _run(policy, index, steps, heads_depth, lookup_right):
    """The policy's last choice after `steps` steps whose heads' tree was right to `heads_depth`."""
    choice = policy.choose(_ctx(index))
    for _ in range(steps):
        tree = choice.tree
        policy.observe(_step(tree, heads_depth, tree.num_lookup if lookup_right else 0, tree.num_lookup))
        choice = policy.choose(_ctx(index))
    return choice


def test_expected_tokens_count_a_depth_when_either_source_is_right_there():
    """E(d, l) = 1 + sum_k P(the heads' tree (depth d) or the lookup chain (length l) is right to depth k), the
    sources independent: H_k = c_1 ... c_k, L_k = q_1 ... q_k."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        c = torch.rand(5, generator=gen).tolist()
        q = torch.rand(7, generator=gen).tolist()
        est = Estimates(c, q, 7)
        for d in range(6):
            for n in range(8):
                h = [math.prod(c[:k]) if k <= d else 0.0 for k in range(1, 9)]
                copy = [math.prod(q[:k]) if k <= n else 0.0 for k in range(1, 9)]
                direct = 1 + sum(1 - (1 - hk) * (1 - lk) for hk, lk in zip(h, copy, strict=True))
                assert est.expected(d, n) == pytest.approx(direct, abs=1e-12)
    assert (
        Estimates([0.5], [], 0).expected(1, 0) == 1.5 and Estimates([], [0.5, 0.5], 2).expected(0, 2) == 1.75
    )


def test_hybrid_policy_adds_nothing_without_a_match_and_grows_with_evidence():
    base = load_tree("tree_8")
    policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    choice = policy.choose(_ctx(NgramIndex([1, 2, 3, 4])))
    assert choice.tree is base and choice.signals["match"] == 0  # no match: the heads' tree alone
    index = NgramIndex([1, 2, 3, 4, 5, 6, 1, 2, 3], max_ngram=3)
    first = policy.choose(_ctx(index)).tree.num_lookup
    tree = _run(policy, index, 12, heads_depth=0, lookup_right=True).tree
    assert tree.num_lookup == 8 > first
    assert tree.heads_tree.num_nodes == 0  # copying wins outright: lookup only
    # the lookup keeps missing at its first token: once the copying's evidence has aged (a chain that was right
    # at depth 1 was right to its end, so its deeper rates stay high), short branches or none
    tree = _run(policy, index, 3 * 16, heads_depth=0, lookup_right=False).tree
    assert tree.num_lookup <= 2


def test_a_lookup_chain_that_is_wholly_right_or_wrong_at_once_gets_long_branches():
    """Copying is bursty: a chain either copies a whole span or misses at its first token. Half the steps
    wholly right is worth 1 + 8/2 = 5 tokens for an 8-token chain, so the branch is the longest, without the
    heads' tree (right at depth 1 half the time); read as one geometric rate (r ~ 0.5: 1 + 0.5 + 0.25 + ...
    < 2) the branch stayed short and the heads' tree was kept."""
    base = load_tree("tree_8")
    policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    index = NgramIndex([1, 2, 3, 4, 5, 6, 1, 2, 3], max_ngram=3)
    choice = policy.choose(_ctx(index))
    for i in range(
        40
    ):  # a chain of the full branch length: all right on even steps, wrong at once on odd ones
        lookup = choice.tree.num_lookup
        policy.observe(_step(choice.tree, i % 2, lookup * (i % 2 == 0), lookup))
        choice = policy.choose(_ctx(index))
    assert choice.tree.num_lookup >= 6 and choice.tree.heads_tree.num_nodes == 0


def _copying(caution: float, steps: int = 40) -> tuple[list[int], HybridPolicy]:
    """The lookup chain lengths a lookup-only policy drafts, step by step, on text that keeps copying (every
    chain right to its end), on the `DEAR` curve."""
    index = NgramIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 1, 2, 3], max_ngram=3)
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=10, caution=caution), DEAR)
    lengths = []
    for _ in range(steps):
        n = policy.choose(_ctx(index)).tree.num_lookup
        lengths.append(n)
        emitted = list(range(4, 4 + n + 1))  # the chain 4, 5, ... right to its end, and the bonus token
        policy.observe(Step(f"L{n}", n, n, n + 1, emitted, lookup_nodes=n, sources={"heads": 0, "lookup": n}))
    return lengths, policy


def test_a_chain_waits_until_its_first_token_is_surely_right_where_a_node_costs_a_plain_step():
    """Lookup.caution: where one drafted node costs 1.84 plain steps (DEAR), a chain pays only when it starts
    right most of the time. One right first token lifts that rate from its prior (0.6) to 0.73, and the rule on
    the rate itself drafts at once (on llama.cpp such chains yielded 1.5-1.7 tokens for 1.8 steps' cost);
    one standard error down, the rule waits for a few more. Text that keeps copying gets the same long chains
    either way: only the first depth's rate is lowered, not the deeper ones that make long chains pay."""
    eager, _ = _copying(caution=0.0)
    careful, policy = _copying(caution=1.0)
    assert eager[1] >= 2 and careful[:4] == [0, 0, 0, 0]
    assert careful[-1] == eager[-1] >= 6
    rates, lowered = policy.copy[3].values(), policy.copy[3].values(1.0)
    assert lowered[0] < rates[0] and lowered[1:] == rates[1:]
    with pytest.raises(EntMTPError, match="caution must be >= 0"):
        Lookup(caution=-1.0)


@dataclass
class Offer:
    """A cross source (a drafts.Session) that offers `chain` with `probs` (cumulative) after every text."""

    chain: tuple[int, ...]
    probs: tuple[float, ...]
    match: int = 5

    def draft(self, context, max_tokens):
        return self

    @property
    def tokens(self):
        return self.chain

    def extend(self, tokens):
        pass


def _offered(probs, text=(1, 2, 3, 4, 5, 6, 7, 8, 9)):
    """An index whose text has no n-gram match of its own and whose cross source offers a 10-token chain."""
    return NgramIndex(list(text), max_ngram=3, cross=Offer(tuple(range(50, 60)), tuple(probs)))


def test_a_sources_own_estimates_price_its_chain_from_the_first_step():
    """A branch from a source that estimates its tokens (the suffix cache: how often each continued its context
    before) starts at those estimates, not at the prior by match length: on a curve where a drafted node costs
    1.84 plain steps (`DEAR`), a chain the source is sure of is drafted at the first step, as far as it stays
    sure, and one it guesses at is not drafted at all."""
    careful = Lookup(tokens=10)
    index = _offered([1.0] * 6 + [0.3, 0.1, 0.05, 0.02])
    assert index.ranked(index.tail(3), 1).origins == ["suffix"]
    assert index.estimates() == pytest.approx([1.0] * 6 + [0.3, 1 / 3, 0.5, 0.4])
    sure = HybridPolicy(StaticPolicy(Tree.root_only()), careful, DEAR).choose(_ctx(index)).tree
    assert sure.num_lookup == 6  # the sure part of the chain, where its estimate falls the chain ends
    guessed = _offered([0.3, 0.1, 0.05])
    tree = HybridPolicy(StaticPolicy(Tree.root_only()), careful, DEAR).choose(_ctx(guessed)).tree
    assert tree.num_lookup == 0
    # the text's own n-grams have no estimates: the same match from the text is priced at the prior (plain here)
    text = NgramIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], max_ngram=3)
    assert HybridPolicy(StaticPolicy(Tree.root_only()), careful, DEAR).choose(_ctx(text)).tree.num_lookup == 0


def test_a_predictions_chain_is_priced_at_its_copy_rate_from_the_first_step():
    """A branch from a prediction starts at the prediction's copy rate (prediction.PREDICTED_RATE), not at the
    text's prior by match length: on a curve where drafted nodes are cheap (`COSTLY`) the same chain is drafted
    longer from the first step when the prediction estimates it than when it does not."""
    prediction = Prediction(list(range(20, 40)))
    text = [9, 20, 21, 22]  # the text follows the prediction's first three tokens
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=10), COSTLY)
    estimated = TextLookup(3, prediction).begin(text)
    assert estimated.ranked(estimated.tail(3), 1).origins == ["prediction"]
    unestimated = NgramIndex(text, max_ngram=3, prefix=prediction.tokens)  # the same index, no session
    lengths = [policy.fresh().choose(_ctx(i)).tree.num_lookup for i in (estimated, unestimated)]
    assert lengths[0] > lengths[1] > 0, lengths


def test_a_chain_is_priced_on_the_curve_at_the_steps_own_context():
    """Where the machine's curve was measured at several contexts, a step's options are priced on the curve at
    its own context (LatencyModel.at): on a curve whose drafted nodes are dear after a short prompt (DEAR's
    multiples) and cheap after a long one (COSTLY's), the prediction's chain is drafted shorter after 100 tokens
    than after 2,000, and the curve's mean prices neither context's steps."""
    nodes = [0, 1, 2, 4, 8, 16, 32]
    short, long = DEAR(nodes), COSTLY(nodes)
    curve = LatencyModel(nodes, (short + long) / 2, contexts=[128, 2048], by_context=[short, long])
    assert curve.at(0)(nodes) == pytest.approx(short) and curve.at(9000)(nodes) == pytest.approx(long)
    assert curve.at(1000) is curve.at(1000 + CONTEXT_BUCKET - 1000 % CONTEXT_BUCKET - 1)  # one per bucket
    assert DEAR.at(5000) is DEAR  # measured at one context: itself
    prediction = Prediction(list(range(20, 40)))
    index = TextLookup(3, prediction).begin([9, 20, 21, 22])
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=10), curve)
    lengths = [
        policy.fresh().choose(StepContext(0, at, 100, None, lookup=index)).tree.num_lookup
        for at in (100, 2000)
    ]
    assert lengths[0] < lengths[1], lengths
    flat = HybridPolicy(
        StaticPolicy(Tree.root_only()), Lookup(tokens=10), LatencyModel(nodes, (short + long) / 2)
    )
    mean = [
        flat.fresh().choose(StepContext(0, at, 100, None, lookup=index)).tree.num_lookup for at in (100, 2000)
    ]
    assert mean[0] == mean[1]  # without contexts every step is priced on the mean


def test_each_source_is_priced_at_its_own_rates():
    """A source's misses lower its own rates, not another's: after a run of steps where the suffix cache's chain
    was wrong at its first token, the cache's next chain is not drafted though it still says it is sure, and the
    text's own n-gram chains are priced at their prior, as before any step."""
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=10), DEAR)
    index = _offered([1.0] * 10)
    prior = policy.copy[3].values()
    lengths = []
    for _ in range(8):
        n = policy.choose(_ctx(index)).tree.num_lookup
        lengths.append(n)
        policy.observe(Step(f"L{n}", n, 0, 1, [0], lookup_nodes=n, sources={"heads": 0, "lookup": 0}))
    assert lengths[0] == 10 and lengths[-1] == 0
    assert policy.rates["suffix"][3].values()[0] < 0.5 * prior[0]
    assert policy.copy[3].values() == prior  # the text's own rates: untouched
    assert policy.rates["prediction"][3].values() == prior


def test_hybrid_policy_keeps_the_heads_tree_when_the_heads_are_right():
    base = load_tree("tree_8")
    policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    index = NgramIndex([1, 2, 3, 4, 5, 6, 1, 2, 3], max_ngram=3)
    choice = _run(policy, index, 12, heads_depth=3, lookup_right=False)
    assert choice.tree.heads_tree is base and choice.tree.num_lookup <= 1
    assert choice.signals["match"] == 3


def test_fixed_length_policy_always_adds_the_full_branch_when_there_is_a_match():
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=5, adaptive=False))
    tree = policy.choose(_ctx(NgramIndex([1, 2, 3, 1, 2], max_ngram=2))).tree
    assert tree.num_lookup == 5 and tree.name == "L5"


def test_hybrid_policy_takes_plain_steps_when_the_heads_keep_missing_and_retries_them_later():
    base = load_tree("tree_8")
    policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    nothing = NgramIndex([1, 2, 3, 4])  # no match: no lookup branch
    choice = _run(policy, nothing, 16, heads_depth=0, lookup_right=False)
    tree = choice.tree
    assert tree.num_nodes == 0  # the heads were always wrong: a plain step costs less
    assert choice.signals["heads"] == 0.0
    retried = 0
    for _ in range(80):  # plain steps verify no head: their evidence ages back towards the prior
        policy.observe(_step(tree, 0, 0, 0))
        tree = policy.choose(_ctx(nothing)).tree
        retried += tree is base
    assert 1 <= retried <= 10  # tried again now and then, dropped again as long as the heads miss


def test_dropped_heads_are_judged_by_their_probe_instead_of_retried_blindly():
    """On a step without the heads' tree, the probe's depth-1 candidates (drafted anyway) against the emitted
    token say exactly whether the heads would have been right: a dropped tree that keeps missing stays
    dropped, and one that would have been right comes back within a few steps."""
    base = load_tree("tree_8")
    nothing = NgramIndex([1, 2, 3, 4])
    probe = Probe(torch.tensor([[7, 8, 9]]), torch.zeros(1, 3))  # head 1's top 3 at every step

    def run(policy, steps, token):
        tree = policy.choose(StepContext(0, 4, 100, None, probe=probe, lookup=nothing)).tree
        kept = 0
        for _ in range(steps):
            accepted = int(tree.num_nodes > 0 and token in (7, 8, 9))  # tree_8 drafts ranks 0-2 at depth 1
            policy.observe(
                Step(tree.name, tree.num_nodes, accepted, accepted + 1, [token, 0][: accepted + 1])
            )
            tree = policy.choose(StepContext(0, 4, 100, None, probe=probe, lookup=nothing)).tree
            kept += tree is base
        return tree, kept

    for counterfactual, retried in ((True, 0), (False, 1)):
        policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY, counterfactual=counterfactual)
        tree, _ = run(policy, 16, token=0)  # verified and wrong: plain steps
        assert tree.num_nodes == 0
        _, kept = run(policy, 80, token=0)  # the probe keeps missing too
        assert (kept > 0) == bool(retried)
    policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    run(policy, 16, token=0)
    _, kept = run(policy, 12, token=8)  # rank 1 of head 1: tree_8 would have been right
    assert kept >= 6  # back within a few steps, and kept


def test_a_short_branch_learns_how_far_the_text_copies_one_token_past_it():
    """A step judges the lookup chain its match offered one token past the part it drafted (none: its first
    token), by the emitted tokens, where that part was right: that token is emitted whatever the heads did, so
    the judgement is unbiased. Without it a branch kept short beside the heads' tree never learned its deeper
    rates (they stayed at the prior) however far the text copied."""
    base = load_tree("tree_8")
    index = NgramIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], max_ngram=3)
    assert copy_chain(index, 8) == [4, 5, 6, 7, 8, 9, 1, 2]
    policy = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    prior = policy.copy[3].values()
    tree = policy.choose(_ctx(index)).tree
    policy.observe(Step(tree.name, 9, 3, 4, [4, 5, 6, 7], sources={"heads": 3, "lookup": 0}))
    rates = policy.copy[3].values()  # the heads' tree alone: the chain's first token judged, right
    assert rates[0] > prior[0] and rates[1:] == prior[1:]
    # a 2-token branch right to its end: its third token judged by the bonus token (not the fourth, which the
    # heads' path emitted)
    policy.choose(_ctx(index))
    policy.observe(Step("x", 10, 4, 5, [4, 5, 6, 7, 8], lookup_nodes=2, sources={"heads": 4, "lookup": 2}))
    rates = policy.copy[3].values()
    assert rates[2] > prior[2] and rates[3:] == prior[3:]
    # a wrong token: that depth missed
    missed = HybridPolicy(StaticPolicy(base), Lookup(tokens=8), COSTLY)
    missed.choose(_ctx(index))
    missed.observe(Step(tree.name, 9, 3, 4, [0, 5, 6, 7], sources={"heads": 3, "lookup": 0}))
    assert missed.copy[3].values()[0] < prior[0] and missed.copy[3].values()[1:] == prior[1:]
    # (right, judged) past the first `start` tokens, to at most `most` more
    assert chain_depth([4, 5, 6], [4, 5, 6, 7], 0, 8) == (3, 3)  # judged as far as the chain goes
    assert chain_depth([4, 5, 6], [9, 5], 1, 1) == (0, 0)  # the emitted path was another branch
    assert chain_depth([4, 5, 6], [4, 5, 0, 7], 1, 1) == (1, 1)  # one more, right
    assert chain_depth([4, 5, 6], [4, 5, 0], 1, 2) == (1, 2)  # two more: right, then wrong


def _lazy(computed: list, first=(7, 8, 9)):
    """A lazy probe (as the engine offers it) of head 1's candidates `first`, counting its computations in
    `computed` (`_step`'s steps emit token 0 first)."""
    probe = Probe(torch.tensor([first]), torch.zeros(1, 3))
    return LazyProbe(lambda: computed.append(1) or probe)


def test_a_step_no_heads_tree_can_pay_for_never_computes_their_probe():
    """When copying beats anything the heads could add at their current rates, the hybrid chooses without its
    inner policy and the engine's lazy probe is never computed; heads that are right are probed every step."""
    base, index = load_tree("tree_8"), NgramIndex([1, 2, 3, 4, 5, 6, 1, 2, 3], max_ngram=3)
    policy = HybridPolicy(ProbeReadingPolicy(base), Lookup(tokens=8), COSTLY)
    computed: list = []
    for _ in range(12):  # the heads miss, the lookup branch is right
        tree = policy.choose(StepContext(0, 9, 100, None, probe=_lazy(computed), lookup=index)).tree
        policy.observe(_step(tree, 0, tree.num_lookup, tree.num_lookup))
    computed.clear()
    choice = policy.choose(StepContext(0, 9, 100, None, probe=_lazy(computed), lookup=index))
    assert not computed and choice.signals["probed"] == 0.0
    assert choice.tree.heads_tree.num_nodes == 0 and choice.tree.num_lookup == 8
    fresh = HybridPolicy(ProbeReadingPolicy(base), Lookup(tokens=8), COSTLY)
    for step in range(12):  # the heads are right, the lookup wrong: the heads' tree, probed every step
        if step == 6:
            computed.clear()
        choice = fresh.choose(StepContext(0, 9, 100, None, probe=_lazy(computed, (0, 8, 9)), lookup=index))
        fresh.observe(_step(choice.tree, 3, 0, choice.tree.num_lookup))
    assert len(computed) == 6 and choice.tree.heads_tree is base


def test_without_a_match_the_heads_are_probed_while_probing_pays():
    """Nothing to copy: the choice is the heads' tree or a plain step. While the probed steps take more tokens
    than their cost in plain steps (the probe's included), every step is probed; once they take fewer, the probe
    is skipped (a plain step), and it comes back now and then as that evidence ages."""
    base, nothing = load_tree("tree_8"), NgramIndex([1, 2, 3, 4])
    for heads_depth, probed in ((3, range(48, 49)), (0, range(2, 9))):  # the heads right to depth 3; missing
        policy = HybridPolicy(ProbeReadingPolicy(base), Lookup(tokens=8), COSTLY)
        computed: list = []
        for _ in range(48):
            choice = policy.choose(StepContext(0, 4, 100, None, probe=_lazy(computed), lookup=nothing))
            policy.observe(_step(choice.tree, heads_depth, 0, 0))
        assert len(computed) in probed
        assert choice.tree is (base if heads_depth else Tree.root_only())


@pytest.mark.parametrize("caution", [0.0, 1.0])
@pytest.mark.parametrize("inner", ["chain_1", "chain_3", "mc_sim_7b_63"])
def test_choosing_without_the_probe_never_changes_the_choice(inner, caution):
    """Wherever the hybrid skips the heads, the full choice (the inner policy asked, every option weighed) picks
    the same tree: the skip only saves the probe. (With a one-node chain the skip's bound is exact, so a
    skip where the full choice would keep the heads fails here.) On the rates themselves (caution 0) the copying
    here makes both kinds of step; with the default caution copying alone wins less often, and every step
    must still agree."""
    base = Tree("chain_1", ((0,),)) if inner == "chain_1" else load_tree(inner)
    gen = torch.Generator().manual_seed(0)
    skipped = 0
    for trial in range(40):
        policy = HybridPolicy(ProbeReadingPolicy(base), Lookup(tokens=10, caution=caution), COSTLY)
        index = NgramIndex([1, 2, 3, 4, 5, 6, 1, 2, 3][: 4 + trial % 6], max_ngram=3)  # matches 0..3
        for _ in range(int(torch.randint(0, 20, (1,), generator=gen))):
            tree = policy.choose(StepContext(0, 9, 100, None, probe=_lazy([]), lookup=index)).tree
            heads, run = (int(x) for x in torch.randint(0, 4, (2,), generator=gen))
            policy.observe(
                _step(tree, min(heads, tree.heads_tree.depth), min(run, tree.num_lookup), tree.num_lookup)
            )
        full = copy.deepcopy(policy)
        full._heads_lose = lambda *args: False
        ctx = StepContext(0, 9, 100, None, probe=_lazy([]), lookup=index)
        chosen = policy.choose(ctx)
        skipped += chosen.signals.get("probed") == 0.0
        assert chosen.tree.name == full.choose(ctx).tree.name
    assert skipped < 40 and (skipped > 0 or caution > 0)  # without caution, both kinds of step were compared


def test_counterfactual_depth_reads_every_depth_a_probe_holds():
    chain = load_tree("chain_3")  # ranks (0,), (0, 0), (0, 0, 0)
    probe = Probe(torch.tensor([[5, 6], [7, 8], [9, 10]]), torch.zeros(3, 2))  # Medusa: every depth
    assert counterfactual_depth(chain, probe, [5, 7, 9, 1]) == (3, 3)
    assert counterfactual_depth(chain, probe, [5, 7, 1]) == (2, 3)  # wrong at depth 3
    assert counterfactual_depth(chain, probe, [5, 8]) == (1, 3)  # rank 1 at depth 2: not in the chain
    assert counterfactual_depth(chain, probe, [5, 7]) == (2, 2)  # two tokens emitted: depth 3 unknown
    assert counterfactual_depth(chain, Probe(probe.tokens[:1], probe.logprobs[:1]), [5, 7]) == (1, 1)  # Hydra
    assert counterfactual_depth(chain, None, [5]) == (0, 0)
    assert counterfactual_depth(chain, Probe(torch.empty(0, dtype=torch.long), torch.zeros(0)), [5]) == (0, 0)


def test_free_verification_copies_the_whole_branch():
    """node_cost 0 (a GPU, where verifying a few more tokens is nearly free): any chance of a hit pays."""
    policy = HybridPolicy(StaticPolicy(load_tree("tree_8")), Lookup(tokens=6, node_cost=0.0))
    tree = policy.choose(_ctx(NgramIndex([1, 2, 3, 1, 2], max_ngram=2))).tree
    assert tree.num_lookup == 6 and tree.heads_tree.num_nodes == 8


# ---- what a step costs to choose (issue #62: counted, not timed) ------------------------------------------


def test_where_no_chain_can_pay_lookup_alone_takes_a_plain_step_without_weighing_the_options(monkeypatch):
    """Lookup alone on a dear curve (DEAR): a chain of n tokens takes at most 1 + n q_1 tokens, so below
    `pays_from` (min over n of (cost(n) - 1) / n) no chain pays and the step is plain without building the
    estimates and the options. The choice is the one the full weighing makes, at every step of random copy
    rates and matches (a policy with the fast path off weighs each step beside it); on text that never copies,
    no step builds the estimates (with the fast path off, every step does)."""
    from entmtp.scheduler import hybrid as hybrid_mod

    built = []
    real = hybrid_mod.Estimates
    monkeypatch.setattr(hybrid_mod, "Estimates", lambda *a: built.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    fast_steps = 0
    for trial in range(30):
        policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=6, caution=trial % 2), DEAR)
        assert policy.lookup_only and 0.5 < policy.pays_from < 0.84  # a 1-node chain needs q_1 > 0.84 here
        index = NgramIndex([1, 2, 3, 4, 5, 6, 1, 2, 3][: 4 + trial % 6], max_ngram=3)
        for _ in range(int(torch.randint(0, 25, (1,), generator=gen))):
            n = policy.choose(_ctx(index)).tree.num_lookup
            right = bool(torch.rand(1, generator=gen) < trial / 30)  # the chain copies, wholly, or not
            emitted = [4, 5, 6, 1, 2, 3, 4, 5][: n + 1] if right else [0]
            k = n if right else 0
            policy.observe(
                Step(f"L{n}", n, k, k + 1, emitted, lookup_nodes=n, sources={"heads": 0, "lookup": k})
            )
        full = copy.deepcopy(policy)
        full.lookup_only = False
        built.clear()
        chosen = policy.choose(_ctx(index))
        fast_steps += not built
        assert chosen.tree.name == full.choose(_ctx(index)).tree.name
        assert (policy._chosen, policy._unmatched) == (full._chosen, full._unmatched)
    assert 0 < fast_steps < 30  # both kinds of step were compared
    plain_text = NgramIndex([1, 2, 3, 4, 1, 5, 6, 7, 1, 8], max_ngram=3)  # "1" matches, then it misses
    for fast in (True, False):
        policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=6), DEAR)
        policy.lookup_only = fast
        built.clear()
        for _ in range(20):
            choice = policy.choose(_ctx(plain_text))
            assert choice.tree.num_nodes == 0
            policy.observe(Step("root", 0, 0, 1, [9], sources={}))
        assert len(built) == (0 if fast else 20)


def test_a_plain_step_reads_one_token_of_the_offered_chain_not_the_whole_chain():
    """Per step: one index query for the match, and of the chain the match offers only what the step drafted
    plus the one token judged past it. Reading the whole `Lookup.tokens` chain every step cost the default on
    llama.cpp a share of every step where it took plain steps; with that put back this counts 11 queries."""
    index = NgramIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], max_ngram=3)
    queries = []
    real = index.ranked  # every query (`candidates` is its view)
    index.ranked = lambda *a, **k: queries.append(a) or real(*a, **k)
    policy = HybridPolicy(StaticPolicy(Tree.root_only()), Lookup(tokens=10), DEAR)
    prior = policy.copy[3].values()
    choice = policy.choose(_ctx(index))
    assert choice.tree.num_nodes == 0 and choice.menu is None  # a plain step; no menu outside a batch
    policy.observe(Step("root", 0, 0, 1, [4], sources={}))
    assert len(queries) == 2
    assert policy.copy[3].values()[0] > prior[0]  # ... and the first token was judged, right
    batched = StepContext(0, len(index.tokens), 100, None, lookup=index, latency=DEAR)
    assert policy.choose(batched).menu is not None  # a batch's joint choice reads the menu


def test_the_chain_a_choice_read_is_read_again_after_the_index_grew():
    """`observe` reads the chain the index offered when the step chose, although the step's tokens have been
    indexed since: the same tokens, however the new ones change the counts."""
    index = NgramIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], max_ngram=3)
    before, size = copy_chain(index, 8), len(index.tokens)
    index.extend([9, 9, 1, 2, 3, 9, 9, 2, 3, 9])  # "2 3" now continues with 9 more often than with 4
    assert copy_chain(index, 8) != before
    assert copy_chain(index, 8, size) == before == [4, 5, 6, 7, 8, 9, 1, 2]
