"""The key oracle: speculative greedy output equals plain greedy output token for token (float32)."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.accept import Sampling
from entmtp.batch import Batch, generate_batch
from entmtp.engine import Engine
from entmtp.errors import EntMTPError, PromptError
from entmtp.heads import HeadsConfig, random_heads
from entmtp.lookup import Lookup
from entmtp.policy import StaticPolicy, static
from entmtp.scheduler.hybrid import hybrid
from entmtp.train.shards import base_targets
from entmtp.tree import Tree, load_tree

TREES = ["mc_sim_7b_63", "tree_16", "tree_4", "chain_5", "chain_1"]


def plain_greedy(model, ids, n):
    return Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=n).token_ids


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plain_decoding_equals_transformers_generate(arch):
    model = tiny_model(arch)
    ids = list(range(10, 30))
    assert plain_greedy(model, ids, 40) == hf_greedy(model, ids, 40)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("rank_mod", [1, 3])
def test_oracle_drafts_give_identical_output_and_long_steps(arch, tree, rank_mod):
    model = tiny_model(arch, seed=1)
    ids = [5, 17, 99, 3, 250, 7, 7, 64]
    n = 48
    ref = plain_greedy(model, ids, n)
    heads = OracleHeads(ids + ref, rank_mod=rank_mod, wrong_every=5)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree)).generate(ids, max_new_tokens=n)
    assert result.token_ids == ref
    assert sum(result.tokens_per_step) + 1 == len(result.token_ids)  # +1: the prefill's token
    t = load_tree(tree)
    if t.topk >= rank_mod:  # the right token is in the tree: steps accept several drafts
        assert max(result.tokens_per_step) >= min(t.depth, 2) + 1
        assert result.num_steps < n - 1


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_tiny_temperature_decodes_greedily(temperature):
    """T = 1e-40 (and 5e-324, 0 in float32) overflowed logits / T: it now writes the greedy tokens."""
    model, ids = tiny_model("llama", seed=1), list(range(40, 52))
    engine = Engine(model, ByteTokenizer())
    out = engine.generate(ids, max_new_tokens=12, temperature=temperature, seed=1)
    assert out.token_ids == plain_greedy(model, ids, 12)


@pytest.mark.parametrize("tree,rank_mod", [("mc_sim_7b_63", 3), ("chain_4", 1)])
def test_gumbel_sampling_writes_plain_sampling_tokens_whatever_the_tree(tree, rank_mod):
    """Under the gumbel rule a seed fixes every position's token: drafts that are the plain decode's tokens
    (the oracle's) are accepted, at side-branch ranks too, and the output is plain decoding's, token for token;
    so is the output of real heads drafting under the noise. Another seed writes another text."""
    model = tiny_model("llama", seed=1)
    ids = [5, 17, 99, 3, 250, 7, 7, 64]
    n, kw = 40, dict(temperature=0.8, acceptance="gumbel")
    plain = Engine(model, ByteTokenizer())
    ref = plain.generate(ids, max_new_tokens=n, seed=3, **kw).token_ids
    assert ref != plain.generate(ids, max_new_tokens=n, seed=4, **kw).token_ids
    heads = OracleHeads(ids + ref, rank_mod=rank_mod, wrong_every=5)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree)).generate(
        ids, max_new_tokens=n, seed=3, **kw
    )
    assert result.token_ids == ref
    assert max(result.tokens_per_step) >= 3 and result.acceptance == "gumbel"
    for kind, arch in [("medusa", "mlp"), ("hydra", "prefix-mlp")]:
        cfg = HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256, head_arch=arch)
        real = Engine(
            model, ByteTokenizer(), heads=random_heads(cfg, seed=0, init="random"), policy=static(tree)
        )
        assert real.generate(ids, max_new_tokens=n, seed=3, **kw).token_ids == ref


def test_gumbel_sampling_draws_each_token_from_the_temperature_distribution_given_the_ones_before():
    """Over many seeds the first token follows softmax(logits / T) at the prompt, and the second, given the
    likeliest first, its own: each position has noise of its own (a row used twice would correlate them)."""
    model = tiny_model("llama", seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked enough that few seeds estimate the distributions
    ids, temperature, n = [5, 17, 99, 3], 1.0, 2000
    engine = Engine(model, ByteTokenizer())
    outs = [
        engine.generate(ids, max_new_tokens=2, temperature=temperature, acceptance="gumbel", seed=s).token_ids
        for s in range(n)
    ]

    def probs(prefix):
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([prefix])).logits[0, -1].float() / temperature, dim=-1)

    def tv(tokens, p):
        return (
            0.5
            * (torch.bincount(torch.tensor(tokens), minlength=p.numel()).float() / len(tokens) - p)
            .abs()
            .sum()
        )

    p1 = probs(ids)
    top = int(p1.argmax())
    second = [o[1] for o in outs if o[0] == top]
    assert tv([o[0] for o in outs], p1) < 0.04
    assert len(second) > 1000 and tv(second, probs(ids + [top])) < 0.05
    # a model whose every distribution is uniform: each position's own noise makes neighbours independent
    # (equal 1 time in 256); one noise row for two positions would repeat the token every time
    with torch.no_grad():
        model.model.norm.weight.zero_()
    flat = [
        engine.generate(ids, max_new_tokens=3, seed=s, temperature=1.0, acceptance="gumbel").token_ids
        for s in range(300)
    ]
    assert sum(o[0] == o[1] or o[1] == o[2] for o in flat) <= 10
    assert len({o[0] for o in flat}) > 150


def test_heads_draft_under_the_noise_of_each_depths_position():
    """With the gumbel rule's noise the heads' candidates at depth d are the top of log-probability + T g,
    g the noise of position (committed positions) + d: the position that depth's draft will take."""
    from entmtp.accept import GumbelNoise

    model = tiny_model("llama", seed=2)
    cfg = HeadsConfig(kind="medusa", num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random").bind(model)
    hidden = torch.randn(9, 64)
    noise, temperature = GumbelNoise(seed=5, vocab_size=256), 0.8
    drafter = heads.drafter(noise, temperature)
    drafter.extend(hidden)
    probe = drafter.probe(load_tree("mc_sim_7b_63"), torch.tensor([1]))
    with torch.inference_mode():
        feat = hidden[-1]
        for d in range(probe.depth):
            lp = torch.log_softmax(heads.project(d, heads.heads[d].blocks(feat)).float(), dim=-1)
            want = (lp + temperature * noise.at([9 + 1 + d])[0]).topk(probe.topk).indices
            assert probe.tokens[d].tolist() == want.tolist()
            assert torch.allclose(probe.logprobs[d], lp[want])
        unperturbed = torch.log_softmax(heads.project(0, heads.heads[0].blocks(feat)).float(), dim=-1)
    assert probe.tokens[0].tolist() != unperturbed.topk(probe.topk).indices.tolist()  # the noise mattered


def test_side_branch_acceptance_moves_cache_entries():
    """rank_mod=2 puts the truth on rank 1 half the time: accepted paths are not a prefix of node ids."""
    model = tiny_model("llama", seed=2)
    ids = list(range(40, 60))
    ref = plain_greedy(model, ids, 40)
    heads = OracleHeads(ids + ref, rank_mod=2)
    steps = []
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static("mc_sim_7b_63"))
    for ev in engine.stream(ids, max_new_tokens=40):
        if ev.step is not None:
            steps.append(ev.step)
    assert ev.result.token_ids == ref
    assert sum(s.accepted for s in steps) > len(steps)  # many multi-token steps


def test_eos_inside_an_accepted_chunk_ends_output_exactly_there():
    model = tiny_model("llama", seed=3)
    ids = [1, 2, 3, 4, 5, 6]
    ref = plain_greedy(model, ids, 40)
    # make a token first seen at index >= 6 the EOS token: plain decoding stops right after it
    first = {}
    for i, tok in enumerate(ref):
        first.setdefault(tok, i)
    # chain_5 steps emit tokens 1-6, 7-12, ...: an index that is not a multiple of 6 sits inside a chunk
    eos_index = next(i for tok, i in first.items() if i >= 6 and i % 6 not in (0, 5))
    model.generation_config.eos_token_id = ref[eos_index]
    plain = plain_greedy(model, ids, 40)
    assert plain == ref[: eos_index + 1]
    assert hf_greedy_with_eos(model, ids, 40, ref[eos_index]) == plain
    heads = OracleHeads(ids + ref, rank_mod=1)  # always right: steps accept up to 5 drafts
    result = Engine(model, ByteTokenizer(), heads=heads, policy=static("chain_5")).generate(
        ids, max_new_tokens=40
    )
    assert result.token_ids == plain
    assert result.finish_reason == "eos"
    # the final step accepted drafts past the EOS: the output was cut inside the accepted chunk
    last = result.steps[-1]
    assert last.token_ids[-1] == ref[eos_index]
    assert last.accepted + 1 > last.tokens


def hf_greedy_with_eos(model, ids, n, eos):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind,arch", [("medusa", "mlp"), ("hydra", "mlp"), ("hydra", "prefix-mlp")])
@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "tree_8", "chain_4"])
def test_real_heads_random_weights_identical_output(kind, arch, tree):
    model = tiny_model("llama", seed=4)
    cfg = HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256, head_arch=arch)
    heads = random_heads(cfg, seed=0, init="random")
    ids = list(range(100, 120))
    ref = plain_greedy(model, ids, 32)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=static(tree)).generate(ids, max_new_tokens=32)
    assert result.token_ids == ref


