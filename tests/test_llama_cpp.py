"""The llama.cpp backend (backends/llama_cpp.py): the same engine, heads, policies and lookup drafts over
llama.cpp's kernels. On an F32 GGUF written from the embedded model, speculative greedy output equals the
backend's own plain greedy output token for token, whatever the tree, the policy or the batch, and plain greedy
equals transformers' float32; seeded gumbel sampling writes plain sampling's tokens; sequence ids and KV cells
come back after every generation; bad input gets a one-line error."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from conftest import OracleHeads
from entmtp.errors import EntMTPError
from entmtp.tree import Tree

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama-cpp extra is not installed (make setup installs it)"
)

from entmtp.accept import ACCEPTANCE  # noqa: E402
from entmtp.backends import backend_name, describe_weights  # noqa: E402
from entmtp.backends.llama_cpp import (  # noqa: E402
    MAX_SEQ,
    LlamaCppError,
    embedded_f32_gguf,
    leaf_sets,
    load_gguf,
    read_gguf,
)
from entmtp.batch import generate_batch  # noqa: E402
from entmtp.engine import Engine  # noqa: E402
from entmtp.lookup import Lookup  # noqa: E402
from entmtp.policy import StaticPolicy, static  # noqa: E402
from entmtp.scheduler.hybrid import hybrid  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps. The quick brown fox jumps again.",
]
N = 32


@pytest.fixture(scope="module")
def f32():
    """(model, tokenizer) of the embedded model's F32 GGUF on llama.cpp, the heads' side in float32."""
    from entmtp.model import embedded_model_dir

    torch.set_num_threads(2)
    return load_gguf(
        embedded_f32_gguf(), dtype=torch.float32, threads=2, tokenizer_dir=str(embedded_model_dir())
    )


@pytest.fixture(scope="module")
def plain(f32):
    model, tok = f32
    engine = Engine(model, tok, heads=None, policy=static(Tree.root_only()))
    return {p: engine.generate(p, max_new_tokens=N).token_ids for p in PROMPTS}


def free_seqs_are_all_back(model):
    rt = model.runtime
    return len(rt.free_seqs) == MAX_SEQ and all(
        rt.lib.llama_memory_seq_pos_max(rt.mem, s) == -1 for s in range(8)
    )


def test_a_gguf_model_is_a_causal_lm_for_the_heads(f32):
    model, _ = f32
    assert backend_name(model) == "llama-cpp"
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as in the GGUF


def test_leaf_sets_give_each_node_the_leaves_below_it():
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1]])  # root; a, b; a's children c, d
    sets = leaf_sets(tree)
    assert [len(s) for s in sets] == [3, 2, 1, 1, 1]  # root: every leaf; a: c's and d's; b, c, d: their own
    assert sets[0] == sorted(set().union(*sets[1:]))


def test_plain_greedy_equals_transformers_float32(f32, plain, embedded):
    hf, hf_tok = embedded
    reference = Engine(hf, hf_tok, heads=None, policy=static(Tree.root_only()))
    for p in PROMPTS:
        assert plain[p] == reference.generate(p, max_new_tokens=N).token_ids


def test_speculative_greedy_equals_plain_with_the_shipped_heads(f32, plain, tree="tree_8"):
    from entmtp.shipped import resolve_heads

    model, tok = f32
    engine = Engine(model, tok, heads=resolve_heads("hydra", model), policy=static(tree))
    accepted = 0
    for p in PROMPTS:
        result = engine.generate(p, max_new_tokens=N)
        assert result.token_ids == plain[p]
        accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0  # drafts were verified and kept, not only plain steps
    assert free_seqs_are_all_back(model)


def test_side_branches_and_a_tree_per_step_keep_the_right_cells(f32, plain):
    """Oracle drafts whose right token sits at rank 0 or 1 make accepted paths run through side branches (the
    path's cells belong to a borrowed sequence), under a policy that switches trees every step."""
    from test_policy_switching import CyclingPolicy

    model, tok = f32
    for p in PROMPTS:
        ids = Engine(model, tok).encode(p, N)
        heads = OracleHeads(ids + plain[p], num_heads=5, rank_mod=2, wrong_every=5)
        engine = Engine(model, tok, heads=heads, policy=CyclingPolicy())
        result = engine.generate(ids, max_new_tokens=N)
        assert result.token_ids == plain[p]
        assert len({s.tree for s in result.steps}) == 4
    assert free_seqs_are_all_back(model)


def test_lookup_nodes_and_batch_rows_equal_plain(f32, plain):
    from entmtp.shipped import resolve_heads

    model, tok = f32
    heads = resolve_heads("hydra", model)
    engine = Engine(model, tok, heads=heads, policy=hybrid(static("tree_8"), Lookup()))
    alone = [engine.generate(p, max_new_tokens=N) for p in PROMPTS]
    assert [r.token_ids for r in alone] == [plain[p] for p in PROMPTS]
    assert sum(s.lookup_accepted for r in alone for s in r.steps) > 0  # copies from the prompt were kept
    batched = generate_batch(engine, PROMPTS, max_new_tokens=N)
    assert [r.token_ids for r in batched] == [plain[p] for p in PROMPTS]
    assert free_seqs_are_all_back(model)


def spy_embeddings(monkeypatch, runtime) -> list[bool]:
    """The `embeddings` argument of every llama.cpp decode `runtime` runs from now on."""
    seen, decode = [], runtime.decode

    def spy(tokens, positions, seqs, outputs, embeddings=True):
        seen.append(embeddings)
        return decode(tokens, positions, seqs, outputs, embeddings)

    monkeypatch.setattr(runtime, "decode", spy)
    return seen


def test_without_heads_no_decode_asks_for_hidden_states(f32, plain, monkeypatch):
    """Plain and lookup-only decoding read no hidden states: llama.cpp's embeddings stay off for the prefill
    and every step (also in the cost probe's steps without heads), and the tokens are plain greedy's."""
    from entmtp.costs.probe import Probe

    model, tok = f32
    seen = spy_embeddings(monkeypatch, model.runtime)
    lookup = Engine(model, tok, heads=None, policy=hybrid(None, Lookup()))
    for p in PROMPTS:
        result = lookup.generate(p, max_new_tokens=N)
        assert result.token_ids == plain[p]
    assert sum(s.lookup_accepted for s in result.steps) > 0  # multi-token lookup decodes ran
    probe = Probe(model, None, sizes=(0, 4))
    row = probe.row(64, probe.room(4))
    probe.step(row, 4), probe.step(row, 0)
    assert seen and not any(seen)
    assert not model.runtime.embeddings
    row[0].cache.release()


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
PEOPLE = [
    "Extract the person as JSON: Maria Garcia, 34, lives in Madrid.",
    "Extract the person as JSON: Tom Becker is 51 and lives in Hamburg.",
    "Extract the person as JSON: Aiko Tanaka, a 27-year-old engineer from Osaka.",
]


def test_a_grammars_forced_nodes_are_verified_without_output_rows(f32, monkeypatch):
    """Under a grammar, a tree node whose mask allows one token needs no logits (every acceptance rule takes that
    token): llama.cpp decodes it without an output row, so no output head runs for it. The output is the output
    without forced drafts, token for token; with log-probabilities asked for, every row is computed."""
    from entmtp.backends.llama_cpp import LlamaCppBase
    from entmtp.shaping import Shaping

    model, tok = f32
    rf, prompt = PERSON_FORMAT, PEOPLE[0]
    engine = Engine(model, tok, heads=None, policy=static(Tree.root_only()))
    skipped, real = [], LlamaCppBase.forward

    def spy(self, tokens, tree, cache, **kw):
        if tree is not None:
            skipped.append(0 if kw.get("outputs") is None else kw["outputs"].count(False))
        return real(self, tokens, tree, cache, **kw)

    monkeypatch.setattr(LlamaCppBase, "forward", spy)
    got = engine.generate(prompt, max_new_tokens=48, response_format=rf)
    assert sum(skipped) >= 4  # the keys' forced tokens, decoded without their rows
    with_logprobs = engine.generate(prompt, max_new_tokens=48, response_format=rf, logprobs=1)
    assert with_logprobs.token_ids == got.token_ids
    skipped.clear()
    engine.generate(prompt, max_new_tokens=48, response_format=rf, logprobs=1)
    assert skipped and not any(skipped)  # log-probabilities read every emitted token's own row
    monkeypatch.setattr(Shaping, "forced", lambda self, cost, limit: [])
    assert engine.generate(prompt, max_new_tokens=48, response_format=rf).token_ids == got.token_ids


def test_a_batchs_forced_nodes_are_verified_without_output_rows(f32, monkeypatch):
    """In a continuous batch too, the forced nodes of each row's tree (its grammar's mask allows one token there)
    are decoded without output rows in the batch's one llama_decode; each row's output is the same request's
    decoded alone without forced drafts (every node's logits computed), token for token. With log-probabilities
    asked for, every row of every batched decode is an output row, and the tokens are the same."""
    from entmtp.backends.llama_cpp import LlamaCppBase
    from entmtp.shaping import Shaping

    model, tok = f32
    engine = Engine(model, tok, heads=None, policy=static(Tree.root_only()))
    batched = []  # (tokens, output rows) of each batched step's llama_decode
    real_batch, real_decode, inside = LlamaCppBase.forward_batch, model.runtime.decode, []

    def forward_batch(self, *args, **kw):
        inside.append(True)
        try:
            return real_batch(self, *args, **kw)
        finally:
            inside.pop()

    def decode(tokens, positions, seqs, outputs, embeddings=True):
        if inside:
            batched.append((len(tokens), len(tokens) if embeddings else sum(outputs)))
        return real_decode(tokens, positions, seqs, outputs, embeddings)

    monkeypatch.setattr(LlamaCppBase, "forward_batch", forward_batch)
    monkeypatch.setattr(model.runtime, "decode", decode)
    kwargs = dict(max_new_tokens=48, response_format=PERSON_FORMAT)
    got = [r.token_ids for r in generate_batch(engine, PEOPLE, **kwargs)]
    assert sum(n - rows for n, rows in batched) >= 4  # the keys' forced tokens, decoded without their rows
    batched.clear()
    with_logprobs = [r.token_ids for r in generate_batch(engine, PEOPLE, logprobs=1, **kwargs)]
    assert batched and all(rows == n for n, rows in batched)  # log-probabilities read every row
    assert with_logprobs == got
    monkeypatch.setattr(Shaping, "forced", lambda self, cost, limit: [])
    assert [engine.generate(p, **kwargs).token_ids for p in PEOPLE] == got
    assert free_seqs_are_all_back(model)


def test_logits_are_the_same_bits_with_hidden_states_on_or_off(f32):
    """What the heads' hidden states cost is their copy, not different numbers: a tree's logits with
    llama.cpp's embeddings on equal those with them off, bit for bit (F32 GGUF)."""
    rt = f32[0].runtime
    seq = rt.take_seq()
    try:
        rt.decode(list(range(100, 164)), list(range(64)), [[seq]] * 64, [False] * 63 + [True], False)
        tokens, positions = [5, 17, 42, 9, 300, 7], list(range(64, 70))
        out = {}
        for emb in (True, False, True):
            logits, hidden = rt.decode(tokens, positions, [[seq]] * 6, [True] * 6, embeddings=emb)
            out.setdefault(emb, []).append(logits)
            assert hidden.shape == ((6, rt.n_embd) if emb else (0, rt.n_embd))
            rt.seq_rm(seq, 64)
        assert np.array_equal(out[True][0], out[False][0]) and np.array_equal(out[True][0], out[True][1])
    finally:
        rt.give_seq(seq)


def test_a_token_of_two_sequences_that_have_diverged_is_still_refused(f32):
    """llama.cpp refuses a token that belongs to two sequences unless both hold the same positions (a tree's
    branches share their parents' cells so). The patch's fifth part makes that check walk only the sequences of
    the batch, where a token has several, instead of every pair of the context's 256: the check still holds."""
    rt = f32[0].runtime
    a, b, c = rt.take_seq(), rt.take_seq(), rt.take_seq()
    try:
        rt.decode(list(range(100, 116)), list(range(16)), [[a]] * 16, [False] * 15 + [True], False)
        rt.seq_cp(a, b)  # positions 0-15, as a's
        rt.seq_cp(a, c, 4)  # positions 4-15: the same last one, another first
        rt.decode([7], [16], [[a, b]], [True], False)  # coupled and alike: decoded
        rt.seq_rm(a, 16), rt.seq_rm(b, 16)
        with pytest.raises(LlamaCppError, match="llama_decode failed"):
            rt.decode([7], [16], [[a, c]], [True], False)
        rt.decode([7], [16], [[c]], [True], False)  # alone, c's positions follow on: decoded
    finally:
        for seq in (a, b, c):
            rt.give_seq(seq)


def test_an_interrupt_stops_a_prefill_between_graph_nodes_and_leaves_no_cells(f32):
    """An interrupt raised from another thread while a 1,200-token prefill runs stops llama.cpp part way
    (its abort callback reads the flag): `Preempted`, well before the prefill's own time, and the sequence
    holds no cell of it (not even those of the llama_decode calls that finished). Run again, whole, the
    prefill's logits are bit for bit those of a prefill never interrupted, and with the interrupt down the
    callback changes no bit either; after the call the context has no callback (a raised flag stops
    nothing)."""
    import threading
    import time

    from entmtp.interrupt import Interrupt, Preempted

    model, _ = f32
    base = model.entmtp_base()
    ids = torch.tensor([(7 * i) % 3000 + 100 for i in range(1200)])

    def prefill(interrupt=None):
        """(logits or None when stopped, seconds, the cache: a context of its own, so that no earlier cell
        moves its numbers)."""
        cache = base.new_cache(1300, private=True)
        t0 = time.perf_counter()
        try:
            fwd = base.forward(ids, None, cache, logits_to_keep=1, hidden=False, interrupt=interrupt)
            base.commit(cache, list(range(len(ids))))
            return fwd.logits, time.perf_counter() - t0, cache
        except Preempted:
            return None, time.perf_counter() - t0, cache

    want, whole_s, _ = prefill()
    down, _, _ = prefill(Interrupt())
    assert torch.equal(down, want)
    interrupt = Interrupt()
    timer = threading.Timer(whole_s / 4, interrupt.set)
    timer.start()
    stopped, stopped_s, cache = prefill(interrupt)
    timer.join()
    rt = cache.runtime
    assert stopped is None and stopped_s < 0.75 * whole_s
    assert rt.lib.llama_memory_seq_pos_max(rt.mem, cache.seq) == -1 and cache.length == 0
    cache.release()
    again, _, _ = prefill()  # the flag is still raised: no callback reads it now
    assert torch.equal(again, want)


def test_seeded_gumbel_sampling_writes_plain_samplings_tokens(f32):
    from entmtp.shipped import resolve_heads

    model, tok = f32
    kwargs = dict(max_new_tokens=N, temperature=0.8, acceptance="gumbel", seed=7)
    plain = Engine(model, tok, heads=None, policy=static(Tree.root_only())).generate(PROMPTS[0], **kwargs)
    spec = Engine(model, tok, heads=resolve_heads("hydra", model), policy=static("tree_8")).generate(
        PROMPTS[0], **kwargs
    )
    assert spec.token_ids == plain.token_ids
    assert sum(s.accepted for s in spec.steps) > 0


def test_a_seeded_sampled_row_repeats_whatever_its_batch_mates():
    """llama.cpp's logits for a sequence move (by up to ~1 on the Q4_1 file) when other sequences' cells
    interleave with its own in a shared KV cache; a seeded sampled row therefore runs in a context of its own,
    and writes what it writes alone."""
    from entmtp.batch import Batch
    from entmtp.model import embedded_gguf, embedded_model_dir
    from entmtp.shipped import resolve_heads

    model, tok = load_gguf(embedded_gguf(), threads=2, tokenizer_dir=str(embedded_model_dir()))
    engine = Engine(model, tok, heads=resolve_heads("hydra", model), policy=static(Tree.root_only()))
    haiku = [{"role": "user", "content": "Write a haiku about autumn leaves."}]
    story = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
    kwargs = dict(max_new_tokens=40, temperature=0.8, seed=1234)
    alone = engine.generate(haiku, **kwargs).token_ids
    batch = Batch(engine)
    for seed in (11, 12, 13):
        batch.start(story, max_new_tokens=64, temperature=0.8, seed=seed)
    row = batch.start(haiku, **kwargs)
    mine = None
    while len(batch):
        for r, event in batch.step():
            if r is row and event.result is not None:
                mine = event.result.token_ids
    assert mine == alone
    assert model.runtime.reserved == 0 and len(model.runtime.free_seqs) == MAX_SEQ


def test_kv_cells_are_promised_at_a_generations_start_and_come_back(f32):
    """Generations share the context's n_ctx cells: one that would not fit fails before decoding anything
    (a decode failing later for lack of room would end its batch-mates' steps too)."""
    model, _ = f32
    rt, base = model.runtime, model.entmtp_base()
    big = base.new_cache(rt.n_ctx - 100)
    with pytest.raises(LlamaCppError, match="KV cells"):
        base.new_cache(200)
    small = base.new_cache(100)
    with pytest.raises(LlamaCppError, match="KV cells"):
        small.capacity = 101
    big.release()
    small.capacity = 300
    assert rt.reserved == 300
    window = model.config.max_position_embeddings
    cells = rt.n_ctx
    assert not rt.grow(cells + window) and rt.n_ctx == cells  # a generation holds cells: no new context
    small.release()
    assert rt.reserved == 0 and free_seqs_are_all_back(model)


def test_a_batch_of_r_rows_gets_a_context_of_r_full_windows(f32):
    """The server's batch of --max-batch rows: each may fill the model's window, so none is refused for
    lack of KV cells while a row is free."""
    model, _ = f32
    rt, window = model.runtime, model.config.max_position_embeddings
    batch = model.entmtp_base().new_batch(rows=2)
    assert rt.n_ctx >= 2 * window
    rows = [batch.add(window - 8, scratch=64) for _ in range(2)]
    for row in rows:
        batch.remove(row)
    assert rt.reserved == 0 and free_seqs_are_all_back(model)


def test_the_quantized_gguf_drafts_and_accepts():
    """The shipped Q4_1 file: the backend's plain and speculative greedy texts may part at a near-tie
    (the bench reports how often, as "identical"); here, drafts are accepted and the run completes."""
    from entmtp.model import embedded_gguf, embedded_model_dir
    from entmtp.shipped import resolve_heads

    model, tok = load_gguf(embedded_gguf(), threads=2, tokenizer_dir=str(embedded_model_dir()))
    engine = Engine(model, tok, heads=resolve_heads("hydra", model), policy=static("tree_8"))
    result = engine.generate(PROMPTS[0], max_new_tokens=N)
    assert len(result.token_ids) == N and len(result.steps) < N - 1


@pytest.mark.parametrize("repacked", ["as chosen", "off"])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_chain_decoded_at_once_gives_each_row_its_one_token_decode(fmt, repacked, monkeypatch):
    """A speculative step decodes its drafted tokens in one llama_decode; each row must be what decoding the
    tokens one at a time gives, up to the rounding of a many-token decode (the attention's kernels differ by
    batch size: measured on the AMX Xeon, a row's mean |difference| up to 0.37, its largest 1.02, many rows
    bit-exact). Checked for every row count from 1 to 10 on the quantized formats, with the weights repacked as
    the runtime chooses: on an AMX CPU entmtp's patch decodes 2 to 6 rows of Q4_1 weights and 2 to 3 of Q8_0
    by the one-row kernels (llama_build.py), more by the AMX tiles, so a row mixed up or dropped in either shows
    here as a row far from its one-token decode (a mutant that reads the first row's activations for every row
    fails it: NaN rows). With the repacked weights off, the path of the CPUs without AMX: the patch's Q4_1 tiles
    (each column bit for bit its one-column product: test_llama_kernels.py) and llama.cpp's own Q8_0 ones."""
    from entmtp.backends.gguf import embedded_in_format as _embedded_in_format

    if repacked == "off":
        monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "0")
    from entmtp.model import embedded_gguf, embedded_model_dir

    path = embedded_gguf() if fmt == "Q4_1" else _embedded_in_format(fmt)
    model, _ = load_gguf(path, threads=2, tokenizer_dir=str(embedded_model_dir()))
    rt = model.runtime
    seq = rt.take_seq()
    rng = np.random.default_rng(0)
    try:
        prefix = rng.integers(100, 40000, 64).tolist()
        rt.decode(prefix, list(range(64)), [[seq]] * 64, [False] * 63 + [True], False)
        for k in range(1, 11):
            tokens, positions = rng.integers(100, 40000, k).tolist(), list(range(64, 64 + k))
            at_once, _ = rt.decode(tokens, positions, [[seq]] * k, [True] * k, embeddings=False)
            rt.seq_rm(seq, 64)
            one_by_one = []
            for t, pos in zip(tokens, positions, strict=True):
                logits, _ = rt.decode([t], [pos], [[seq]], [True], embeddings=False)
                one_by_one.append(logits[0])
            rt.seq_rm(seq, 64)
            diff = np.abs(at_once - np.stack(one_by_one))  # [k, V]
            assert diff.mean(axis=1).max() < 0.5 and diff.max() < 2.0, (k, diff.mean(axis=1), diff.max())
    finally:
        rt.give_seq(seq)


