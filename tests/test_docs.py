"""Every relative link in README.md and the Markdown files under docs/ (guides, results folders' READMEs and
reports) points to a file that exists, and every #anchor to a heading of that file (GitHub's heading ids), so
moving or renaming a guide, a results folder or a heading cannot leave a dead link behind."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page, code blocks left out."""
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", page.read_text())
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_pages_have_links_to_check():
    assert len(PAGES) >= 10  # README and the guides
    assert sum(len(links(p)) for p in PAGES) >= 30


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    dead = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not dead, f"{page.relative_to(ROOT)}: " + "; ".join(dead)


GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(?<![\w/.-])((?:scripts|docs/results)/[\w./-]+\.(?:py|sh))\b")


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_script_a_guide_names_exists(page):
    """A guide that says `python scripts/x.py` or `docs/results/<name>/x.py` names a file of the checkout (scripts
    move from scripts/ to docs/results/<name>/ when their experiment is finished)."""
    missing = sorted({m for m in SCRIPT.findall(page.read_text()) if not (ROOT / m).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names {', '.join(missing)}"


def test_a_dead_link_and_a_dead_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title here\n[ok](#title-here) [gone](missing.md) [bad](#nowhere)\n```\n[code](no.md)\n```\n"
    )
    assert links(page) == ["#title-here", "missing.md", "#nowhere"]
    assert anchors(page) == {"title-here"}
    assert SCRIPT.findall("run `python scripts/a_b.py` then docs/results/x-y/c.sh, not myscripts/d.py") == [
        "scripts/a_b.py",
        "docs/results/x-y/c.sh",
    ]


# ---- the source's own references: a docstring or comment that names a .py file names one that exists ---------

SRC = ROOT / "src" / "entmtp"
UPSTREAM = {"medusa/model/medusa_model.py"}  # another project's file, named as the origin of a formula
PY_NAME = re.compile(r"([\w/]+\.py)\b")


def dead_file_names(root: Path = SRC) -> list[str]:
    """`file:line: name` for each `.py` name in `root`'s sources that is no file of the repository (by its
    path under src/entmtp, or by its own name anywhere: tests/, scripts/, docs/results/)."""
    known = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    known |= {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    out = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in PY_NAME.findall(line):
                if name not in known and name.rsplit("/", 1)[-1] not in known and name not in UPSTREAM:
                    out.append(f"{path.relative_to(root)}:{n}: {name}")
    return out


def test_every_py_file_the_source_names_exists():
    assert dead_file_names() == []


def test_a_name_of_a_file_that_was_moved_is_found(tmp_path):
    (tmp_path / "m.py").write_text(
        '"""Costs come from the probe (surface.py) and the cache (costs/cache.py)."""\n'
    )
    assert [d.rsplit(": ", 1)[1] for d in dead_file_names(tmp_path)] == ["surface.py"]
