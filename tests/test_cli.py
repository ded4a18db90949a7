"""CLI contract: `entmtp generate ... --json`, `entmtp trees`, and errors as messages (exit 2)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from entmtp.cli import main


def test_trees_lists_named_trees_with_counts(capsys):
    assert main(["trees"]) == 0
    out = capsys.readouterr().out
    assert "mc_sim_7b_63" in out and "10/28/23/2" in out and "chain_5" in out


@pytest.mark.slow
def test_generate_json_contract(capsys):
    code = main(
        [
            "generate",
            "What is 2+2?",
            "--heads",
            "none",
            "--max-new-tokens",
            "8",
            "--json",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "token_ids", "num_steps", "tokens_per_step", "trees", "seconds", "tokens_per_second"):
        assert key in out
    assert len(out["token_ids"]) <= 8 and out["num_steps"] == len(out["tokens_per_step"]) == len(out["trees"])
    assert all(t == 1 for t in out["tokens_per_step"])


@pytest.mark.slow
def test_generate_streams_text_and_stats_line(capsys):
    assert main(["generate", "Say hello.", "--heads", "none", "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tokens/step" in captured.err and "tokens/s" in captured.err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "", "--heads", "none"], "prompt is empty"),
        (["generate", "hi", "--heads", "none", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["generate", "hi", "--heads", "none", "--max-new-tokens", "100000"], "context window"),
        (["generate", "hi", "--heads", "/nonexistent/heads"], "/nonexistent/heads"),
        (["generate", "hi", "--heads", "none", "--dtype", "float32", "--temperature", "-1"], "temperature"),
    ],
)
def test_generate_errors_are_clear(capsys, args, message):
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench"
    args = [
        "bench",
        "--heads",
        "hydra",
        "--trees",
        "chain_2,tree_4",
        "--policies",
        "",
        "--peers",
        "",
        "--lookup-only",
        "",
        "--tasks",
        "gsm8k",
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "12",
        "--dtype",
        "float32",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "hydra/tree_4" in printed and "speedup" in printed
    data = json.loads((out / "results.json").read_text())
    rows = data["summary"]["gsm8k"]
    assert set(rows) == {"plain", "hydra/chain_2", "hydra/tree_4"} and rows["plain"]["speedup"] == 1.0
    assert rows["plain"]["tokens_per_step"] == 1.0 and rows["hydra/tree_4"]["tokens_per_step"] >= 1.0
    assert data["mismatches"] == []  # float32: speculative output equals plain output


@pytest.mark.slow
def test_step_costs_writes_phase_breakdown_and_answers_to_its_old_name(tmp_path, capsys):
    out = tmp_path / "costs.json"
    argv = ["--heads", "medusa", "--trees", "chain_1,tree_4", "--steps", "3", "--out", str(out)]
    assert main(["step-costs", *argv]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"plain", "chain_1", "tree_4"}
    assert "is now `entmtp step-costs`" not in capsys.readouterr().err
    assert main(["profile", *argv[:-4], "--steps", "1", "--out", str(out)]) == 0  # the old name still works
    assert "`entmtp profile` is now `entmtp step-costs`" in capsys.readouterr().err
    for r in rows.values():
        assert r["total"] >= r["verify"] > 0 and r["overhead"] >= 0
    assert rows["tree_4"]["nodes"] == 4 and rows["plain"]["tokens_per_step"] == 1.0


def test_bench_rejects_unknown_task(capsys):
    assert main(["bench", "--tasks", "nosuchtask", "--heads", "none"]) == 2
    assert "unknown task 'nosuchtask'" in capsys.readouterr().err


def test_bad_entmtp_gguf_path_is_named(monkeypatch, tmp_path):
    from entmtp.errors import EntMTPError
    from entmtp.model import embedded_gguf

    monkeypatch.setenv("ENTMTP_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(EntMTPError, match="missing.gguf is not a file"):
        embedded_gguf()


def test_calibrate_argument_errors_come_before_loading_anything(capsys):
    assert main(["calibrate", "--latency-only"]) == 2
    assert "--latency-only updates an existing profile: pass it with --profile" in capsys.readouterr().err
    assert main(["calibrate", "--task", "poetry"]) == 2
    assert "unknown task 'poetry'" in capsys.readouterr().err
    assert main(["calibrate", "--task", "gsm8k", "--num-prompts", "50"]) == 2
    assert "calibration split holds 20 prompts" in capsys.readouterr().err
    assert main(["calibrate", "--latency-only", "--profile", "/nonexistent/p.json"]) == 2
    assert "profile /nonexistent/p.json does not exist" in capsys.readouterr().err


def test_prompt_files_are_validated(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    assert main(["calibrate", "--task", str(bad)]) == 2
    assert "line 2 has no non-empty 'prompt' string or 'turns' list" in capsys.readouterr().err
    assert main(["calibrate", "--task", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--policy", "cost", "--profile", "/nonexistent/p.json"],
            "profile /nonexistent/p.json does not exist",
        ),
        (
            ["--policy", "dynamic", "--profile", "writing", "--heads", "src/entmtp/assets/heads/hydra"],
            "shipped profiles exist only for the shipped heads",
        ),
    ],
)
def test_generate_policy_errors_are_clear(capsys, args, message):
    code = main(["generate", "hi", "--max-new-tokens", "4", *args])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_calibrate_then_generate_with_every_policy_then_latency_only(tmp_path, capsys):
    out = tmp_path / "p.json"
    small = ["--latency-prompts", "1", "--latency-tokens", "6", "--latency-repeats", "1", "--no-progress"]
    args = [
        "calibrate",
        "--heads",
        "medusa",
        "--task",
        "gsm8k",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
    ]
    assert main([*args, *small, "--dtype", "float32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EntMTP*" in printed and "oracle" in printed and "typical: recommended policy" in printed
    assert out.exists() and out.with_suffix(".png").exists() and (tmp_path / "p.traces.safetensors").exists()
    plain = ["generate", "What is 7 * 6?", "--max-new-tokens", "16", "--json", "--dtype", "float32"]
    assert main([*plain, "--heads", "none"]) == 0
    ref = json.loads(capsys.readouterr().out)["token_ids"]
    for policy in ("static", "binary", "ladder", "cost", "dynamic"):
        assert main([*plain, "--heads", "medusa", "--profile", str(out), "--policy", policy]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == ref, policy
        assert len(got["trees"]) == len(got["signals"]) == got["num_steps"]
    sampled = [*plain, "--heads", "medusa", "--profile", str(out), "--policy", "cost", "--no-lookup"]
    assert main([*sampled, "--temperature", "0.7", "--acceptance", "typical", "--seed", "1"]) == 0
    typical_bank = set(json.loads(out.read_text())["modes"]["typical"]["bank"])
    assert set(json.loads(capsys.readouterr().out)["trees"]) <= typical_bank  # T > 0 uses the typical section
    bench = tmp_path / "bench"
    args = [
        "bench",
        "--heads",
        "medusa",
        "--trees",
        "tree_4",
        "--policies",
        "static,binary,cost,dynamic",
        "--replay",
    ]
    more = ["--profile", str(out), "--tasks", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "12"]
    more += ["--peers", "", "--lookup-only", ""]
    assert main([*args, *more, "--dtype", "float32", "--out", str(bench), "--no-progress"]) == 0
    data = json.loads((bench / "results.json").read_text())
    rows = data["summary"]["gsm8k"]
    assert set(rows) == {
        "plain",
        "medusa/tree_4",
        "medusa/static",
        "medusa/binary",
        "medusa/cost",
        "medusa/dynamic",
    }
    assert data["mismatches"] == []  # float32: every policy's output equals plain decoding
    assert rows["medusa/dynamic"]["choose_ms_per_step"] > 0 and rows["plain"]["choose_ms_per_step"] >= 0
    rep = data["replays"]["gsm8k"]["medusa"]
    assert rep["oracle"]["tokens_per_second"] >= max(
        rep[p]["tokens_per_second"] for p in ("static", "binary", "cost")
    )
    assert "replayed" in capsys.readouterr().out
    # the run's pictures: the profile's frontiers and one generation's trace, linked from the report
    assert data["trace"]["config"] == "medusa/static" and data["trace"]["steps"]
    assert (bench / "trace.png").read_bytes()[:4] == b"\x89PNG"
    frontier = f"frontier-medusa-{out.stem}.png"  # frontier-HEADS-PROFILE.png
    assert (bench / frontier).read_bytes()[:4] == b"\x89PNG"
    report = (bench / "report.md").read_text()
    assert f"({frontier})" in report and "(trace.png)" in report
    assert data["meta"]["command"].startswith("entmtp bench") and data["meta"]["versions"]["torch"]
    before = json.loads(out.read_text())
    assert (
        main(
            [
                "calibrate",
                "--heads",
                "medusa",
                "--latency-only",
                "--profile",
                str(out),
                *small,
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    after = json.loads(out.read_text())
    assert after["modes"]["greedy"]["growth"] == before["modes"]["greedy"]["growth"]
    assert after["traces_sha256"] == before["traces_sha256"]
    assert set(after["modes"]) == {"greedy", "typical"}  # the T=0.7 section is kept and re-derived
    assert (
        main(["calibrate", "--heads", "medusa", "--retune", "--profile", str(out), "--dtype", "float32"]) == 0
    )
    retuned = json.loads(out.read_text())
    assert retuned["latency"] == after["latency"] and retuned["modes"]["typical"]["traces"]


def test_bench_items_can_name_one_heads():
    from entmtp.bench import _for_heads

    spec = "mc_sim_7b_63,hydra:tree_4,medusa:chain_2"
    assert _for_heads(spec, "hydra") == ["mc_sim_7b_63", "tree_4"]
    assert _for_heads(spec, "medusa") == ["mc_sim_7b_63", "chain_2"]
    assert _for_heads("", "hydra") == []


REPEAT = "Repeat this list exactly, twice: red, green, blue, yellow, purple, orange."


def _json_ids(capsys, args):
    assert main(["generate", REPEAT, "--max-new-tokens", "40", "--json", "--dtype", "float32", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_generate_with_lookup_equals_plain_greedy(tmp_path, capsys):
    plain = _json_ids(capsys, ["--heads", "none"])["token_ids"]
    lookup_tree = tmp_path / "copy3.json"
    lookup_tree.write_text(json.dumps([["L0"], ["L0", "L0"], ["L0", "L0", "L0"]]))
    hybrid_tree = tmp_path / "hybrid.json"
    hybrid_tree.write_text(json.dumps([[0], [1], [0, 0], [0, "L0"], ["L0"], ["L0", "L0"]]))
    runs = {
        "lookup": ["--heads", "none", "--lookup"],
        "lookup-fixed": ["--heads", "none", "--lookup", "--lookup-fixed", "--lookup-tokens", "6"],
        "lookup tree file": ["--heads", "none", "--tree", str(lookup_tree)],
        "hydra + lookup": ["--heads", "hydra", "--tree", "tree_4", "--lookup"],
        "hybrid tree file": ["--heads", "hydra", "--tree", str(hybrid_tree)],
        "scheduled + lookup": ["--heads", "hydra", "--policy", "dynamic", "--lookup"],
    }
    for name, args in runs.items():
        out = _json_ids(capsys, args)
        assert out["token_ids"] == plain, name
    assert sum(out["lookup_accepted"]) > 0 and out["num_steps"] < len(plain) - 1  # it copied the list


@pytest.mark.parametrize(
    "content, message",
    [
        ('[["L0", 0]]', "head rank after a lookup rank"),
        ('[["Lx"]]', 'a lookup rank is written "L" and a number'),
        ('[[0], [0, "L0"]', "is not valid JSON"),
    ],
)
def test_generate_rejects_malformed_hybrid_tree_files(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["generate", "hi", "--heads", "hydra", "--tree", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and "bad.json" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--peers", "vllm"], "unknown peer 'vllm'"),
        (["--lookup-only", "sometimes"], "unknown --lookup-only variant 'sometimes'"),
        (["--heads", "hydra", "--policies", "hydra:fancy+lookup"], "unknown policy 'fancy+lookup'"),
        (["--heads", "hydra", "--trees", "nosuch"], "--trees: unknown tree 'nosuch'"),
        (["--heads", "hydra", "--trees", "hydr:tree_8"], "--trees item 'hydr:tree_8' is for heads 'hydr'"),
        (["--heads", "hydr"], "unknown heads 'hydr' in --heads"),
    ],
)
def test_bench_rejects_unknown_peers_and_lookup_variants(capsys, args, message):
    assert main(["bench", "--tasks", "gsm8k", "--heads", "none", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_peers_lookup_and_hybrids(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--heads", "hydra", "--trees", "tree_4,tree_4+lookup", "--policies", "static+lookup"]
    args += ["--peers", "hf-generate,hf-prompt-lookup,llama-cpp", "--lookup-only", "adaptive,fixed"]
    args += ["--tasks", "specbench-summarization", "--num-prompts", "1", "--max-new-tokens", "24"]
    args += ["--dtype", "float32", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "lookup share" in printed
    data = json.loads((out / "results.json").read_text())
    rows = data["summary"]["specbench-summarization"]
    expected = {"plain", "hf-generate", "hf-prompt-lookup", "lookup", "lookup-fixed", "hydra/tree_4"}
    expected |= {"hydra/tree_4+lookup", "hydra/static+lookup"}
    try:
        import llama_cpp  # noqa: F401

        expected.add("llama-cpp")
    except ImportError:
        assert "skipping peer llama-cpp" in printed and "pip install llama-cpp-python" in printed
    assert set(rows) == expected
    assert data["mismatches"] == []  # float32: every method, peers included, gives plain greedy's output


@pytest.mark.slow
def test_bench_own_prompt_file_identity_and_ctrl_c_keeps_what_finished(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "mine.jsonl"
    lines = [{"prompt": "Repeat: a b c a b c"}, {"turns": ["Say hi."]}, {"prompt": "Count to 3."}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "b"
    args = ["bench", "--heads", "none", "--lookup-only", "adaptive", "--peers", "", "--prompts", str(prompts)]
    args += [
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--dtype",
        "float32",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    data = json.loads((out / "results.json").read_text())
    row = data["summary"]["mine"]["lookup"]
    assert row["prompts"] == 3 and row["identical_to_plain"] == 1.0 and row["first_differences"] == []
    lo, hi = row["speedup_ci95"]
    assert lo <= row["speedup_mean_of_ratios"] <= hi
    report = (out / "report.md").read_text()
    assert "## mine (3 prompts)" in report and "| lookup |" in report and "100%" in report
    assert "![speedup over plain decoding per task and method](speedup.png)" in report
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert data["meta"]["prompts_file"] == str(prompts) and data["meta"]["interrupted"] is False

    from entmtp.engine import Engine

    calls = {"n": 0}
    original = Engine.generate

    def interrupting(self, *a, **k):  # warm-up (2 calls), prompt 0 (2 calls), then Ctrl-C in prompt 1
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(Engine, "generate", interrupting)
    assert main(args) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["interrupted"] is True
    assert {name: r["prompts"] for name, r in data["summary"]["mine"].items()} == {"plain": 1, "lookup": 1}
    assert "interrupted" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--heads", "none", "--lookup", "--lookup-tokens", "0"], "tokens >= 1"),
        (["generate", "hi", "--heads", "none", "--lookup", "--lookup-ngram", "0"], "max_ngram >= 1"),
        (
            ["generate", "hi", "--heads", "none", "--lookup", "--lookup-node-cost", "-1"],
            "node_cost must be >= 0",
        ),
        (["bench", "--heads", "none", "--lookup-only", "adaptive", "--lookup-tokens", "0"], "tokens >= 1"),
    ],
)
def test_bad_lookup_settings_fail_before_loading_a_model(capsys, monkeypatch, args, message):
    import entmtp.model

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(entmtp.model, "load_model", no_loading)
    assert main(args) == 2
    assert message in capsys.readouterr().err


TINY_CONFIG = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def test_step_costs_random_model_from_a_config_compares_cache_paths(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "p.json"
    argv = ["step-costs", "--random-model", str(config), "--kv", "dynamic,kv", "--trees", "chain_1,tree_4"]
    assert main([*argv, "--steps", "2", "--rounds", "2", "--past", "20", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["rows"]) == {
        f"{t}@{m}" for t in ("plain", "chain_1", "tree_4") for m in ("dynamic", "kv")
    }
    assert all(r["steps"] == 4 for r in data["rows"].values())  # 2 rounds x 2 steps
    meta = data["meta"]
    assert meta["prompt_tokens"] == 20 and meta["weight_bytes"] > 0 and meta["floor_ms"] > 0
    assert "the floor of a step that reads every weight once" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv", "graphs"], "--kv graphs needs a CUDA device"),
        (["--kv", "dynamic,paged"], "unknown --kv mode 'paged'"),
        (["--random-model", "llama-70b"], "neither a shape (smollm2-135m, llama-7b) nor a config.json"),
        (["--random-model", "smollm2-135m", "--model", "x"], "either --model or --random-model, not both"),
        (["--rounds", "0"], "--past, --steps and --rounds must be >= 1"),
    ],
)
def test_step_costs_bad_options_are_named(argv, message, capsys):
    assert main(["step-costs", *argv]) == 2
    assert message in capsys.readouterr().err


def test_step_costs_random_model_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["step-costs", "--random-model", str(bad)]) == 2
    assert "not a JSON config" in capsys.readouterr().err
    bad.write_text(json.dumps({"hidden_size": 8}))
    assert main(["step-costs", "--random-model", str(bad)]) == 2
    assert "needs a model_type" in capsys.readouterr().err


def _rec(tokens, seconds, steps=0, nll=None):
    r = {"prompt": 0, "tokens": tokens, "seconds": seconds, "steps": steps, "step_seconds": seconds * 0.9}
    r |= {"prefill_seconds": 0.0, "tokens_per_step": 1.0, "choose_seconds": 0.0, "probe_seconds": 0.0}
    r |= {"trees": {}, "lookup_tokens": 0}
    if nll is not None:
        r |= {"nll": nll, "nll_tokens": tokens}
    return r


def test_bench_metrics_on_hand_made_logs():
    from entmtp.bench import _summarise
    from entmtp.report import speedup_interval

    plain = [_rec(100, 10.0, 99), _rec(100, 1.0, 99)]  # 10 and 100 tokens/s
    fast = [_rec(100, 5.0, 50), _rec(100, 1.0, 50)]  # 2x on the first prompt, 1x on the second
    s_plain, s_fast = _summarise(plain), _summarise(fast)
    # ratio of sums: 200 tokens / 6 s against 200 / 11 s; mean of per-prompt ratios: (2 + 1) / 2
    assert s_fast["tokens_per_second"] / s_plain["tokens_per_second"] == pytest.approx(11 / 6)
    ci = speedup_interval(fast, plain)
    assert ci["speedup_mean_of_ratios"] == pytest.approx(1.5)
    lo, hi = ci["speedup_ci95"]
    assert 1.0 <= lo <= 1.5 <= hi <= 2.0
    assert speedup_interval(fast[:1], plain[:1])["speedup_ci95"] == [pytest.approx(2.0)] * 2
    assert s_fast["tokens_per_step"] == pytest.approx((200 - 2) / 100)  # the prefill's token has no step
    assert "perplexity" not in s_fast
    sampled = _summarise([_rec(10, 1.0, 5, nll=10 * 0.5), _rec(30, 1.0, 5, nll=30 * 1.5)])
    assert sampled["perplexity"] == pytest.approx(math.exp((5 + 45) / 40))


def test_continuation_nll_matches_the_base_models_log_probs():
    from conftest import tiny_model
    from entmtp.bench import _nll

    model = tiny_model("llama", seed=1)
    ids, out = [5, 6, 7], [8, 9]
    got = _nll(model, ids, out)
    logp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0].float(), dim=-1)
    want = -(logp[2, 8] + logp[3, 9])
    assert got["nll_tokens"] == 2 and got["nll"] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "RESULTS/x.json"], "give a directory"),
        (["--num-prompts", "0"], "--num-prompts and --max-new-tokens must be >= 1"),
    ],
)
def test_bench_bad_output_and_sizes_are_named_before_loading(extra, message, capsys):
    assert main(["bench", "--tasks", "gsm8k", "--heads", "none", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bench_output_under_a_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["bench", "--tasks", "gsm8k", "--heads", "none", "--out", str(blocker)]) == 2
    assert "is a file: give a directory" in capsys.readouterr().err
    assert main(["bench", "--tasks", "gsm8k", "--heads", "none", "--out", str(blocker / "sub")]) == 2
    assert "cannot be written" in capsys.readouterr().err
    assert not (blocker.parent / "sub").exists()


def test_quick_sizes_and_explicit_ones_win():
    import argparse

    from entmtp.bench import _resolve_sizes

    quick = argparse.Namespace(quick=True, num_prompts=None, max_new_tokens=None, trees="", peers=None)
    _resolve_sizes(quick)
    assert (quick.num_prompts, quick.max_new_tokens) == (2, 48)
    assert quick.trees == "" and quick.peers == "hf-prompt-lookup"  # an explicit "" (no trees) wins
    assert quick.policies == "hydra:static,hydra:dynamic,hydra:dynamic+lookup"
    full = argparse.Namespace(quick=False, num_prompts=None, max_new_tokens=32, policies="static")
    _resolve_sizes(full)
    assert (full.num_prompts, full.max_new_tokens, full.policies) == (10, 32, "static")
    assert full.trees == "mc_sim_7b_63,hydra:tree_8" and full.peers == "hf-generate,hf-prompt-lookup"


@pytest.mark.slow
def test_bench_quick_sampled_reports_perplexity(tmp_path, capsys):
    out = tmp_path / "q"
    args = [
        "bench",
        "--quick",
        "--heads",
        "none",
        "--lookup-only",
        "adaptive",
        "--peers",
        "",
        "--tasks",
        "gsm8k,sharegpt",
    ]
    args += ["--max-new-tokens", "8", "--temperature", "0.7", "--dtype", "float32", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    data = json.loads((out / "results.json").read_text())
    for task in ("gsm8k", "sharegpt"):
        for row in data["summary"][task].values():
            assert row["prompts"] == 2 and 1.0 <= row["perplexity"] < 1e6
    assert data["meta"]["quick"] is True and data["meta"]["max_new_tokens"] == 8
    assert "| perplexity |" in (out / "report.md").read_text() and "perplexity" in capsys.readouterr().out
