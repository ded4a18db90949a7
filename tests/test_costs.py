"""The machine part of a schedule (costs/) and choosing by it (build/).

The replays charge each step the step cost of one machine's curve: two 2-core CPUs of this project's pool,
one AVX2-only and one with AVX-512 and native bf16 (tests/data/machines, `entmtp step-costs` output, in each
dtype), the AVX-512/bf16 CPU whose latencies the shipped profiles carry, and one H200 with CUDA graphs
(docs/results/gpu-check). On each, the default schedule must never be slower than plain decoding and never
more than a few percent below that curve's best static tree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_model, tiny_model
from entmtp import costs as costs_mod
from entmtp import machine as machine_mod
from entmtp.build import EngineSpec, build
from entmtp.build import choose as build_mod
from entmtp.build import loaded as load_mod
from entmtp.calibration.replay import replay, step_ms
from entmtp.calibration.traces import load_traces
from entmtp.cli import main
from entmtp.costs import CostCorrector, CostCurve, CostsError, costs_for, fill, measure, synthetic_tree
from entmtp.costs import candidates as choices_mod
from entmtp.costs import measured as measured_mod
from entmtp.costs.probe import Probe
from entmtp.errors import EntMTPError
from entmtp.machine import describe, describe_record, record
from entmtp.policy import StaticPolicy
from entmtp.records import Step
from entmtp.scheduler.factory import scheduled_policy
from entmtp.scheduler.profiles import resolve_profile
from entmtp.tree import Tree

ROOT = Path(__file__).resolve().parents[1]
MACHINES = Path(__file__).parent / "data" / "machines"


def gpu_curve() -> CostCurve:
    rows = json.loads((ROOT / "docs/results/gpu-check/profile-smollm2-135m.json").read_text())["rows"]
    graphs = [r for r in rows.values() if r["mode"] == "graphs"]
    return CostCurve.from_latency([r["nodes"] for r in graphs], [r["total"] for r in graphs], "h200")


def curves(profile) -> dict[str, CostCurve]:
    lat = profile.latency.model()
    return {
        "avx2-bfloat16": CostCurve.from_step_costs(MACHINES / "avx2-bfloat16.json"),
        "avx2-float32": CostCurve.from_step_costs(MACHINES / "avx2-float32.json"),
        "avx512bf16-bfloat16": CostCurve.from_step_costs(MACHINES / "avx512bf16-bfloat16.json"),
        "avx512bf16-float32": CostCurve.from_step_costs(MACHINES / "avx512bf16-float32.json"),
        "avx512-bf16 (shipped)": CostCurve.from_latency(list(lat.nodes), list(lat.ms), "shipped"),
        "h200": gpu_curve(),
    }


def curve(ms: list[float], nodes=(0, 1, 2, 4, 8, 16, 32, 64)) -> CostCurve:
    return CostCurve(tuple(nodes), tuple(ms), (0.0,) * len(nodes))


# ---- the curve -------------------------------------------------------------------------------------------


def test_a_curve_round_trips_through_json_and_reads_step_cost_tables():
    c = CostCurve.from_step_costs(MACHINES / "avx2-bfloat16.json")
    assert c.nodes[0] == 0 and c.plain_ms == pytest.approx(41.1, abs=0.1)
    assert c.draft_share > 0  # the heads' drafting was measured in that table
    assert CostCurve.from_json(json.loads(json.dumps(c.to_json()))) == c
    with pytest.raises(CostsError, match="plain step"):
        CostCurve.from_latency([1, 4], [30.0, 40.0], "no plain row")


def test_a_machine_is_named_by_its_gpu_or_by_cpu_model_cores_and_kernel_flags():
    """Two CPUs called "AMD EPYC" differed 2x in what a tree costs: reports name the flags that decide it."""
    cpu = {"device": "cpu", "name": "AMD EPYC", "cpu_flags": ["avx2", "fma"], "cpu_count": 2}
    assert describe(cpu) == "AMD EPYC (2 cores; avx2, fma)"
    assert describe({**cpu, "cpu_flags": []}).startswith("AMD EPYC (2 cores; none of avx2, fma, avx512f,")
    assert describe({**cpu, "device": "cuda", "name": "NVIDIA H200"}) == "NVIDIA H200"


def test_synthetic_trees_are_valid_trees_of_the_asked_size_and_depth():
    for n in (1, 2, 4, 8, 16, 32, 64):
        t = synthetic_tree(n, num_heads=4)
        assert t.num_nodes == n and t.depth <= 4
        t.check_fits(4, require_contiguous=True)  # prefix-closed and rank-contiguous, as Hydra needs
    assert synthetic_tree(0, 4).num_nodes == 0
    assert synthetic_tree(64, 4).nodes_per_depth[0] < 16  # wide and deep like mc_sim_7b_63, not a fan


def test_sizes_past_the_budget_are_extrapolated_pessimistically():
    row = {0: 10.0, 1: 11.0, 2: 12.0, 4: 20.0}
    out = fill.extrapolate(row, (0, 1, 2, 4, 8))
    assert out[:4] == [10.0, 11.0, 12.0, 20.0]
    assert out[4] == pytest.approx(20.0 + 4 * 4.0)  # the last segment's slope (4 ms/node) is the steeper
    flat = fill.extrapolate({0: 10.0, 1: 9.0}, (0, 1, 8))  # noise made the last segment fall
    assert flat[2] >= 9.0


def test_measure_times_every_size_within_its_budget():
    """A tiny model's probe takes about a second: a budget far above that leaves no size or context out,
    whatever else the machine runs (a tight budget made this test depend on the machine's load)."""
    model = tiny_model()
    c = measure(model, None, sizes=(0, 1, 4), contexts=(16, 48), budget_s=60.0, progress=False)
    assert c.nodes == (0, 1, 4) and all(ms > 0 for ms in c.step_ms)
    assert c.contexts == (16, 48) and len(c.by_context) == 2
    assert c.seconds < 60.0 + 2.0 and c.key["model"]["hidden_size"] == 64


def test_measure_can_verify_through_the_graphs_padded_forward():
    """On CUDA the engine verifies by replaying one graph per tree-size bucket, so the probe does too; on a
    CPU the same padded static-shape forward runs eagerly, which is what this checks."""
    c = measure(
        tiny_model(), None, sizes=(0, 1, 4), contexts=(16,), budget_s=5.0, progress=False, graphs=True
    )
    assert c.nodes == (0, 1, 4) and all(ms > 0 for ms in c.step_ms) and c.key["graphs"] is True


def counted_probes(tmp_path, monkeypatch) -> list[int]:
    """A cache under tmp_path and a small, counted `measure`: the list grows by one per probe."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    calls = []
    real = measured_mod.measure

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, sizes=(0, 1), contexts=(16,), progress=False)

    monkeypatch.setattr(measured_mod, "measure", counted)
    return calls


def test_costs_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    calls = counted_probes(tmp_path, monkeypatch)
    model = tiny_model()
    first = costs_for(model, None)
    again = costs_for(model, None)
    assert len(calls) == 1 and again == first
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and not list((tmp_path / "costs").glob(".*tmp*"))  # atomic: no leftovers
    files[0].write_text("{ truncated")
    costs_for(model, None)  # a corrupt file is measured again, not trusted
    assert len(calls) == 2 and json.loads(files[0].read_text())["format"] == "entmtp-costs"


@pytest.mark.parametrize("content", ["null", "[]", '"x"', "3", '{"format": "entmtp-costs"}'])
def test_a_cache_record_that_is_json_but_not_one_is_named_and_measured_again(
    tmp_path, monkeypatch, capsys, content
):
    """Every cached record kind (curve, surface, prefill, choice cost): valid JSON that is not the record is a
    CostsError naming the file, and `costs_for` measures the curve again with one line that says so."""
    from entmtp.costs import ChoiceCost, CostSurface, PrefillCost
    from entmtp.costs.cache import read_record

    path = tmp_path / "record.json"
    path.write_text(content)
    kinds = {
        CostCurve: "cost curve",
        CostSurface: "cost surface",
        PrefillCost: "prefill cost",
        ChoiceCost: "choice cost",
    }
    for kind, what in kinds.items():
        with pytest.raises(CostsError, match=f"{what} {re.escape(str(path))} is unreadable"):
            read_record(path, kind)
    calls = counted_probes(tmp_path, monkeypatch)
    model = tiny_model()
    costs_for(model, None)
    curve = next((tmp_path / "costs").glob("*.json"))
    curve.write_text(content)
    capsys.readouterr()
    costs_for(model, None)
    assert len(calls) == 2 and f"{curve}" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["null", "[]", '"x"', '{"key": 3}', "{ truncated"])
def test_a_choices_file_that_holds_no_choices_is_named_and_written_afresh(
    tmp_path, monkeypatch, capsys, content
):
    """`dtype-choices.json` holding `null`, a list, a string or a non-name: `build` says so in one line,
    measures again, and writes the file anew (it stopped startup with an AttributeError)."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    path = choices_mod.choices_path()
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert choices_mod.read_choices(build_mod.say) == {}
    assert str(path) in capsys.readouterr().err
    choices_mod.save_choices({"k": "transformers/bfloat16"})
    assert choices_mod.read_choices(build_mod.say) == {"k": "transformers/bfloat16"}


def test_the_probe_measures_every_size_cpu_policies_choose_and_a_new_plan_measures_again(
    tmp_path, monkeypatch
):
    """A CPU's step cost climbs in steps (docs/results/probe-sizes/probe_sizes.py), so the sizes CPU policies choose (1-8
    nodes) are measured, not interpolated; a curve cached under another plan of sizes is measured again."""
    assert set(range(9)) <= set(measured_mod.SIZES) and max(measured_mod.SIZES) == 64
    calls = counted_probes(tmp_path, monkeypatch)
    model = tiny_model()
    costs_for(model, None)
    monkeypatch.setattr(measured_mod, "SIZES", (0, 1, 2, 4, 8, 16, 32, 64))  # the old, sparse plan
    costs_for(model, None)
    costs_for(model, None)
    assert len(calls) == 2 and len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_a_slowdown_while_the_probe_measures_moves_every_size_alike(monkeypatch):
    """The machine runs 3x slower for a stretch of 30 steps in the middle of the probe (a busy neighbour): each
    size's cost in plain steps, what the policies choose by, stays what it is."""
    true_ms = {n: 10.0 + 2.0 * n for n in measured_mod.SIZES}
    calls = []

    def step(self, row, n):
        calls.append(n)
        slow = 3.0 if 40 <= len(calls) < 70 else 1.0
        return true_ms[n] * slow, 0.0

    monkeypatch.setattr(Probe, "step", step)
    c = measure(tiny_model(), None, contexts=(16,), budget_s=30.0, progress=False)
    for n, rel in zip(c.nodes, c.relative(c.nodes), strict=True):
        assert rel == pytest.approx(true_ms[n] / true_ms[0], rel=1e-6)


def steps(nodes, ms, n=10):
    return [Step("t", nodes, 0, 1, [1], {"total": ms / 1000}) for _ in range(n)]


def test_the_corrector_rewrites_a_size_only_when_steps_disagree_beyond_the_noise(tmp_path):
    c = CostCurve((0, 4), (10.0, 20.0), (0.0, 0.0), key={"k": 1}, source="probe")
    path = tmp_path / "c.json"
    fix = CostCorrector(c, path)
    plain = steps(0, 10.0, n=12)  # plain steps as measured: the yardstick of the generation

    assert fix.observe(plain + steps(4, 22.0)) is None and not path.exists()  # 10% off: noise
    assert fix.observe(plain + steps(4, 40.0)) is None and not path.exists()  # once: maybe a burst of load
    fixed = fix.observe(plain + steps(4, 40.0))  # twice the curve, twice in a row: the machine changed
    assert fixed.step_ms == (10.0, 40.0) and fixed.source == "corrected"
    assert CostCurve.from_json(json.loads(path.read_text())).step_ms == (10.0, 40.0)
    assert fix.observe(steps(0, 10.0, n=3)) is None  # too few steps to judge


def test_a_loaded_machine_corrects_nothing(tmp_path):
    """Other processes on the cores slow every size alike: the curve's shape, all a policy reads, holds."""
    c = CostCurve((0, 4), (10.0, 20.0), (0.0, 0.0), key={"k": 1}, source="probe")
    fix = CostCorrector(c, tmp_path / "c.json")
    for load in (3.0, 20.0, 20.0, 25.0):
        assert fix.observe(steps(0, 10.0 * load, n=12) + steps(4, 20.0 * load)) is None
        assert fix.observe(steps(4, 20.0 * load)) is None  # one size alone says nothing about the shape
    assert fix.curve.step_ms == (10.0, 20.0) and not (tmp_path / "c.json").exists()


def test_a_corrected_point_stays_between_its_neighbours(tmp_path):
    c = CostCurve((0, 4, 8), (10.0, 20.0, 30.0), (0.0,) * 3, key={"k": 1}, source="probe")
    fix = CostCorrector(c, tmp_path / "c.json")
    slow = steps(0, 10.0, n=12) + steps(4, 240.0)  # 4 nodes at 240 ms next to plain steps at 10
    fix.observe(slow)
    assert fix.observe(slow).step_ms == (10.0, 30.0, 30.0)  # not dearer than 8 nodes


# ---- choosing by the curve: replays on four machines -------------------------------------------------------


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_the_default_schedule_is_never_below_plain_nor_far_below_the_best_static_tree(kind):
    profile = resolve_profile("mixed", kind)
    traces = load_traces(profile)
    for name, c in curves(profile).items():
        lat = c.latency()
        ms_of = step_ms(lat)
        chosen, _, _ = scheduled_policy(profile, "greedy", lat)
        policy = StaticPolicy(chosen) if isinstance(chosen, Tree) else chosen
        got = replay(policy, traces, ms_of).tokens_per_second
        plain = 1000.0 / float(lat(0))
        best = max(replay(StaticPolicy(t), traces, ms_of).tokens_per_second for t in profile.bank())
        assert got >= 0.999 * plain, f"{kind} on {name}: {got:.1f} tokens/s below plain {plain:.1f}"
        assert got >= 0.97 * best, f"{kind} on {name}: {got:.1f} tokens/s, best static tree {best:.1f}"


def test_entmtp_star_moves_with_the_machine():
    profile = resolve_profile("mixed", "hydra")
    on = {name: profile.best_tree("greedy", c.latency()).num_nodes for name, c in curves(profile).items()}
    assert on["avx2-bfloat16"] == 0  # a 1-node tree costs 1.5 plain steps there: plain decoding wins
    assert on["h200"] >= 16 > on["avx512-bf16 (shipped)"] >= 2  # nodes are nearly free on the GPU
    stored = profile.mode("greedy").measured_on.best
    assert profile.best_tree("greedy").name == stored  # no curve: the stored one


def test_where_every_tree_loses_the_default_decodes_plain_steps_only():
    profile = resolve_profile("mixed", "hydra")
    dear = curve([10.0] + [10.0 * (2 + n) for n in (1, 2, 4, 8, 16, 32, 64)])  # a node costs > a plain step
    chosen, why, _ = scheduled_policy(profile, "greedy", dear.latency())
    assert isinstance(chosen, Tree) and chosen.num_nodes == 0 and "beats a plain step" in why
    forced, _, _ = scheduled_policy(profile, "greedy", dear.latency(), "dynamic")  # asked for: given
    assert not isinstance(forced, Tree)


def test_the_heads_trees_must_also_beat_a_plain_step_without_heads():
    """An engine with heads pays for them on every step (on llama.cpp: the embeddings on, every token an output
    row): a tree that beats the heads' own plain step by less than that is slower than plain steps without
    heads, and the default then runs none (measured on the AMX Xeon: the shipped Q4_1 model's best tree
    116.8 tokens/s, 112.6 plain with heads, 118.9 without). The curve without heads is measured only where a
    tree wins on the heads' curve."""
    profile = resolve_profile("mixed", "hydra")
    with_heads = curve([10.0, 11.0, 11.5, 12.5, 15.0, 20.0, 30.0, 50.0])  # nodes cheap: a tree beats plain
    best_tree = max(
        v for k, v in profile.static_speeds("greedy", with_heads.latency()).items() if k != "none"
    )
    asked = []

    def without(plain_ms):
        def measure():
            asked.append(plain_ms)
            return curve([plain_ms] + [plain_ms * 2] * 7)

        return measure

    cheaper = 1000.0 / best_tree * 0.98  # a plain step without heads that beats the best tree
    chosen, why, expected = scheduled_policy(
        profile, "greedy", with_heads.latency(), heads_less=without(cheaper)
    )
    assert isinstance(chosen, Tree) and chosen.num_nodes == 0 and "without heads" in why
    assert expected == pytest.approx(1000.0 / cheaper)
    dearer = 1000.0 / best_tree * 1.02  # one that does not: the heads stay
    chosen, _, _ = scheduled_policy(profile, "greedy", with_heads.latency(), heads_less=without(dearer))
    assert not isinstance(chosen, Tree)
    dear = curve(
        [10.0] + [10.0 * (2 + n) for n in (1, 2, 4, 8, 16, 32, 64)]
    )  # no tree wins: nothing measured
    scheduled_policy(profile, "greedy", dear.latency(), heads_less=without(1.0))
    forced, _, _ = scheduled_policy(profile, "greedy", with_heads.latency(), "dynamic", without(1.0))
    assert not isinstance(forced, Tree) and asked == [cheaper, dearer]  # a named policy: as asked


def test_every_machine_curve_names_its_machine():
    """A replay's figure is only as good as knowing whose curve it is: each file names its CPU and the flags
    that decide its kernels (two "AMD EPYC" machines here differ 2x in what a tree costs)."""
    for path in sorted(MACHINES.glob("*.json")):
        machine = json.loads(path.read_text())["meta"]["machine"]
        assert machine["cpu"] and "avx2" in machine["cpu_flags"], path.name
        assert ("avx512_bf16" in machine["cpu_flags"]) == path.name.startswith("avx512bf16"), path.name


def test_threshold_policies_are_not_the_default_on_another_machines_curve():
    profile = resolve_profile("writing", "hydra")  # its sample section recommends `binary`, tuned there
    assert profile.recommended_policy("sample") == "binary"
    chosen, why, _ = scheduled_policy(profile, "sample", gpu_curve().latency())
    assert type(chosen).__name__ == "DynamicPolicy" and "dynamic" in why


# ---- building: dtype by measurement ------------------------------------------------------------------------


@pytest.mark.slow
def test_auto_dtype_keeps_the_faster_candidate_and_where_trees_lose_decodes_plain(tmp_path, monkeypatch):
    """Fake curves: float32 is faster here and every tree loses. The build keeps float32, drops the heads
    (no probe cost either), remembers the choice, and decodes plain steps only; its lookup branch is priced on
    the curve without heads (what the engine then runs), asked for once the heads are dropped."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_NO_PROBE")
    ms = {torch.bfloat16: 40.0, torch.float32: 30.0}
    seen = []

    def fake(model, heads, **kw):
        seen.append((model.dtype, heads is not None))
        base = ms[model.dtype]
        return CostCurve((0, 1, 4, 64), (base, 3 * base, 6 * base, 70 * base), (0.0,) * 4, source="test")

    monkeypatch.setattr(load_mod, "costs_for", fake)
    monkeypatch.setattr(build_mod, "_best_cases", lambda *a: {})  # both curves measured (the fake ones)
    monkeypatch.setattr(choices_mod, "choices_path", lambda: tmp_path / "choices.json")
    one = {"log": lambda m: None, "route": False}  # one engine (routing by prompt length: test_routing.py)
    built = build(EngineSpec(heads="hydra"), **one)
    assert set(seen) == {(d, h) for d in ms for h in (True, False)}  # each candidate: both curves
    assert built.plan.dtype == "float32" and built.plan.policy == "plain"
    assert built.engine.heads is None and built.engine.model.dtype == torch.float32
    result = built.engine.generate("Name three colors.", max_new_tokens=12)
    assert result.steps and all(s.tree_nodes == 0 for s in result.steps)
    seen.clear()
    again = build(EngineSpec(heads="hydra"), **one)  # the choice is cached: one load
    assert again.plan.dtype == "float32" and seen == [(torch.float32, True), (torch.float32, False)]


def test_two_cpus_of_one_name_with_other_flags_do_not_share_a_cost_curve(monkeypatch):
    """Two "AMD EPYC" machines, AVX2 only and AVX-512 with bf16, differ 2x in what a tree costs: the flags are
    part of the cost cache's key."""
    model = tiny_model()
    keys = []
    for flags in (["avx2", "fma"], ["avx2", "fma", "avx512f", "avx512_bf16"]):
        monkeypatch.setattr(
            machine_mod, "cpu_info", lambda f=flags: {"name": "AMD EPYC", "flags": f, "cores": 2}
        )
        keys.append(costs_mod.cost_path(costs_mod.cost_key(model, None)))
    assert keys[0] != keys[1]


def test_a_cost_curve_from_before_machine_records_loads_as_machine_unknown():
    from entmtp.costs import CostSurface

    curve = CostCurve((0, 1, 4), (30.0, 33.0, 36.0), (0.0, 1.5, 2.0), machine=record())
    surface = CostSurface((1, 8), (0, 4), ((30.0, 36.0), (80.0, 120.0)), machine=record())
    assert CostCurve.from_json(curve.to_json()) == curve and curve.with_points({1: 34.0}).machine == record()
    assert CostSurface.from_json(surface.to_json()) == surface
    for kind, c in ((CostCurve, curve), (CostSurface, surface)):
        old = {k: v for k, v in c.to_json().items() if k != "machine"}
        assert kind.from_json(old).machine is None
    assert describe_record(None).startswith("machine unknown")


def test_a_record_that_did_not_read_the_cpus_flags_never_claims_the_cpu_has_none():
    """Records made afterwards from what a run kept (a CPU's name, no flags) say the flags are unknown: "none
    of avx2, ..." would claim an AVX2-less CPU. A record that read them and found none still says so."""
    from entmtp.scheduler.profiles import Hardware, describe_machine

    late = describe_record({"cpu": "AMD EPYC", "logical_cpus": 2, "threads": 2})
    assert late == "AMD EPYC (? cores, 2 CPUs, 2 threads; CPU flags not recorded)"
    assert "none of" in describe_record({"cpu": "old", "cpu_flags": [], "logical_cpus": 1, "threads": 1})
    shipped = Hardware("cpu", "AMD EPYC", 2, 2, "bfloat16")  # the shipped profiles' hardware: no flags
    assert describe_machine(None, shipped) == (
        "machine unknown (the profile records 'AMD EPYC', 2 cores, CPU flags not recorded)"
    )


def test_generate_measures_the_machine_once_and_says_what_it_chose(tmp_path, monkeypatch, capsys):
    save_tiny_model(tmp_path / "m")
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ENTMTP_NO_PROBE")
    monkeypatch.setattr(measured_mod, "SIZES", (0, 1, 4))
    monkeypatch.setattr(measured_mod, "measure", _small(measured_mod.measure))
    args = [
        "-v",
        "generate",
        "Hi",
        "--model",
        str(tmp_path / "m"),
        "--heads",
        "none",
        "--max-new-tokens",
        "4",
    ]
    assert main([*args, "--dtype", "float32", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    # the progress line names what it measures and how long it may take
    assert "measuring transformers/float32's step costs (once, at most 3 s)" in err
    assert "step costs (probe): plain" in err
    assert "weights: float32 on transformers (as asked)" in err
    curves = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "costs").glob("*.json")]
    assert [c["machine"] for c in curves if "nodes" in c] == [record("cpu")]  # where it was measured
    assert main([*args, "--dtype", "float32", "--threads", "1"]) == 0  # cached: measured once
    assert "measuring" not in capsys.readouterr().err
    assert main([*args, "--threads", "1"]) == 0  # auto: both CPU dtypes compared, the faster one chosen
    err = capsys.readouterr().err
    said = re.search(r"weights: (\w+) on transformers \(most expected tokens/s here: ([^)]*)\)", err)
    assert said, "the auto choice did not say what it measured"
    chosen = said[1]
    measured, _, unmeasured = said[2].partition("; not measured, at most: ")
    speeds = {d: float(v) for d, v in re.findall(r"(\w+) ([\d.]+)", measured)}
    skipped = {d: float(v) for d, v in re.findall(r"(\w+) ([\d.]+)", unmeasured)}
    assert set(speeds) | set(skipped) == {"bfloat16", "float32"} and speeds[chosen] == max(speeds.values())
    assert all(bound < speeds[chosen] for bound in skipped.values())  # it could not have won
    assert skipped == {
        d: float(v)
        for d, v in re.findall(r"not measuring transformers/(\w+): at most ([\d.]+) tokens/s", err)
    }


def _small(measure):
    def run(model, heads=None, **kw):
        told = {k: kw[k] for k in ("progress", "what") if k in kw}
        return measure(model, heads, sizes=(0, 1, 4), contexts=(16,), budget_s=3.0, **told)

    return run


@pytest.mark.parametrize(
    "spec, message",
    [
        (EngineSpec(dtype="fp8"), "unknown dtype 'fp8': use one of auto, bfloat16, float32, float16"),
        (
            EngineSpec(policy="fast"),
            "unknown policy 'fast': use one of static, binary, ladder, cost, dynamic",
        ),
        (EngineSpec(kv="paged"), "unknown kv cache 'paged'"),
        (EngineSpec(tree="no_such_tree"), "no_such_tree"),
    ],
)
def test_a_bad_spec_is_named_before_any_model_loads(spec, message, monkeypatch):
    monkeypatch.setattr(build_mod, "_load", lambda *a, **kw: pytest.fail("a model was loaded"))
    with pytest.raises(EntMTPError, match=re.escape(message)):
        build(spec)


def test_calibrate_refuses_a_time_cap_of_zero(capsys):
    assert main(["calibrate", "--heads", "hydra", "--tree-seconds", "0"]) == 2
    assert "--tree-seconds must be > 0, got 0.0" in capsys.readouterr().err
