"""`entmtp bench` end to end on a tiny random model: every task, every kind of method, every output file."""

from __future__ import annotations

import json

import pytest

from conftest import save_tiny_model
from entmtp.cli import main
from entmtp.heads import HeadsConfig, random_heads, save_heads
from entmtp.prompts import TASKS


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random model saved with the embedded tokenizer, random Hydra heads for it, and a profile
    calibrated on it in seconds."""
    root = tmp_path_factory.mktemp("tiny")
    model_dir, heads_dir = root / "model", root / "heads"
    save_heads(random_heads(HeadsConfig.for_model(save_tiny_model(model_dir), "hydra", 4), seed=1), heads_dir)
    calibrate = ["calibrate", "--model", str(model_dir), "--heads", str(heads_dir)]
    calibrate += ["--num-prompts", "4", "--max-new-tokens", "12", "--greedy-only", "--latency-prompts", "1"]
    calibrate += ["--latency-tokens", "6", "--latency-repeats", "1", "--out", str(root / "profile.json")]
    assert main([*calibrate, "--dtype", "float32", "--no-progress"]) == 0
    return root


def test_bench_on_a_tiny_model_runs_every_task_and_writes_json_markdown_and_plots(tiny_dir, capsys):
    out = tiny_dir / "bench"
    heads = str(tiny_dir / "heads")
    args = ["bench", "--model", str(tiny_dir / "model"), "--heads", heads, "--tasks", ",".join(TASKS)]
    args += ["--trees", "mc_sim_7b_63,tree_8+lookup", "--policies", "static,cost,dynamic+lookup"]
    args += ["--profile", str(tiny_dir / "profile.json"), "--peers", "hf-generate,hf-prompt-lookup,llama-cpp"]
    args += ["--lookup-only", "adaptive", "--replay", "--num-prompts", "2", "--max-new-tokens", "12"]
    assert main([*args, "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "skipping peer llama-cpp" in printed  # it plays the embedded GGUF, not this model

    data = json.loads((out / "results.json").read_text())
    methods = {"plain", "hf-generate", "hf-prompt-lookup", "lookup"}
    methods |= {f"heads/{x}" for x in ("mc_sim_7b_63", "tree_8+lookup", "static", "cost", "dynamic+lookup")}
    assert set(data["summary"]) == set(TASKS)
    for task, rows in data["summary"].items():
        assert set(rows) == methods, task
        assert rows["plain"]["speedup"] == 1.0 and rows["plain"]["prompts"] == 2
        for name, r in rows.items():
            assert name == "plain" or r["identical_to_plain"] == 1.0, (task, name)  # float32: lossless
            assert r["tokens_per_second"] > 0 and 0 <= r["lookup_share"] <= 1
            lo, hi = r["speedup_ci95"]
            assert lo <= r["speedup_mean_of_ratios"] <= hi
        assert set(data["replays"][task]["heads"]) >= {"static", "cost", "dynamic+lookup", "oracle"}
    assert data["mismatches"] == []
    assert data["meta"]["command"].startswith("entmtp bench") and data["meta"]["commit"]

    report = (out / "report.md").read_text()
    images = ["speedup.png", "trace.png", "frontier-heads-profile.png"]
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in report
    for task in TASKS:
        assert TASKS[task][1] in report
    assert "| decode tokens/s | choose ms | trees | identical |" in report
    assert "| heads/mc_sim_7b_63 |" in report and "mc_sim_7b_63 100%" in report  # its tree's share of steps
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.json", "report.md", *images])
