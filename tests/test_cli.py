"""CLI contract: `entmtp generate ... --json`, `entmtp trees`, and errors as messages (exit 2)."""

from __future__ import annotations

import json

import pytest

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
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--heads",
        "hydra",
        "--trees",
        "chain_2,tree_4",
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
    data = json.loads(out.read_text())
    rows = data["summary"]["gsm8k"]
    assert set(rows) == {"plain", "hydra/chain_2", "hydra/tree_4"} and rows["plain"]["speedup"] == 1.0
    assert rows["plain"]["tokens_per_step"] == 1.0 and rows["hydra/tree_4"]["tokens_per_step"] >= 1.0
    assert data["mismatches"] == []  # float32: speculative output equals plain output


@pytest.mark.slow
def test_profile_writes_phase_breakdown(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert (
        main(["profile", "--heads", "medusa", "--trees", "chain_1,tree_4", "--steps", "3", "--out", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"plain", "chain_1", "tree_4"}
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
