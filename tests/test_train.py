"""entmtp.train on a tiny random Llama and a character-level ChatML tokenizer: seconds, no real training."""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model
from entmtp import machine as machine_mod
from entmtp.engine import Engine
from entmtp.errors import DataError, HeadsError
from entmtp.heads import Heads, HeadsConfig, load_heads, random_heads, save_heads
from entmtp.machine import auto_dtype
from entmtp.model import encode_prompt
from entmtp.prompts import load_prompts
from entmtp.train import (
    EvalSettings,
    GenSettings,
    HeadsSettings,
    TrainSettings,
    generate_data,
    load_split,
    load_training_prompts,
    train,
)
from entmtp.train import pipeline as pipeline_mod
from entmtp.train import shards as shards_mod
from entmtp.train.answers import IDENTITY as ANSWER_IDENTITY
from entmtp.train.answers import AnswerStore
from entmtp.train.command import add_train_arguments, train_settings_from_args
from entmtp.train.evaluate import (
    evaluate_heads,
    plot_learning_curve,
    report_markdown,
    task_line,
    teacher_forced_accuracy,
)
from entmtp.train.pipeline import cap_vocab, train_heads
from entmtp.train.trainer import LOG, batch_windows, check_data_fits, distill_loss, make_windows
from entmtp.tree import Tree

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROMPTS = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(12)] + ["Write a poem.", "Say hi."]


