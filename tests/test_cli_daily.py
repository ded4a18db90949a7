"""The command line as a daily tool: clear model errors, quiet output, stdin prompts, `entmtp chat`, doctor."""

from __future__ import annotations

import io
import json

import pytest
import torch

from conftest import tiny_model
from entmtp import __version__
from entmtp import model as model_module
from entmtp.cli import main
from entmtp.engine import Engine
from entmtp.errors import EntMTPError
from entmtp.machine import cpu_info, describe_record, record
from entmtp.packing import bf16_supported

FLOAT = ["--dtype", "float32", "--heads", "none"]


def _run(capsys, args, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# ---- model errors -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dirs(tmp_path_factory, embedded):
    """A tiny random Llama with the embedded tokenizer (vocab 49152, hidden 64): one with the chat template,
    one without."""
    _, tokenizer = embedded
    model = tiny_model("llama", vocab=len(tokenizer))
    dirs = {}
    for name in ("chat", "plain"):
        d = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        if name == "plain":  # drop the chat template from the saved tokenizer
            (d / "chat_template.jinja").unlink(missing_ok=True)
            cfg_file = d / "tokenizer_config.json"
            data = json.loads(cfg_file.read_text())
            data.pop("chat_template", None)
            cfg_file.write_text(json.dumps(data))
        dirs[name] = d
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, message",
    [
        ("gpt2", "could not load model 'gpt2'"),
        ("/nonexistent/dir", "model directory /nonexistent/dir does not exist"),
    ],
)
def test_unloadable_models_get_one_clear_line(capsys, monkeypatch, model, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = _run(capsys, ["generate", "hi", "--model", model, "--heads", "none"])
    assert code == 2 and message in err and "Traceback" not in err
    assert "embedded" in err  # the fix names the default


def test_hf_hub_offline_set_after_import_keeps_the_loader_off_the_hub(monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; the loader reads it when it loads, so one set later
    (by a program, or the test above) never sends it to the Hub and its retries (23 s here without a network)."""
    asked = {}

    def not_cached(path, **kwargs):
        asked.update(kwargs)
        raise OSError(f"{path} is not in the cache")

    monkeypatch.setattr(model_module.AutoModelForCausalLM, "from_pretrained", not_cached)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EntMTPError, match="not found in the local Hugging Face cache \\(OSError\\)"):
        model_module.load_model("some-org/some-model")
    assert asked["local_files_only"] is True
    asked.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: the Hub may be asked
    with pytest.raises(EntMTPError, match="or the Hub"):
        model_module.load_model("some-org/some-model")
    assert "local_files_only" not in asked


def test_a_directory_without_a_model_is_named(capsys, tmp_path):
    code, _, err = _run(capsys, ["generate", "hi", "--model", str(tmp_path), "--heads", "none"])
    assert code == 2 and f"directory {tmp_path} holds no model (no config.json)" in err


@pytest.mark.slow
def test_heads_for_another_model_name_both_sizes(capsys, tiny_model_dirs):
    code, _, err = _run(
        capsys, ["generate", "hi", "--model", str(tiny_model_dirs["chat"]), "--heads", "hydra"]
    )
    assert code == 2 and "hidden size 576" in err and "has 64" in err and "Traceback" not in err


@pytest.mark.slow
def test_chat_formatting_without_a_template_is_an_error(capsys, monkeypatch, tiny_model_dirs):
    plain = str(tiny_model_dirs["plain"])
    code, _, err = _run(capsys, ["chat", "--model", plain, "--heads", "none"], "hi\n", monkeypatch)
    assert code == 2 and "no chat template" in err
    code, _, err = _run(
        capsys, ["generate", "hi", "--model", plain, "--heads", "none", "--system", "Be brief."]
    )
    assert code == 2 and "--system needs a chat template" in err
    code, out, _ = _run(
        capsys, ["generate", "hi", "--model", plain, "--heads", "none", "--max-new-tokens", "3"]
    )
    assert code == 0 and out  # plain continuation still works


# ---- prompts from stdin and files; quiet output -----------------------------------------------------------


@pytest.mark.slow
def test_stdin_and_prompt_files_give_the_same_output_as_the_argument(capsys, monkeypatch, tmp_path):
    args = ["--max-new-tokens", "8", "--json", *FLOAT]
    code, out, err = _run(capsys, ["generate", "What is 2+2?", *args])
    assert code == 0
    reference = json.loads(out)["token_ids"]  # stdout holds nothing but the JSON object
    assert "Loading weights" not in err  # quiet by default
    for prompt_args, stdin in ((["-"], "What is 2+2?"), ([], "What is 2+2?\n")):
        code, out, _ = _run(capsys, ["generate", *prompt_args, *args], stdin, monkeypatch)
        assert code == 0 and json.loads(out)["token_ids"] != [] and json.loads(out)["prompt_tokens"] > 0
    file = tmp_path / "prompt.txt"
    file.write_text("What is 2+2?")
    code, out, _ = _run(capsys, ["generate", "--prompt-file", str(file), *args])
    assert json.loads(out)["token_ids"] == reference
    code, out, _ = _run(capsys, ["generate", "-", *args], "What is 2+2?", monkeypatch)
    assert json.loads(out)["token_ids"] == reference


@pytest.mark.slow
def test_system_message_changes_the_prompt(capsys):
    args = ["--max-new-tokens", "4", "--json", *FLOAT]
    _, out, _ = _run(capsys, ["generate", "Hi", *args])
    _, out_sys, _ = _run(capsys, ["generate", "Hi", "--system", "You are a pirate.", *args])
    # SmolLM2's template adds its own default system message when none is given: ours replaces it
    assert json.loads(out_sys)["prompt_tokens"] != json.loads(out)["prompt_tokens"]


def test_prompt_errors_come_before_loading_anything(capsys, monkeypatch, tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal(""))
    code, _, err = _run(capsys, ["generate", "--heads", "none"])
    assert code == 2 and "no prompt" in err
    code, _, err = _run(
        capsys, ["generate", "--prompt-file", str(tmp_path / "missing.txt"), "--heads", "none"]
    )
    assert code == 2 and "cannot read --prompt-file" in err and "missing.txt" in err
    code, _, err = _run(
        capsys, ["generate", "x", "--prompt-file", str(tmp_path / "p.txt"), "--heads", "none"]
    )
    assert code == 2 and "not both" in err


# ---- chat -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_scripted_two_turn_chat_remembers_the_first_turn(capsys, monkeypatch, embedded):
    script = (
        "My name is Ada and I live in Paris.\nWhat is my name?\n/reset\nWhat is my name?\n/exit\nignored\n"
    )
    args = ["chat", "--max-new-tokens", "24", *FLOAT]
    code, out, err = _run(capsys, args, script, monkeypatch)
    assert code == 0
    speed = [line for line in err.splitlines() if "tokens/step" in line]
    assert len(speed) == 3  # three replies; /exit ended the session before "ignored"
    context = [int(line.split("context ")[1].split()[0]) for line in speed]
    assert context[1] > context[0] > context[2]  # turn 2 saw turn 1; /reset forgot it
    assert "[conversation reset]" in err
    # the exact replies: turn 2 is generated from turn 1 and its reply, turn 3 (after /reset) from itself
    engine = Engine(*embedded)
    first, second = "My name is Ada and I live in Paris.", "What is my name?"
    r1 = engine.generate([{"role": "user", "content": first}], max_new_tokens=24).text
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": r1},
        {"role": "user", "content": second},
    ]
    r2 = engine.generate(history, max_new_tokens=24).text
    r3 = engine.generate([{"role": "user", "content": second}], max_new_tokens=24).text
    assert out == f"{r1}\n{r2}\n{r3}\n" and r2 != r3


@pytest.mark.slow
def test_chat_uses_lookup_and_heads_options(capsys, monkeypatch):
    args = ["chat", "--max-new-tokens", "12", "--dtype", "float32", "--heads", "hydra", "--lookup"]
    code, _, err = _run(capsys, args, "Repeat: one two three one two three\n", monkeypatch)
    assert code == 0 and "tokens/step" in err


# ---- version and doctor -----------------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"entmtp {__version__}"


def test_doctor_reports_the_installation(capsys):
    code, out, _ = _run(capsys, ["doctor", "--json"])
    r = json.loads(out)
    assert code == 0 and r["entmtp"] == __version__ and r["torch"] == torch.__version__
    assert set(r["shipped_heads"]) == {"medusa", "hydra"} and "mixed" in r["shipped_profiles"]["hydra"]
    assert set(r["extras"]) >= {"llama_cpp", "fastapi", "openai"}
    assert r["cpu_bf16_packing"].startswith("available" if bf16_supported() else "not available")
    assert r["machine"] == describe_record(record()) and r["machine"].startswith(cpu_info()["name"])
    assert set(r["versions"]) == {"entmtp", "torch", "transformers", "llama-cpp-python"}
    assert r["shipped_profiles_machines"]["hydra/mixed"].startswith("machine unknown")  # made before records
    from entmtp.backends.llama_build import describe_build

    assert r["llama_cpp_build"] == describe_build() and r["suffix_drafts"].startswith(
        ("available", "not installed")
    )
    code, out, _ = _run(capsys, ["doctor"])
    assert "model_cache:" in out and "extras:" in out


def test_doctor_names_each_cached_cost_file_for_what_it_is(capsys, tmp_path, monkeypatch):
    """The cost cache holds curves, batched surfaces and policies' choices (costs/): each is summarised as what it
    is, and only a file that cannot be read is called unreadable (with the fix)."""
    from entmtp.costs import ChoiceCost, CostCurve, CostSurface, costs_dir, save_curve

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    hw = {"hardware": {"dtype": "bfloat16", "threads": 2}, "heads": {"kind": "hydra"}}
    save_curve(CostCurve((0, 1, 4), (30.0, 33.0, 36.0), (0.0, 1.5, 2.0), key=hw), costs_dir() / "curve.json")
    surface = CostSurface((1, 8), (0, 4), ((30.0, 36.0), (80.0, 120.0)), key=hw)
    (costs_dir() / "surface.json").write_text(json.dumps(surface.to_json()))
    (costs_dir() / "broken.json").write_text("{")
    choice = ChoiceCost("DynamicPolicy", 0.25, 16, key=hw, machine=record())
    (costs_dir() / "choice-1.json").write_text(json.dumps(choice.to_json()))
    code, out, _ = _run(capsys, ["doctor", "--json"])
    costs = json.loads(out)["step_costs"]
    assert code == 0 and costs["curve.json"].startswith("bfloat16, 2 threads, heads hydra: plain 30.0 ms")
    assert costs["curve.json"].endswith("machine unknown (written before machine records were kept))")
    assert costs["surface.json"].startswith(
        "bfloat16, 2 threads, heads hydra: batched steps of 1-8 rows: plain 30.0 ms at 1, 10.0 ms a row at 8"
    )
    assert "broken.json is unreadable (JSONDecodeError" in costs["broken.json"]
    assert costs["broken.json"].endswith("delete it to measure again")
    assert costs["choice-1.json"].startswith(
        "bfloat16, 2 threads, heads hydra: DynamicPolicy's choice: 0.250 ms a step (median of 16 engine steps)"
    )
    assert costs["choice-1.json"].endswith(f"{describe_record(record())})")


def test_more_bad_options_are_named_before_loading(capsys, tmp_path):
    code, _, err = _run(capsys, ["generate", "hi", "--system", "Be brief.", "--no-chat", "--heads", "none"])
    assert code == 2 and "--system needs the chat template: drop --no-chat" in err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    code, _, err = _run(capsys, ["bench", "--heads", "none", "--prompts", str(bad)])
    assert code == 2 and "line 2 is not JSON" in err
    code, _, err = _run(capsys, ["serve", "--max-queue", "-1", "--heads", "none"])
    assert code == 2 and "--max-queue must be >= 0" in err
