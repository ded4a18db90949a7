"""`entmtp bench` as a specification, room by room: the plan (what runs, every name checked before a model
loads), the engines (all built in one place), the records and their summary (by metrics.py), Ctrl-C, and the
whole command on a tiny random model and on the embedded one."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import replace

import pytest
import torch

from conftest import run_script, save_tiny_model, tiny_model
from entmtp.bench import (
    Measurements,
    engines,
    for_heads,
    load,
    make_plan,
    nll,
    record,
    speedup_interval,
    summarise,
    summarise_tasks,
)
from entmtp.bench.peers import _amx_differs
from entmtp.bench.plan import resolve_sizes
from entmtp.cli import build_parser, main
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.heads import HeadsConfig, random_heads, save_heads
from entmtp.machine import describe_record
from entmtp.machine import record as machine_record
from entmtp.prompts import TASKS
from entmtp.records import Result, Step


def bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


# -- the plan: what runs, checked before any model loads --------------------------------------------------------


def test_items_apply_to_every_heads_unless_prefixed_with_one():
    spec = "mc_sim_7b_63,hydra:tree_4,medusa:chain_2"
    assert for_heads(spec, "hydra") == ["mc_sim_7b_63", "tree_4"]
    assert for_heads(spec, "medusa") == ["mc_sim_7b_63", "chain_2"]
    assert for_heads("", "hydra") == []


def test_quick_and_full_runs_fill_what_the_command_line_leaves_unset():
    quick = argparse.Namespace(quick=True, num_prompts=None, max_new_tokens=None, trees="", peers=None)
    resolve_sizes(quick)
    assert (quick.num_prompts, quick.max_new_tokens) == (2, 48)
    assert quick.trees == "" and quick.peers == "hf-prompt-lookup"  # an explicit "" (no trees) wins
    assert quick.policies == "hydra:static,hydra:dynamic,hydra:dynamic+lookup"
    full = argparse.Namespace(quick=False, num_prompts=None, max_new_tokens=32, policies="static")
    resolve_sizes(full)
    assert (full.num_prompts, full.max_new_tokens, full.policies) == (10, 32, "static")
    assert full.trees == "mc_sim_7b_63,hydra:tree_8" and full.peers == "hf-generate,hf-prompt-lookup"


def test_a_plan_names_its_tasks_prompts_heads_and_methods(tmp_path):
    args = [
        "--tasks",
        "gsm8k,humaneval",
        "--num-prompts",
        "2",
        "--heads",
        "hydra,none",
        "--out",
        str(tmp_path),
    ]
    args += [
        "--trees",
        "tree_4,medusa:chain_2",
        "--policies",
        "dynamic+lookup-fixed",
        "--peers",
        "hf-generate",
    ]
    plan = make_plan(bench_args(*args))
    assert plan.tasks == ["gsm8k", "humaneval"] and all(len(p) == 2 for p in plan.prompts.values())
    assert plan.heads == ["hydra"] and plan.peers == ["hf-generate"] and plan.lookup_only == ["adaptive"]
    assert plan.trees("hydra") == ["tree_4"] and plan.trees("medusa") == ["tree_4", "chain_2"]
    tree, lookup = plan.split_lookup(plan.policies("hydra")[0])
    assert tree == "dynamic" and lookup is not None and not lookup.adaptive
    assert plan.split_lookup("tree_4") == ("tree_4", None)
    assert plan.out == tmp_path and not (tmp_path / "results.json").exists()  # written only at the end


def test_the_peers_load_after_every_engine_and_keep_their_place(monkeypatch):
    """In one process a llama.cpp model loaded first decoded 3-6% slower than the same file loaded after it
    (docs/results/never-slower/overhead, "load order"): the peers load once every engine of entmtp's is built,
    so whatever the order gives goes to the baselines, and still come right after plain decoding."""
    from entmtp.bench import engines as engines_mod

    built, real = [], engines_mod.engine
    monkeypatch.setattr(engines_mod, "engine", lambda *a, **k: built.append("engine") or real(*a, **k))
    peers = {"peer": object()}
    monkeypatch.setattr(engines_mod, "build_peers", lambda *a, **k: built.append("peers") or peers)
    args = ("--tasks", "gsm8k", "--heads", "none", "--lookup-only", "adaptive", "--peers", "")
    methods = engines_mod.load(make_plan(bench_args(*args, "--dtype", "float32", "--no-probe")))
    assert built == ["engine", "engine", "peers"]
    assert list(methods.static) == ["plain", "peer", "lookup"]


def test_a_prompt_file_is_one_task_named_after_it(tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {n}."}) for n in range(5)))
    plan = make_plan(bench_args("--prompts", str(prompts), "--num-prompts", "3", "--heads", "none"))
    assert plan.tasks == ["mine"] and len(plan.prompts["mine"]) == 3


def test_each_default_is_set_against_the_fastest_plain_decoding_of_its_own_backend():
    """The report's never-slower line (issue #62): a default's tokens/s over the faster plain dtype on
    transformers, or over entmtp's plain steps on llama.cpp, by the backend its plan names."""
    from entmtp.bench.report import never_slower_lines
    from entmtp.bench.summary import default_over_plain

    rows = {
        "plain": 30.0, "plain@float32": 20.0, "plain@llama-cpp": 100.0, "default": 99.0,
        "default@transformers": 45.0, "default@llama-cpp": 101.0,
    }  # fmt: skip
    summary = {"gsm8k": {k: {"tokens_per_second": v} for k, v in rows.items()}}
    plans = {
        "default": "backend: llama-cpp (measured)\nweights: Q4_1",
        "default@transformers": "backend: transformers (as asked)",
        "default@llama-cpp": "backend: llama-cpp (as asked)",
    }
    ratios = default_over_plain(summary, plans)["gsm8k"]
    assert ratios == pytest.approx({"default": 0.99, "default@transformers": 1.5, "default@llama-cpp": 1.01})
    said = never_slower_lines(summary, plans)
    assert (
        said[-1]
        == "Never slower than its backend's plain decoding on every row (>= 1.00x): no: `default` on gsm8k."
    )
    assert "| gsm8k | 0.99x | 1.01x | 1.50x |" in said