def consistent(entry: dict) -> bool:
    """An evaluation's tokens/step is what its parts imply: its steps' tokens over its steps (the prefill's
    token in none; metrics.mean_tokens_per_step), at least one step, each emitting at least one token."""
    return (
        entry["steps"] > 0
        and entry["tokens"] >= entry["steps"]
        and entry["tokens_per_step"] == pytest.approx(entry["tokens"] / entry["steps"])
    )


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; <|im_end|> (id 1) is EOS, <pad> id 2."""
    specials = ["<|im_start|>", "<|im_end|>", "<pad>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML
    return tok


def tiny_base(seed: int = 0):
    model = tiny_model("llama", seed, eos_token_id=1, pad_token_id=2)
    return model, char_tokenizer()


GEN = GenSettings(
    num_prompts=12, max_new_tokens=24, val_fraction=0.2, shard_size=4, sample_fraction=0.25, top_k=5
)
FAST = TrainSettings(
    steps=12, batch_size=4, window=16, lr=1e-2, eval_every=6, checkpoint_every=4, log_every=2
)


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def distill(base, tmp_path_factory):
    model, tok = base
    d = tmp_path_factory.mktemp("distill")
    generate_data(
        model, tok, d, prompts=PROMPTS, settings=GEN, batch_size=3, base_model="tiny", progress=False
    )
    return d


def medusa(model, num_heads: int = 3, **kw):
    return random_heads(HeadsConfig.for_model(model, "medusa", num_heads, base_model="tiny", **kw), seed=0)


def _weights(heads) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in heads.state_dict().items()}


# ---- data ----------------------------------------------------------------------------------------------


def test_training_prompt_sources(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "gsm8k").mkdir()
    gpteacher = [{"instruction": "Fix the code.", "input": "x = = 1", "response": "x = 1"}]
    (tmp_path / "train" / "gpteacher_codegen.json").write_text(json.dumps(gpteacher))
    alpaca = [
        json.dumps({"instruction": "Name a color.", "input": "", "output": "red", "status": "ok"}),
        json.dumps({"instruction": "Too similar.", "input": "", "output": "x", "status": "too similar"}),
        '{"instruction": "broken',  # v2 ends in broken lines upstream
    ]
    (tmp_path / "train" / "alpaca_libre_tasks_v2.jsonl").write_text("\n".join(alpaca) + "\n")
    (tmp_path / "gsm8k" / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    prompts = load_training_prompts(tmp_path)
    expected = ["Fix the code.\n\nx = = 1", "Name a color.", "1+1?"]
    assert prompts == expected
    user = tmp_path / "mine.jsonl"
    user.write_text('"plain string"\n{"prompt": "a prompt"}\n')
    assert load_training_prompts(prompts_file=user) == ["plain string", "a prompt"]
    # a second directory (the project's data/): context-copy prompts and chats, deduplicated across both
    project = tmp_path / "project"
    (project / "train").mkdir(parents=True)
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye?"},
    ]
    records = [
        {"instruction": "Summarize this.", "input": "A long passage.", "kind": "summarize"},
        {"messages": chat, "kind": "multi_turn"},
        {"messages": chat[:2]},  # ends with the assistant: nothing to answer, skipped
        {"messages": [{"role": "robot", "content": "?"}]},  # an unknown role: skipped
        {"question": "1+1?"},  # already in gsm8k/train.jsonl: kept once, from the first directory
    ]
    (project / "train" / "context.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    prompts, sources = load_training_prompts(f"{tmp_path},{project}", with_sources=True)
    assert prompts == [*expected, "Summarize this.\n\nA long passage.", chat]
    assert sources == [
        "gpteacher_codegen.json",
        "alpaca_libre_tasks_v2.jsonl",
        "train.jsonl",
        "context.jsonl",
        "context.jsonl",
    ]
    assert load_training_prompts([tmp_path, project]) == prompts


def test_shards_and_manifest(distill):
    manifest = json.loads((distill / "manifest.json").read_text())
    assert manifest["complete"] and manifest["base_model"] == "tiny"
    assert manifest["num_val"] == 2 and manifest["num_train"] == 10  # 20% of 12 held out
    files = sorted(s["file"] for s in manifest["shards"])
    assert files == [
        "train-00000.safetensors",
        "train-00001.safetensors",
        "train-00002.safetensors",
        "val-00000.safetensors",
    ]
    shard = load_file(str(distill / "train-00000.safetensors"))
    n = shard["tokens"].shape[0]
    assert shard["hidden"].shape == (n, 64) and shard["hidden"].dtype == torch.bfloat16
    assert shard["topk_ids"].shape == (n, 5) and shard["topk_logp"].dtype == torch.float16
    assert int(shard["offsets"][-1]) == n and shard["offsets"].numel() == 5
    train = load_split(distill, "train")
    assert train.num_sequences == 10
    assert train.num_anchors == sum(s["anchors"] for s in manifest["shards"] if s["split"] == "train")
    assert not list(distill.glob(".*tmp*"))


def test_load_split_is_the_shards_concatenated_and_refuses_a_bad_shard(distill, tmp_path):
    """load_split fills one preallocated tensor per field (no second copy of the split in memory): the
    same as concatenating the shards; an unreadable shard or one the manifest miscounts is a clear error."""
    files = sorted(distill.glob("train-*.safetensors"))
    shards = [load_file(str(f)) for f in files]
    data = load_split(distill, "train")
    assert torch.equal(data.hidden, torch.cat([s["hidden"] for s in shards]))
    assert torch.equal(data.topk_ids, torch.cat([s["topk_ids"] for s in shards]).long())
    assert torch.equal(data.topk_logp, torch.cat([s["topk_logp"] for s in shards]))
    assert torch.equal(data.tokens, torch.cat([s["tokens"] for s in shards]).long())
    lengths = torch.cat([s["offsets"].diff() for s in shards])
    assert torch.equal(data.offsets, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    assert torch.equal(data.prompt_lens, torch.cat([s["prompt_lens"] for s in shards]).long())
    # what the draft vocabulary and the Hydra++ prefix layer's scale read, one shard at a time
    manifest = shards_mod.Manifest.read(distill)
    counts = shards_mod.token_counts(distill, "train", manifest)
    assert torch.equal(counts, torch.bincount(data.tokens, minlength=manifest.vocab_size))
    rms = float(data.hidden.float().pow(2).mean(-1).sqrt().mean())
    assert shards_mod.mean_feature_rms(distill, "train", manifest) == pytest.approx(rms, rel=1e-5)
    d = tmp_path / "bad"
    d.mkdir()
    for f in distill.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["shards"][-1]["positions"] += 1
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="manifest lists"):
        load_split(d, manifest["shards"][-1]["split"])
    (d / "train-00001.safetensors").write_bytes(b"not a shard")
    with pytest.raises(DataError, match="cannot read shard .*train-00001"):
        load_split(d, "train")


def test_several_distillation_directories_train_as_one(base, distill, tmp_path):
    """Data made apart (say GSM8K's prompts beside the instruction prompts') trains as one: the splits are
    the directories' shards in order, the draft vocabulary counts both, and the data's identity is both
    (a run resumed on one of them alone is refused). Directories that do not fit together are named."""
    model, tok = base
    other = tmp_path / "other"
    words = [f"Spell the word number {i} backwards." for i in range(10)]
    generate_data(
        model, tok, other, prompts=words, settings=GEN, batch_size=3, base_model="tiny", progress=False
    )
    both = shards_mod.DistillData.read(f"{distill},{other}")
    assert both.positions("train") == sum(load_split(d, "train").num_anchors for d in (distill, other))
    a, b, ab = load_split(distill, "train"), load_split(other, "train"), load_split(both, "train")
    assert torch.equal(ab.hidden, torch.cat([a.hidden, b.hidden]))
    assert torch.equal(ab.topk_ids, torch.cat([a.topk_ids, b.topk_ids]))
    assert torch.equal(ab.offsets, torch.cat([a.offsets[:-1], b.offsets + a.offsets[-1]]))
    assert torch.equal(ab.prompt_lens, torch.cat([a.prompt_lens, b.prompt_lens]))
    assert torch.equal(
        shards_mod.token_counts(both, "train"),
        shards_mod.token_counts(distill, "train") + shards_mod.token_counts(other, "train"),
    )
    assert load_split([distill, other], "val").num_sequences == 2 * load_split(distill, "val").num_sequences
    shas = {shards_mod.DistillData.read(d).prompts_sha for d in (distill, other, both)}
    assert len(shas) == 3
    # training reads both; resuming that run on one directory alone is another data set
    kw = dict(base=base, model="tiny", stages="train", train_settings=replace(FAST, steps=4), progress=False)
    kw["heads_settings"] = HeadsSettings(num_heads=2, draft_vocab=40, max_draft_vocab=40)
    summary = train_heads("medusa", tmp_path / "run", distill_dir=f"{distill},{other}", stop_after=2, **kw)
    assert summary["train"]["stopped_early"] and summary["train"]["step"] == 2
    with pytest.raises(HeadsError, match="data"):
        train_heads("medusa", tmp_path / "run", distill_dir=distill, resume=True, **kw)
    done = train_heads("medusa", tmp_path / "run", distill_dir=[distill, other], resume=True, **kw)
    assert done["train"]["step"] == 4 and (tmp_path / "run" / "heads.safetensors").is_file()
    # what cannot be put together
    topk3 = tmp_path / "topk3"
    generate_data(
        model,
        tok,
        topk3,
        prompts=words,
        settings=replace(GEN, top_k=3),
        batch_size=3,
        base_model="tiny",
        progress=False,
    )
    with pytest.raises(DataError, match=f"{topk3} does not fit with {distill}: top_k 3 \\(in .*: 5\\)"):
        shards_mod.DistillData.read([distill, topk3])
    with pytest.raises(DataError, match="listed twice"):
        shards_mod.DistillData.read(f"{distill},{distill}")
    with pytest.raises(DataError, match="no distillation data directory given: pass --distill-dir"):
        shards_mod.DistillData.read(" , ")
    with pytest.raises(DataError, match="gen stage writes one distillation directory"):
        train_heads(
            "medusa", tmp_path / "gen2", base=base, stages="gen,train", distill_dir=f"{distill},{other}"
        )
    assert not (tmp_path / "gen2").exists()


def test_greedy_targets_match_tokens(base, distill):
    """In a greedy response, the stored argmax at t is the next stored token x_{t+1}."""
    shard = load_file(str(distill / "train-00000.safetensors"))
    for s in range(4):
        if shard["sampled"][s]:
            continue
        lo, hi = int(shard["offsets"][s]), int(shard["offsets"][s + 1])
        p = int(shard["prompt_lens"][s])
        argmax = shard["topk_ids"][lo + p - 1 : hi - 1, 0]
        tokens = shard["tokens"][lo + p : hi]
        assert (argmax == tokens).float().mean() > 0.9  # batched vs teacher-forced: all but rare near-ties


def test_the_teacher_forced_pass_batches_similar_lengths_and_keeps_the_order(base):
    """base_targets pads little: a batch holds sequences of neighbouring lengths. Each sequence's rows come back
    in the order given, as a pass over that sequence alone gives them."""
    model, _ = base
    lengths = [30, 5, 22, 6, 29, 7, 21, 4]
    seqs = [[3 + (i * 7 + j) % 20 for j in range(n)] for i, n in enumerate(lengths)]
    widths = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    rows = shards_mod.base_targets(model, seqs, top_k=3, batch_size=2)
    hook.remove()
    assert sorted(widths) == [
        5,
        7,
        22,
        30,
    ]  # 4+5, 6+7, 21+22, 29+30: 4 padded positions, not 64 in given order
    for s, r in zip(seqs, rows, strict=True):
        alone = shards_mod.base_targets(model, [s], top_k=3)[0]
        assert torch.equal(r["tokens"], torch.tensor(s[:-1], dtype=torch.int32))
        assert torch.allclose(r["hidden"].float(), alone["hidden"].float(), atol=1e-4)
        assert torch.allclose(r["topk_logp"].float(), alone["topk_logp"].float(), atol=1e-2)


def test_generation_resumes_and_is_reused(base, distill, tmp_path, monkeypatch):
    model, tok = base
    d = tmp_path / "copy"
    d.mkdir()
    for f in distill.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    before = load_file(str(d / "train-00001.safetensors"))
    (d / "train-00001.safetensors").unlink()  # as if killed while writing it
    calls = []
    real = shards_mod.engine_responses
    monkeypatch.setattr(shards_mod, "engine_responses", lambda *a, **k: calls.append(1) or real(*a, **k))
    generate_data(
        model, tok, d, prompts=PROMPTS, settings=GEN, batch_size=3, base_model="tiny", progress=False
    )
    assert 1 <= len(calls) <= 2  # one shard again: its greedy group and maybe a sampled group
    after = load_file(str(d / "train-00001.safetensors"))
    assert torch.equal(before["tokens"], after["tokens"])  # seeded: the same responses, sampled ones too
    calls.clear()
    generate_data(
        model, tok, d, prompts=PROMPTS, settings=GEN, batch_size=3, base_model="tiny", progress=False
    )
    assert calls == []  # complete: reused as is
    with pytest.raises(DataError, match="other settings.*max_new_tokens"):
        other = GenSettings(**{**GEN.__dict__, "max_new_tokens": 8})
        generate_data(model, tok, d, prompts=PROMPTS, settings=other, base_model="tiny", progress=False)


def test_stored_answers_make_the_same_shards_without_generating(base, distill, tmp_path, monkeypatch):
    """The answers kept apart (an AnswerStore: 2 bytes a token) rebuild the same data on a fresh machine:
    a run whose answers are all stored generates nothing and writes shards equal to the generated ones.
    Answers made for other data are refused with the fix; a damaged file is named."""
    model, tok = base
    run = dict(prompts=PROMPTS, settings=GEN, batch_size=3, base_model="tiny", progress=False)
    answers = tmp_path / "answers"
    made = generate_data(model, tok, tmp_path / "made", answers_dir=answers, **run)
    stored = AnswerStore(answers, {k: 0 for k in ANSWER_IDENTITY}).stored()
    assert stored == sorted(s["file"] for s in made.shards) and {s["answers"] for s in made.shards} == {
        "generated"
    }
    assert _sequences(tmp_path / "made") == _sequences(distill)  # the store changes no token
    calls = []
    monkeypatch.setattr(shards_mod, "engine_responses", lambda *a, **k: calls.append(1))
    again = generate_data(model, tok, tmp_path / "fresh", answers_dir=answers, **run)
    assert calls == [] and {s["answers"] for s in again.shards} == {"stored"}
    for entry in made.shards:  # teacher-forced from the stored answers: the same tensors
        a, b = (load_file(str(tmp_path / d / entry["file"])) for d in ("made", "fresh"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "answers stored" in shards_mod.shard_line(again.shards[0], again)
    other = replace(GEN, max_new_tokens=8)
    with pytest.raises(DataError, match="made for other data.*max_new_tokens.*another --answers-dir"):
        generate_data(model, tok, tmp_path / "other", answers_dir=answers, **{**run, "settings": other})
    (tmp_path / "a-file").write_text("")
    with pytest.raises(DataError, match="answers directory .*a-file is a file: give a directory"):
        generate_data(model, tok, tmp_path / "file", answers_dir=tmp_path / "a-file", **run)
    (answers / "train-00000.answers.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DataError, match="cannot read answers .*train-00000.answers.safetensors"):
        generate_data(model, tok, tmp_path / "damaged", answers_dir=answers, **run)


def _sequences(d: Path) -> list[tuple[int, list[int]]]:
    """(sampled, tokens) of every stored sequence of a distillation directory, shard by shard."""
    out = []
    for f in sorted(d.glob("*.safetensors")):
        shard = load_file(str(f))
        o = shard["offsets"].tolist()
        out += [
            (int(shard["sampled"][s]), shard["tokens"][o[s] : o[s + 1]].tolist()) for s in range(len(o) - 1)
        ]
    return out


def test_both_answers_are_batched_and_seeded_whatever_the_batch(base, tmp_path):
    """Every prompt answered greedy and sampled (T=0.7, gumbel), next to each other in one shard; the
    continuous batch's rows repeat token for token with another batch size, sampled ones too."""
    model, tok = base
    both = replace(GEN, both_answers=True, num_prompts=5, shard_size=4, max_new_tokens=16)
    runs = {}
    for batch_size in (1, 3):
        d = tmp_path / f"b{batch_size}"
        m = generate_data(
            model,
            tok,
            d,
            prompts=PROMPTS,
            settings=both,
            batch_size=batch_size,
            base_model="t",
            progress=False,
        )
        runs[batch_size] = _sequences(d)
        assert m.num_val == 2 and m.num_train == 8 and sum(s["sequences"] for s in m.shards) == 10
    assert runs[1] == runs[3]
    seqs = runs[1]
    assert [s for s, _ in seqs] == [0, 1] * 5  # greedy then sampled, prompt after prompt
    prompts = load_file(str(tmp_path / "b1" / "train-00000.safetensors"))["prompt_lens"].tolist()
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # the same prompt, twice
    assert any(g != s for (_, g), (_, s) in zip(seqs[::2], seqs[1::2], strict=True))  # sampling differs


