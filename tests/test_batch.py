"""Continuous batching: every row of a batch decodes exactly what it decodes alone (float32 greedy), whatever
its batch-mates are, do, or when they join and leave; the batched KV cache keeps each row's own entries."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.backends.transformers import BaseModel
from entmtp.batch import (
    GATE_EXPLORE,
    GATE_EXPLORE_MAX,
    GATE_WINDOW,
    Batch,
    BatchOptions,
    Gate,
    generate_batch,
)
from entmtp.cache import BatchKV
from entmtp.costs import CostSurface, LatencyModel
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, random_heads
from entmtp.lookup import Lookup
from entmtp.policy import Menu, joint_budget, static
from entmtp.scheduler.hybrid import hybrid
from entmtp.tree import Tree, load_tree

# prompts of different lengths; the repeated ones give the lookup drafts something to copy
PROMPTS = [
    list(range(100, 112)),
    list(b"abcabcabcabcabc"),
    list(range(30, 33)),
    list(b"the cat sat on the mat; the cat sat on the"),
    list(range(200, 241)),
]


@pytest.fixture(scope="module")
def engine():
    model = tiny_model("llama", seed=4)
    cfg = HeadsConfig(kind="medusa", num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=0, init="random")
    return Engine(model, ByteTokenizer(), heads=heads, policy=static("tree_8"))


def alone(engine, prompt, n=None, **kwargs):
    return engine.generate(prompt, **({} if n is None else {"max_new_tokens": n}), **kwargs)


def plain(engine, prompt, n):
    return Engine(engine.model, ByteTokenizer()).generate(prompt, max_new_tokens=n).token_ids


def test_every_row_of_a_mixed_batch_equals_its_own_plain_decoding(engine):
    """Rows with different prompt lengths, the root alone, a static tree, a deep tree and a lookup hybrid, in
    one batch: each row's tokens are its plain greedy decoding, and each takes the steps it takes alone."""
    policies = [
        static(Tree.root_only()),
        static("tree_8"),
        static("mc_sim_7b_63"),
        hybrid(static("tree_8"), Lookup()),
        hybrid(None, Lookup()),
    ]
    batch = Batch(
        engine, BatchOptions(gate=False)
    )  # every step as the rows' policies choose (the gate changes steps only)
    results = {}
    for i, (prompt, policy) in enumerate(zip(PROMPTS, policies, strict=True)):
        row, _ = batch.add(prompt, policy=policy, max_new_tokens=24 + 4 * i)
        results[row.id] = i
    done = {}
    sizes = set()
    while len(batch):
        for row, event in batch.step():
            if event.result is not None:
                done[results[row.id]] = event.result
        sizes.add(batch.last.rows)
    assert max(sizes) == len(PROMPTS)  # all rows really shared steps
    for i, (prompt, policy) in enumerate(zip(PROMPTS, policies, strict=True)):
        n = 24 + 4 * i
        assert done[i].token_ids == plain(engine, prompt, n), f"row {i}"
        solo = Engine(engine.model, ByteTokenizer(), heads=engine.heads, policy=policy).generate(
            prompt, max_new_tokens=n
        )
        assert [(s.tree, s.token_ids) for s in done[i].steps] == [(s.tree, s.token_ids) for s in solo.steps]
    assert any(
        s.accepted for r in done.values() for s in r.steps
    )  # drafts were accepted: the check has teeth


def test_rows_that_finish_early_or_are_cancelled_leave_the_others_exact(engine):
    """A row that ends after 3 tokens (its slot is refilled by the last row's move) and one cancelled midway
    change nothing in the rows still running."""
    batch = Batch(engine)
    rows = [batch.add(p, max_new_tokens=n)[0] for p, n in zip(PROMPTS[:4], (40, 3, 40, 40), strict=True)]
    out = {r.id: list(r.state.out) for r in rows}  # the prefill's token
    steps = 0
    while len(batch):
        for row, event in batch.step():
            out[row.id] += event.token_ids
        steps += 1
        if steps == 4:
            batch.cancel(rows[2])
    for i in (0, 3):
        assert out[rows[i].id] == plain(engine, PROMPTS[i], 40)
    assert out[rows[1].id] == plain(engine, PROMPTS[1], 3)
    assert out[rows[2].id] == plain(engine, PROMPTS[2], 40)[: len(out[rows[2].id])]
    assert len(out[rows[2].id]) < 40  # it really stopped