def test_edit_prompts_carry_their_code_as_the_prediction_for_every_method_but_the_baselines(tmp_path):
    """The `edits` task: a HumanEval solution, an edit request, the code as prediction (OpenAI's Predicted
    Outputs); a prompt file's `prediction` field likewise. Plain baselines and peers decode without it."""
    from entmtp.bench.run import predicted
    from entmtp.prompts import load_prompt_file, load_prompts

    edits = load_prompts("edits", "test", n=5)
    assert all(p.prediction.startswith("```python\n") and p.prediction[10:-3] in p for p in edits)
    assert len({p.split(" Reply")[0][:20] for p in edits}) == 5  # five kinds of edit in turn
    mine = tmp_path / "mine.jsonl"
    mine.write_text(
        json.dumps({"prompt": "Fix: x = 1", "prediction": "x = 2"}) + "\n" + json.dumps({"prompt": "Hi"})
    )
    with_one, without = load_prompt_file(mine)
    assert with_one.prediction == "x = 2" and not hasattr(without, "prediction")
    mine.write_text(json.dumps({"prompt": "Fix", "prediction": 3}))
    with pytest.raises(EntMTPError, match="'prediction' must be a string"):
        load_prompt_file(mine)
    assert (
        predicted("lookup@llama-cpp", True) and predicted("default", True) and predicted("heads/static", True)
    )
    assert not predicted("plain", True) and not predicted("plain@llama-cpp", True)
    assert not predicted("llama-cpp", False)  # a peer


@pytest.mark.parametrize(
    "args, message",
    [
        (["--peers", "vllm"], "unknown peer 'vllm'"),
        (["--lookup-only", "sometimes"], "unknown --lookup-only variant 'sometimes'"),
        (["--heads", "hydra", "--policies", "hydra:fancy+lookup"], "unknown policy 'fancy+lookup'"),
        (["--heads", "hydra", "--trees", "nosuch"], "--trees: unknown tree 'nosuch'"),
        (["--heads", "hydra", "--trees", "hydr:tree_8"], "--trees item 'hydr:tree_8' is for heads 'hydr'"),
        (["--heads", "hydr"], "unknown heads 'hydr' in --heads"),
        (["--out", "RESULTS/x.json"], "give a directory"),
        (["--num-prompts", "0"], "--num-prompts and --max-new-tokens must be >= 1"),
        (["--lookup-tokens", "0"], "tokens >= 1"),
    ],
)
def test_a_bad_name_or_size_is_named_by_the_plan(args, message):
    with pytest.raises(EntMTPError, match=re.escape(message)):
        make_plan(bench_args("--tasks", "gsm8k", "--heads", "none", *args))