def test_max_new_tokens_is_respected_exactly():
    model = tiny_model("llama", seed=5)
    ids = list(range(10))
    ref = plain_greedy(model, ids, 30)
    for n in (1, 2, 7, 30):
        heads = OracleHeads(ids + ref, rank_mod=1)
        out = Engine(model, ByteTokenizer(), heads=heads, policy=static("chain_5")).generate(
            ids, max_new_tokens=n
        )
        assert out.token_ids == ref[:n]
        assert out.finish_reason == "length"


def test_stop_string_ends_text_before_it():
    model = tiny_model("llama", seed=6)
    ids = list(b"hello")
    full = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=30)
    text = full.text
    stop = text[5:7]
    assert stop and "\ufffd" not in stop
    out = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=30, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]


def test_a_stop_string_keeps_the_tokens_that_write_the_text_and_no_more():
    """The step that completes a stop string keeps only its tokens that begin before it (the last may reach
    into it); tokens, log-probabilities and their count follow. Earlier steps' tokens were streamed already
    and stay, so a stream's tokens add up to the result's."""
    model = tiny_model("llama", seed=6)
    ids = list(b"hello")
    full = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=30)
    clean = [i for i, c in enumerate(full.text) if c != "\ufffd"]
    assert len(clean) > 12
    for start in (clean[4], clean[10]):  # a stop a few tokens long (bytes: one token a character)
        stop = full.text[start : start + 3]
        out = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=30, stop=[stop], logprobs=0)
        assert out.finish_reason == "stop" and out.text == full.text[: full.text.find(stop)]
        decode = ByteTokenizer().decode
        assert len(decode(out.token_ids)) >= len(out.text)  # the text is all written
        last = out.steps[-1].token_ids  # the completing step's kept tokens: each begins before the stop
        before = out.token_ids[: len(out.token_ids) - len(last)]
        assert all(len(decode(before + last[:j])) < len(out.text) for j in range(len(last)))
        assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_streamed_text_is_what_decoding_the_whole_output_streams():
    """The detokenizer decodes only the latest tokens: each piece is still the new part of the whole output's
    text, held back while it ends in an incomplete UTF-8 character (random bytes: many of those)."""
    from entmtp.text import Detokenizer

    tok, rng = ByteTokenizer(), torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(0, 256, (int(torch.randint(1, 120, (), generator=rng)),), generator=rng).tolist()
        ids += list("é ✓ 😀".encode())
        detok, sent, i = Detokenizer(tok, []), 0, 0
        while i < len(ids):
            new = ids[i : i + int(torch.randint(1, 4, (), generator=rng))]
            i += len(new)
            text = tok.decode(ids[:i])  # what the whole output's decode streams
            want = "" if text.endswith("\ufffd") else text[sent:]
            sent += len(want)
            assert detok.push(new) == want
        assert detok.final_text() == tok.decode(ids)