def test_rows_join_a_running_batch_between_steps(engine):
    """generate_batch with max_batch=2 over five prompts: rows join as others leave; each is exact."""
    results = generate_batch(engine, PROMPTS, BatchOptions(max_batch=2), max_new_tokens=20)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == plain(engine, prompt, 20)
        assert result.finish_reason == "length"


def test_seeded_sampling_of_a_row_repeats_whatever_its_batch_mates_do(engine):
    want = alone(engine, PROMPTS[0], 24, temperature=0.8, seed=11).token_ids
    for mates in ([], PROMPTS[1:3], PROMPTS[2:]):
        batch_prompts = [PROMPTS[0], *mates]
        results = generate_batch(engine, batch_prompts, max_new_tokens=24, temperature=0.8, seed=11)
        assert results[0].token_ids == want
    other = alone(engine, PROMPTS[0], 24, temperature=0.8, seed=12).token_ids
    assert other != want  # the seed matters: the check has teeth


def test_gumbel_rows_of_a_gated_budgeted_batch_write_their_plain_sampling_tokens(engine):
    """The gumbel rule's seeded tokens do not depend on the tree, so its rows take the batch's joint budget
    and gate like greedy rows and still write what plain sampling writes with their seeds."""
    plain = Engine(engine.model, ByteTokenizer())
    kw = dict(max_new_tokens=24, temperature=0.8, acceptance="gumbel")
    want = [plain.generate(p, seed=11 + i, **kw).token_ids for i, p in enumerate(PROMPTS)]
    batch = Batch(
        engine, BatchOptions(costs=CostSurface((1, 8), (0, 64), ((10.0, 12.0), (20.0, 400.0))))
    )  # the gate on
    rows = {batch.add(p, seed=11 + i, **kw)[0].id: i for i, p in enumerate(PROMPTS)}
    got: dict[int, list[int]] = {}
    while len(batch):
        for row, event in batch.step():
            if event.result is not None:
                got[rows[row.id]] = event.result.token_ids
    assert [got[i] for i in range(len(PROMPTS))] == want


def test_a_row_ended_by_its_first_token_comes_back_finished(engine):
    batch = Batch(engine)
    row, event = batch.add(PROMPTS[0], max_new_tokens=1)
    assert event.finish_reason == "length" and event.result.token_ids == plain(engine, PROMPTS[0], 1)
    assert len(batch) == 0 and batch.step() == []


def test_batch_cache_rows_keep_their_entries_when_others_leave_and_the_tensor_grows():
    model = tiny_model("llama", seed=1)
    kv = BatchKV(model)
    base = BaseModel(model)
    rows, prompts = [], [list(range(5, 5 + k)) for k in (7, 3, 11)]
    for p in prompts:
        row = kv.add(len(p) + 8)
        base.forward(torch.tensor(p), None, row)
        base.commit(row, list(range(len(p))))
        rows.append(row)
    keep = [r.kv[:, :, :, :, : r.length].clone() for r in rows]
    kv.remove(rows[0])  # the last row moves into slot 0
    big = kv.add(2000)  # the tensor grows: every view is re-pointed
    assert kv.rows == [rows[2], rows[1], big] and kv.capacity >= 2000
    for r, want in zip(rows[1:], keep[1:], strict=True):
        assert torch.equal(r.kv[:, :, :, :, : r.length], want)


