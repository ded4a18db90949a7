"""CLI contract: `entmtp generate ... --json`, `entmtp trees`, and errors as messages (exit 2)."""

from __future__ import annotations

import json

import pytest

from entmtp.cli import main
from entmtp.costs import CostCurve
from entmtp.machine import record


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


def test_bad_entmtp_gguf_path_is_named(monkeypatch, tmp_path):
    from entmtp.errors import EntMTPError
    from entmtp.model import embedded_gguf

    monkeypatch.setenv("ENTMTP_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(EntMTPError, match="missing.gguf is not a file"):
        embedded_gguf()


def test_a_prediction_file_that_cannot_be_read_is_named_before_loading_anything(tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for name, why in (("missing.txt", "FileNotFoundError"), ("latin1.txt", "UnicodeDecodeError")):
        assert main(["generate", "Hi", "--prediction", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert f"--prediction {tmp_path / name}: cannot read it ({why}): give a UTF-8 text file" in err


def test_calibrate_argument_errors_come_before_loading_anything(capsys):
    assert main(["calibrate", "--latency-only"]) == 2
    assert "--latency-only updates an existing profile: pass it with --profile" in capsys.readouterr().err
    assert main(["calibrate", "--retrace"]) == 2
    assert "--retrace updates an existing profile: pass it with --profile" in capsys.readouterr().err
    assert main(["calibrate", "--retune", "--retrace", "--profile", "p.json"]) == 2
    assert "--retune and --retrace are separate runs: pass one of them" in capsys.readouterr().err
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
    assert "sample: P(accepted >= depth) on held-out positions" in printed
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
    assert set(json.loads(capsys.readouterr().out)["trees"]) <= typical_bank  # its rule's section at T > 0
    assert main([*sampled, "--temperature", "0.7", "--seed", "1"]) == 0  # auto: lossless sampling
    sample_bank = set(json.loads(out.read_text())["modes"]["sample"]["bank"])
    assert set(json.loads(capsys.readouterr().out)["trees"]) <= sample_bank
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
    # the run's pictures: the profile's frontiers and one generation's step log, linked from the report
    assert data["step_log"]["config"] == "medusa/static" and data["step_log"]["steps"]
    assert (bench / "steps.png").read_bytes()[:4] == b"\x89PNG"
    frontier = f"frontier-medusa-{out.stem}.png"  # frontier-HEADS-PROFILE.png
    assert (bench / frontier).read_bytes()[:4] == b"\x89PNG"
    report = (bench / "report.md").read_text()
    assert f"({frontier})" in report and "(steps.png)" in report
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
    assert set(after["modes"]) == {"greedy", "sample", "typical"}  # the T=0.7 sections: kept, re-derived
    assert (
        main(["calibrate", "--heads", "medusa", "--retune", "--profile", str(out), "--dtype", "float32"]) == 0
    )
    retuned = json.loads(out.read_text())
    assert retuned["latency"] == after["latency"] and retuned["modes"]["typical"]["traces"]


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
    assert meta["machine"] == record("cpu")  # the CPU, its kernel flags, cores, threads and versions
    assert CostCurve.from_step_costs(out).machine == meta["machine"]  # a curve read from it names it too
    assert "the floor of a step that reads every weight once" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv", "graphs"], "--kv graphs needs a CUDA device"),
        (["--kv", "dynamic,paged"], "unknown --kv mode 'paged'"),
        (["--random-model", "llama-70b"], "neither a shape (smollm2-135m, llama-7b) nor a config.json"),
        (["--random-model", "smollm2-135m", "--model", "x"], "either --model or --random-model, not both"),
        (["--rounds", "0"], "--past, --steps and --rounds must be >= 1"),
        (
            ["--random-model", "smollm2-135m", "--backend", "llama-cpp"],
            "--random-model builds a transformers",
        ),
        (
            ["--backend", "llama-cpp", "--kv", "dynamic"],
            "--kv is transformers' cache: llama-cpp keeps its own",
        ),
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
