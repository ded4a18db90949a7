"""Heads: drafting against slow oracles, teacher forcing vs drafting, official checkpoint layouts, errors."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from conftest import tiny_model
from entmtp.errors import HeadsError
from entmtp.heads import (
    Drafter,
    HeadsConfig,
    HydraHeads,
    MedusaHeads,
    heads_input,
    load_heads,
    random_heads,
    save_heads,
    save_hydra_official,
    save_medusa_official,
)
from entmtp.tree import Tree, load_tree

H, V = 64, 256

# Depth-1 node (2,) and (0,) have no children, (1, 1) has none either: drafting must pick the right parents.
UNEVEN = Tree.from_paths([[0], [1], [2], [1, 0], [1, 2], [1, 0, 0], [1, 0, 1], [1, 2, 0]], "uneven")
FULL = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]], "full")
CHAIN = Tree.from_paths([[0], [0, 0], [0, 0, 0]], "chain")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, vocab=V)  # a frozen base, as in training


@pytest.fixture(scope="module")
def prompt(model):
    """A prompt, its last-layer hidden states [T, H] and the base model's next token."""
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return ids[0], out.hidden_states[-1][0], out.logits[0, -1].argmax()


def make(model, kind, *, init="random", **fields):
    config = HeadsConfig.for_model(model, kind, fields.pop("num_heads", 4), **fields)
    return random_heads(config, seed=3, init=init).bind(model)


def all_logits(heads, hidden, tokens):
    with torch.no_grad():
        return [heads.project(k, f) for k, f in enumerate(heads.features(hidden, tokens))]


def assert_same_heads(a, b, model):
    """The same drafts (both trees), and the same teacher-forced logits and draft log-probabilities to float32
    rounding, from the same committed positions: a CPU BLAS may round a product differently with a buffer's
    alignment (seen on an AVX-512 EPYC: one log-probability of eight, 1 ulp apart, in a full test run only)."""
    g = torch.Generator().manual_seed(5)
    hidden, tokens = torch.randn(2, 9, H, generator=g), torch.randint(0, V, (2, 9), generator=g)
    for la, lb in zip(all_logits(a, hidden, tokens), all_logits(b, hidden, tokens), strict=True):
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    drafters = a.drafter(), b.drafter()
    for drafter in drafters:
        drafter.extend(hidden[0])
    for tree in (FULL, UNEVEN):
        da, db = (drafter.draft(tree, tokens[0, 0]) for drafter in drafters)
        assert torch.equal(da.tokens, db.tokens)
        torch.testing.assert_close(da.logprobs, db.logprobs, rtol=1e-6, atol=1e-6)


# ---- drafting vs slow oracles ---------------------------------------------------------------------


@pytest.mark.parametrize("share", [True, False])
def test_medusa_draft_matches_per_head_topk(model, prompt, share):
    heads = make(model, "medusa", share_lm_head=share)
    _, hidden, root = prompt
    drafter = heads.drafter()
    drafter.extend(hidden)
    draft = drafter.draft(UNEVEN, root)
    assert draft.tokens.shape == (UNEVEN.num_nodes,) and draft.logprobs.dtype == torch.float32
    with torch.no_grad():
        lp = [
            torch.log_softmax(heads.project(k, heads.heads[k].blocks(hidden[-1])).float(), -1)
            for k in range(3)
        ]
    for node, path in enumerate(UNEVEN.paths):
        order = lp[len(path) - 1].argsort(descending=True)
        assert draft.tokens[node] == order[path[-1]], path
        torch.testing.assert_close(draft.logprobs[node], lp[len(path) - 1][order[path[-1]]])