def test_an_output_under_a_file_is_refused_and_nothing_is_created(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(EntMTPError, match="is a file: give a directory"):
        make_plan(bench_args("--tasks", "gsm8k", "--heads", "none", "--out", str(blocker)))
    with pytest.raises(EntMTPError, match="cannot be written"):
        make_plan(bench_args("--tasks", "gsm8k", "--heads", "none", "--out", str(blocker / "sub")))
    assert not (blocker.parent / "sub").exists()


# -- records and their summary ----------------------------------------------------------------------------------


def rec(tokens, seconds, steps=0, nll=None):
    """A hand-made record, as `record` writes them."""
    r = {"prompt": 0, "tokens": tokens, "seconds": seconds, "steps": steps, "step_seconds": seconds * 0.9}
    r |= {"prefill_seconds": 0.0, "tokens_per_step": 1.0, "choose_seconds": 0.0, "probe_seconds": 0.0}
    r |= {"trees": {}, "lookup_tokens": 0}
    if nll is not None:
        r |= {"nll": nll, "nll_tokens": tokens}
    return r


def test_a_record_counts_a_generations_tokens_steps_times_and_trees():
    steps = [
        Step("tree_8", 8, 2, 3, [1, 2, 3], seconds={"total": 0.5, "choose": 0.01}, lookup_accepted=1),
        Step("tree_8", 8, 0, 1, [4], seconds={"total": 0.25, "probe": 0.02}),
        Step("chain_2", 2, 1, 2, [5, 6], seconds={"total": 0.25}),
    ]
    r = record(3, Result("", [0, 1, 2, 3, 4, 5, 6], 9, steps, 1.5, 0.5, "length"))
    assert (r["prompt"], r["tokens"], r["steps"], r["seconds"], r["prefill_seconds"]) == (3, 7, 3, 1.5, 0.5)
    assert r["tokens_per_step"] == 2.0 and r["step_seconds"] == 1.0 and r["lookup_tokens"] == 1
    assert (r["choose_seconds"], r["probe_seconds"]) == (0.01, 0.02)
    assert r["trees"] == {"tree_8": 2, "chain_2": 1}


def test_summaries_pool_prompts_and_the_interval_is_of_per_prompt_speedups():
    plain = [rec(100, 10.0, 99), rec(100, 1.0, 99)]  # 10 and 100 tokens/s
    fast = [rec(100, 5.0, 50), rec(100, 1.0, 50)]  # 2x on the first prompt, 1x on the second
    s_plain, s_fast = summarise(plain), summarise(fast)
    # ratio of sums: 200 tokens / 6 s against 200 / 11 s; mean of per-prompt ratios: (2 + 1) / 2
    assert s_fast["tokens_per_second"] / s_plain["tokens_per_second"] == pytest.approx(11 / 6)
    ci = speedup_interval(fast, plain)
    assert ci["speedup_mean_of_ratios"] == pytest.approx(1.5)
    lo, hi = ci["speedup_ci95"]
    assert 1.0 <= lo <= 1.5 <= hi <= 2.0
    assert speedup_interval(fast[:1], plain[:1])["speedup_ci95"] == [pytest.approx(2.0)] * 2
    assert s_fast["tokens_per_step"] == pytest.approx((200 - 2) / 100)  # the prefill's token has no step
    assert "perplexity" not in s_fast
    sampled = summarise([rec(10, 1.0, 5, nll=10 * 0.5), rec(30, 1.0, 5, nll=30 * 1.5)])
    assert sampled["perplexity"] == pytest.approx(math.exp((5 + 45) / 40))


def test_each_task_is_summarised_against_plain_decoding_with_the_outputs_that_differ():
    runs = {
        "gsm8k": {
            "plain": [rec(10, 2.0, 9), rec(10, 2.0, 9)],
            "heads/tree_8": [rec(10, 1.0, 4), rec(10, 1.0, 4)],
            "llama-cpp": [rec(10, 4.0), rec(10, 4.0)],
        },
        "humaneval": {},  # Ctrl-C came before its first prompt finished
    }
    mismatches = [{"task": "gsm8k", "prompt": 1, "config": "heads/tree_8", "first_difference": 7}]
    summary = summarise_tasks(runs, mismatches, seed=0, greedy=True)
    assert list(summary) == ["gsm8k"]
    rows = summary["gsm8k"]
    assert rows["plain"]["speedup"] == 1.0 and rows["heads/tree_8"]["speedup"] == 2.0
    assert rows["llama-cpp"]["speedup"] == 0.5 and math.isnan(rows["llama-cpp"]["tokens_per_step"])
    assert rows["heads/tree_8"]["identical_to_plain"] == 0.5 and rows["heads/tree_8"][
        "first_differences"
    ] == [7]
    assert "identical_to_plain" not in rows["plain"] and "identical_to_plain" not in rows["llama-cpp"]
    sampled = summarise_tasks(runs, [], seed=0, greedy=False)
    assert "identical_to_plain" not in sampled["gsm8k"]["heads/tree_8"]


def test_ctrl_c_keeps_the_prompts_every_method_finished():
    measured = Measurements(
        runs={"gsm8k": {"plain": [rec(5, 1.0)] * 2, "lookup": [rec(5, 1.0)]}, "sharegpt": {}}
    )
    measured.mismatches = [
        {"task": "gsm8k", "prompt": 0, "config": "lookup", "first_difference": 3},
        {"task": "gsm8k", "prompt": 1, "config": "lookup", "first_difference": 2},
    ]
    measured.keep_finished()
    assert measured.interrupted and measured.tasks == ["gsm8k"]
    assert {name: len(rs) for name, rs in measured.runs["gsm8k"].items()} == {"plain": 1, "lookup": 1}
    assert [m["prompt"] for m in measured.mismatches] == [0]


def test_the_continuations_nll_is_the_base_models_log_probs():
    model = tiny_model("llama", seed=1)
    ids, out = [5, 6, 7], [8, 9]
    got = nll(model, ids, out)
    logp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0].float(), dim=-1)
    want = -(logp[2, 8] + logp[3, 9])
    assert got["nll_tokens"] == 2 and got["nll"] == pytest.approx(float(want), rel=1e-5)
    assert nll(model, ids, []) == {"nll": 0.0, "nll_tokens": 0}