# ---- bad input ---------------------------------------------------------------------------------------------


def test_a_missing_gguf_is_named(tmp_path):
    with pytest.raises(LlamaCppError, match=r"missing\.gguf does not exist"):
        load_gguf(tmp_path / "missing.gguf")


def test_a_corrupt_gguf_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(LlamaCppError, match=r"bad\.gguf is not a readable GGUF file"):
        read_gguf(bad)


def test_a_gguf_file_is_parsed_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """A first run reads each candidate's file for its format, its header and its load: one parse of the
    header; a file written again is parsed again."""
    import shutil

    from entmtp.backends import gguf_header
    from entmtp.backends.llama_cpp import gguf_weights
    from entmtp.model import embedded_gguf

    parsed = []
    real = gguf_header.read_header
    monkeypatch.setattr(gguf_header, "read_header", lambda path: parsed.append(path) or real(path))
    copy = tmp_path / "m.gguf"
    shutil.copyfile(embedded_gguf(), copy)
    assert gguf_weights(copy) == "Q4_1" and read_gguf(copy).config.num_hidden_layers == 30
    assert read_gguf(tmp_path / "." / "m.gguf").config.vocab_size == 49152  # the same file by another name
    assert len(parsed) == 1
    shutil.copyfile(embedded_gguf(), copy)
    os.utime(copy, ns=(1, 1))  # rewritten: another mtime
    read_gguf(copy)
    assert len(parsed) == 2


