"""Settings declared once: every flag of the engine, the generation and the training is a dataclass field's
(settings.py), each subcommand owns its parser, and parsed flags give back the objects they name."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from conftest import ByteTokenizer, tiny_model
from entmtp.accept import GenerationOptions
from entmtp.build import EngineSpec
from entmtp.cli import build_parser, engine_spec
from entmtp.engine import Engine
from entmtp.engine_args import add_engine_arguments, generation_options
from entmtp.lookup import Lookup
from entmtp.settings import add_arguments, dest_of, flag_of, from_args, setting, settings_of
from entmtp.train.command import train_settings_from_args
from entmtp.train.pipeline import EvalSettings, HeadsSettings
from entmtp.train.shards import GenSettings
from entmtp.train.trainer import TrainSettings

SUBCOMMANDS = [
    "generate",
    "chat",
    "serve",
    "doctor",
    "trees",
    "step-costs",
    "profile",
    "bench",
    "calibrate",
    "train-heads",
    "eval-heads",
]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def test_every_subcommand_is_registered_and_prints_its_help(capsys):
    parser = build_parser()
    assert set(_subparsers(parser)) == set(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as done:
            parser.parse_args([name, "--help"])
        assert done.value.code == 0, name
        usage = "step-costs" if name == "profile" else name  # the old name's help is the new name's
        assert capsys.readouterr().out.startswith(f"usage: entmtp {usage}"), name


def test_every_engine_spec_field_is_a_flag_of_generate_chat_and_serve():
    settings = {f.name for f, _ in settings_of(EngineSpec)}
    generation = {f.name for f in dataclasses.fields(GenerationOptions)}
    # the fields that are not EngineSpec's own flags: the generation's two (GenerationOptions' flags), and
    # `gguf_as_given` and `gguf_format`, which `build` sets for auto's llama.cpp candidates (a named --dtype
    # names the weights)
    others = {f.name for f in dataclasses.fields(EngineSpec)} - settings
    assert others == {"temperature", "acceptance", "gguf_as_given", "gguf_format"}
    assert others - {"gguf_as_given", "gguf_format"} <= generation
    lookup_dests = {dest_of(f, s) for f, s in settings_of(Lookup)} | {"lookup"}
    parsers = _subparsers(build_parser())
    for name in ("generate", "chat", "serve"):
        dests = _dests(parsers[name])
        for f, s in settings_of(EngineSpec):
            if f.name != "lookup":
                assert dest_of(f, s) in dests, (name, f.name)
        assert lookup_dests <= dests, name
    for name in ("generate", "chat"):
        assert {dest_of(f, s) for f, s in settings_of(GenerationOptions)} <= _dests(parsers[name])


def test_a_field_added_to_engine_spec_is_a_flag_with_no_other_change():
    @dataclasses.dataclass(frozen=True)
    class Wider(EngineSpec):
        speculate_harder: int = setting(3, help="a setting a later version adds")
        quiet: bool = setting(True, help="on by default: its flag turns it off")

    p = argparse.ArgumentParser()
    add_arguments(p, Wider)
    assert from_args(Wider, p.parse_args([])) == Wider(lookup=Lookup())  # as `entmtp generate` with no flags
    args = p.parse_args(["--speculate-harder", "5", "--no-quiet", "--no-pack", "--dtype", "float32"])
    want = Wider(speculate_harder=5, quiet=False, pack=False, dtype="float32", lookup=Lookup())
    assert from_args(Wider, args) == want
    assert "a setting a later version adds" in p.format_help()


def test_engine_spec_round_trips_through_generate_flags(tmp_path):
    profile = str(tmp_path / "p.json")
    spec = EngineSpec(
        model="some/model",
        backend="transformers",
        dtype="float32",
        device="cuda:1",
        threads=3,
        heads="medusa",
        tree=None,
        policy="cost",
        profile=profile,
        lookup=Lookup(max_ngram=2, tokens=6, adaptive=False, node_cost=0.5, typical=True),
        temperature=0.7,
        acceptance="gumbel",
        probe=False,
        pack=False,
        graphs=False,
        kv="dynamic",
    )
    argv = ["generate", "hi", "--model", "some/model", "--backend", "transformers", "--dtype", "float32"]
    argv += ["--device", "cuda:1", "--threads", "3", "--heads", "medusa", "--policy", "cost"]
    argv += ["--profile", profile, "--lookup", "--lookup-ngram", "2", "--lookup-tokens", "6"]
    argv += ["--lookup-fixed", "--lookup-node-cost", "0.5", "--temperature", "0.7", "--acceptance", "gumbel"]
    argv += ["--no-probe", "--no-pack", "--no-graphs", "--kv", "dynamic"]
    assert engine_spec(build_parser().parse_args(argv)) == spec
    # and from a spec to its flags and back: each field's own flag (settings.flag_of) carries its value
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    plain = dataclasses.replace(spec, lookup=None, temperature=0.0, acceptance="auto")
    flags = []
    for f, s in settings_of(EngineSpec):
        value = getattr(plain, f.name)
        if isinstance(value, bool):
            flags += [flag_of(f, s)] if value != f.default else []
        elif value is not None:
            flags += [flag_of(f, s), str(value)]
    assert engine_spec(p.parse_args([*flags, "--no-lookup"])) == plain


def test_no_flags_name_what_entmtp_generate_does_by_default():
    """EngineSpec()'s defaults are `entmtp generate`'s, lookup drafts' rule included."""
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_spec(args) == EngineSpec() == EngineSpec(lookup=Lookup())  # beside the scheduled default
    for flags, spec in (
        (["--heads", "none"], EngineSpec(heads="none")),
        (["--tree", "tree_8"], EngineSpec(tree="tree_8")),
    ):
        assert engine_spec(build_parser().parse_args(["generate", "hi", *flags])) == spec
        assert spec.lookup is None  # plain decoding, a named tree: none, on either side
    assert generation_options(args) == GenerationOptions()
    serve = build_parser().parse_args(["serve", "--acceptance", "typical"])
    assert engine_spec(serve) == EngineSpec()  # the requests' rule picks no engine section
    assert serve.request_acceptance == "typical"