# -- a tiny random model: the engines, then the whole command ---------------------------------------------------


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


def test_every_engine_of_a_bench_is_built_by_one_function(tiny_dir, monkeypatch):
    built = []
    original = engines.engine

    def counting(*a, **k):
        built.append(original(*a, **k))
        return built[-1]

    monkeypatch.setattr(engines, "engine", counting)
    args = [
        "--model",
        str(tiny_dir / "model"),
        "--heads",
        str(tiny_dir / "heads"),
        "--tasks",
        "gsm8k,sharegpt",
    ]
    args += [
        "--trees",
        "tree_4,tree_4+lookup",
        "--policies",
        "static,dynamic+lookup",
        "--peers",
        "hf-generate",
    ]
    args += ["--lookup-only", "adaptive,fixed", "--profile", str(tiny_dir / "profile.json"), "--no-probe"]
    methods = load(make_plan(bench_args(*args, "--dtype", "float32", "--num-prompts", "1")))
    for task in ("gsm8k", "sharegpt"):
        ran = methods.for_task(task)
        assert list(ran) == [
            "plain", "hf-generate", "lookup", "lookup-fixed", "heads/tree_4", "heads/tree_4+lookup",
            "heads/static", "heads/dynamic+lookup",
        ]  # fmt: skip
        assert all(any(e is b for b in built) for e in ran.values() if isinstance(e, Engine))
        assert sum(isinstance(e, Engine) for e in ran.values()) == len(ran) - 1  # all but the peer
    assert methods.count == 8 and methods.logged == "heads/static"


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.7", "--acceptance", "typical")])
def test_a_bench_method_runs_the_policies_generate_builds_for_its_spec(tiny_dir, sampling):
    """`heads/dynamic+lookup` and a static tree are composed as `entmtp generate` composes them (build): the
    same policy per acceptance rule (under typical acceptance without lookup drafts, as generate runs it), on
    the bench's one loaded model."""
    from entmtp.build import EngineSpec, build
    from entmtp.lookup import Lookup

    model, heads, profile = str(tiny_dir / "model"), str(tiny_dir / "heads"), str(tiny_dir / "profile.json")
    args = ["--model", model, "--heads", heads, "--tasks", "gsm8k", "--trees", "tree_4+lookup", "--peers", ""]
    args += ["--policies", "dynamic+lookup", "--lookup-only", "", "--profile", profile, "--no-probe"]
    methods = load(make_plan(bench_args(*args, *sampling, "--dtype", "float32", "--num-prompts", "1")))
    ran = methods.for_task("gsm8k")
    temperature, acceptance = (0.7, "typical") if sampling else (0.0, "auto")
    spec = EngineSpec(model=model, heads=heads, dtype="float32", lookup=Lookup(), probe=False)
    spec = replace(spec, temperature=temperature, acceptance=acceptance)
    dynamic = dict(policy="dynamic", profile=profile)
    for method, asked in (("dynamic+lookup", dynamic), ("tree_4+lookup", dict(tree="tree_4"))):
        generate = build(replace(spec, **asked), log=lambda m: None).engine
        bench = ran[f"heads/{method}"]
        assert bench.policy == generate.policy and bench.policies == generate.policies, method
        assert bench.model is methods.model and bench.heads is methods.heads[heads]


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
    # plain decoding's own runs are not counted among those compared with it: 8 other methods, 2 prompts a task
    assert f"0 of {8 * 2 * len(TASKS)} runs of the other methods differ from plain decoding" in printed

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
        said = data["replays"][task]["heads"]["cost"]["charges"]  # where each charge came from
        assert said["step"]["source"] == "constant"  # the tests run without probing (ENTMTP_NO_PROBE=1) ...
        assert said["choice"]["note"] == "choice not charged: no measurement"  # ... so nothing measured here
    assert data["mismatches"] == []
    assert data["meta"]["command"].startswith("entmtp bench") and data["meta"]["commit"]
    hw = data["meta"]["hardware"]  # every figure names its machine: the CPU model and the flags that matter
    assert data["meta"]["machine"] == f"{hw['name']} ({hw['cpu_count']} cores; {', '.join(hw['cpu_flags'])})"
    assert data["meta"]["machine_record"] == machine_record("cpu")  # CPU, flags, cores, library versions
    assert set(data["meta"]["versions"]) == {"entmtp", "torch", "transformers", "llama-cpp-python"}

    report = (out / "report.md").read_text()
    assert describe_record(data["meta"]["machine_record"]) in report.split("\n")[4]  # CPU, cores, flags
    images = ["speedup.png", "steps.png", "frontier-heads-profile.png"]
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in report
    for task in TASKS:
        assert TASKS[task][1] in report
    assert "| decode tokens/s | probe ms | choose ms | trees | drafts | identical |" in report
    assert "| heads/mc_sim_7b_63 |" in report and "mc_sim_7b_63 100%" in report  # its tree's share of steps
    for name, r in data["summary"][
        next(iter(TASKS))
    ].items():  # drafts by source, as results.json counts them
        row = next(line for line in report.split("\n") if line.startswith(f"| {name} |"))
        said = ", ".join(f"{s} {c['accepted']}/{c['drafted']}" for s, c in r["drafts"].items())
        assert row.split(" | ")[-2] == said
    assert re.search(r"\| heads/static \|.*\| heads \d+/\d+ \|", report)
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.json", "report.md", *images])
    assert data["compared_runs"] == 8 * 2 * len(TASKS)

    # the report renders again from results.json alone, the same; a run without the hardware record (older
    # files) renders too, saying its machine is unknown
    assert main(["bench", "--render", str(out)]) == 0
    assert (out / "report.md").read_text() == report
    machine = describe_record(data["meta"]["machine_record"])
    del data["meta"]["hardware"], data["meta"]["machine_record"]
    (tiny_dir / "old-results.json").write_text(json.dumps(data))
    assert main(["bench", "--render", str(tiny_dir / "old-results.json")]) == 0
    old = (tiny_dir / "old-report.md").read_text()  # no report.md before it: no plots shown
    unknown = f"machine unknown (the run recorded only {data['meta']['machine']!r}: no CPU model or flags)"
    assert old.replace(unknown, machine) == report.split("\n\n![")[0] + "\n"