def test_the_fast_header_reads_what_ggufs_own_reader_reads(tmp_path):
    """gguf_header.read_header (~10 ms where gguf's reader takes ~1.8 s for the 49k-token vocabulary): every
    scalar and string field the same, arrays left unread, every tensor's name, type, shape and data the same;
    a file it does not read (a big-endian one reads as another version): None, for gguf's reader."""
    import gguf

    from entmtp.backends.gguf_header import read_header
    from entmtp.model import embedded_gguf

    theirs, mine = gguf.GGUFReader(str(embedded_gguf())), read_header(embedded_gguf())
    assert set(mine.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in mine.fields.items():
        if theirs.fields[key].types[0] == gguf.GGUFValueType.ARRAY:
            assert field.contents() is None
        else:
            value = theirs.fields[key].contents()
            assert field.contents() == (pytest.approx(value) if isinstance(value, float) else value)
    assert len(mine.tensors) == len(theirs.tensors) == 272
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    other = tmp_path / "big.gguf"
    other.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    assert read_header(other) is None


def test_heads_for_another_vocabulary_fail_at_bind(f32):
    from entmtp.errors import HeadsError
    from entmtp.heads import HeadsConfig, random_heads

    model, _ = f32
    heads = random_heads(HeadsConfig(kind="hydra", num_heads=2, hidden_size=576, vocab_size=32000))
    with pytest.raises(HeadsError, match="heads expect vocab size 32000 but the model has 49152"):
        heads.bind(model)


def test_without_llama_cpp_python_the_backend_says_how_to_install(monkeypatch):
    from entmtp.build import EngineSpec, check_spec

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(LlamaCppError, match="needs llama-cpp-python: python -m entmtp.backends.llama_build"):
        check_spec(EngineSpec(backend="llama-cpp"))


def test_the_llama_cpp_backend_refuses_a_transformers_model_directory(tmp_path):
    from entmtp.build import EngineSpec, check_spec

    with pytest.raises(EntMTPError, match="--backend llama-cpp runs GGUF files"):
        check_spec(EngineSpec(backend="llama-cpp", model=str(tmp_path)))


CRASH = (
    "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"  # a canary whose child dies like the AMX fault
)
AMX_XEON = {"name": "Xeon", "flags": ["avx512f", "amx_bf16", "amx_int8", "amx_tile"]}


def test_on_a_cpu_with_amx_a_canary_that_dies_keeps_the_repacked_weights_off(monkeypatch, tmp_path):
    """llama-cpp-python 0.3.36 segfaults on some AMX Xeons with llama.cpp's extra buffer types once a decode
    holds two tokens: there a child process tries them first, and when it dies neither the backend nor the
    llama-cpp peer asks for them; one line says why, and the verdict is cached (the canary runs once)."""
    import llama_cpp.llama_cpp as low

    from entmtp import machine
    from entmtp.backends.amx import extra_bufts_safe
    from entmtp.bench.peers import LlamaCppPlain
    from entmtp.model import embedded_gguf

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_LLAMA_EXTRA_BUFTS", raising=False)
    monkeypatch.setattr(machine, "cpu_info", lambda: AMX_XEON)
    said = []
    assert not extra_bufts_safe(embedded_gguf(), say=said.append, canary=CRASH)
    assert len(said) == 1 and "SIGSEGV" in said[0] and "repacked weights stay off" in said[0]
    assert not extra_bufts_safe(embedded_gguf(), say=said.append)  # cached: the real canary is not run
    peer = LlamaCppPlain(n_threads=2)
    assert not peer.llm.model_params.use_extra_bufts
    assert (
        low.llama_model_default_params().use_extra_bufts
    )  # llama-cpp-python's own default is left as it was
    assert not extra_bufts_safe(None)  # nothing to try: off


def test_on_a_cpu_without_amx_the_repacked_weights_are_used_without_a_canary(monkeypatch, tmp_path):
    from entmtp import machine
    from entmtp.backends.amx import extra_bufts_safe
    from entmtp.model import embedded_gguf

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_LLAMA_EXTRA_BUFTS", raising=False)
    monkeypatch.setattr(machine, "cpu_info", lambda: {"name": "EPYC", "flags": ["avx2", "avx512f"]})
    assert extra_bufts_safe(embedded_gguf(), canary=CRASH)
    assert not (tmp_path / "llama-amx.json").exists()
    monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "0")
    assert not extra_bufts_safe(embedded_gguf())