def test_shard_records_both_phases(distill, capsys):
    """Each shard's manifest entry records generation (tokens, seconds) and the teacher-forced pass
    (positions, seconds), wall and CPU, and its bytes; the log line gives their rates."""
    manifest = shards_mod.Manifest.read(distill)
    for entry in manifest.shards:
        assert entry["anchors"] > 0 and entry["positions"] >= entry["anchors"]
        assert entry["gen_seconds"] > 0 and entry["targets_seconds"] > 0 and entry["gen_cpu_seconds"] >= 0
        assert entry["bytes"] == (distill / entry["file"]).stat().st_size
    line = shards_mod.shard_line(manifest.shards[-1], manifest)
    assert (
        "tokens/s" in line and "bytes per anchor" in line and f"{manifest.positions('train')} train" in line
    )


def test_resume_after_a_kill_and_refuse_a_second_writer(base, distill, tmp_path):
    """A run killed mid-shard leaves its temp file (no rename happened) and its lock: the next run deletes
    the temp file and takes over the dead run's lock; a live writer's lock is refused. Data made before
    both_answers existed (no such key in its manifest) is resumed as made with the default."""
    model, tok = base
    d = tmp_path / "killed"
    d.mkdir()
    for f in distill.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "train-00002.safetensors").unlink()
    (d / ".train-00002.safetensors.tmp-99999-abcdef01").write_bytes(b"half a shard")
    manifest = json.loads((d / "manifest.json").read_text())
    del manifest["settings"]["both_answers"]
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] != "train-00002.safetensors"]
    manifest["complete"] = False
    (d / "manifest.json").write_text(json.dumps(manifest))
    (d / ".lock").write_text(f"{os.getppid()}\n")  # a live process that is not this one
    run = dict(prompts=PROMPTS, settings=GEN, batch_size=3, base_model="tiny", progress=False)
    with pytest.raises(DataError, match=f"being written by process {os.getppid()}"):
        generate_data(model, tok, d, **run)
    (d / ".lock").write_text("999999999\n")  # no such process: a killed run's lock
    m = generate_data(model, tok, d, **run)
    assert m.complete and len(m.shards) == 4 and not list(d.glob(".*tmp*")) and not (d / ".lock").exists()
    assert _sequences(d) == _sequences(distill)


# ---- training ------------------------------------------------------------------------------------------


def test_windows_cover_every_anchor_once(distill):
    data = load_split(distill, "train")
    w = make_windows(data, window=16, num_heads=3)
    assert (
        int((w.hi - w.lo).sum()) == data.num_anchors - data.num_sequences
    )  # the last position has no target
    order = torch.cat([batch_windows(len(w), 0, s, 5) for s in range(4)])
    assert order.numel() == 20 and torch.equal(
        order, torch.cat([batch_windows(len(w), 0, s, 5) for s in range(4)])
    )


def test_loss_decreases(base, distill, tmp_path):
    model, _ = base
    heads = medusa(model)
    settings = TrainSettings(**{**FAST.__dict__, "steps": 30, "eval_every": 30, "checkpoint_every": 0})
    result = train(model, heads, distill, tmp_path / "run", settings=settings, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / LOG).read_text().splitlines()]
    losses = [r["loss"] for r in log if r.get("loss") is not None]
    assert result.step == 30 and len(losses) == 15
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3
    assert log[0]["step"] == 0 and len(log[0]["val_top1"]) == 3  # untrained heads: the curve's first point
    assert len(log[-1]["val_top1"]) == 3 and result.positions_per_second > 0
    png = plot_learning_curve(tmp_path / "run" / LOG, tmp_path / "run" / "curve.png")
    assert png is not None and png.stat().st_size > 1000


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
@pytest.mark.parametrize("loss", ["ce", "mix"])
def test_hydra_trains(base, distill, tmp_path, arch, loss):
    model, _ = base
    heads = random_heads(HeadsConfig.for_model(model, "hydra", 2, head_arch=arch, base_model="tiny"), seed=0)
    settings = TrainSettings(
        **{**FAST.__dict__, "steps": 3, "loss": loss, "eval_every": 0, "checkpoint_every": 0}
    )
    result = train(model, heads, distill, tmp_path, settings=settings, progress=False)
    assert result.step == 3 and all(0 <= x <= 1 for x in result.val_top1) and len(result.val_top1) == 2


