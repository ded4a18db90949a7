"""scripts/ holds only maintained tools: each answers `--help` with its usage, without loading a model.
A finished experiment lives beside the results it produced, in docs/results/<name>/, and is not tested here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
PYTHON_TOOLS = sorted(SCRIPTS.glob("*.py"))
SHELL_TOOLS = sorted(SCRIPTS.glob("*.sh"))

# Runs every Python tool's `--help` in one interpreter (torch and entmtp are imported once, not once per tool)
# and prints {path: [exit code, stdout]} as JSON on the real stdout.
HELP_ALL = """
import contextlib, io, json, os, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, buf = [path, "--help"], io.StringIO()
    sys.path.insert(0, os.path.dirname(path))  # as `python path` does: the tools import each other
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        code = "returned without printing help"
    except SystemExit as e:
        code = e.code
    except Exception as e:  # an import or module-level failure: report it by name
        code = f"{type(e).__name__}: {e}"
    out[path] = [code, buf.getvalue()]
print(json.dumps(out), file=sys.__stdout__)
"""


def test_scripts_holds_only_the_maintained_tools():
    """Adding a script to scripts/ means adding it here (and so to the --help check below); an experiment goes
    to docs/results/<name>/ with its numbers instead."""
    names = {p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__"}  # tools import each other
    assert names == {
        "accept_cost.py",
        "against_faster_plain.py",
        "build_draft_vocab.py",
        "build_training_prompts.py",
        "calibrate_shipped.py",
        "gpu_check.sh",
        "gpu_targets.py",
        "load_server.py",
        "machine_curves.py",
        "replay_policies.py",
        "replay_sampling.py",
        "results_table.py",
        "same_text.py",
        "soak_server.py",
        "train_shipped_heads.sh",
    }


def test_every_python_tool_prints_its_usage_with_help():
    run = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *map(str, PYTHON_TOOLS)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for path in PYTHON_TOOLS:
        code, text = results[str(path)]
        assert code == 0, f"{path.name} --help: {code}"
        assert text.startswith("usage: "), f"{path.name} --help printed {text[:200]!r}"


@pytest.mark.parametrize("path", SHELL_TOOLS, ids=lambda p: p.name)
def test_every_shell_tool_prints_its_header_with_help_and_runs_nothing(path):
    run = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "Usage:" in run.stdout
    assert "set -euo" not in run.stdout and "#" not in run.stdout.splitlines()[0]