def _batch_with_rows(dtype: torch.dtype, lengths: list[int]) -> tuple[BatchKV, list]:
    """A batch cache in `dtype` whose rows hold `lengths` committed tokens, one more row added and removed
    first (so its tensor has more rows than are in use), its slots filled with noise."""
    model = tiny_model("llama", seed=3).to(dtype)
    kv = BatchKV(model)
    rows = [kv.add(300) for _ in range(len(lengths) + 1)]
    kv.remove(rows[0])  # the last row moves into its place
    kv.kv.copy_(torch.randn(kv.kv.shape))
    for row, length in zip(kv.rows, lengths, strict=True):
        row.length = length
    return kv, kv.rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batched_forward_writes_each_rows_keys_at_its_own_slots_and_nothing_else(dtype):
    kv, rows = _batch_with_rows(dtype, [7, 0, 40])
    n = 3
    before = kv.kv.clone()
    kv.begin(n)
    shape = (len(rows), kv.kv_heads, n, kv.head_dim)  # [B, kv_heads, n, head_dim]
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    keys, values = kv.update(k, v, 1)
    want = before.clone()
    for b, row in enumerate(rows):
        want[0, 1, b, :, row.length : row.length + n] = k[b]
        want[1, 1, b, :, row.length : row.length + n] = v[b]
    assert torch.equal(kv.kv, want)  # bit for bit: every other slot, row and layer untouched
    assert keys.shape[2] == values.shape[2] == 40 + n  # attention reads up to the longest row's last slot
    assert torch.equal(keys, want[0, 1, :3, :, : 40 + n]) and torch.equal(values, want[1, 1, :3, :, : 40 + n])


def test_a_bf16_batch_cache_write_never_copies_the_whole_cache():
    """The write costs what it writes: `scatter_` on a bf16 cache upcast the whole [B, kv_heads, capacity,
    head_dim] layer to float32 and back on every call (28% of the data job's generation)."""
    kv, rows = _batch_with_rows(torch.bfloat16, [5, 9])
    kv.begin(1)
    k = torch.randn(len(rows), kv.kv_heads, 1, kv.head_dim).to(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        kv.update(k, k, 0)
    layer = kv.kv[0, 0, : len(rows)].numel()
    copied = [e for e in prof.events() if e.name == "aten::copy_" and e.input_shapes]
    assert all(math.prod(e.input_shapes[0]) < layer for e in copied), [e.input_shapes for e in copied]


def test_one_batched_forward_gives_each_row_its_own_forwards_logits():
    model = tiny_model("llama", seed=2)
    base = BaseModel(model)
    trees = [load_tree("tree_8"), Tree.root_only(), load_tree("chain_4")]
    prompts = [list(range(10, 30)), list(range(3, 8)), list(range(50, 61))]
    kv = BatchKV(model)
    singles = []
    for p, tree in zip(prompts, trees, strict=True):
        row = kv.add(64)
        base.forward(torch.tensor(p), None, row)
        base.commit(row, list(range(len(p))))
        solo = base.new_cache(64)
        base.forward(torch.tensor(p), None, solo)
        base.commit(solo, list(range(len(p))))
        tokens = torch.arange(tree.size) + 40
        singles.append((tokens, base.forward(tokens, tree, solo)))
    fwds = base.forward_batch([t for t, _ in singles], trees, kv)
    for (_, want), got in zip(singles, fwds, strict=True):
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)


def test_graphs_or_no_preallocated_cache_are_refused_with_the_fix():
    model = tiny_model("llama", seed=3)
    with pytest.raises(EntMTPError, match="max-batch 1"):
        Batch(Engine(model, ByteTokenizer(), kv="dynamic"))
    with pytest.raises(EntMTPError, match="max_batch must be >= 1, got 0"):
        BatchOptions(max_batch=0)