def test_a_target_outside_the_logits_drops_out_of_the_loss():
    """distill_loss with target columns of -1 (tokens outside the draft vocabulary): they leave the top-k,
    which is renormalised over the rest; a position with no target left costs nothing."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6)
    ids = torch.tensor([[2, 4, 5], [-1, 1, 3], [-1, -1, -1]])
    logp = torch.log_softmax(torch.randn(3, 3), -1)
    got = distill_loss(logits, ids, logp, "mix")
    lp = torch.log_softmax(logits, -1)
    q0 = torch.softmax(logp[0], -1)
    kl0 = (q0 * (q0.log() - lp[0, ids[0]])).sum()
    torch.testing.assert_close(got[0], 0.5 * (kl0 - lp[0, 2]))
    q1 = torch.softmax(logp[1, 1:], -1)  # renormalised over the two columns inside
    torch.testing.assert_close(got[1], 0.5 * (q1 * (q1.log() - lp[1, ids[1, 1:]])).sum())  # no CE term
    assert got[2] == 0 and torch.isfinite(got).all()


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_the_draft_vocabulary_loss_is_the_full_one_over_the_whole_vocabulary(
    base, distill, tmp_path, projection
):
    """vocab=draft scores the heads over their draft vocabulary only. With every token in it, it is the full
    loss (the same weights after training, whether the heads share the base output layer or train their
    own); with a subset it trains, and its top-1 counts a target outside the subset as a miss. Without a
    draft vocabulary it asks for one."""
    model, _ = base
    V = model.config.vocab_size
    every, trained = torch.arange(V), {}
    for vocab in ("full", "draft"):
        heads = medusa(model, share_lm_head=projection == "shared")
        heads.set_draft_vocab(every)
        settings = replace(FAST, steps=4, vocab=vocab, checkpoint_every=0, eval_every=0)
        trained[vocab] = train(model, heads, distill, tmp_path / vocab, settings=settings, progress=False)
        trained[vocab + "-weights"] = _weights(heads)
    assert trained["full"].loss == pytest.approx(trained["draft"].loss, rel=1e-5)
    a, b = trained["full-weights"], trained["draft-weights"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    if projection == "own":
        return  # the subset, resumed, for own projections: test_own_projections_train_only_their_draft_rows
    data = load_split(distill, "val")
    heads = medusa(model)
    heads.set_draft_vocab(data.tokens.unique()[: V // 3])  # a third of the tokens the data holds
    settings = replace(FAST, steps=8, vocab="draft", checkpoint_every=4, eval_every=4)
    stopped = train(
        model, heads, distill, tmp_path / "subset", settings=settings, progress=False, stop_after=4
    )
    vocab = heads.draft_vocab.clone()
    resumed = medusa(model)
    resumed.set_draft_vocab(torch.arange(7))  # the checkpoint's vocabulary wins
    result = train(
        model, resumed, distill, tmp_path / "subset", settings=settings, progress=False, resume=True
    )
    assert stopped.stopped_early and result.step == 8 and torch.equal(resumed.draft_vocab, vocab)
    assert all(0 <= x <= 1 for x in result.val_top1) and len(result.val_top1) == 3
    with pytest.raises(HeadsError, match="needs heads with one.*--vocab full"):
        train(model, medusa(model), distill, tmp_path / "none", settings=settings, progress=False)


def test_own_projections_train_only_their_draft_rows(base, distill, tmp_path):
    """Heads with vocab projections of their own, scored over a draft vocabulary, train only its rows: the
    optimiser holds [Vd, H] rows, not [V, H] (on SmolLM2, 8,192 of 49,152 a head), and the log says so; the
    other rows keep their values, the drafts read the trained rows, and a resumed run ends with the uninterrupted run's weights. A
    checkpoint of a run that stepped the whole projection is refused with the difference named; heads without
    a draft vocabulary are refused as shared ones are."""
    model, _ = base
    V, H = model.config.vocab_size, model.config.hidden_size
    vocab = load_split(distill, "val").tokens.unique()[: V // 3]
    settings = replace(FAST, steps=8, vocab="draft", checkpoint_every=4, eval_every=4)

    def own_heads():
        heads = medusa(model, share_lm_head=False)
        heads.set_draft_vocab(vocab)
        return heads

    tree, hidden, root = Tree.from_paths([[0], [1], [0, 0], [0, 0, 0]]), torch.randn(4, H), torch.tensor([5])

    def drafts(heads):
        drafter = heads.eval().drafter()
        drafter.extend(hidden)
        return drafter.draft(tree, root)

    heads = own_heads()
    before, untrained = _weights(heads), drafts(heads)  # a draft before training slices the old rows
    train(model, heads, distill, tmp_path / "whole", settings=settings, progress=False)
    after = _weights(heads)
    first = json.loads((tmp_path / "whole" / LOG).read_text().splitlines()[0])
    assert (
        first["trained_parameters"] == sum(p.numel() for p in heads.parameters()) - 3 * (V - len(vocab)) * H
    )
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    for k in range(3):
        w0, w1 = before[f"heads.{k}.proj.weight"], after[f"heads.{k}.proj.weight"]
        assert torch.equal(w1[outside], w0[outside]) and not torch.allclose(w1[vocab], w0[vocab])
    ckpt = torch.load(tmp_path / "whole" / "checkpoints" / "step-00000008.pt", weights_only=True)
    moments = [st["exp_avg"].shape for st in ckpt["optimizer"]["state"].values()]
    assert moments.count((vocab.numel(), H)) == 3 and (V, H) not in moments
    fresh = own_heads()
    fresh.load_state_dict(after)
    got, want = drafts(heads), drafts(fresh)  # the trained rows, not the rows sliced before training
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    assert not torch.equal(got.logprobs, untrained.logprobs)

    part = own_heads()
    stopped = train(model, part, distill, tmp_path / "part", settings=settings, progress=False, stop_after=4)
    resumed = own_heads()
    train(model, resumed, distill, tmp_path / "part", settings=settings, progress=False, resume=True)
    got = _weights(resumed)
    assert stopped.stopped_early and all(torch.equal(after[k], got[k]) for k in after)

    old = torch.load(tmp_path / "part" / "checkpoints" / "step-00000004.pt", weights_only=True)
    del old["signature"]["trained_rows"]  # what a run that stepped all V rows recorded
    old["step"] = 5
    torch.save(old, tmp_path / "part" / "checkpoints" / "step-00000009.pt")
    with pytest.raises(HeadsError, match="other settings \\(trained_rows differ\\)"):
        train(model, own_heads(), distill, tmp_path / "part", settings=settings, progress=False, resume=True)
    no_vocab = medusa(model, share_lm_head=False)
    with pytest.raises(HeadsError, match="needs heads with one.*--vocab full"):
        train(model, no_vocab, distill, tmp_path / "none", settings=settings, progress=False)


def test_resume_matches_uninterrupted(base, distill, tmp_path):
    model, _ = base
    full = medusa(model)
    train(model, full, distill, tmp_path / "a", settings=FAST, progress=False)
    part = medusa(model)
    first = train(model, part, distill, tmp_path / "b", settings=FAST, progress=False, stop_after=6)
    assert first.stopped_early and first.step == 6
    with pytest.raises(HeadsError, match="unfinished training run.*--resume"):
        train(model, medusa(model), distill, tmp_path / "b", settings=FAST, progress=False)
    resumed = medusa(model)  # fresh weights: everything must come from the checkpoint
    second = train(model, resumed, distill, tmp_path / "b", settings=FAST, progress=False, resume=True)
    assert second.step == FAST.steps and not second.stopped_early
    a, b = _weights(full), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    log_a = (tmp_path / "a" / LOG).read_text().splitlines()
    log_b = (tmp_path / "b" / LOG).read_text().splitlines()
    assert [json.loads(x)["loss"] for x in log_a] == [json.loads(x)["loss"] for x in log_b]
    with pytest.raises(HeadsError, match="other settings.*lr"):
        other = TrainSettings(**{**FAST.__dict__, "lr": 1e-3})
        train(model, medusa(model), distill, tmp_path / "b", settings=other, progress=False, resume=True)


def test_bfloat16_training_runs_the_heads_in_bf16_and_resumes_a_float32_run(base, distill, tmp_path):
    """precision=bfloat16 on the CPU: the heads' matmuls run in bf16 (autocast), their weights and optimiser
    stay fp32; a float32 run's checkpoint resumes in bf16 (precision is not part of the run's identity)."""
    model, _ = base
    seen: dict[str, set] = {}
    for precision in ("float32", "bfloat16"):
        heads = medusa(model)
        linear = next(m for m in heads.heads[0].blocks.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_hook(
            lambda m, i, o, p=precision: seen.setdefault(p, set()).add(o.dtype)
        )
        s = replace(FAST, steps=4, precision=precision, eval_every=0, checkpoint_every=0)
        train(model, heads, distill, tmp_path / precision, settings=s, progress=False, stop_after=2)
        hook.remove()
        assert all(p.dtype == torch.float32 for p in heads.parameters())
    assert seen == {"float32": {torch.float32}, "bfloat16": {torch.bfloat16}}
    resumed = train(
        model,
        medusa(model),
        distill,
        tmp_path / "float32",
        settings=replace(FAST, steps=4, precision="bfloat16", eval_every=0, checkpoint_every=0),
        progress=False,
        resume=True,
    )
    assert resumed.step == 4 and not resumed.stopped_early
    with pytest.raises(DataError, match="precision 'fp8' is unknown"):
        TrainSettings(precision="fp8")


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_auto_precision_is_bf16_only_where_the_hardware_multiplies_it(
    base, distill, tmp_path, monkeypatch, native
):
    """auto: bfloat16 on CUDA and on a CPU with native bf16 (avx512_bf16, AMX); float32 on a CPU that would
    emulate it (a teacher-forced pass 6.5x slower on the AVX2-only EPYC). The run's first log line says what it
    chose and how many distinct positions a pass over its training split trains on."""
    monkeypatch.setattr(machine_mod, "native_bf16", lambda flags=None: native)
    want = "bfloat16" if native else "float32"
    assert auto_dtype("cpu") == want and auto_dtype("cuda") == "bfloat16"
    model, _ = base
    heads, seen = medusa(model), set()
    linear = next(m for m in heads.heads[0].blocks.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    s = replace(FAST, steps=2, precision="auto", eval_every=0, checkpoint_every=0)
    train(model, heads, distill, tmp_path, settings=s, progress=False)
    assert seen == {getattr(torch, want)}
    first = json.loads((tmp_path / LOG).read_text().splitlines()[0])
    split = load_split(shards_mod.DistillData.read(distill), "train")
    answers = int(
        (split.offsets.diff() - split.prompt_lens).sum()
    )  # each answer token's position has a target
    assert (first["step"], first["precision"], first["train_positions"]) == (0, want, answers)


def test_train_heads_loads_the_base_model_in_float32_on_a_cpu_without_native_bf16(tmp_path, monkeypatch):
    """train-heads' base model (batched generation, teacher-forced passes) takes `auto_dtype`'s dtype by
    default; a dtype named on the command line is kept."""
    asked = []

    def load_model(model, dtype, device):
        asked.append(dtype)
        raise KeyboardInterrupt  # stop before anything is generated

    monkeypatch.setattr(pipeline_mod, "load_model", load_model)
    monkeypatch.setattr(machine_mod, "native_bf16", lambda flags=None: False)
    pf = tmp_path / "prompts.jsonl"
    pf.write_text(json.dumps({"instruction": PROMPTS[0]}) + "\n")
    for dtype in ("auto", "bfloat16"):
        with pytest.raises(KeyboardInterrupt):
            train_heads(
                "medusa", tmp_path / dtype, stages="gen", prompts_file=pf, dtype=dtype, progress=False
            )
    assert asked == ["float32", "bfloat16"]
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    assert p.parse_args(["--kind", "hydra", "--out", "o"]).dtype == "auto"


def test_saved_heads_give_identical_logits(base, distill, tmp_path):
    model, _ = base
    heads = medusa(model)
    train(
        model,
        heads,
        distill,
        tmp_path / "run",
        settings=TrainSettings(**{**FAST.__dict__, "steps": 3}),
        progress=False,
    )
    save_heads(heads, tmp_path / "heads")
    loaded = load_heads(tmp_path / "heads").bind(model)
    hidden, tokens = torch.randn(2, 7, 64), torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        for k, (f1, f2) in enumerate(
            zip(heads.features(hidden, tokens), loaded.features(hidden, tokens), strict=True)
        ):
            assert torch.equal(heads.project(k, f1), loaded.project(k, f2))


def test_teacher_forced_accuracy_of_an_oracle(base):
    """Heads whose head 1 is the base model itself (identity feature) are right wherever x_{t+1} repeats
    as x_{t+2}; check the bookkeeping on a sequence where we know the answers."""
    model, _ = base
    heads = medusa(model, num_heads=2).bind(model)  # medusa init: every head is the identity feature
    decoder = model.get_decoder()
    prompt = [0, 5, 6, 7]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):  # greedy continuation
            h = decoder(input_ids=torch.tensor([seq])).last_hidden_state
            seq.append(int(model.lm_head(h[0, -1]).argmax()))
    report = teacher_forced_accuracy(model, heads, [(prompt, seq[len(prompt) :])])
    # head k at t predicts with the base's own next-token distribution; it is right when x_{t+k+1} == x_{t+1}
    expect = [
        sum(seq[t + k + 1] == seq[t + 1] for t in range(len(prompt) - 1, len(seq) - k - 1))
        / (len(seq) - k - len(prompt))
        for k in (1, 2)
    ]
    assert report["top1"] == pytest.approx(expect)
    assert report["positions"] == [len(seq) - len(prompt) - 1, len(seq) - len(prompt) - 2]
    assert all(a >= b for a, b in zip(report["top10"], report["top1"], strict=True))


# ---- the pipeline and bad input ------------------------------------------------------------------------


def test_train_heads_end_to_end(base, tmp_path):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("\n".join(json.dumps({"instruction": p}) for p in PROMPTS) + "\n")
    kw = dict(
        base=base,
        prompts_file=pf,
        gen_settings=GenSettings(num_prompts=8, max_new_tokens=16, val_fraction=0.25, shard_size=4),
        train_settings=TrainSettings(steps=4, batch_size=2, window=16, checkpoint_every=2, eval_every=2),
        heads_settings=HeadsSettings(num_heads=2),
        eval_settings=EvalSettings(
            prompts=1, max_new_tokens=8, tasks=("gsm8k",), trees=("tree_4", "tree_16")
        ),
        progress=False,
    )
    summary = train_heads("medusa", tmp_path / "out", **kw)
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "heads.safetensors").is_file()
    assert (out / "learning_curve.png").is_file()
    assert summary["train"]["step"] == 4 and summary["distill"]["train_positions"] > 0
    assert json.loads((out / "distill" / "manifest.json").read_text())["sources"] == {"prompts.jsonl": 8}
    report = json.loads((out / "eval" / "eval.json").read_text())
    assert report["trees"] == ["tree_4"] and "tree_16" in report["skipped_trees"]  # tree_16 is 3 deep
    gsm = report["tasks"]["gsm8k"]
    assert len(gsm["top1"]) == 2 and consistent(gsm["speculative"]["tree_4"])
    assert "Top-1 accuracy per head" in (out / "eval" / "eval.md").read_text()
    # the same data trains Hydra heads: the gen stage finds it complete and reuses it
    hydra = train_heads(
        "hydra", tmp_path / "hydra", **{**kw, "distill_dir": out / "distill", "stages": "gen,train"}
    )
    assert hydra["distill"]["seconds"] < summary["distill"]["seconds"] + 5
    loaded = load_heads(tmp_path / "hydra")
    assert loaded.config.kind == "hydra"
    assert loaded.draft_vocab is not None and 1 in loaded.draft_vocab.tolist()  # EOS always draftable
    with pytest.raises(HeadsError, match="already holds heads.*--overwrite"):
        train_heads("medusa", out, **kw)
    assert report_markdown(report).count("| GSM8K |") == 5
    # --init: continue from trained heads on (here the same) data; their weights are the starting point
    slow = replace(kw["train_settings"], steps=2, lr=1e-9, warmup=0.0)
    more = {**kw, "distill_dir": out / "distill", "stages": "train", "train_settings": slow}
    train_heads("hydra", tmp_path / "hydra2", init=tmp_path / "hydra", **more)
    before, after = load_heads(tmp_path / "hydra").state_dict(), load_heads(tmp_path / "hydra2").state_dict()
    assert all(torch.allclose(before[k].float(), after[k].float(), atol=1e-5) for k in before)  # lr ~ 0
    old_vocab = set(load_heads(tmp_path / "hydra").draft_vocab.tolist())
    assert old_vocab <= set(load_heads(tmp_path / "hydra2").draft_vocab.tolist())
    with pytest.raises(HeadsError, match="--init heads in .* differ.*kind='hydra' \\(asked 'medusa'\\)"):
        train_heads("medusa", tmp_path / "medusa2", init=tmp_path / "hydra", **more)
    # Hydra++ from Hydra mlp heads: the same heads behind a prefix layer that starts as x -> s * x / rms(x)
    prefix = HeadsSettings(num_heads=2, head_arch="prefix-mlp")
    train_heads("hydra", tmp_path / "hydrapp", init=tmp_path / "hydra", **{**more, "heads_settings": prefix})
    old, pp = (
        load_heads(tmp_path / "hydra", dtype=torch.float32),
        load_heads(tmp_path / "hydrapp", dtype=torch.float32),
    )
    assert pp.config.head_arch == "prefix-mlp" and old_vocab <= set(pp.draft_vocab.tolist())
    state = pp.state_dict()
    assert all(torch.allclose(v.float(), state[k].float(), atol=1e-5) for k, v in old.state_dict().items())
    hidden = load_split(out / "distill", "train").hidden.float()
    scale = hidden.pow(2).mean(-1).sqrt().mean()
    assert torch.allclose(pp.prefix.norm.weight, scale.expand_as(pp.prefix.norm.weight), rtol=1e-4)
    model, _ = base
    old.bind(model)
    pp.bind(model)
    h, t = hidden[None, :12], torch.arange(12)[None] + 5  # [1, 12, H], [1, 12]
    eps = model.config.rms_norm_eps
    expect = old.features(pp.prefix.norm.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), t)
    for a, b in zip(pp.features(h, t), expect, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
    with pytest.raises(HeadsError, match="head_arch='prefix-mlp' \\(asked 'mlp'\\)"):
        train_heads("hydra", tmp_path / "back", init=tmp_path / "hydrapp", **more)


def _trained_looking_heads(model, directory: Path) -> Heads:
    """Hydra heads (2) for the tiny model with weights away from their init, so that keeping them is checked;
    saved in ``directory``."""
    heads = random_heads(HeadsConfig.for_model(model, "hydra", 2, base_model="tiny"), seed=0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    heads.set_draft_vocab(torch.arange(1, 60))
    save_heads(heads, directory)
    return heads


def test_init_heads_grow_starting_from_the_function_they_computed(base, distill, tmp_path):
    """--init heads may grow into more residual blocks a head (the new ones exactly the identity) and a vocab
    projection of each head's own (a copy of the shared base output layer, bias zero): the grown heads start
    by drafting exactly what the old ones drafted. Shrinking is refused with the fields named."""
    model, _ = base
    old = _trained_looking_heads(model, tmp_path / "old")
    still = TrainSettings(
        steps=2, batch_size=2, window=16, lr=1e-9, warmup=0.0, checkpoint_every=2, eval_every=2
    )
    kw = dict(
        base=base, model="tiny", distill_dir=distill, stages="train", train_settings=still, progress=False
    )
    bigger = HeadsSettings(num_heads=2, num_layers=3, share_lm_head=False)
    train_heads("hydra", tmp_path / "grown", init=tmp_path / "old", heads_settings=bigger, **kw)
    grown = load_heads(tmp_path / "grown", dtype=torch.float32)
    assert grown.config.num_layers == 3 and not grown.config.share_lm_head
    assert set(old.draft_vocab.tolist()) <= set(grown.draft_vocab.tolist())
    old.bind(model)
    grown.bind(model)
    hidden = load_split(distill, "train").hidden.float()[None, :12]  # [1, 12, H]
    tokens = torch.arange(12)[None] + 5
    for k, (a, b) in enumerate(
        zip(old.features(hidden, tokens), grown.features(hidden, tokens), strict=True)
    ):
        assert torch.allclose(a, b, atol=1e-5)
        assert torch.allclose(old.project(k, a), grown.project(k, b), atol=1e-4)
    with pytest.raises(HeadsError, match="num_layers=3 \\(asked 1\\), share_lm_head=False \\(asked True\\)"):
        train_heads(
            "hydra",
            tmp_path / "back",
            init=tmp_path / "grown",
            heads_settings=HeadsSettings(num_heads=2),
            **kw,
        )


def test_cap_vocab():
    counts = torch.tensor([0, 5, 1, 9, 0, 3, 0, 2])  # [V] token counts in the new data
    # special tokens stay however rare; then the most frequent
    assert cap_vocab(torch.arange(7), counts, 3, keep=[0], prefer=torch.tensor([4, 6])).tolist() == [0, 1, 3]
    # on ties (here unseen tokens) the old vocabulary comes first
    assert cap_vocab(torch.tensor([2, 4, 6, 7]), counts, 3, prefer=torch.tensor([6])).tolist() == [2, 6, 7]
    assert cap_vocab(torch.tensor([2, 4, 6, 7]), counts, 3, prefer=torch.tensor([4])).tolist() == [2, 4, 7]


def test_bad_inputs(base, distill, tmp_path):
    model, tok = base
    with pytest.raises(DataError, match="prompt file .*missing.jsonl does not exist"):
        load_training_prompts(prompts_file=tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"answer": "no prompt here"}\n')
    with pytest.raises(DataError, match="holds no prompts"):
        load_training_prompts(prompts_file=empty)
    with pytest.raises(DataError, match="training data directory .* does not exist"):
        load_training_prompts(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no distillation data"):
        train(model, medusa(model), tmp_path / "nodata", tmp_path / "out", progress=False)
    # heads made for another model
    other = random_heads(HeadsConfig(kind="medusa", num_heads=2, hidden_size=32, vocab_size=256), seed=0)
    with pytest.raises((HeadsError, DataError), match="hidden"):
        train(model, other, distill, tmp_path / "out", progress=False)
    # an output directory with other heads in it
    save_heads(medusa(model), tmp_path / "taken")
    with pytest.raises(HeadsError, match="already holds heads"):
        train(model, medusa(model), distill, tmp_path / "taken", progress=False)
    with pytest.raises(DataError, match="loss 'mse' is unknown"):
        TrainSettings(loss="mse")
    with pytest.raises(DataError, match="unknown stage"):
        train_heads("medusa", tmp_path / "x", base=base, stages="gen,fly")
    # nothing half-written: a failed run leaves no output directory behind
    with pytest.raises(DataError, match="does not exist"):
        train_heads(
            "medusa", tmp_path / "never", base=base, prompts_file=tmp_path / "missing.jsonl", progress=False
        )
    assert not (tmp_path / "never").exists()
    with pytest.raises(DataError, match="no distillation data"):
        train_heads("medusa", tmp_path / "never2", base=base, stages="train", progress=False)
    assert not (tmp_path / "never2").exists()
    with pytest.raises(DataError, match="draft_vocab must be >= 0"):
        HeadsSettings(draft_vocab=-1)
    with pytest.raises(DataError, match="max_draft_vocab must be >= 0 \\(0: no cap\\)"):
        HeadsSettings(max_draft_vocab=-1)
    with pytest.raises(HeadsError, match="save_dtype 'int8' is unknown"):
        HeadsSettings(save_dtype="int8")
    with pytest.raises(DataError, match="unknown task 'nosuch'"):
        EvalSettings(tasks=("gsm8k", "nosuch"))
    with pytest.raises(DataError, match="no training prompt source given.*--data-dir.*--prompts"):
        load_training_prompts()
    with pytest.raises(DataError, match="no training prompt source given"):
        train_heads("medusa", tmp_path / "never3", base=base, progress=False)
    assert not (tmp_path / "never3").exists()
    with pytest.raises(DataError, match="train_time_limit must be a positive number"):
        train_heads("medusa", tmp_path / "x", base=base, train_time_limit=0)
    with pytest.raises(DataError, match="gen_time_limit must be a positive number"):
        train_heads("medusa", tmp_path / "x", base=base, gen_time_limit=-5)


def test_cli_arguments():
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(
        ["--kind", "hydra", "--out", "o", "--steps", "7", "--device", "cuda", "--stages", "train"]
    )
    assert (args.kind, args.steps, args.device, args.stages, args.num_heads) == (
        "hydra",
        7,
        "cuda",
        "train",
        4,
    )
    assert args.eval_prompts == 10 and args.eval_trees == ("mc_sim_7b_63", "tree_8")
    assert Path(args.out) == Path("o")
    # the arguments' defaults are the settings' defaults
    assert train_settings_from_args(args) == {
        "gen_settings": GenSettings(),
        "train_settings": TrainSettings(steps=7),
        "heads_settings": HeadsSettings(),
        "eval_settings": EvalSettings(),
    }
    args = p.parse_args(
        ["--kind", "hydra", "--out", "o", "--seed", "3", "--own-lm-head", "--eval-tasks", "gsm8k"]
    )
    got = train_settings_from_args(args)
    assert got["gen_settings"].seed == got["train_settings"].seed == 3  # one seed for data and training
    assert not got["heads_settings"].share_lm_head and got["eval_settings"].tasks == ("gsm8k",)
    # no default training data in the library: the CLI names it
    assert args.data_dir is None
    from entmtp.cli import build_parser

    cli_args = build_parser().parse_args(["train-heads", "--kind", "medusa", "--out", "o"])
    assert cli_args.data_dir.split(",")[0] == "shipped"  # the prompts in the package: no folder outside it
    # both commands' base model follows the hardware by default: no emulated bf16 on a CPU without it
    assert cli_args.dtype == build_parser().parse_args(["eval-heads", "hydra"]).dtype == "auto"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_on_cuda(tmp_path):
    model, tok = tiny_base()
    model.to("cuda")
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("\n".join(json.dumps({"instruction": p}) for p in PROMPTS) + "\n")
    summary = train_heads(
        "hydra",
        tmp_path / "out",
        base=(model, tok),
        device="cuda",
        prompts_file=pf,
        gen_settings=GenSettings(num_prompts=8, max_new_tokens=16, val_fraction=0.25, shard_size=4),
        train_settings=TrainSettings(steps=20, batch_size=4, window=16, lr=1e-2, eval_every=10),
        heads_settings=HeadsSettings(num_heads=2),
        eval_settings=EvalSettings(prompts=1, max_new_tokens=8, tasks=("gsm8k",), trees=("tree_4",)),
        progress=False,
    )
    log = [json.loads(line) for line in (tmp_path / "out" / LOG).read_text().splitlines()]
    losses = [r["loss"] for r in log if r.get("loss") is not None]
    assert summary["train"]["step"] == 20 and losses[-1] < losses[0]
    assert consistent(summary["eval"]["tasks"]["gsm8k"]["speculative"]["tree_4"])
    assert load_heads(tmp_path / "out").config.kind == "hydra"


def test_gen_time_limit_leaves_resumable_partial_data(base, tmp_path):
    model, tok = base
    d = tmp_path / "partial"
    m = generate_data(
        model,
        tok,
        d,
        prompts=PROMPTS,
        settings=GEN,
        batch_size=3,
        base_model="tiny",
        progress=False,
        time_limit=0.0,
    )
    assert m.shards == [] and not m.complete  # no shard started after the (zero) limit
    m = generate_data(
        model, tok, d, prompts=PROMPTS, settings=GEN, batch_size=3, base_model="tiny", progress=False
    )
    assert m.complete and len(m.shards) > 0


def test_train_time_limit_plans_fewer_steps_and_finishes(base, distill, tmp_path):
    from entmtp.train.trainer import TIME_PROBE_STEPS

    model, _ = base
    heads = medusa(model)
    settings = TrainSettings(**{**FAST.__dict__, "steps": 200, "eval_every": 0, "checkpoint_every": 0})
    result = train(
        model, heads, distill, tmp_path / "run", settings=settings, progress=False, time_limit=1e-6
    )
    assert result.step == TIME_PROBE_STEPS and not result.stopped_early  # a complete, shorter run
    log = [json.loads(line) for line in (tmp_path / "run" / LOG).read_text().splitlines()]
    assert log[-1]["step"] == TIME_PROBE_STEPS and "val_top1" in log[-1]  # final eval ran


# ---- eval-heads: new heads against the ones they would replace -------------------------------------------


def test_each_tasks_result_prints_with_or_without_a_progress_bar(base, capsys):
    """`eval-heads --no-progress` drops the bar, not the results: one line per task, as it finishes."""
    model, tok = base
    heads = random_heads(HeadsConfig.for_model(model, "hydra", 2), seed=1, init="random")
    run = dict(
        tasks=("gsm8k", "specbench-math"), split="test", num_prompts=1, max_new_tokens=4, trees=("chain_2",)
    )
    for progress in (False, True):  # off a terminal the bar gives way to the same lines
        report = evaluate_heads(model, tok, heads, progress=progress, **run)
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines == [task_line(t, report["tasks"][t]) for t in ("gsm8k", "specbench-math")]
        assert lines[0].startswith("eval gsm8k: head top-1 ") and "tokens/step chain_2 " in lines[0]


def test_the_evaluation_decodes_at_temperature_with_each_sampling_rule_seeded_alike(base):
    """eval's sampling rules: tokens/step at T=0.7 per rule and tree, for the heads and the baseline; each
    prompt is seeded alike for both, so identical heads give identical figures. An unknown rule is named."""
    model, tok = base
    heads = random_heads(HeadsConfig.for_model(model, "hydra", 2), seed=1, init="random")
    twin = random_heads(HeadsConfig.for_model(model, "hydra", 2), seed=1, init="random")
    run = dict(tasks=("gsm8k",), split="test", num_prompts=2, max_new_tokens=8, trees=("chain_2", "tree_4"))
    report = evaluate_heads(
        model, tok, heads, baseline=twin, progress=False, sampling=("sample", "typical"), **run
    )
    e = report["tasks"]["gsm8k"]
    for rule in ("sample", "typical"):
        for tree in ("chain_2", "tree_4"):
            new, old = e["sampling"][rule][tree], e["baseline"]["sampling"][rule][tree]
            assert consistent(new)
            assert (new["tokens"], new["steps"]) == (old["tokens"], old["steps"])  # seeded alike
    md = report_markdown(report)
    assert "## Mean tokens per step at T=0.7, sample acceptance" in md and "typical acceptance" in md
    with pytest.raises(ValueError, match="unknown sampling rule 'nosuch'"):
        evaluate_heads(model, tok, heads, progress=False, sampling=("nosuch",), **run)
    with pytest.raises(DataError, match="unknown sampling rule 'greedy'"):
        EvalSettings(sampling=("greedy",))


def test_the_evaluation_by_trace_replay_gives_decodings_tokens_per_step_without_decoding(base):
    """method replay: greedy tokens and steps per tree are exactly the decoded ones, for the heads and the
    baseline; lossless sampling scores both heads on the same plain samples, so identical heads give identical
    figures; no tokens/s is reported; rules a replay cannot score exactly are refused, naming the way out."""
    from scheduler_helpers import fitted_heads

    model, tok = base
    run = dict(tasks=("gsm8k",), split="test", num_prompts=3, max_new_tokens=12, trees=("chain_2", "tree_4"))
    first = encode_prompt(tok, load_prompts("gsm8k", "test", 1)[0])
    text = first + Engine(model, tok).generate(first, max_new_tokens=12).token_ids
    config = HeadsConfig.for_model(model, "hydra", 2)
    heads = fitted_heads("hydra", model, text, steps=200, config=config)  # they accept on the first prompt
    other = random_heads(config, seed=2, init="random")
    decoded = evaluate_heads(model, tok, heads, baseline=other, progress=False, **run)
    replayed = evaluate_heads(model, tok, heads, baseline=other, progress=False, method="replay", **run)
    d, r = decoded["tasks"]["gsm8k"], replayed["tasks"]["gsm8k"]
    for tree in run["trees"]:
        for side in (lambda e: e, lambda e: e["baseline"]):
            dec, rep = side(d)["speculative"][tree], side(r)["speculative"][tree]
            assert (rep["tokens"], rep["steps"]) == (dec["tokens"], dec["steps"])
            assert "tokens_per_second" not in rep
    assert r["top1"] == d["top1"]  # teacher-forced accuracy does not depend on the method
    assert max(d["speculative"][t]["tokens_per_step"] for t in run["trees"]) > 1.0  # drafts were accepted
    md = report_markdown(replayed)
    assert "by trace replay: no tokens/s" in md and "tokens/s new /" not in md
    assert "tokens/s new /" in report_markdown(decoded)
    twin = copy.deepcopy(heads)
    sampled = evaluate_heads(
        model, tok, heads, baseline=twin, progress=False, method="replay", sampling=("sample",), **run
    )["tasks"]["gsm8k"]
    for tree in run["trees"]:
        new, old = sampled["sampling"]["sample"][tree], sampled["baseline"]["sampling"]["sample"][tree]
        assert consistent(new) and (new["tokens"], new["steps"]) == (
            old["tokens"],
            old["steps"],
        )
    with pytest.raises(ValueError, match="unknown evaluation method 'nosuch': use decode or replay"):
        evaluate_heads(model, tok, heads, progress=False, method="nosuch", **run)
    with pytest.raises(ValueError, match="'typical' cannot be replayed .* use method decode"):
        evaluate_heads(model, tok, heads, progress=False, method="replay", sampling=("typical",), **run)
    with pytest.raises(DataError, match="cannot replay sampling rules gumbel .* method decode"):
        EvalSettings(method="replay", sampling=("sample", "gumbel"))


@pytest.mark.slow
def test_eval_heads_compares_with_baseline_heads_on_tasks_and_dev_categories(tmp_path, capsys):
    from conftest import save_tiny_model
    from entmtp.cli import main

    model = save_tiny_model(tmp_path / "model")
    for name, seed in (("new", 1), ("old", 2)):
        save_heads(
            random_heads(HeadsConfig.for_model(model, "hydra", 2), seed=seed, init="random"), tmp_path / name
        )
    out = tmp_path / "report"
    args = [
        "eval-heads",
        str(tmp_path / "new"),
        "--against",
        str(tmp_path / "old"),
        "--model",
        str(tmp_path / "model"),
    ]
    args += ["--tasks", "gsm8k,humaneval,specbench-rag,specbench-translation", "--num-prompts", "1"]
    args += ["--max-new-tokens", "8", "--trees", "chain_2,tree_4", "--dtype", "float32", "--out", str(out)]
    assert main([*args, "--sampling", "typical", "--no-progress"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["settings"]["sampling"] == ["typical"] and report["settings"]["dtype"] == "float32"
    assert set(report["tasks"]["gsm8k"]["baseline"]["sampling"]["typical"]) == {"chain_2", "tree_4"}
    assert report["settings"]["split"] == "test" and report["baseline"]["name"] == str(tmp_path / "old")
    for task, e in report["tasks"].items():
        for side in (e, e["baseline"]):
            assert set(side["speculative"]) == {"chain_2", "tree_4"}, task
            assert all(consistent(v) and v["tokens_per_second"] > 0 for v in side["speculative"].values())
    md = (out / "eval.md").read_text()
    assert f"## Against {tmp_path / 'old'}" in md and "tree_4 tokens/s new /" in md
    # two of the four tasks and two dev categories: each mean is labelled by the tasks it is over
    assert "**mean, humaneval + gsm8k**" in md and "four tasks" not in md
    assert "**mean, specbench-translation + specbench-rag**" in md
    assert "**min, specbench-translation + specbench-rag**" in md
    assert "Spec-Bench RAG" in md and "Against" in capsys.readouterr().out
    # bad input: an unknown task and missing heads are named
    assert main(["eval-heads", str(tmp_path / "new"), "--tasks", "nosuch"]) == 2
    assert "unknown task 'nosuch'" in capsys.readouterr().err
    assert main(["eval-heads", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval-heads", str(tmp_path / "new"), "--against", str(tmp_path / "nothing")]) == 2
    assert f"heads directory {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err


def test_eval_summary_rows_say_four_tasks_only_when_all_four_were_run():
    from entmtp.prompts import FOUR_TASKS
    from entmtp.train.evaluate import _groups

    assert _groups(dict.fromkeys(FOUR_TASKS)) == [("four tasks", list(FOUR_TASKS))]
    assert _groups(dict.fromkeys(["writing", "gsm8k"])) == [("gsm8k + writing", ["gsm8k", "writing"])]


def test_heads_refuse_data_stored_at_another_layer_and_say_how_to_make_it():
    """Heads reading the layer one below the last cannot train on data that stored the last layer, nor on that
    layer's raw state when they read it normed: the error names what each holds and the flag that makes
    matching data."""
    config = HeadsConfig(kind="hydra", num_heads=2, hidden_size=8, vocab_size=16, hidden_state_offset=1)
    data = argparse.Namespace(
        name="d", base_model="m", hidden_size=8, vocab_size=16, hidden_state_offset=0, hidden_state_norm=True
    )  # what check_data_fits reads of a DistillData
    with pytest.raises(DataError, match=r"offset 0 .* offset 1: generate data with --hidden-state-offset 1"):
        check_data_fits(data, config)
    raw = argparse.Namespace(**{**vars(data), "hidden_state_offset": 1, "hidden_state_norm": False})
    with pytest.raises(
        DataError, match=r"stores layer states raw .* through the final norm.* without --no-hidden"
    ):
        check_data_fits(raw, config)
    check_data_fits(argparse.Namespace(**{**vars(data), "hidden_state_offset": 1}), config)  # fits: no error


def test_heads_trained_on_an_earlier_layer_read_it_in_data_training_and_evaluation(base, tmp_path):
    """--hidden-state-offset 1: the data stores the normed state of the layer before the last, the new heads
    are made to read it, and the evaluation decodes with them (greedy output: plain's, checked there)."""
    model, tok = base
    gen = replace(GEN, num_prompts=6, max_new_tokens=12, hidden_state_offset=1)
    d = tmp_path / "distill"
    generate_data(
        model, tok, d, prompts=PROMPTS, settings=gen, batch_size=3, base_model="tiny", progress=False
    )
    manifest = json.loads((d / "manifest.json").read_text())["settings"]
    assert (manifest["hidden_state_offset"], manifest["hidden_state_norm"]) == (1, True)
    shard = shards_mod._read_shard(d, shards_mod.Manifest.read(d).shard_files("train")[0])
    first = shard["tokens"][: int(shard["offsets"][1])].tolist()
    with torch.no_grad():
        out = model.get_decoder()(input_ids=torch.tensor([first]), output_hidden_states=True)
    want = model.get_decoder().norm(out.hidden_states[-2])[0].to(shard["hidden"].dtype)
    torch.testing.assert_close(shard["hidden"][: len(first)], want, atol=0.02, rtol=0.02)
    summary = train_heads(
        "hydra",
        tmp_path / "heads",
        base=(model, tok),
        model="tiny",
        distill_dir=d,
        stages="train,eval",
        train_settings=replace(FAST, steps=2),
        heads_settings=HeadsSettings(num_heads=2),
        eval_settings=EvalSettings(prompts=1, max_new_tokens=6, tasks=("gsm8k",), trees=("tree_4",)),
        progress=False,
    )
    heads = load_heads(tmp_path / "heads")
    assert (heads.config.hidden_state_offset, heads.config.hidden_state_norm) == (1, True)
    assert consistent(summary["eval"]["tasks"]["gsm8k"]["speculative"]["tree_4"])


def test_init_heads_from_the_last_layer_continue_on_data_of_an_earlier_layer_and_read_it(base, tmp_path):
    """--init heads trained on the last layer, on data that stores an earlier layer: they start from their
    weights (a warm start) and read the data's layer, as new heads would; grown heads too. Without the move
    the trainer would refuse the data."""
    model, tok = base
    d = tmp_path / "distill"
    gen = replace(GEN, num_prompts=4, max_new_tokens=8, hidden_state_offset=1)
    generate_data(
        model, tok, d, prompts=PROMPTS, settings=gen, batch_size=4, base_model="tiny", progress=False
    )
    old = _trained_looking_heads(model, tmp_path / "old")
    still = replace(FAST, steps=2, lr=1e-9, warmup=0.0)
    kw = dict(base=base, model="tiny", distill_dir=d, stages="train", train_settings=still, progress=False)
    for name, settings in (
        ("moved", HeadsSettings(num_heads=2)),
        ("grown", HeadsSettings(num_heads=2, num_layers=2)),
    ):
        train_heads("hydra", tmp_path / name, init=tmp_path / "old", heads_settings=settings, **kw)
        new = load_heads(tmp_path / name, dtype=torch.float32)
        assert (new.config.hidden_state_offset, new.config.hidden_state_norm) == (1, True)
        kept = dict(new.named_parameters())
        for key, value in old.named_parameters():  # the old weights, up to the bf16 of saving
            torch.testing.assert_close(kept[key], value, atol=0.02, rtol=0.02)


def test_data_made_before_the_norm_setting_resumes_and_an_earlier_layers_raw_data_is_told_apart():
    """A manifest without hidden_state_norm: at offset 0 it is the same data as today's (the last layer is
    normed either way); at an offset it stored the raw state, which normed settings must not extend."""

    def manifest(**settings):
        return shards_mod.Manifest(
            base_model="m",
            hidden_size=8,
            vocab_size=16,
            settings=settings,
            prompts_sha="s",
            num_val=1,
            num_train=1,
        )

    now = asdict(GenSettings())
    old = {k: v for k, v in now.items() if k != "hidden_state_norm"}
    shards_mod._check_same_data(Path("d"), manifest(**old), manifest(**now))  # resumes: no error
    at_layer = {**now, "hidden_state_offset": 1}
    old_at_layer = {k: v for k, v in at_layer.items() if k != "hidden_state_norm"}
    with pytest.raises(DataError, match=r"hidden_state_norm: False there, True now"):
        shards_mod._check_same_data(Path("d"), manifest(**old_at_layer), manifest(**at_layer))


def test_the_layer_flags_set_the_data_settings():
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(
        ["--kind", "hydra", "--out", "o", "--hidden-state-offset", "3", "--no-hidden-state-norm"]
    )
    gen = train_settings_from_args(args)["gen_settings"]
    assert (gen.hidden_state_offset, gen.hidden_state_norm) == (3, False)


@pytest.mark.slow
def test_the_documented_quick_start_trains_on_a_fresh_clone(tmp_path, monkeypatch, capsys):
    """`entmtp train-heads --kind hydra --out runs/hydra` (docs/training-heads.md) as written, run from a folder
    with nothing beside it (no ../shared/data, no data/): the shipped prompts are its data. Here on a tiny
    model, for a few prompts and steps."""
    from conftest import save_tiny_model
    from entmtp.cli import main
    from entmtp.train.prompt_sources import load_training_prompts, shipped_dir

    save_tiny_model(tmp_path / "model")
    work = tmp_path / "clone"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["train-heads", "--kind", "hydra", "--out", "runs/hydra", "--model", str(tmp_path / "model")]
    args += ["--stages", "gen,train", "--num-prompts", "6", "--max-new-tokens", "8", "--steps", "3"]
    args += ["--dtype", "float32", "--no-progress"]
    assert main(args) == 0
    assert (work / "runs" / "hydra" / "config.json").is_file()
    manifest = json.loads(next((work / "runs" / "hydra").rglob("manifest.json")).read_text())
    assert manifest, "no data manifest: the generation stage made nothing"
    prompts, sources = load_training_prompts("shipped", with_sources=True)
    assert len(prompts) == 24735 and "train.jsonl" in sources  # GSM8K's training split, not its test
    assert (shipped_dir() / "PROVENANCE.md").is_file()


def test_a_train_job_is_one_object_and_keywords_change_its_fields(tmp_path, monkeypatch):
    """`train_heads(kind, out, job, **fields)`: the job's fields, with the keywords on top; a field it does
    not have is refused by name before anything runs."""
    from entmtp.train import pipeline

    seen = {}
    monkeypatch.setattr(pipeline, "_check_inputs", lambda *a: seen.setdefault("inputs", a))
    monkeypatch.setattr(pipeline, "_load_base", lambda *a: pytest.fail("nothing loads past the checks"))
    monkeypatch.setattr(pipeline, "load_training_prompts", lambda *a, **k: pytest.fail("no prompts read"))
    job = pipeline.TrainJob(stages="train", resume=True, train_time_limit=5.0)
    with pytest.raises(pytest.fail.Exception, match="nothing loads"):
        pipeline.train_heads("medusa", tmp_path, job, overwrite=True)
    stages, out, distill, resume, overwrite, gen_limit, train_limit = seen["inputs"]
    assert (stages, resume, overwrite, train_limit) == (("train",), True, True, 5.0)
    assert distill == tmp_path / "distill"  # the default: OUT/distill
    with pytest.raises(TypeError, match="stage"):
        pipeline.train_heads("medusa", tmp_path, stage="train")
