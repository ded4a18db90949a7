"""The pages' figures are their data's: every data table of the front page (README.md) and of docs/results.md
is derived again from the results file it cites, and must equal the page's table cell for cell (bold
included), so a figure that went stale, or was typed by hand, fails.

How each table is derived is declared once, in `TABLES`: the front page's headline table from its bench run
(`headline`), docs/results.md's bench tables by scripts/results_table.py (the script that wrote them), a
table of one run's tokens/s over another's by the same script with `--against`. Tables that quote other
pages, the paper or ranges over several files are listed in `QUOTED`, with what they quote, so that every
table of the two pages is one or the other (`test_every_table_is_derived_or_quoted`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/results.md")


def tables(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each Markdown table of `text` (header, rule and rows)."""
    out, current, start = [], [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("|"):
            if not current:
                start = n
            current.append(line.rstrip())
        elif current:
            out.append((start, current))
            current = []
    if current:
        out.append((start, current))
    return out


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


# ---- derivations ---------------------------------------------------------------------------------------------

ROUTED_COLUMNS = {  # the headline table's columns: the bench run's method names
    "entmtp plain (transformers)": "plain",
    "transformers prompt lookup": "hf-prompt-lookup",
    "entmtp lookup (transformers)": "lookup",
    "entmtp default on transformers": "default@transformers",
    "entmtp plain on llama.cpp": "plain@llama-cpp",
    "entmtp lookup on llama.cpp": "lookup@llama-cpp",
    "entmtp default on llama.cpp": "default@llama-cpp",
    "`entmtp generate` (auto: routed by prompt length)": "default",
}


def headline(data: dict, page: list[str]) -> list[str]:
    """The front page's table: per task, llama-cpp-python's tokens/s, then each method's tokens/s over it;
    bold: the fastest method of a row where one beat llama-cpp-python; then the geometric means over the 11
    rows and over 10 (MT-Bench once: Spec-Bench's copy of its questions left out). The task labels are the page's own."""
    summary = data["summary"]
    header = cells(page[0])
    methods = [ROUTED_COLUMNS[h] for h in header[2:]]
    labels = [cells(line)[0] for line in page[2:]]
    out = page[:2]
    ratios = {m: [] for m in methods}
    for label, (task, rows) in zip(labels, summary.items(), strict=False):
        base = rows["llama-cpp"]["tokens_per_second"]
        speed = {m: rows[m]["tokens_per_second"] / base for m in methods}
        best = max(speed, key=speed.get)
        row = [label, f"{base:.1f}"]
        for m in methods:
            ratios[m].append((task, speed[m]))
            cell = f"{speed[m]:.2f}x"
            row.append(f"**{cell}**" if m == best and round(speed[m], 2) > 1.0 else cell)
        out.append("| " + " | ".join(row) + " |")
    for label, skip in ((labels[-2], ()), (labels[-1], ("specbench-mtbench",))):
        means = [math.exp(sum(math.log(r) for t, r in ratios[m] if t not in skip) / sum(t not in skip for t, _ in ratios[m])) for m in methods]  # fmt: skip
        out.append("| " + " | ".join([label, "", *(f"{x:.2f}x" for x in means)]) + " |")
    return out


def by_script(data: dict, page: list[str], against: str | None = None) -> list[str]:
    """A table as scripts/results_table.py writes it for the page's methods and replay columns."""
    header = cells(page[0])
    replay = [h.removeprefix("replay ").removesuffix(" / static") for h in header if h.startswith("replay ")]
    methods = [h for h in header[1:] if h != "best" and not h.startswith("replay ")]
    text = script_module("results_table.py").table(data, methods, replay, _load(against) if against else None)
    lines = text.splitlines()
    return [lines[0], page[1], *(_label(line, page) for line in lines[2:])]


def _label(line: str, page: list[str]) -> str:
    """The script's row with the page's label for its task (the page may say "specbench-mtbench (MT-Bench again)")."""
    task = cells(line)[0]
    for row in page[2:]:
        label = cells(row)[0]
        if label.split(" (")[0] == task:
            return line.replace(f"| {task} |", f"| {label} |", 1)
    return line


@dataclass(frozen=True)
class Derived:
    page: str
    header: str  # the table's first line starts with this
    results: str  # the results file it is derived from
    derive: object  # (data, page lines) -> lines
    against: str | None = None
    nth: int = 0  # which of the page's tables with this first line (two may share one)


TABLES = [
    Derived("README.md", "| task | llama-cpp-python plain, tokens/s |", "docs/results/llama-cpp/bench-routed/results.json", headline),
    Derived("docs/results.md", "| task | plain | hf-prompt-lookup | lookup | hydra/mc_sim_7b_63 | hydra/tree_8 |", "docs/results/bench-v3/results.json", by_script),
    Derived("docs/results.md", "| task | plain | hf-prompt-lookup | lookup | hydra/mc_sim_7b_63 | medusa/mc_sim_7b_63 |", "docs/results/bench-v2/results.json", by_script),
    Derived("docs/results.md", "| task | plain | hf-prompt-lookup | lookup | hydra/mc_sim_7b_63 | hydra/static | hydra/dynamic | hydra/dynamic+lookup | best | replay", "docs/results/bench-quick/results.json", by_script),
    Derived("docs/results.md", "| task | plain | hf-prompt-lookup | lookup | hydra/mc_sim_7b_63 | hydra/static | hydra/dynamic | hydra/dynamic+lookup | best |", "docs/results/bench-quick-packed/results.json", by_script, "docs/results/bench-quick-packed/unpacked-results.json", 0),
    Derived("docs/results.md", "| task | plain | hf-prompt-lookup | lookup | hydra/mc_sim_7b_63 | hydra/static | hydra/dynamic | hydra/dynamic+lookup | best |", "docs/results/bench-v2-packed/results.json", by_script, None, 1),
]  # fmt: skip
# the tables that quote rather than derive, by their first line's start, with what they quote
QUOTED = {
    ("README.md", "| guide |"): "the guides' index",
    ("README.md", "| word |"): "the glossary",
    ("README.md", "| your situation |"): "figures of the runs the front page and docs/results.md name",
    ("docs/results.md", "| folder"): "the results folders' index",
    (
        "docs/results.md",
        "| task | plain | transformers prompt lookup |",
    ): "docs/results/lookup.txt's table (tokens/s with tokens/step)",
    (
        "docs/results.md",
        "| heads | policy |",
    ): "ranges and medians over replay-policies' replay.json, two dates",
    ("docs/results.md", "| task | static | dynamic-fixed |"): "replay-policies/replay.txt's tables",
    ("docs/results.md", "| | paper"): "the EntMTP paper's Table 1 beside this project's figures",
}


def _find(spec: Derived) -> list[list[str]]:
    """The page's tables whose first line is `spec.header` (else starts with it)."""
    found = [lines for _, lines in tables((ROOT / spec.page).read_text()) if lines[0].startswith(spec.header)]
    return [t for t in found if t[0] == spec.header] or found


def _same(a: list[str], b: list[str]) -> bool:
    """Equal cell for cell (a table's spacing is the writer's)."""
    return [cells(line) for line in a] == [cells(line) for line in b]


@pytest.mark.parametrize("spec", TABLES, ids=lambda s: f"{s.page}:{s.results}")
def test_a_pages_table_is_its_results_file_derived_again(spec):
    found = _find(spec)
    assert len(found) > spec.nth, (
        f"{spec.page}: {len(found)} tables start {spec.header!r} (moved? update TABLES)"
    )
    page = found[spec.nth]
    data = _load(spec.results)
    derived = spec.derive(data, page, spec.against) if spec.against else spec.derive(data, page)
    stale = [f"page: {p}\ndata: {d}" for p, d in zip(page, derived, strict=False) if cells(p) != cells(d)]
    assert _same(derived, page), "\n".join(stale) or f"{len(page)} lines on the page, {len(derived)} derived"


def test_every_table_is_derived_or_quoted():
    for name in PAGES:
        for start, lines in tables((ROOT / name).read_text()):
            first = lines[0]
            derived = any(s.page == name and first.startswith(s.header) for s in TABLES)
            quoted = any(p == name and first.startswith(h) for p, h in QUOTED)
            assert derived or quoted, (
                f"{name}:{start}: a table neither derived (TABLES) nor quoted (QUOTED): {first[:80]}"
            )


def test_a_stale_figure_fails(tmp_path, monkeypatch):
    """The check on a planted stale cell: the front page's table with one figure changed is not its data's."""
    spec = TABLES[0]
    page = _find(spec)[0]
    stale = [*page[:2], page[2].replace("0.95x", "0.97x", 1), *page[3:]]
    assert not _same(stale, page)
    assert not _same(headline(_load(spec.results), stale), stale)  # the check fails on it
    assert _same(headline(_load(spec.results), page), page)  # and passes on the page as it is