def test_the_gate_runs_the_faster_kind_of_step_and_tries_the_other_again_in_time():
    gate = Gate()
    assert gate.speculate(4)  # speculation first
    gate.observe(4, True, tokens=8, seconds=0.1)  # 80 tokens/s
    assert not gate.speculate(4)  # then a plain step, to measure it
    gate.observe(4, False, tokens=4, seconds=0.02)  # 200 tokens/s: plain is faster here
    kinds = [gate.speculate(4) for _ in range(GATE_EXPLORE * 16)]
    tried = [i for i, k in enumerate(kinds) if k]  # tried again, ever less often while it loses
    assert np.diff(tried).tolist() == [GATE_EXPLORE * 2, GATE_EXPLORE * 4, GATE_EXPLORE * 8]
    assert tried[0] == GATE_EXPLORE and GATE_EXPLORE * 8 == GATE_EXPLORE_MAX
    assert not gate.speculate(3)  # 3 rows read what 4 rows measured (one bucket) ...
    assert gate.speculate(8)  # ... and each bucket of batch sizes is measured on its own
    assert [Gate.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 2, 2, 3, 3, 4, 4]
    for _ in range(GATE_WINDOW):  # speculation got faster: its recent steps outweigh the old ones
        gate.observe(4, True, tokens=12, seconds=0.04)  # 300 tokens/s
    assert gate.rate(4, True) == pytest.approx(300.0) and gate.speculate(4)
    kinds = [gate.speculate(4) for _ in range(GATE_EXPLORE)]
    assert kinds == [True] * (GATE_EXPLORE - 1) + [False]  # a new lead: the other kind is tried soon again
    gate.observe(1, False, tokens=1, seconds=0.001)
    assert gate.speculate(1)  # a row alone is its policy's business, as in Engine.stream


def test_a_gated_batch_still_gives_every_row_its_plain_decoding(engine):
    results = generate_batch(
        engine, PROMPTS, BatchOptions(max_batch=3), max_new_tokens=30
    )  # the gate on (the default)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == plain(engine, prompt, 30)


def menu(expected):
    return Menu(np.array(expected, dtype=float), lambda n: Tree.root_only())


def test_the_joint_budget_maximizes_the_batchs_tokens_per_ms_of_the_whole_step():
    rows = [menu([1.0, 1.6, 1.9, 2.0]), menu([1.0, 1.2, 1.3, 1.35])]
    flat = LatencyModel([0, 3], [10.0, 10.5])  # nodes nearly free: the largest budget
    steep = LatencyModel([0, 3], [10.0, 25.0])  # every node costs the whole batch: plain steps
    middle = LatencyModel([0, 1, 3], [10.0, 11.0, 20.0])  # one node pays (2.8 / 11 > 2 / 10), more do not
    assert joint_budget(rows, [3, 3], flat) == 3
    assert joint_budget(rows, [3, 3], steep) == 0
    assert joint_budget(rows, [1, 1], middle) == 1
    assert joint_budget([rows[0], None], [2, 2], steep) == 2  # a row without a menu keeps its tree
    assert joint_budget([None, None], [2, 2], steep) is None


def test_batch_aware_rows_verify_trees_within_the_joint_budget_and_stay_exact(engine):
    steep = CostSurface((1, 8), (0, 64), ((10.0, 12.0), (20.0, 400.0)))
    spec = Engine(
        engine.model, ByteTokenizer(), heads=engine.heads, policy=hybrid(static("tree_8"), Lookup())
    )
    batch = Batch(spec, BatchOptions(costs=steep, gate=False))
    for p in PROMPTS:
        batch.add(p, max_new_tokens=24)
    budgets, done = set(), []
    while len(batch):
        for _, event in batch.step():
            budgets.add(event.step.signals.get("budget"))
            assert event.step.tree_nodes <= event.step.signals.get("budget", 64)
            if event.result is not None:
                done.append(event.result)
    assert budgets - {None}  # the joint choice ran
    assert sorted(r.token_ids for r in done) == sorted(plain(engine, p, 24) for p in PROMPTS)


