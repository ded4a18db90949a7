"""The preallocated KV cache (cache.KVCache) and the static-shape verification that CUDA graphs replay
(graphs.VerifyGraphs, run eagerly here): greedy output identical to transformers' DynamicCache path (float32)
for every shipped tree and for a policy that switches trees every step; the commit of non-contiguous paths;
the cache's edges; the fallback for models it cannot serve. CUDA-only checks live in test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.backends.transformers import BaseModel
from entmtp.cache import DynamicKV, KVCache, static_mask
from entmtp.engine import Engine
from entmtp.graphs import BUCKETS, VerifyGraphs, bucket, kv_bucket
from entmtp.lookup import Lookup
from entmtp.policy import static
from entmtp.scheduler.hybrid import hybrid
from entmtp.tree import Tree, list_trees, load_tree
from test_policy_switching import CYCLE, CyclingPolicy

SHIPPED = sorted(list_trees())
IDS = [5, 17, 99, 3, 250, 7, 7, 64]


def generate(model, ids, n, mode, heads=None, policy=None, **kw):
    """Greedy output on one of the three paths: 'dynamic' (DynamicCache), 'kv' (preallocated, views),
    'static' (preallocated, full-capacity static shapes padded to graph buckets, run eagerly)."""
    engine = Engine(
        model,
        ByteTokenizer(),
        heads=heads,
        policy=policy,
        kv="dynamic" if mode == "dynamic" else "auto",
        **kw,
    )
    if mode == "static":
        engine.graphs = VerifyGraphs(engine.base, capture=False)
    return engine.generate(ids, max_new_tokens=n), engine


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", SHIPPED)
def test_every_shipped_tree_identical_on_all_cache_paths(arch, tree):
    model = tiny_model(arch, seed=3)
    n = 40
    ref = generate(model, IDS, n, "dynamic")[0].token_ids  # plain decoding, today's path
    t = load_tree(tree)
    # rank 1 holds the truth half the time: side branches, so non-contiguous commits (chains: rank 0)
    heads = OracleHeads(IDS + ref, rank_mod=min(2, t.topk), wrong_every=5)
    for mode in ("dynamic", "kv", "static"):
        result, _ = generate(model, IDS, n, mode, heads=heads, policy=static(t))
        assert result.token_ids == ref, (mode, tree)
        assert max(result.tokens_per_step) >= min(t.depth, 2) + 1


@pytest.mark.parametrize("mode", ["kv", "static"])
def test_policy_switching_trees_every_step_identical(mode):
    model = tiny_model("llama", seed=4)
    n = 64
    ref = generate(model, IDS, n, "dynamic")[0].token_ids
    heads = OracleHeads(IDS + ref, rank_mod=2)
    policy = CyclingPolicy()
    result, engine = generate(model, IDS, n, mode, heads=heads, policy=policy)
    assert result.token_ids == ref
    assert [s.tree for s in result.steps][:8] == CYCLE * 2
    if mode == "static":  # root-only, chain_3, mc_sim_7b_63 (64 nodes) and tree_4 each ran in their bucket
        assert {b for b, _ in engine.graphs.graphs} == {bucket(1), bucket(4), bucket(64), bucket(5)}
        again = engine.generate(IDS, max_new_tokens=n)  # a second generation reuses the cache and buckets
        assert again.token_ids == ref


def test_lookup_hybrid_trees_identical_on_static_path():
    """Hybrid trees are pruned per step to the lookup nodes that have a proposal: many tree shapes, few
    buckets."""
    model = tiny_model("llama", seed=5)
    ids = [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9, 8, 7]  # repetitive: the lookup index has continuations
    n = 48
    ref = generate(model, ids, n, "dynamic")[0].token_ids
    heads = OracleHeads(ids + ref, rank_mod=3, wrong_every=4)
    for mode in ("kv", "static"):
        result, engine = generate(
            model, ids, n, mode, heads=heads, policy=hybrid(static("tree_8"), Lookup(adaptive=False))
        )
        assert result.token_ids == ref
        assert any(s.lookup_nodes for s in result.steps)


def _filled(cache, n, seed=0):
    """Write n random tokens' keys/values into each layer the way attention does; return them."""
    g = torch.Generator().manual_seed(seed)
    cache.begin(n)
    kvs = []
    for layer in range(2):
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        keys, values = (
            cache.update(k, v, layer) if isinstance(cache, KVCache) else cache.hf.update(k, v, layer)
        )
        kvs.append((k, v, keys, values))
    return kvs


def test_commit_of_a_non_contiguous_path_moves_entries_in_place():
    ours, ref = KVCache(2, 32), DynamicKV(tiny_model().config)
    for cache in (ours, ref):
        _filled(cache, 5, seed=1)
        cache.commit([0, 1, 2, 3, 4])  # the prefix
    kv_before = ours.kv
    new = _filled(ours, 7, seed=2)
    _filled(ref, 7, seed=2)
    path = [0, 2, 5, 6]  # root, then a side branch: nodes 2, 5, 6
    ours.commit(path)
    ref.commit(path)
    assert ours.kv is kv_before  # no reallocation
    assert ours.length == ref.length == 9
    for layer in range(2):
        k_new = new[layer][0]
        torch.testing.assert_close(ours.kv[0, layer, :, :, 5:9], k_new[:, :, path], rtol=0, atol=0)
        torch.testing.assert_close(ours.kv[0, layer, :, :, :9], ref.hf.layers[layer].keys, rtol=0, atol=0)
        torch.testing.assert_close(ours.kv[1, layer, :, :, :9], ref.hf.layers[layer].values, rtol=0, atol=0)