def naive_hydra(heads, feature, root, tree):
    """Slow oracle: each node's head input is built by walking its own path."""
    emb = heads._require_base().embed
    tokens, logprobs = {}, {}
    for path in tree.paths:
        branch = [root] + [tokens[path[:i]] for i in range(1, len(path))]
        x = torch.cat([feature] + [emb(torch.tensor([t]))[0] for t in branch])
        lp = torch.log_softmax(heads.project(len(path) - 1, heads.heads[len(path) - 1].blocks(x)).float(), -1)
        token = lp.argsort(descending=True)[path[-1]]
        tokens[path], logprobs[path] = int(token), lp[token]
    return torch.tensor([tokens[p] for p in tree.paths]), torch.stack([logprobs[p] for p in tree.paths])


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
@pytest.mark.parametrize("tree", [FULL, UNEVEN], ids=lambda t: t.name)
def test_hydra_draft_matches_per_node_loop(model, prompt, arch, tree):
    heads = make(model, "hydra", head_arch=arch, share_lm_head=False)
    _, hidden, root = prompt
    drafter = heads.drafter()
    drafter.extend(hidden)
    draft = drafter.draft(tree, root)
    with torch.no_grad():
        tokens, logprobs = naive_hydra(heads, drafter.feature, int(root), tree)
    assert torch.equal(draft.tokens, tokens)
    torch.testing.assert_close(draft.logprobs, logprobs)
    again = drafter.draft(tree, root)  # the cached per-tree plan gives the same draft
    assert torch.equal(again.tokens, draft.tokens)


def test_ungrounded_hydra_drafts_like_medusa(model, prompt):
    heads = make(model, "hydra", grounded=False)
    _, hidden, root = prompt
    drafter = heads.drafter()
    drafter.extend(hidden)
    draft = drafter.draft(FULL, root)
    with torch.no_grad():
        first = torch.log_softmax(heads.project(0, heads.heads[0].blocks(hidden[-1])).float(), -1)
    assert draft.tokens[0] == first.argmax()


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
def test_teacher_forced_features_reproduce_greedy_chain(model, prompt, arch):
    heads = make(model, "hydra", head_arch=arch)
    ids, hidden, root = prompt
    drafter = heads.drafter()
    drafter.extend(hidden)
    chain = drafter.draft(CHAIN, root).tokens  # [3]: x_{t+2}, x_{t+3}, x_{t+4}
    t = len(ids) - 1
    tokens = torch.cat([ids, root.reshape(1), chain])[None]  # [1, T+4]
    full_hidden = torch.cat([hidden, torch.zeros(4, H)])[None]  # positions after t are never read at t
    logits = all_logits(heads, full_hidden, tokens)
    assert [int(logits[k][0, t].argmax()) for k in range(3)] == chain.tolist()


def test_root_only_tree_and_too_deep_tree(model, prompt):
    heads = make(model, "hydra", num_heads=2)
    drafter = heads.drafter()
    drafter.extend(prompt[1])
    assert drafter.draft(Tree.root_only(), prompt[2]).tokens.shape == (0,)
    with pytest.raises(HeadsError, match="depth 3 but the heads predict only 2"):
        drafter.draft(FULL, prompt[2])


def test_draft_before_extend_and_unbound(model):
    config = HeadsConfig.for_model(model, "hydra", 3)
    heads = random_heads(config)
    drafter = heads.drafter()
    with pytest.raises(HeadsError, match=r"call extend\(prompt hidden states\)"):
        drafter.draft(FULL, torch.tensor(1))
    drafter.extend(torch.randn(3, H))
    with pytest.raises(HeadsError, match=r"heads.bind\(model\)"):
        drafter.draft(FULL, torch.tensor(1))


# ---- prefix-mlp -----------------------------------------------------------------------------------


def test_prefix_extend_in_chunks_equals_one_chunk_and_features(model, prompt):
    heads = make(model, "hydra", head_arch="prefix-mlp")
    ids, hidden, root = prompt
    one = heads.drafter()
    one.extend(hidden)
    whole = one.feature.clone()
    chunks, lazy = heads.drafter(), heads.drafter()
    for chunk in (hidden[:5], hidden[5:9], hidden[9:]):
        chunks.extend(chunk)
        chunks.feature  # noqa: B018 - reading the feature advances the heads over this chunk alone
        lazy.extend(chunk)  # advanced over all three chunks at once, when read
    torch.testing.assert_close(chunks.feature, whole)
    torch.testing.assert_close(lazy.feature, whole)
    with torch.no_grad():
        prefix_out, _ = heads._run_prefix(hidden[None], 0, None)  # what features() runs first
    torch.testing.assert_close(prefix_out[0, -1], whole)