def test_a_row_at_the_window_s_end_beside_sampled_rows_with_trees_never_overflows(engine):
    """A row whose prompt and max_new_tokens exactly fill the context window, beside sampled rows drafting
    trees: near the end its own tree shrinks to the root, and the batch's padding to the mates' trees still
    fits the cache. Every row runs to its end; the edge row's tokens are its plain greedy decoding."""
    window = engine.window
    edge = [(7 * i) % 250 + 3 for i in range(window - 40)]
    batch = Batch(engine, BatchOptions(gate=False))
    rows = [batch.add(p, max_new_tokens=60, temperature=0.8)[0] for p in PROMPTS[:2]]  # unseeded: batched
    edge_row, _ = batch.add(edge, max_new_tokens=40)
    out = {r.id: list(r.state.out) for r in (*rows, edge_row)}  # the prefill's token
    while len(batch):
        for row, event in batch.step():
            out.setdefault(row.id, []).extend(event.token_ids)
        assert batch.failed == []
        assert batch.last.rows == 3 or edge_row.id not in out or len(out[edge_row.id]) == 40
    assert out[edge_row.id] == plain(engine, edge, 40)
    assert all(len(out[r.id]) == 60 for r in rows)


def test_a_row_whose_own_step_fails_leaves_alone_and_the_others_go_on(engine):
    batch = Batch(engine, BatchOptions(gate=False))  # every step drafts
    rows = [batch.add(p, max_new_tokens=30)[0] for p in PROMPTS[:3]]
    rows[1].state.drafter.draft = lambda *args: 1 / 0  # its drafting fails
    out = {r.id: list(r.state.out) for r in rows}
    failed = []
    while len(batch):
        for row, event in batch.step():
            out[row.id] += event.token_ids
        failed += batch.failed
    assert [(r, type(e)) for r, e in failed] == [(rows[1], ZeroDivisionError)]
    assert out[rows[0].id] == plain(engine, PROMPTS[0], 30) and out[rows[2].id] == plain(
        engine, PROMPTS[2], 30
    )


def test_the_batch_cache_gives_a_dropped_long_rows_memory_back(engine):
    """A row with room for the whole window, dropped after 3 steps: the batch tensor shrinks back to what
    the short row beside it needs (not the long row's size, kept forever), and to nothing once empty."""
    batch = Batch(engine)
    short, _ = batch.add(PROMPTS[0], max_new_tokens=200)
    alone = batch.kv.kv.nbytes
    long, _ = batch.add(PROMPTS[1], max_new_tokens=engine.window - len(PROMPTS[1]))
    grown = batch.kv.kv.nbytes
    for _ in range(3):
        batch.step()
    batch.cancel(long)
    assert grown >= 3 * alone and batch.kv.kv.nbytes == alone
    batch.cancel(short)
    assert batch.kv.kv.nbytes == 0


def test_a_long_prompt_prefills_in_chunks_between_the_other_rows_steps():
    """A 5-chunk prompt started beside a decoding row goes in one chunk per step: the decoding row gets a
    token every step meanwhile (not a stall for the whole prefill), and the long row's first token, and
    then its tokens, are what it decodes alone."""
    from entmtp.engine import PREFILL_CHUNK

    model = tiny_model("llama", seed=4, max_position_embeddings=2048)
    engine = Engine(model, ByteTokenizer())
    batch = Batch(engine)
    running, _ = batch.add(PROMPTS[0], max_new_tokens=100)
    prompt = [(5 * i) % 250 + 3 for i in range(4 * PREFILL_CHUNK + 7)]
    long = batch.start(prompt, max_new_tokens=10)
    steps_before_its_first_token, tokens = 0, []
    while not tokens:
        out = dict((r.id, e) for r, e in batch.step())
        assert len(out[running.id].token_ids) == 1  # a step of the running row, every step
        steps_before_its_first_token += 1
        tokens = out[long.id].token_ids if long.id in out else []
    assert steps_before_its_first_token == 5
    while len(batch) > 1:
        tokens += (
            dict((r.id, e) for r, e in batch.step()).get(long.id, SimpleNamespace(token_ids=[])).token_ids
        )
    assert tokens == engine.generate(prompt, max_new_tokens=10).token_ids