# -- the embedded model: the command end to end (slow) --------------------------------------------------------


@pytest.mark.slow
def test_the_benchs_default_is_generates_engine_on_the_models_the_bench_loaded_once():
    """--defaults' `default` and `hydra/dynamic+lookup` run the policies `entmtp generate` builds (each rule's),
    and every default shares the bench's loaded models instead of loading its own."""
    from entmtp.build import EngineSpec, Loader, build
    from entmtp.lookup import Lookup

    args = [
        "--heads",
        "hydra",
        "--trees",
        "",
        "--policies",
        "dynamic+lookup",
        "--peers",
        "",
        "--lookup-only",
        "",
    ]
    plan = make_plan(bench_args(*args, "--defaults", "--tasks", "gsm8k", "--num-prompts", "1"))
    methods = load(plan)
    default, dynamic = methods.static["default"], methods.for_task("gsm8k")["hydra/dynamic+lookup"]
    loader = Loader()  # generate's own loads (one model for both), apart from the bench's
    generate = build(EngineSpec(lookup=Lookup()), loader=loader, log=lambda m: None).engine
    assert default.policy == generate.policy and default.policies == generate.policies
    spec = EngineSpec(heads="hydra", policy="dynamic", profile="gsm8k", lookup=Lookup(), dtype="bfloat16")
    generate = build(spec, loader=loader, log=lambda m: None).engine
    assert dynamic.policy == generate.policy and dynamic.policies == generate.policies
    assert len(dynamic.policies) == 4 and dynamic.policies["typical"] != dynamic.policies["greedy"]
    assert default.model is methods.model  # bfloat16: the bench's own
    assert methods.static["previous-default"].model is methods.model
    if "default@llama-cpp" in methods.static:
        assert methods.static["default@transformers"].model is methods.model
        assert methods.static["plain@llama-cpp"].model is methods.static["default@llama-cpp"].model
        routed = methods.static["default-routed"]  # generate --mixed-weights (here unmeasured: one backend)
        engines = [lane.engine for lane in routed.lanes] if hasattr(routed, "lanes") else [routed]
        loaded = (methods.model, methods.static["default@llama-cpp"].model)
        assert all(any(e.model is m for m in loaded) for e in engines)
    from entmtp.bench.report import weights_lines  # the report names each built default's weights

    assert any(
        line.startswith("- `default`: weights: bfloat16 on transformers")
        for line in weights_lines(methods.plans)
    )