def test_several_files_are_tried_in_one_child_and_each_alone_where_that_child_dies(monkeypatch, tmp_path):
    """A first run under --dtype auto on an AMX CPU loads four formats of one model: their canaries run in one
    child (its start, mostly `import torch`, is most of a canary's time). A child that dies says nothing of which
    file killed it, so each is then tried alone: every verdict is its own file's, and cached."""
    from entmtp import machine
    from entmtp.backends.amx import canary_verdicts, prewarm

    log = tmp_path / "children.log"
    canary = (
        "import os, signal, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(os.path.basename(a) for a in sys.argv[1:]) + '\\n')\n"
        "if any(a.endswith('bad.gguf') for a in sys.argv[1:]): os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ENTMTP_LLAMA_EXTRA_BUFTS", raising=False)
    monkeypatch.setattr(machine, "cpu_info", lambda: AMX_XEON)
    a, b, c, bad = (tmp_path / f"{n}.gguf" for n in ("a", "b", "c", "bad"))
    for f in (a, b, c, bad):
        f.write_bytes(f.name.encode())
    children = lambda: log.read_text().splitlines() if log.exists() else []  # noqa: E731

    assert [w for w, _ in canary_verdicts([a, b], canary)] == [True, True]
    assert children() == ["a.gguf b.gguf"]
    assert [w for w, _ in canary_verdicts([b, a], canary)] == [True, True] and len(children()) == 1  # cached
    verdicts = canary_verdicts([c, bad], canary)
    assert verdicts == [(True, "a clean exit"), (False, "killed by SIGSEGV")]
    assert children()[1:] == ["c.gguf bad.gguf", "c.gguf", "bad.gguf"]
    prewarm([a, tmp_path / "missing.gguf", tmp_path / "d.gguf"], canary)  # only files that exist, not cached
    assert len(children()) == 4
    (tmp_path / "d.gguf").write_bytes(b"d")
    monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "0")  # decided by the user: no canary
    prewarm([tmp_path / "d.gguf"], canary)
    assert len(children()) == 4
    monkeypatch.delenv("ENTMTP_LLAMA_EXTRA_BUFTS")
    prewarm([tmp_path / "d.gguf"], canary)
    assert children()[4:] == ["d.gguf"]