def test_views_and_static_shapes():
    view, static = KVCache(2, 16), KVCache(2, 16, static=True)
    (_, _, keys, _), _ = _filled(view, 3)
    assert keys.shape[2] == 3  # a view of the committed prefix plus the new tokens
    (_, _, keys, _), _ = _filled(static, 3)
    assert keys.shape[2] == 16  # the whole capacity: one shape per tree size
    # the static mask: prefix [0, past), then the tree's own mask, then nothing
    tree = load_tree("tree_4")
    mask = static_mask(tree.mask, 6, 16)
    assert mask.shape == (tree.size, 16)
    assert mask[:, :6].all() and not mask[:, 6 + tree.size :].any()
    assert torch.equal(mask[:, 6 : 6 + tree.size], tree.mask)
    assert torch.equal(static_mask(tree.mask, torch.tensor(6), 16), mask)  # past as a device scalar


def test_cache_overflow_is_refused():
    cache = KVCache(2, 8)
    cache.begin(8)
    cache.length = 3
    with pytest.raises(ValueError, match="overflow the KV cache of 8"):
        cache.begin(6)


def test_a_tree_that_would_overflow_the_window_falls_back_to_plain_steps():
    """prompt + max_new_tokens fills the context window exactly: near the end no tree fits, so the engine
    takes plain steps there, and the output is still plain decoding's."""
    model = tiny_model("llama", seed=6, max_position_embeddings=128)
    ids = list(range(30, 50))  # 20 tokens; 108 new fill the window of 128
    n = 108
    for mode in ("dynamic", "kv", "static"):
        ref = generate(model, ids, n, "dynamic")[0].token_ids
        heads = OracleHeads(ids + ref, rank_mod=1)
        result, engine = generate(model, ids, n, mode, heads=heads, policy=static("mc_sim_7b_63"))
        assert result.token_ids == ref
        assert result.steps[-1].tree == "none"  # 64 nodes never fit in the last slots
        assert result.steps[0].tree == "mc_sim_7b_63"


def test_graph_buckets_cover_the_largest_shipped_tree():
    assert bucket(1) == 1 and bucket(63) == 64 and bucket(65) == 80 and bucket(BUCKETS[-1] + 1) is None
    assert max(load_tree(t).size for t in SHIPPED) <= BUCKETS[-1]


def test_a_tree_past_the_last_bucket_runs_eagerly():
    model = tiny_model("llama", seed=7)
    wide = Tree.from_paths([[i] for i in range(BUCKETS[-1] + 4)], name="wide")
    ref = generate(model, IDS, 12, "dynamic")[0].token_ids
    heads = OracleHeads(IDS + ref, num_heads=1, rank_mod=300)
    result, engine = generate(model, IDS, 12, "static", heads=heads, policy=static(wide))
    assert result.token_ids == ref
    assert all(b < BUCKETS[-1] for b, _ in engine.graphs.graphs)  # ran eagerly, not in a bucket


def test_models_the_cache_cannot_serve_fall_back_with_a_notice(capsys):
    model = tiny_model("qwen2", seed=8, use_sliding_window=True, sliding_window=500, max_window_layers=0)
    base = BaseModel(model)
    assert not base.preallocate
    assert "keeps transformers' DynamicCache" in capsys.readouterr().err
    assert isinstance(base.new_cache(64), DynamicKV)
    ids = list(range(10, 40))
    n = 24
    ref = generate(model, ids, n, "dynamic")[0].token_ids
    heads = OracleHeads(ids + ref, rank_mod=2)
    result, engine = generate(model, ids, n, "kv", heads=heads, policy=static("tree_8"))
    assert result.token_ids == ref and engine.graphs is None


def test_unknown_kv_option_is_refused():
    with pytest.raises(ValueError, match="unknown kv cache 'paged'"):
        BaseModel(tiny_model(), kv="paged")


def test_kv_buckets_grow_geometrically_and_stop_at_the_capacity():
    sizes = [kv_bucket(n, 10_000) for n in (1, 256, 257, 513, 769, 1025, 1537, 2049, 3073, 4097)]
    assert sizes == [256, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144]
    assert kv_bucket(5000, 4096) == 4096


def test_static_path_crossing_kv_buckets_is_identical():
    """A generation whose context crosses 256 and 512 slots: attention reads more slots as it grows (one
    static shape per (tree bucket, kv_len)), and the output stays plain decoding's."""
    model = tiny_model("llama", seed=9, max_position_embeddings=1024)
    ids = [(7 * i) % 250 + 3 for i in range(240)]
    n = 300
    ref = generate(model, ids, n, "dynamic")[0].token_ids
    heads = OracleHeads(ids + ref, rank_mod=2, wrong_every=6)
    result, engine = generate(model, ids, n, "static", heads=heads, policy=static("tree_8"))
    assert result.token_ids == ref
    assert {kv for _, kv in engine.graphs.graphs} == {256, 512, 768}