def test_a_short_prompt_goes_in_ahead_of_the_rest_of_a_long_one():
    """The chunk that goes in is the next one of the prompt with the fewest tokens left: a one-chunk prompt
    started after a 5-chunk one has its first token at the first step, and one started when the long prompt
    is half in at the next step; both then decode what they decode alone."""
    from entmtp.engine import PREFILL_CHUNK

    model = tiny_model("llama", seed=4, max_position_embeddings=2048)
    engine = Engine(model, ByteTokenizer())
    batch = Batch(engine)
    prompt = [(5 * i) % 250 + 3 for i in range(4 * PREFILL_CHUNK + 7)]
    long = batch.start(prompt, max_new_tokens=6)
    short = batch.start(PROMPTS[0], max_new_tokens=6)
    first_token_step, tokens = {}, {long.id: [], short.id: []}
    step, late = 0, None
    while len(batch):
        step += 1
        if step == 3:
            late = batch.start(PROMPTS[3], max_new_tokens=6)
            tokens[late.id] = []
        for r, e in batch.step():
            first_token_step.setdefault(r.id, step)
            tokens[r.id] += e.token_ids
    assert first_token_step[short.id] == 1 and first_token_step[late.id] == 3
    assert first_token_step[long.id] == 7  # its five chunks, two steps later than alone
    assert tokens[long.id] == engine.generate(prompt, max_new_tokens=6).token_ids
    assert tokens[short.id] == engine.generate(PROMPTS[0], max_new_tokens=6).token_ids
    assert tokens[late.id] == engine.generate(PROMPTS[3], max_new_tokens=6).token_ids


def test_a_long_prompt_passed_over_by_a_stream_of_short_ones_still_goes_in():
    """Shorter prompts go first, but a prompt passed over MAX_PASSES steps in a row gets the next chunk: one
    new short prompt every step never starves a long one."""
    from entmtp.batch import MAX_PASSES
    from entmtp.engine import PREFILL_CHUNK

    engine = Engine(tiny_model("llama", seed=4, max_position_embeddings=2048), ByteTokenizer())
    batch = Batch(engine)
    long = batch.start([(5 * i) % 250 + 3 for i in range(PREFILL_CHUNK + 7)], max_new_tokens=2)
    chunks_in = []
    for _ in range(3 * (MAX_PASSES + 1)):
        batch.start(PROMPTS[2], max_new_tokens=1)  # a new short prompt before every step
        before = long.state.cache.length
        batch.step()
        chunks_in.append(long.state.cache.length > before)
    assert sum(chunks_in) >= 2 and all(sum(chunks_in[i : i + MAX_PASSES + 1]) for i in range(0, 18, 9))


def _interrupt_after(layer: int, model, interrupt):
    """Raise `interrupt` once `layer` of `model`'s decoder has run: the forward in flight stops part way."""
    return model.get_decoder().layers[layer].register_forward_hook(lambda *_: interrupt.set())


def _during_prefill(batch, hook):
    """`batch.step` with `hook()` (a torch hook handle) installed only around its prefill chunk."""
    prefill = batch._prefill

    def hooked(row, interrupt=None):
        handle = hook()
        try:
            return prefill(row, interrupt)
        finally:
            handle.remove()

    def step(interrupt=None):
        batch._prefill = hooked
        try:
            return Batch.step(batch, interrupt)
        finally:
            del batch._prefill

    return step