def test_the_canary_decodes_with_the_repacked_weights_in_a_child_process():
    """The real canary loads the model with the extra buffer types and decodes 1, 2 and 64 tokens. On a CPU
    without AMX nothing is known to crash, so it must come back clean (a broken canary would keep AMX off
    everywhere); on an AMX CPU its verdict is that machine's."""
    from entmtp.backends.amx import has_amx, run_canary
    from entmtp.model import embedded_gguf

    works, how = run_canary(embedded_gguf())
    if not has_amx():
        assert (works, how) == (True, "a clean exit")
    several = run_canary([embedded_gguf(), embedded_gguf()])  # each file loaded, decoded and freed in turn
    if not has_amx():
        assert several == (True, "a clean exit")


# ---- choosing the backend ----------------------------------------------------------------------------------


def test_auto_measures_both_backends_where_a_gguf_can_run(tmp_path):
    from entmtp.build import EngineSpec
    from entmtp.build import candidates as _candidates

    assert {c.split("/")[0] for c in _candidates(EngineSpec(), probe=True)} == {"transformers", "llama-cpp"}
    assert _candidates(EngineSpec(model=str(tmp_path / "m.gguf")), probe=True)[-1].startswith("llama-cpp/")
    assert all(
        c.startswith("transformers/") for c in _candidates(EngineSpec(model=str(tmp_path)), probe=True)
    )
    assert _candidates(EngineSpec(backend="llama-cpp", dtype="float32"), probe=True) == ["llama-cpp/float32"]
    assert _candidates(EngineSpec(), probe=False) == ["transformers/bfloat16"]  # nothing measured: today's


