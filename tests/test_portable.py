"""No shipped file, result or test fixture names one machine's path: what ships in the wheel
(src/entmtp/assets), what pages cite (docs/results) and what tests read (tests/data) record model names, hashes
and relative paths (files.portable, machine.model_name), so they mean the same on every machine."""

from __future__ import annotations

import re
from pathlib import Path

from entmtp.files import portable
from entmtp.machine import model_name

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src/entmtp/assets", "docs/results", "tests/data")
# a path from the root of a Unix or macOS file system ("/home/ada/...", "/tmp/x"), not a URL's path or "~/"
ABSOLUTE = re.compile(
    r"(?<![\w.~:/<>-])/(?:root|home|tmp|work|Users|mnt|opt|var|private|data|scratch)/[\w.+-]"
)


def absolute_paths(root: Path, folders=FOLDERS) -> list[str]:
    """`file:line` of every absolute path in the text files under `folders` of `root`."""
    found = []
    for folder in folders:
        for f in sorted((root / folder).rglob("*")):
            if not f.is_file():
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a binary file (a plot, a weights file)
            for n, line in enumerate(text.splitlines(), 1):
                if ABSOLUTE.search(line):
                    found.append(f"{f.relative_to(root)}:{n}")
    return found


def test_no_shipped_file_result_or_fixture_names_a_machines_path():
    found = absolute_paths(ROOT)
    assert not found, f"absolute paths (record names, hashes and relative paths instead): {found[:10]}"


def test_the_check_finds_a_planted_path(tmp_path):
    (tmp_path / "docs" / "results" / "run").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "run" / "results.json").write_text(
        '{"profile": "/home/ada/entmtp/p.json"}\n'
    )
    (tmp_path / "docs" / "results" / "run" / "README.md").write_text(
        "see https://example.org/tmp/x and ~/.cache\n"
    )
    assert absolute_paths(tmp_path) == ["docs/results/run/results.json:1"]


def test_records_name_paths_portably(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert portable(tmp_path / "out" / "results.json") == "out/results.json"  # the working directory's
    assert portable(Path.home() / ".cache" / "x") == "~/.cache/x"
    assert portable("/somewhere/else/profile.json") == "profile.json"
    assert portable("relative/path.json") == "relative/path.json"
    (tmp_path / "smollm2-135m-instruct").mkdir()
    assert model_name(str(tmp_path / "smollm2-135m-instruct")) == "smollm2-135m-instruct"  # a local model
    assert (
        model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )  # a hub id
