"""On a CUDA GPU: verification replayed from captured CUDA graphs gives the same greedy output as eager
decoding with transformers' DynamicCache (float32), for every shipped tree, a policy switching trees every
step, hybrid lookup trees and real (random) heads; in bf16 at the SmolLM2-135M shape the replay equals the
same static-shape forward run eagerly. Skipped without a GPU (`scripts/gpu_check.sh` runs these)."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp.engine import Engine
from entmtp.graphs import VerifyGraphs, bucket
from entmtp.heads import HeadsConfig, random_heads
from entmtp.lookup import Lookup
from entmtp.policy import static
from entmtp.random_model import random_model
from entmtp.scheduler.hybrid import hybrid
from entmtp.tree import list_trees, load_tree
from test_policy_switching import CyclingPolicy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
IDS = [5, 17, 99, 3, 250, 7, 7, 64]


def cuda_model(seed, **kw):
    return tiny_model("llama", seed=seed, **kw).to("cuda")


def plain(model, ids, n):
    return (
        Engine(model, ByteTokenizer(), kv="dynamic", graphs=False).generate(ids, max_new_tokens=n).token_ids
    )


@pytest.mark.parametrize("tree", list_trees())
def test_graphs_identical_to_eager_for_every_shipped_tree(tree):
    model = cuda_model(3)
    ref = plain(model, IDS, 40)
    t = load_tree(tree)
    heads = OracleHeads(IDS + ref, rank_mod=min(2, t.topk), wrong_every=5)
    engine = Engine(model, ByteTokenizer(), heads=heads, policy=static(t))
    assert engine.graphs is not None
    result = engine.generate(IDS, max_new_tokens=40)
    assert result.token_ids == ref
    assert bucket(t.size) in {b for b, _ in engine.graphs.graphs}
    assert max(result.tokens_per_step) >= min(t.depth, 2) + 1


def test_graphs_with_a_policy_switching_trees_every_step():
    model = cuda_model(4)
    ref = plain(model, IDS, 64)
    engine = Engine(model, ByteTokenizer(), heads=OracleHeads(IDS + ref, rank_mod=2), policy=CyclingPolicy())
    assert engine.generate(IDS, max_new_tokens=64).token_ids == ref
    assert len(engine.graphs.graphs) == 4
    assert engine.generate(IDS, max_new_tokens=64).token_ids == ref  # replayed, not recaptured
    assert len(engine.graphs.captures) == 4


def test_graphs_with_lookup_hybrid_trees():
    model = cuda_model(5)
    ids = [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9, 8, 7]
    ref = plain(model, ids, 48)
    heads = OracleHeads(ids + ref, rank_mod=3, wrong_every=4)
    engine = Engine(
        model, ByteTokenizer(), heads=heads, policy=hybrid(static("tree_8"), Lookup(adaptive=False))
    )
    result = engine.generate(ids, max_new_tokens=48)
    assert result.token_ids == ref and any(s.lookup_nodes for s in result.steps)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_graphs_with_real_random_heads(kind):
    model = cuda_model(6)
    cfg = HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    ref = plain(model, IDS, 48)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=static("mc_sim_7b_63")).generate(
        IDS, max_new_tokens=48
    )
    assert result.token_ids == ref


def test_a_longer_generation_grows_the_cache_and_recaptures():
    model = cuda_model(7, max_position_embeddings=4096)
    engine = Engine(model, ByteTokenizer(), heads=OracleHeads(IDS, rank_mod=1), policy=static("chain_1"))
    engine.heads.reference = IDS + plain(model, IDS, 1500)
    short = engine.generate(IDS, max_new_tokens=40)
    first = engine.graphs.cache
    assert first.capacity == 1024
    long = engine.generate(IDS, max_new_tokens=1500)
    assert engine.graphs.cache.capacity == 2048 and engine.graphs.cache is not first
    assert long.token_ids == engine.heads.reference[len(IDS) :] and short.token_ids == long.token_ids[:40]


def test_replay_equals_the_same_forward_run_eagerly_at_smollm2_shape_bf16():
    model, tok = random_model("smollm2-135m", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = model.config
    heads = random_heads(
        HeadsConfig(kind="medusa", num_heads=4, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    )
    outs = []
    for capture in (True, False):
        engine = Engine(model, tok, heads=heads, policy=static("mc_sim_7b_63"))
        engine.graphs = VerifyGraphs(engine.base, capture=capture)
        outs.append(engine.generate(ids, max_new_tokens=64).token_ids)
    assert outs[0] == outs[1]


def test_the_cost_probe_verifies_through_captured_graphs_as_the_engine_does():
    from entmtp.costs import measure

    curve = measure(cuda_model(3), None, sizes=(0, 1, 4, 16), contexts=(32,), budget_s=10.0, progress=False)
    assert curve.key["graphs"] is True and curve.key["hardware"]["device"] == "cuda"
    assert all(ms > 0 for ms in curve.step_ms)