def test_auto_keeps_the_backend_with_the_most_expected_tokens_per_second(monkeypatch, tmp_path):
    """`build` loads each candidate, reads its expected tokens/s off its measured curve and keeps the fastest,
    and caches the choice; the plan names the backend and why."""
    import entmtp.build.choose as build_mod
    import entmtp.build.composed as compose_mod

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_NO_PROBE", raising=False)
    speeds = {"transformers/bfloat16": 40.0, "transformers/float32": 30.0, "llama-cpp/bfloat16": 90.0}
    loaded = []

    def fake_load(loader, spec, cand, budget, log):
        loaded.append(cand)
        model = build_mod.Loaded(spec, object(), None, None, "none", None)
        policies = dict.fromkeys(ACCEPTANCE, StaticPolicy(Tree.root_only()))
        return build_mod._Option(
            model, build_mod.Composed(policies, "greedy", "plain", "test", speeds[cand], {}, (), False)
        )

    monkeypatch.setattr(build_mod, "_load", fake_load)
    monkeypatch.setattr(build_mod, "_best_cases", lambda *a: {})  # every candidate measured
    monkeypatch.setattr(build_mod, "candidates", lambda spec, probe: list(speeds))
    monkeypatch.setattr(build_mod, "_room_for_another", lambda model, cand: True)
    monkeypatch.setattr(compose_mod, "Engine", lambda *a, **k: "engine")
    one = {"log": lambda m: None, "route": False}  # one engine: routing's own tests are in test_routing.py
    plan = build_mod.build(build_mod.EngineSpec(), **one).plan
    assert (plan.backend, plan.dtype) == ("llama-cpp", "bfloat16")
    assert "llama-cpp/bfloat16 90.0" in plan.backend_reason
    loaded.clear()
    again = build_mod.build(build_mod.EngineSpec(), **one).plan  # the cached choice: one load
    assert loaded == ["llama-cpp/bfloat16"] and again.backend == "llama-cpp"


def test_build_runs_the_embedded_gguf_on_llama_cpp():
    """With no dtype named, llama.cpp runs the embedded Q4_1 file as it is, and the plan says so in words."""
    from entmtp.build import EngineSpec, build

    built = build(EngineSpec(backend="llama-cpp", tree="tree_8", probe=False), log=lambda m: None)
    assert built.plan.backend == "llama-cpp" and backend_name(built.engine.model) == "llama-cpp"
    plan = built.plan.describe()
    assert "backend: llama-cpp (as asked)" in plan
    assert "weights: Q4_1 GGUF (" in plan and "(the GGUF file as given" in plan
    assert "heads: hydra, computing in " in plan and "threads: " in plan
    from entmtp.backends.amx import has_amx
    from entmtp.backends.llama_build import describe_build

    kernels = "no AMX on this CPU" if not has_amx() else "AMX kernels "
    assert f"llama.cpp: {describe_build()}; {kernels}" in plan  # which build runs, and whether AMX does
    result = built.engine.generate(PROMPTS[0], max_new_tokens=8)
    assert len(result.token_ids) == 8


# ---- a named dtype names the weights on every backend (#70) ------------------------------------------------

LONG_PROMPT = "Summarize this report in two sentences.\n\n" + " ".join(
    f"In week {i} the team shipped {i + 2} fixes, closed {3 * i} issues and reviewed {i + 5} pull requests."
    for i in range(1, 16)
)


@pytest.mark.parametrize("prompt", [PROMPTS[0], LONG_PROMPT], ids=["short", "long"])
def test_dtype_float32_decodes_float32_weights_whichever_backend_and_route(prompt):
    """`--dtype float32` runs float32 weights on transformers and on llama.cpp (the F32 GGUF written from the
    embedded model), so plain and speculative greedy decoding give the same tokens on each backend auto can
    choose, and through a route between the two lanes whichever lane a prompt's length picks."""
    from entmtp.build import EngineSpec, build
    from entmtp.costs import PrefillCost
    from entmtp.routing import Lane, Router

    outputs, engines = {}, {}
    for backend in ("transformers", "llama-cpp"):
        for heads, tree in (("none", None), ("hydra", "tree_8"), ("medusa", "mc_sim_7b_63")):
            spec = EngineSpec(backend=backend, dtype="float32", heads=heads, tree=tree, threads=2)
            built = build(spec, log=lambda m: None)
            assert built.plan.weights.startswith("float32"), built.plan.describe()
            engines[backend, heads] = built.engine
            outputs[backend, heads] = built.engine.generate(prompt, max_new_tokens=24).token_ids
    assert "F32 GGUF" in describe_weights(engines["llama-cpp", "none"].model)
    # a route that sends short prompts to llama.cpp and long ones to transformers (this EPYC's shape)
    llama_prefill, torch_prefill = (
        PrefillCost((128, 1024), (530.0, 4210.0)),
        PrefillCost((128, 1024), (135.0, 941.0)),
    )
    for heads in ("none", "hydra"):
        router = Router(
            Lane("llama-cpp", engines["llama-cpp", heads], llama_prefill, 95.0, "float32"),
            Lane("transformers", engines["transformers", heads], torch_prefill, 37.0, "float32"),
        )
        outputs["routed", heads] = router.generate(prompt, max_new_tokens=24).token_ids
    reference = outputs["transformers", "none"]
    assert {k: v for k, v in outputs.items() if v != reference} == {}


def test_a_user_gguf_is_decoded_as_given_and_never_as_another_dtype(tmp_path):
    """A user's Q4_1 GGUF: `--dtype float32` on llama.cpp is refused by name (it would decode Q4_1), and under
    `auto` backend llama.cpp is no candidate for that dtype; a BF16 GGUF serves `--dtype bfloat16`."""
    from entmtp.backends.llama_cpp import gguf_weights, write_float_gguf
    from entmtp.build import EngineSpec, build
    from entmtp.build import candidates as _candidates
    from entmtp.model import embedded_gguf

    q4 = str(embedded_gguf())
    assert gguf_weights(q4) == "Q4_1"
    with pytest.raises(EntMTPError, match=r"holds Q4_1 weights and --dtype float32 names float32 weights"):
        build(EngineSpec(model=q4, backend="llama-cpp", dtype="float32", heads="none"), log=lambda m: None)
    assert _candidates(EngineSpec(model=q4, dtype="float32"), probe=True) == ["transformers/float32"]
    assert _candidates(EngineSpec(model=q4), probe=True)[-1].startswith("llama-cpp/")  # auto: as given
    bf16 = write_float_gguf(q4, tmp_path / "m-bf16.gguf", "bfloat16")
    assert gguf_weights(bf16) == "BF16"
    built = build(
        EngineSpec(model=str(bf16), backend="llama-cpp", dtype="bfloat16", heads="none"), log=lambda m: None
    )
    assert built.plan.weights.startswith("bfloat16 (BF16 GGUF m-bf16.gguf)")
    assert len(built.engine.generate(PROMPTS[0], max_new_tokens=4).token_ids) == 4
    assert not list(tmp_path.glob("*.tmp"))  # nothing half-written