@pytest.mark.slow
def test_static_trees_on_the_embedded_model_give_plain_decodings_output_in_float32(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--heads", "hydra", "--trees", "chain_2,tree_4", "--policies", "", "--peers", ""]
    args += ["--lookup-only", "", "--tasks", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "12"]
    args += ["--dtype", "float32", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "hydra/tree_4" in printed and "speedup" in printed
    data = json.loads((out / "results.json").read_text())
    rows = data["summary"]["gsm8k"]
    assert set(rows) == {"plain", "hydra/chain_2", "hydra/tree_4"} and rows["plain"]["speedup"] == 1.0
    tree_4 = data["runs"]["gsm8k"]["hydra/tree_4"]  # its steps' tokens over its steps, the prefill's in none
    steps = sum(r["steps"] for r in tree_4)
    assert rows["plain"]["tokens_per_step"] == 1.0 and steps > 0
    assert rows["hydra/tree_4"]["tokens_per_step"] == pytest.approx(
        (sum(r["tokens"] for r in tree_4) - 1) / steps
    )
    assert data["mismatches"] == []  # float32: speculative output equals plain output


@pytest.mark.slow
def test_peers_lookup_and_hybrids_all_give_plain_greedys_output(tmp_path, capsys):
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
        if _amx_differs():  # on a CPU with AMX and the patched build: its own plain decoding joins (peers.py)
            expected.add("llama-cpp-amx")
    except ImportError:
        assert "skipping peer llama-cpp" in printed and "pip install llama-cpp-python" in printed
    assert set(rows) == expected
    assert data["mismatches"] == []  # float32: every method, peers included, gives plain greedy's output


@pytest.mark.slow
def test_a_prompt_file_is_one_task_and_ctrl_c_writes_what_every_method_finished(
    tmp_path, capsys, monkeypatch
):
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


@pytest.mark.slow
def test_a_sampled_quick_run_reports_perplexity(tmp_path, capsys):
    out = tmp_path / "q"
    args = ["bench", "--quick", "--heads", "none", "--lookup-only", "adaptive", "--peers", ""]
    args += ["--tasks", "gsm8k,sharegpt"]
    args += ["--max-new-tokens", "8", "--temperature", "0.7", "--dtype", "float32", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    data = json.loads((out / "results.json").read_text())
    for task in ("gsm8k", "sharegpt"):
        for row in data["summary"][task].values():
            assert row["prompts"] == 2 and 1.0 <= row["perplexity"] < 1e6
    assert data["meta"]["quick"] is True and data["meta"]["max_new_tokens"] == 8
    assert "| perplexity |" in (out / "report.md").read_text() and "perplexity" in capsys.readouterr().out


def test_the_command_exits_2_naming_an_unknown_task(capsys):
    assert main(["bench", "--tasks", "nosuchtask", "--heads", "none"]) == 2
    assert "unknown task 'nosuchtask'" in capsys.readouterr().err


def test_same_text_names_a_folder_without_results_and_a_missing_method(tmp_path):
    """scripts/same_text.py compares two methods of an `entmtp bench` run: a folder it did not write, or a method
    the run lacks, is refused by name and nothing is written."""
    run = run_script("same_text.py", str(tmp_path), "default", "lookup")
    assert run.returncode != 0
    assert (
        f"{tmp_path / 'results.json'} not found: give the folder an `entmtp bench --out` wrote" in run.stderr
    )
    runs = {
        "plain": [{"prompt": 0, "tokens": 9, "seconds": 1.0}],
        "lookup": [{"prompt": 0, "tokens": 9, "seconds": 0.5}],
    }
    (tmp_path / "results.json").write_text(json.dumps({"runs": {"gsm8k": runs}, "mismatches": []}))
    run = run_script("same_text.py", str(tmp_path), "default", "lookup")
    assert run.returncode != 0
    assert "gsm8k has no method 'default': the run has plain, lookup" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_report_says_what_its_replays_were_priced_with():
    """A run's replays name each charge's source; a run from before replays recorded them (bench-v3) says they
    were priced on other machines' figures and cannot be priced again from its file, and with what command."""
    from pathlib import Path

    from entmtp.bench.report import replay_pricing

    old = {"humaneval": {"hydra": {"static": {"tokens_per_second": 50.0}}}}
    said = replay_pricing(old, "entmtp bench --replay --out X")
    assert "stored latencies" in said and "HEADS_DRAFT_COST (another machine's)" in said
    assert "cannot be priced again from this file: `entmtp bench --replay --out X`" in said
    charges = {
        "step": {"source": "measured", "note": "this machine's probe curve"},
        "choice": {"source": "none", "note": "not charged: no measurement"},
    }
    new = {"qa": {"hydra": {"dynamic": {"tokens_per_second": 50.0, "charges": charges}}}}
    assert replay_pricing(new, "x").endswith(
        "step: measured (this machine's probe curve); choice: none (not charged: no measurement)."
    )
    run = Path(__file__).resolve().parents[1] / "docs/results/bench-v3"  # the published run, re-rendered
    data = json.loads((run / "results.json").read_text())
    assert replay_pricing(data["replays"], data["meta"]["command"]) in (run / "report.md").read_text()