def test_generate_decodes_its_text_once_and_a_stream_step_by_step():
    """`generate` returns only the result, so without stop strings its text is decoded once at the end, not
    twice a step (the per-step decodes were ~1% of a llama.cpp step); the same text, and a stream's pieces
    still add up to it. With a stop string it decodes as it goes, which finding the stop needs."""

    class Counting(ByteTokenizer):
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.calls += 1
            return super().decode(ids, skip_special_tokens)

    tok, ids = Counting(), list(b"hello world, hello")
    engine = Engine(tiny_model(), tok)
    out = engine.generate(ids, max_new_tokens=24)
    assert len(out.token_ids) == 24 and Counting.calls <= 2
    pieces = [e.text for e in engine.stream(ids, max_new_tokens=24)]
    assert "".join(pieces) == out.text and sum(map(bool, pieces)) > 1
    stop = out.text[5:7]
    assert engine.generate(ids, max_new_tokens=24, stop=[stop]).text == out.text[: out.text.index(stop)]


def test_sampling_is_seeded_and_repeatable():
    model = tiny_model("llama", seed=7)
    cfg = HeadsConfig(kind="medusa", num_heads=3, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static("tree_8"))
    a = engine.generate(list(range(9)), max_new_tokens=20, temperature=0.8, seed=11).token_ids
    b = engine.generate(list(range(9)), max_new_tokens=20, temperature=0.8, seed=11).token_ids
    c = engine.generate(list(range(9)), max_new_tokens=20, temperature=0.8, seed=12).token_ids
    assert a == b and a != c