def test_generation_flags_give_the_options_the_engine_takes():
    argv = ["generate", "hi", "--max-new-tokens", "9", "--temperature", "0.5", "--acceptance", "typical"]
    argv += ["--seed", "4", "--stop", "END", "--stop", "\n\n"]
    got = generation_options(build_parser().parse_args(argv))
    assert got == GenerationOptions(9, 0.5, "typical", 4, ["END", "\n\n"])
    bench = build_parser().parse_args(["bench", "--temperature", "0.7"])
    assert (bench.seed, bench.max_new_tokens, bench.acceptance) == (0, None, "auto")  # bench's own defaults


def test_bad_generation_options_are_named_before_anything_loads(capsys):
    from entmtp.cli import main

    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "hi", "--acceptance", "typical"]) == 2
    assert "acceptance 'typical' needs a temperature > 0" in capsys.readouterr().err


def test_the_engine_takes_generation_options_as_one_object_or_as_keywords():
    engine = Engine(tiny_model("llama", seed=1), ByteTokenizer())
    ids = list(range(40, 52))
    options = GenerationOptions(max_new_tokens=6, temperature=0.8, seed=3)
    by_object = engine.generate(ids, options).token_ids
    assert by_object == engine.generate(ids, max_new_tokens=6, temperature=0.8, seed=3).token_ids
    assert by_object == engine.generate(ids, GenerationOptions(max_new_tokens=2), max_new_tokens=6,
                                        temperature=0.8, seed=3).token_ids  # fmt: skip
    assert len(by_object) == 6
    with pytest.raises(TypeError, match="max_tokens"):
        engine.generate(ids, max_tokens=6)  # a misspelt option is an error, never ignored


def test_every_training_setting_is_a_flag_and_reads_back():
    parsers = _subparsers(build_parser())
    train, evaluate = _dests(parsers["train-heads"]), _dests(parsers["eval-heads"])
    for cls in (GenSettings, TrainSettings, HeadsSettings):
        assert {dest_of(f, s) for f, s in settings_of(cls)} <= train, cls.__name__
    assert {dest_of(f, s, "eval-") for f, s in settings_of(EvalSettings)} <= train & evaluate
    argv = ["train-heads", "--kind", "hydra", "--out", "o", "--num-prompts", "5", "--lr", "0.01"]
    argv += ["--own-lm-head", "--head-arch", "prefix-mlp", "--eval-tasks", "gsm8k,writing", "--seed", "2"]
    got = train_settings_from_args(build_parser().parse_args(argv))
    assert got == {
        "gen_settings": GenSettings(num_prompts=5, seed=2),
        "train_settings": TrainSettings(lr=0.01, seed=2),
        "heads_settings": HeadsSettings(share_lm_head=False, head_arch="prefix-mlp"),
        "eval_settings": EvalSettings(tasks=("gsm8k", "writing")),
    }
    args = build_parser().parse_args(["eval-heads", "h", "--num-prompts", "3", "--trees", "tree_4"])
    assert from_args(EvalSettings, args, prefix="eval-") == EvalSettings(
        prompts=3, trees=("tree_4",), tasks=args.eval_tasks
    )


def test_every_calibration_setting_is_a_flag_and_reads_back():
    from entmtp.calibration.calibrate import CalibrationSettings

    calibrate = _subparsers(build_parser())["calibrate"]
    assert {dest_of(f, s) for f, s in settings_of(CalibrationSettings)} <= _dests(calibrate)
    args = calibrate.parse_args(["--max-new-tokens", "12", "--latency-repeats", "1", "--tree-seconds", "2.5"])
    got = from_args(CalibrationSettings, args)
    assert got == CalibrationSettings(max_new_tokens=12, latency_repeats=1, tree_seconds=2.5)