def test_prefix_layer_equals_official_one_layer_llama(model, prompt, tmp_path):
    """The official prefix layer is a 1-layer LlamaModel fed inputs_embeds; ours must compute the same."""
    heads = make(model, "hydra", head_arch="prefix-mlp", share_lm_head=False)
    save_hydra_official(heads, tmp_path)
    official = torch.load(tmp_path / "hydra_lm_head.pt", weights_only=True)
    llama = LlamaModel(_one_layer(model.config)).eval()
    prefix = {k[len("prefix_embeding_layer.") :]: v for k, v in official.items() if k.startswith("prefix_")}
    missing, unexpected = llama.load_state_dict(prefix, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    hidden = prompt[1]
    with torch.no_grad():
        expected = llama(inputs_embeds=hidden[None]).last_hidden_state[0]
    drafter = heads.drafter()
    drafter.extend(hidden)
    torch.testing.assert_close(drafter.feature, expected[-1], rtol=1e-5, atol=1e-5)


def _one_layer(config):
    one = LlamaConfig(**config.to_dict())
    one.num_hidden_layers = 1
    return one


def test_features_train_with_gradients(model, prompt):
    heads = make(model, "hydra", head_arch="prefix-mlp", share_lm_head=True)
    ids, hidden, _ = prompt
    loss = sum(
        heads.project(k, f).logsumexp(-1).mean()
        for k, f in enumerate(heads.features(hidden[None], ids[None]))
    )
    loss.backward()
    assert heads.prefix.self_attn.q_proj.weight.grad is not None
    assert heads.heads[2].blocks[0].res_connection.weight.grad is not None
    assert model.lm_head.weight.grad is None


# ---- files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pt"])
def test_medusa_official_round_trip_reads_head_count_from_weights(model, tmp_path, safetensors):
    heads = make(model, "medusa", num_heads=5, num_layers=2, share_lm_head=False)
    save_medusa_official(heads, tmp_path, config_heads=2, safetensors=safetensors)  # the 2-vs-5 quirk
    assert (tmp_path / ("medusa_lm_head.safetensors" if safetensors else "medusa_lm_head.pt")).exists()
    loaded = load_heads(tmp_path)
    assert isinstance(loaded, MedusaHeads)
    assert (loaded.config.num_heads, loaded.config.num_layers, loaded.config.share_lm_head) == (5, 2, False)
    assert_same_heads(heads, loaded.bind(model), model)


def test_medusa_official_keys(model, tmp_path):
    heads = make(model, "medusa", num_heads=2, num_layers=1, share_lm_head=False)
    save_medusa_official(heads, tmp_path)
    state = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    assert sorted(state) == [
        "0.0.linear.bias",
        "0.0.linear.weight",
        "0.1.weight",
        "1.0.linear.bias",
        "1.0.linear.weight",
        "1.1.weight",
    ]
    assert state["0.1.weight"].shape == (V, H)


def test_shared_projection_exports_base_layer(model, tmp_path):
    heads = make(model, "medusa", num_heads=3)
    save_medusa_official(heads, tmp_path)
    loaded = load_heads(tmp_path).bind(model)
    assert not loaded.config.share_lm_head
    assert_same_heads(heads, loaded, model)


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
def test_hydra_official_round_trip(model, tmp_path, arch):
    heads = make(model, "hydra", head_arch=arch, num_heads=5, num_layers=2, share_lm_head=False)
    save_hydra_official(heads, tmp_path, config_heads=2)
    state = torch.load(tmp_path / "hydra_lm_head.pt", weights_only=True)
    first, proj = (
        ("1", "hydra_lm_head.0.1.weight") if arch == "prefix-mlp" else ("0", "hydra_lm_head.0.weight")
    )
    assert state[f"hydra_mlp.1.{first}.linear.weight"].shape == (
        H,
        3 * H,
    )  # head 2 reads feature + 2 embeddings
    assert f"hydra_mlp.1.{first}.res_connection.bias" in state and proj in state
    loaded = load_heads(tmp_path)
    assert isinstance(loaded, HydraHeads)
    c = loaded.config
    assert (c.num_heads, c.num_layers, c.head_arch, c.grounded) == (5, 2, arch, True)
    assert_same_heads(heads, loaded.bind(model), model)


def test_hydra_official_ignores_embedding_tables_and_guesses_head_split(model, tmp_path):
    heads = make(model, "hydra", head_arch="prefix-mlp", share_lm_head=False)
    save_hydra_official(heads, tmp_path)
    state = torch.load(tmp_path / "hydra_lm_head.pt", weights_only=True)
    state["input_embed_fn.weight"] = torch.zeros(V, H)  # the official module registers the base embedding
    state["prefix_embeding_layer.embed_tokens.weight"] = torch.zeros(V, H)
    torch.save(state, tmp_path / "hydra_lm_head.pt")
    (tmp_path / "config.json").write_text('{"hydra_num_heads": 4, "hydra_head_arch": "prefix-mlp"}')
    loaded = load_heads(tmp_path)
    assert loaded.config.head_dim == 32  # a guess until bind() reads the model's split
    loaded.bind(model)
    assert (loaded.config.num_attention_heads, loaded.config.head_dim) == (4, 16)
    assert_same_heads(heads, loaded, model)


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
def test_own_format_round_trip_keeps_dtype(model, tmp_path, arch):
    heads = make(model, "hydra", head_arch=arch, hidden_state_offset=1).to(torch.bfloat16)
    save_heads(heads, tmp_path)
    loaded = load_heads(tmp_path)
    assert loaded.dtype == torch.bfloat16 and loaded.config == heads.config
    assert_same_heads(heads, loaded.bind(model), model)
    assert load_heads(tmp_path, dtype=torch.float32).dtype == torch.float32


def test_own_format_medusa_saves_only_head_parameters(model, tmp_path):
    from safetensors.torch import load_file

    heads = make(model, "medusa", init="medusa")
    save_heads(heads, tmp_path)
    assert set(load_file(tmp_path / "heads.safetensors")) == set(heads.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in heads.state_dict())
    assert_same_heads(heads, load_heads(tmp_path).bind(model), model)


def test_save_refuses_existing_heads_unless_overwrite(model, tmp_path):
    heads = make(model, "medusa")
    save_heads(heads, tmp_path)
    with pytest.raises(HeadsError, match=r"already holds heads .*overwrite=True"):
        save_heads(heads, tmp_path)
    with pytest.raises(HeadsError, match="overwrite=True"):
        save_medusa_official(heads, tmp_path)
    save_medusa_official(heads, tmp_path, overwrite=True)  # replaces ours; stale heads.safetensors removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "medusa_lm_head.pt"]


# ---- errors ---------------------------------------------------------------------------------------


def test_bind_names_both_sizes(model):
    wrong_hidden = random_heads(HeadsConfig("medusa", 2, hidden_size=576, vocab_size=V))
    with pytest.raises(HeadsError, match="hidden size 576 but the model has 64.*train heads for this model"):
        wrong_hidden.bind(model)
    wrong_vocab = random_heads(HeadsConfig("hydra", 2, hidden_size=H, vocab_size=1000))
    with pytest.raises(HeadsError, match="vocab size 1000 but the model has 256"):
        wrong_vocab.bind(model)


def test_config_errors():
    with pytest.raises(HeadsError, match="kind 'eagle'"):
        HeadsConfig("eagle", 2)
    with pytest.raises(HeadsError, match="Hydra-only"):
        HeadsConfig("medusa", 2, head_arch="prefix-mlp")
    with pytest.raises(HeadsError, match="HeadsConfig.for_model"):
        HeadsConfig("hydra", 2, head_arch="prefix-mlp", num_attention_heads=4)  # partial geometry


def test_missing_or_empty_directory(tmp_path):
    with pytest.raises(HeadsError, match="does not exist"):
        load_heads(tmp_path / "nope")
    with pytest.raises(HeadsError, match="no heads found"):
        load_heads(tmp_path)


def test_corrupt_and_truncated_weights(model, tmp_path):
    heads = make(model, "medusa")
    save_heads(heads, tmp_path / "ours")
    weights = tmp_path / "ours" / "heads.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadsError, match=r"heads.safetensors: the file is corrupt or truncated"):
        load_heads(tmp_path / "ours")
    weights.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(HeadsError, match="corrupt or truncated"):
        load_heads(tmp_path / "ours")

    save_medusa_official(heads, tmp_path / "pt")
    (tmp_path / "pt" / "medusa_lm_head.pt").write_bytes(b"\x80\x02garbage" * 100)
    with pytest.raises(HeadsError, match=r"medusa_lm_head.pt: the file is corrupt"):
        load_heads(tmp_path / "pt")


def test_missing_and_misshapen_keys(model, tmp_path):
    heads = make(model, "medusa", num_heads=3, share_lm_head=False)
    save_medusa_official(heads, tmp_path)
    path = tmp_path / "medusa_lm_head.pt"
    state = torch.load(path, weights_only=True)
    del state["2.0.linear.bias"]
    torch.save(state, path)
    with pytest.raises(HeadsError, match=r"medusa_lm_head.pt do not match .*missing keys 2.0.linear.bias"):
        load_heads(tmp_path)
    state["2.0.linear.bias"] = torch.zeros(H + 1)
    torch.save(state, path)
    with pytest.raises(HeadsError, match=r"2.0.linear.bias has shape \(65,\) .*inconsistent"):
        load_heads(tmp_path)

    save_heads(make(model, "hydra"), tmp_path / "ours")
    from safetensors.torch import load_file, save_file

    ours = load_file(tmp_path / "ours" / "heads.safetensors")
    ours["heads.9.proj.weight"] = torch.zeros(1)
    save_file(ours, tmp_path / "ours" / "heads.safetensors")
    with pytest.raises(HeadsError, match="unexpected keys heads.9.proj.weight"):
        load_heads(tmp_path / "ours")


def test_prefix_layer_without_geometry_is_built_at_bind(model, tmp_path):
    config = HeadsConfig("hydra", 3, hidden_size=H, vocab_size=V, head_arch="prefix-mlp")
    heads = random_heads(config, seed=2, init="random")
    assert heads.prefix is None
    with pytest.raises(HeadsError, match=r"call heads.bind\(model\) before saving"):
        save_heads(heads, tmp_path)
    heads.bind(model)
    assert (heads.config.num_attention_heads, heads.config.num_key_value_heads, heads.config.head_dim) == (
        4,
        2,
        16,
    )
    again = random_heads(config, seed=2, init="random").bind(model)  # seeded: the same layer
    assert torch.equal(heads.prefix.self_attn.q_proj.weight, again.prefix.self_attn.q_proj.weight)
    save_heads(heads, tmp_path)
    assert_same_heads(heads, load_heads(tmp_path).bind(model), model)


@pytest.mark.parametrize("kind,share", [("medusa", True), ("medusa", False), ("hydra", False)])
def test_draft_vocabulary_restricts_drafts_and_round_trips(model, prompt, tmp_path, kind, share):
    from entmtp.heads import frequent_tokens

    heads = make(model, kind, share_lm_head=share)
    _, hidden, root = prompt
    drafter = heads.drafter()
    drafter.extend(hidden)
    full = drafter.draft(UNEVEN, root)
    heads.set_draft_vocab(torch.arange(V))  # the whole vocabulary: the same drafts
    same = drafter.draft(UNEVEN, root)
    assert torch.equal(same.tokens, full.tokens)
    torch.testing.assert_close(same.logprobs, full.logprobs)
    # a subset without the full-vocabulary top-1 of every depth-1 draft: those tokens can no longer appear
    banned = set(full.tokens.tolist())
    vocab = torch.tensor([t for t in range(V) if t not in banned])
    heads.set_draft_vocab(vocab)
    sub = drafter.draft(UNEVEN, root)
    assert set(sub.tokens.tolist()) <= set(vocab.tolist())
    save_heads(heads, tmp_path / "h")
    loaded = load_heads(tmp_path / "h").bind(model)
    assert torch.equal(loaded.draft_vocab, vocab)
    again = loaded.drafter()
    again.extend(hidden)
    assert torch.equal(again.draft(UNEVEN, root).tokens, sub.tokens)
    counts = torch.zeros(V)
    counts[[5, 9, 9, 9, 7, 7]] += torch.tensor([1.0, 3.0, 3.0, 3.0, 2.0, 2.0])
    assert frequent_tokens(counts, 2, keep=[0]).tolist() == [0, 7, 9]


def test_draft_vocabulary_errors(model):
    heads = make(model, "medusa")
    with pytest.raises(HeadsError, match="draft vocabulary"):
        heads.set_draft_vocab(torch.tensor([0, V]))
    with pytest.raises(HeadsError, match="draft vocabulary"):
        heads.set_draft_vocab(torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("kind,arch", [("medusa", "mlp"), ("hydra", "mlp"), ("hydra", "prefix-mlp")])
def test_probing_rows_together_gives_each_row_its_own_probe(model, prompt, kind, arch):
    """A batched step probes every row's master at once (Drafter.probe_rows): the same candidates and
    probabilities, and for Hydra the same branch context, as each row's own probe."""
    heads = make(model, kind, head_arch=arch)
    master = load_tree("mc_sim_7b_63")
    ids, hidden, _ = prompt
    drafters = []
    for t in (12, 7, 3):  # three rows: different prefixes of the prompt
        d = heads.drafter()
        d.extend(hidden[:t])
        drafters.append(d)
    roots = ids[[3, 5, 9]]
    together = Drafter.probe_rows(drafters, master, roots)
    for d, root, got in zip(drafters, roots, together, strict=True):
        want = d.probe(master, root.reshape(1))
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
        if want.context is not None:
            torch.testing.assert_close(got.context, want.context)


# ---- what the heads read -------------------------------------------------------------------------------


def test_heads_read_an_earlier_layer_through_the_final_norm_unless_told_raw(model):
    """`heads_input`: offset 0 is the last layer's state (already normed); offset k the output of the layer k
    before the last, through the same final norm, or raw with norm False."""
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    decoder = model.get_decoder()
    with torch.no_grad():
        out = decoder(input_ids=ids, output_hidden_states=True)
        assert torch.equal(heads_input(decoder, out, 0), out.last_hidden_state)
        assert torch.equal(heads_input(decoder, out, 1), decoder.norm(out.hidden_states[-2]))
        assert torch.equal(heads_input(decoder, out, 1, norm=False), out.hidden_states[-2])
    raw = out.hidden_states[-2].norm(dim=-1)
    normed = heads_input(decoder, out, 1).norm(dim=-1)
    assert not torch.allclose(raw, normed)  # the norm is not a no-op on this model


def test_a_base_model_without_a_final_norm_refuses_heads_that_need_one(model):
    class NoNorm(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_decoder(self):
            return torch.nn.Identity()  # no .norm

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    heads = random_heads(HeadsConfig.for_model(model, "medusa", 2, hidden_state_offset=1), seed=0)
    with pytest.raises(HeadsError, match=r"final norm, which \w+ lacks .*hidden_state_norm False"):
        heads.bind(NoNorm(model))
    raw = random_heads(
        HeadsConfig.for_model(model, "medusa", 2, hidden_state_offset=1, hidden_state_norm=False), seed=0
    )
    raw.bind(NoNorm(model))  # raw states need no norm


@pytest.mark.parametrize("save", ["ours", "hydra", "medusa"])
def test_saved_heads_keep_the_layer_they_read_and_older_files_read_it_raw(model, tmp_path, save):
    """Every format keeps hidden_state_offset and hidden_state_norm. A config written before
    hidden_state_norm existed read an earlier layer raw, and loads so."""
    kind = "medusa" if save == "medusa" else "hydra"
    heads = make(model, kind, hidden_state_offset=2, share_lm_head=save == "ours")
    {"ours": save_heads, "hydra": save_hydra_official, "medusa": save_medusa_official}[save](heads, tmp_path)
    loaded = load_heads(tmp_path).config
    assert (loaded.hidden_state_offset, loaded.hidden_state_norm) == (2, True)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["hidden_state_norm"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_heads(tmp_path).config
    assert (loaded.hidden_state_offset, loaded.hidden_state_norm) == (2, False)