def test_each_acceptance_rule_runs_its_own_policy():
    """A server's requests differ in temperature: `policies` gives a rule its own tree (a profile's section
    for it); a rule without one runs the engine's `policy`. A batch row picks the same way."""
    model = tiny_model("llama", seed=7)
    cfg = HeadsConfig(kind="medusa", num_heads=3, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    engine = Engine(
        model, ByteTokenizer(), heads=heads, policy=static("tree_8"), policies={"sample": static("chain_3")}
    )
    ids = list(range(9))

    def trees(**kwargs):
        return {s.tree for s in engine.generate(ids, max_new_tokens=12, seed=1, **kwargs).steps}

    assert trees() == {"tree_8"}
    assert trees(temperature=0.7) == {"chain_3"}  # auto at T > 0: lossless sampling
    assert trees(temperature=0.7, acceptance="typical") == {"tree_8"}
    rules = [
        engine.generate(ids, max_new_tokens=4, seed=1, **kw).acceptance for kw in ({}, {"temperature": 0.7})
    ]
    assert rules == ["greedy", "sample"]  # each result says which rule accepted its drafts
    row, _ = Batch(engine).add(ids, max_new_tokens=12, temperature=0.7, seed=1)
    assert row.state.policy.trees[0].name == "chain_3"
    with pytest.raises(
        EntMTPError, match=r"keyed by acceptance rule \(greedy, sample, typical, gumbel\), got 'hot'"
    ):
        Engine(
            model, ByteTokenizer(), heads=heads, policy=static("tree_8"), policies={"hot": static("chain_3")}
        )


def test_bad_lengths_are_rejected_with_clear_messages():
    model = tiny_model("llama")
    engine = Engine(model, ByteTokenizer())
    with pytest.raises(PromptError, match="max_new_tokens must be >= 1"):
        engine.generate([1, 2], max_new_tokens=0)
    with pytest.raises(PromptError, match="context window is 512"):
        engine.generate(list(range(256)) * 2, max_new_tokens=1)
    with pytest.raises(PromptError, match="use max_new_tokens <= 412"):
        engine.generate(list(range(100)), max_new_tokens=500)
    with pytest.raises(PromptError, match="empty"):
        engine.generate("   ", max_new_tokens=5)
    for bad in (-1, 21):
        with pytest.raises(
            EntMTPError, match=rf"logprobs must be 0\.\.20 \(top tokens per position\), got {bad}"
        ):
            engine.generate([1, 2], max_new_tokens=2, logprobs=bad)


def test_tree_deeper_than_heads_is_rejected():
    from entmtp.errors import TreeError

    model = tiny_model("llama")
    cfg = HeadsConfig(kind="medusa", num_heads=2, hidden_size=64, vocab_size=256)
    with pytest.raises(TreeError, match="depth"):
        Engine(model, ByteTokenizer(), heads=random_heads(cfg), policy=static("chain_3"))


def test_unknown_tree_name_is_rejected():
    from entmtp.errors import TreeError

    model = tiny_model("llama")
    cfg = HeadsConfig(kind="medusa", num_heads=2, hidden_size=64, vocab_size=256)
    with pytest.raises(TreeError, match="mc_sim_7b_63"):  # the error lists the shipped trees
        Engine(model, ByteTokenizer(), heads=random_heads(cfg), policy=static("no_such_tree"))


def test_engine_runs_the_policies_it_is_given_and_refuses_a_tree_name_or_a_tree():
    """`Engine` converts nothing: a tree name or a `Tree`, as its policy or in `policies` (and for `hybrid` or
    a batch row), is refused with the fix, `static(...)`; the policies given are the very objects it runs (no
    copies, no wraps); no policy is plain decoding, the root alone, even with heads (never a default tree)."""
    model = tiny_model("llama")
    heads = random_heads(HeadsConfig(kind="medusa", num_heads=3, hidden_size=64, vocab_size=256), seed=0)
    for bad, fix in (("tree_8", r"static\('tree_8'\)"), (load_tree("tree_8"), r"static\(tree\)")):
        with pytest.raises(
            TypeError, match=rf"^Engine takes a TreePolicy, not the tree .+: pass entmtp\.policy\.{fix}"
        ):
            Engine(model, ByteTokenizer(), heads, bad)
        with pytest.raises(TypeError, match=rf"^Engine's policies\['sample'\] takes a TreePolicy.+{fix}"):
            Engine(model, ByteTokenizer(), heads, static("tree_8"), policies={"sample": bad})
        with pytest.raises(TypeError, match=rf"^hybrid takes a TreePolicy.+{fix}"):
            hybrid(bad)
    main, sample = static("tree_8"), hybrid(static("chain_3"), Lookup())
    engine = Engine(model, ByteTokenizer(), heads, main, policies={"sample": sample})
    assert (
        engine.policy is main and list(engine.policies) == ["sample"] and engine.policies["sample"] is sample
    )
    assert engine.policy_for(Sampling(0.7)) is sample and engine.policy_for(Sampling()) is main
    with pytest.raises(TypeError, match=r"^a batch row takes a TreePolicy, not the tree 'chain_3'"):
        Batch(engine).add(list(range(9)), policy="chain_3", max_new_tokens=4)
    plain = Engine(model, ByteTokenizer(), heads)  # heads, no policy: plain decoding, not tree_8
    assert plain.policy == static(Tree.root_only())
    steps = plain.generate(list(range(9)), max_new_tokens=6).steps
    assert steps and {s.tree for s in steps} == {"none"} and not any(s.tree_nodes for s in steps)


def test_root_only_tree_is_plain_decoding():
    model = tiny_model("llama", seed=8)
    ids = list(range(30, 40))
    cfg = HeadsConfig(kind="medusa", num_heads=2, hidden_size=64, vocab_size=256)
    out = Engine(model, ByteTokenizer(), heads=random_heads(cfg), policy=static(Tree.root_only())).generate(
        ids, max_new_tokens=12
    )
    assert out.token_ids == plain_greedy(model, ids, 12)
    assert out.tokens_per_step == [1] * 11


def test_logprobs_are_the_base_models_log_softmax_of_each_emitted_token():
    model = tiny_model("llama", seed=7)
    ids = list(range(60, 75))
    ref = plain_greedy(model, ids, 20)
    heads = OracleHeads(ids + ref, rank_mod=1)  # multi-token steps: several tokens' rows per verification
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static("chain_5"))
    events = list(engine.stream(ids, max_new_tokens=20, logprobs=3))
    result = events[-1].result
    assert result.token_ids == ref and max(result.tokens_per_step) > 1
    assert [lp for ev in events for lp in ev.logprobs] == result.logprobs
    with torch.no_grad():
        logits = model(torch.tensor([ids + ref])).logits[
            0, len(ids) - 1 : -1
        ]  # [20, V]: row i predicts ref[i]
    want = torch.log_softmax(logits.float(), dim=-1)
    got = torch.tensor([lp.logprob for lp in result.logprobs])
    torch.testing.assert_close(got, want[torch.arange(20), torch.tensor(ref)], atol=1e-4, rtol=0)
    for row, lp in zip(want, result.logprobs, strict=True):
        top = row.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4, rtol=0)
    assert engine.generate(ids, max_new_tokens=5).logprobs is None  # only when asked for