def test_an_interrupted_chunk_stops_part_way_and_runs_again_whole():
    """An interrupt raised while a prompt's chunk is in its forward (here: after the decoder's first layer)
    stops that chunk: no event, the prompt's length in the cache unmoved, the other rows' steps done. The
    same chunk is never stopped twice (it runs whole at the next step even with the interrupt still raised),
    and the interrupted prompt, and its batch-mate, decode exactly what they decode alone."""
    from entmtp.engine import PREFILL_CHUNK
    from entmtp.interrupt import Interrupt

    model = tiny_model("llama", seed=4, max_position_embeddings=2048)
    engine = Engine(model, ByteTokenizer())
    batch = Batch(engine)
    running, first = batch.add(PROMPTS[1], max_new_tokens=30)
    prompt = [(5 * i) % 250 + 3 for i in range(2 * PREFILL_CHUNK + 7)]
    long = batch.start(prompt, max_new_tokens=8)
    tokens, interrupt = {running.id: first.token_ids, long.id: []}, Interrupt()
    batch.step = _during_prefill(batch, lambda: _interrupt_after(0, model, interrupt))
    out = dict((r.id, e) for r, e in batch.step(interrupt))  # the running row's step, then the chunk
    del batch.step
    assert batch.preemptions == 1 and long.state.cache.length == 0 and list(out) == [running.id]
    tokens[running.id] += out[running.id].token_ids
    assert interrupt.is_set()
    for r, e in batch.step(interrupt):  # the same chunk, whole, though the interrupt is still raised
        tokens[r.id] += e.token_ids
    assert batch.preemptions == 1 and long.state.cache.length == PREFILL_CHUNK
    interrupt.clear()
    while len(batch):
        for r, e in batch.step(interrupt):
            tokens[r.id] += e.token_ids
    assert tokens[long.id] == engine.generate(prompt, max_new_tokens=8).token_ids
    assert tokens[running.id] == engine.generate(PROMPTS[1], max_new_tokens=30).token_ids


def test_a_seeded_sampled_row_repeats_bit_for_bit_in_busy_batches(engine):
    """A batched forward's logits for a row differ in their last bits from that row's own forward, and with
    its batch-mates (the kernels' blocking follows the rows and the longest row's keys), which moves a seeded
    draw near a boundary: so a seeded sampled row is verified by its own forward. Many trials of a seeded
    request at T=0.8 among 1-5 batch-mates (greedy rows drafting trees, unseeded sampled rows, a long
    prompt), joining at a random step: its tokens and their log-probabilities are, bit for bit, alone's."""
    long = [(7 * i) % 250 + 3 for i in range(300)]
    rng = np.random.default_rng(0)
    kw = dict(max_new_tokens=8, temperature=0.8, logprobs=0)
    for trial in range(12):
        seed, prompt = 1000 + trial, PROMPTS[trial % 4]
        want = alone(engine, prompt, seed=seed, **kw)
        batch = Batch(engine, BatchOptions(gate=False))
        mates = [long, *PROMPTS]
        for m in range(rng.integers(1, 6)):
            batch.add(mates[(trial + m) % len(mates)], max_new_tokens=20, temperature=0.8 if m % 2 else 0.0)
        for _ in range(rng.integers(0, 3)):
            batch.step()
        row, event = batch.add(prompt, seed=seed, **kw)
        while event.result is None:
            event = dict(batch.step())[row]
        got = event.result
        assert got.token_ids == want.token_ids, f"trial {trial}"
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs], f"trial {trial}"


# ---- the import direction --------------------------------------------------------------------------------

SRC = Path(__file__).parents[1] / "src" / "entmtp"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every entmtp module (or name in one) `path` imports, at the top or inside a function."""
    package = _module(path).split(".")[: None if path.name == "__init__.py" else -1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out |= {module, *(f"{module}.{a.name}" for a in node.names)}
    return out


def test_the_engine_never_imports_batching_directly_or_through_another_module():
    """Batching is a function over an engine (batch.generate_batch(engine, ...)): batch.py imports engine.py,
    and nothing engine.py imports (at the top or inside a function, followed through every module) leads
    back to batch.py, so the two never form an import cycle again."""
    graph = {_module(p): _imports(p) for p in SRC.rglob("*.py")}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    seen, todo = set(), ["entmtp.engine"]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert "entmtp.batch" not in seen
    assert "entmtp.engine" in graph["entmtp.batch"]