def test_step_costs_times_the_llama_cpp_engines_own_step(tmp_path):
    """`entmtp step-costs --backend llama-cpp`: where a step's time goes on llama.cpp's kernels, with the heads
    drafting as the engine's default does (int8 copies, bf16 heads) and the GGUF file's bytes as the weights."""
    import json

    from entmtp.cli import main
    from entmtp.heads.int8 import int8_supported
    from entmtp.model import embedded_gguf

    out = tmp_path / "costs.json"
    argv = ["step-costs", "--backend", "llama-cpp", "--trees", "chain_1,tree_4", "--steps", "2"]
    assert main([*argv, "--threads", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {"plain", "chain_1", "tree_4"}
    assert record["rows"]["tree_4"]["verify"] > 0 and record["rows"]["plain"]["mode"] == "own"
    meta = record["meta"]
    assert meta["backend"] == "llama-cpp" and meta["weight_bytes"] == embedded_gguf().stat().st_size
    assert meta["drafting_weights"] == ("int8" if int8_supported() else "bfloat16")
    assert main([*argv, "--no-draft-int8", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["drafting_weights"] == "bfloat16"


def test_a_router_sends_a_long_prompt_to_transformers_and_a_short_one_to_llama_cpp(f32, plain, embedded):
    """Forced costs of this EPYC's shape (llama.cpp: fast decode, slow prefill): each request's output is
    the chosen engine's own, told apart by its steps (the heads' trees on llama.cpp, plain on transformers)."""
    from entmtp.build import same_tokenizer
    from entmtp.costs import PrefillCost
    from entmtp.routing import Lane, Router
    from entmtp.shipped import resolve_heads

    (model, tok), (hf, hf_tok) = f32, embedded
    assert same_tokenizer(tok, hf_tok)  # the embedded GGUF runs transformers' tokenizer: routing may apply
    llama = Engine(model, tok, heads=resolve_heads("hydra", model), policy=static("tree_8"))
    torch_engine = Engine(hf, hf_tok, heads=None)
    router = Router(
        Lane("llama-cpp", llama, PrefillCost((128, 1024), (530.0, 4210.0)), 95.0),
        Lane("transformers", torch_engine, PrefillCost((128, 1024), (135.0, 941.0)), 37.0),
    )
    short = router.generate(PROMPTS[0], max_new_tokens=N)
    assert short.token_ids == plain[PROMPTS[0]] and any(s.tree_nodes for s in short.steps)
    long_prompt, n = " ".join([PROMPTS[1]] * 10), N // 2
    assert len(router.encode(long_prompt, n)) >= router.threshold(n) > len(router.encode(PROMPTS[0], n))
    long = router.generate(long_prompt, max_new_tokens=n)
    assert all(s.tree_nodes == 0 for s in long.steps)
    assert long.token_ids == torch_engine.generate(long_prompt, max_new_tokens=n).token_ids


# ---- Predicted Outputs on both backends (prediction.py) ---------------------------------------------------


def test_a_prediction_changes_no_greedy_token_on_either_backend(f32, plain, embedded):
    """On llama.cpp's F32 GGUF and transformers' float32, plain and with the heads' tree: a right, a partly
    right, a wrong and an empty prediction each give plain greedy decoding's tokens; a right one is accepted
    in chains."""
    from entmtp.shipped import resolve_heads

    (model, tok), (hf, hf_tok) = f32, embedded
    engines = {
        "llama-cpp plain": Engine(model, tok),
        "llama-cpp tree_8": Engine(model, tok, heads=resolve_heads("hydra", model), policy=static("tree_8")),
        "transformers plain": Engine(hf, hf_tok),
    }
    for prompt in PROMPTS:
        out = plain[prompt]
        text = tok.decode(out, skip_special_tokens=True)
        edited = text.replace(" ", "  ", 3)  # an edit: a few tokens differ, the rest is the answer
        for name, engine in engines.items():
            for pred in (text, edited, "Nothing like the answer at all.", ""):
                got = engine.generate(prompt, max_new_tokens=N, prediction=pred)
                assert got.token_ids == out, (name, prompt, pred)
            right = engine.generate(prompt, max_new_tokens=N, prediction=out)
            assert right.prediction.accepted == len(out) and right.prediction.rejected == 0
            assert right.num_steps <= len(out) // 2, (name, right.num_steps)


# ---- weight formats: on a CPU whose AMX kernels run, auto measures Q8_0, F16 and BF16 beside Q4_1 --------------


def test_on_an_amx_cpu_auto_measures_each_written_format_and_elsewhere_the_file_as_given(monkeypatch):
    from entmtp import machine
    from entmtp.backends.llama_cpp import WRITTEN_FORMATS
    from entmtp.backends.registry import at as _at
    from entmtp.build import EngineSpec
    from entmtp.build import candidates as _candidates

    monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "1")  # the AMX kernels run (the canary's verdict)
    monkeypatch.setattr(machine, "cpu_info", lambda: AMX_XEON)
    llama = [c for c in _candidates(EngineSpec(), probe=True) if c.startswith("llama-cpp/")]
    assert llama == ["llama-cpp/bfloat16", *(f"llama-cpp/bfloat16:{f}" for f in WRITTEN_FORMATS)]
    spec = _at(EngineSpec(), "llama-cpp/bfloat16:F16")
    assert (spec.backend, spec.dtype, spec.gguf_format, spec.gguf_as_given) == (
        "llama-cpp",
        "bfloat16",
        "F16",
        False,
    )
    assert _at(EngineSpec(), "llama-cpp/bfloat16").gguf_as_given  # Q4_1 as shipped
    # none where the AMX kernels do not run, under a named dtype, for a user's model, or without measuring
    for spec, probe in [
        (EngineSpec(dtype="float32"), True),
        (EngineSpec(model="m.gguf"), True),
        (EngineSpec(), False),
    ]:
        assert not [c for c in _candidates(spec, probe=probe) if ":" in c]
    monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "0")
    assert not [c for c in _candidates(EngineSpec(), probe=True) if ":" in c]
    monkeypatch.setattr(machine, "cpu_info", lambda: {"name": "EPYC", "flags": ["avx2", "avx512f"]})
    monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "1")
    assert not [c for c in _candidates(EngineSpec(), probe=True) if ":" in c]


def test_auto_keeps_the_weight_format_with_the_most_expected_tokens_per_second(monkeypatch, tmp_path):
    import entmtp.build.choose as build_mod
    import entmtp.build.composed as compose_mod

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    speeds = {
        "transformers/bfloat16": 40.0,
        "llama-cpp/bfloat16": 70.0,
        "llama-cpp/bfloat16:Q8_0": 80.0,
        "llama-cpp/bfloat16:BF16": 95.0,
    }

    def fake_load(loader, spec, cand, budget, log):
        loaded = build_mod.Loaded(build_mod.at(spec, cand), object(), None, None, "none", None)
        policies = dict.fromkeys(ACCEPTANCE, StaticPolicy(Tree.root_only()))
        return build_mod._Option(
            loaded, build_mod.Composed(policies, "greedy", "plain", "test", speeds[cand], {}, (), False)
        )

    monkeypatch.setattr(build_mod, "_load", fake_load)
    monkeypatch.setattr(build_mod, "candidates", lambda spec, probe: list(speeds))
    monkeypatch.setattr(build_mod, "_room_for_another", lambda model, cand: True)
    monkeypatch.setattr(compose_mod, "Engine", lambda *a, **k: "engine")
    built = build_mod.build(build_mod.EngineSpec(), log=lambda m: None, route=False)
    assert (built.plan.backend, built.loaded.spec.gguf_format) == ("llama-cpp", "BF16")
    assert "llama-cpp/bfloat16:BF16 95.0" in built.plan.backend_reason


@pytest.mark.parametrize("flash", ["1", "0"])
@pytest.mark.parametrize("fmt", ["Q8_0", "F16", "BF16"])
def test_speculative_greedy_in_each_written_format(fmt, flash, monkeypatch):
    """Each format the embedded model is written in decodes its own weights, under a policy that switches trees
    every step, with flash attention on and off (backends/attention.py). On F16 the speculative greedy output
    equals that file's plain greedy output, as on the F32 file. Q8_0 and BF16, like Q4_1, round a one-token
    and a many-token decode differently (their matmul kernels differ by batch size, on an AMX CPU most), so
    there the speculative text may part from the plain text at a near-tie: what holds is that every token it
    emits is the file's own greedy token after the tokens before it (each step's base argmax, checked by
    replaying its output as one prefill)."""
    from entmtp.backends import weights_format
    from entmtp.backends.attention import ENV
    from entmtp.backends.gguf import embedded_in_format as _embedded_in_format
    from entmtp.model import embedded_model_dir
    from test_policy_switching import CyclingPolicy

    monkeypatch.setenv(ENV, flash)
    model, tok = load_gguf(
        _embedded_in_format(fmt), dtype=torch.float32, threads=2, tokenizer_dir=str(embedded_model_dir())
    )
    assert weights_format(model) == {"Q8_0": "Q8_0", "F16": "float16", "BF16": "bfloat16"}[fmt]
    assert model.runtime.flash_attn is (flash == "1")
    plain = Engine(model, tok, heads=None, policy=static(Tree.root_only()))
    for p in PROMPTS:
        ids = plain.encode(p, N)
        reference = plain.generate(ids, max_new_tokens=N).token_ids
        heads = OracleHeads(ids + reference, num_heads=5, rank_mod=2, wrong_every=5)
        result = Engine(model, tok, heads=heads, policy=CyclingPolicy()).generate(ids, max_new_tokens=N)
        assert len({s.tree for s in result.steps}) == 4 and sum(s.accepted for s in result.steps) > 0
        if fmt == "F16":
            assert result.token_ids == reference
        else:  # each emitted token is the greedy token after its prefix, within a near-tie's rounding
            assert_greedy_within_rounding(model, ids, result.token_ids)
            wrong = list(result.token_ids)
            wrong[len(wrong) // 2] = (wrong[len(wrong) // 2] + 1) % model.runtime.n_vocab
            with pytest.raises(AssertionError, match="not a near-tie"):  # the check sees one wrong token
                assert_greedy_within_rounding(model, ids, wrong)
    assert free_seqs_are_all_back(model)


def assert_greedy_within_rounding(model, ids: list[int], out: list[int], tie: float = 0.25) -> None:
    """Every token of `out` is the model's argmax after `ids` + the tokens before it, or within `tie` of its
    logit (a near-tie that a many-token decode may round the other way): read from one prefill of the whole
    text, which computes every position's logits."""
    base = model.entmtp_base()
    cache = base.new_cache(len(ids) + len(out) + 1)
    try:
        fwd = base.forward(torch.tensor(ids + out[:-1]), None, cache, hidden=False)
    finally:
        cache.release()
    logits = fwd.logits[len(ids) - 1 :]  # row i: the distribution of out[i]
    top = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(out)), torch.tensor(out)]
    gap = (top - chosen).tolist()
    assert max(gap) <= tie, (
        f"a token {max(gap):.3f} below the argmax at {gap.index(max(gap))}: not a near-tie"
    )


def test_a_format_file_that_cannot_be_read_or_written_falls_back_to_the_shipped_q4_1_with_one_line(
    monkeypatch, tmp_path, capsys
):
    from entmtp.backends import llama_cpp as backend
    from entmtp.backends.gguf import embedded_in_format as _embedded_in_format
    from entmtp.model import embedded_gguf

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    corrupt = tmp_path / "models" / "smollm2-135m-instruct-f16.gguf"
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    assert _embedded_in_format("F16") == str(embedded_gguf())
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "F16 GGUF could not be written or read" in said[0] and "Q4_1 file" in said[0]
    assert "smollm2-135m-instruct-f16.gguf" in said[0]  # the file to delete

    def disk_full(src, dst, kind):
        raise OSError(f"No space left on device: {dst}")

    monkeypatch.setattr(backend, "write_gguf", disk_full)
    assert _embedded_in_format("Q8_0") == str(embedded_gguf())
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "models" / "smollm2-135m-instruct-q8_0.gguf").exists()