def test_the_policy_observes_each_step_as_it_was_emitted():
    """A step cut by EOS reaches the policy cut: what it learns from is what the user got."""
    model = tiny_model("llama", seed=3)
    ids = [1, 2, 3, 4, 5, 6]
    ref = plain_greedy(model, ids, 40)
    # an EOS token first seen inside a chain_5 step (steps emit tokens 1-6, 7-12, ...)
    eos = next(i for i in range(6, 40) if ref[i] not in ref[:i] and i % 6 not in (0, 5))
    model.generation_config.eos_token_id = ref[eos]
    seen = []

    class Recording(StaticPolicy):
        def observe(self, step):
            seen.append(step)

    heads = OracleHeads(ids + ref, rank_mod=1)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=Recording(load_tree("chain_5"))).generate(ids)
    assert result.finish_reason == "eos" and result.token_ids == ref[: eos + 1]
    assert seen == result.steps
    assert seen[-1].token_ids[-1] == ref[eos] and seen[-1].tokens == len(seen[-1].token_ids)


def test_streamed_text_adds_up_to_the_result_when_a_stop_string_spans_tokens():
    """The engine streams through the same detokenizer as the server: a stop string's first tokens are held
    back until it is clear they do not begin it, and the last event releases whatever is left."""
    model = tiny_model("llama", seed=6)
    ids = list(b"hello")
    text = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=30).text
    # a stop inside the text; one that the text's last characters begin (held to the end, then released)
    for stop in (text[8:12], text[-2:] + "\x01 not in the text"):
        events = list(Engine(model, ByteTokenizer()).stream(ids, max_new_tokens=30, stop=[stop]))
        result = events[-1].result
        assert "".join(ev.text for ev in events) == result.text
        assert result.text == text.split(stop)[0]


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
def test_heads_that_read_an_earlier_layer_give_identical_output_and_read_what_training_stores(arch):
    """Hydra heads on the layer two before the last (through the final norm): the output is plain greedy's,
    one at a time and in a continuous batch, and what the engine feeds them at every committed position is
    what the distillation data stores for that position (one definition: `heads_input`)."""
    model = tiny_model("llama", seed=4)
    cfg = HeadsConfig(
        kind="hydra", num_heads=3, hidden_size=64, vocab_size=256, head_arch=arch, hidden_state_offset=2
    )
    heads = random_heads(cfg, seed=0, init="random")
    fed = []
    make = heads.drafter

    def recording_drafter(*args, **kwargs):  # keeps each `extend`'s states
        drafter = make(*args, **kwargs)
        extend = drafter.extend
        drafter.extend = lambda hidden: (fed.append(hidden.detach().clone()), extend(hidden))[1]
        return drafter

    heads.drafter = recording_drafter
    ids = list(range(100, 120))
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static("tree_8"))
    result = engine.generate(ids, max_new_tokens=32)
    assert result.token_ids == plain_greedy(model, ids, 32)
    got = torch.cat(fed)  # the prompt's states, then each step's accepted path's
    rows = generate_batch(engine, [ids, list(range(50, 61))], max_new_tokens=32)
    assert rows[0].token_ids == result.token_ids

    seq = ids + result.token_ids
    stored = base_targets(model, [seq], top_k=1, hidden_state_offset=2)[0]["hidden"]  # positions 0..L-2
    last = base_targets(model, [seq], top_k=1)[0]["hidden"]
    n = got.shape[0]
    assert len(ids) + 16 <= n <= stored.shape[0]  # the prompt and the accepted paths of several steps
    torch.testing.assert_close(got, stored[:n], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, last[:n], atol=1e-2)  # another layer than the last: the check has teeth
