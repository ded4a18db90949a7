"""Help and docs agree: every option of every subcommand prints its default in `--help` (the parser's own
value, so the two cannot drift), has a line there, and every option docs/cli.md names exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from entmtp.cli import _shows, build_parser

ROOT = Path(__file__).resolve().parents[1]


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


def test_every_option_with_a_default_prints_it():
    """Its value (the parser's own) or, where the help says it in words ("default: all of them"), those."""
    unshown = []
    for name, command in commands().items():
        formatter = command._get_formatter()
        for action in command._actions:
            if not _shows(action):
                continue
            shown = formatter._get_help_string(action) % {"default": action.default}
            if "default" not in shown.lower():
                unshown.append(f"{name} {action.option_strings[0]} (default {action.default!r})")
    assert not unshown, unshown


def test_every_option_has_a_help_line():
    for name, command in commands().items():
        text = command.format_help()
        for action in command._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                line = re.search(rf"^\s+{re.escape(action.option_strings[0])}\b.*$", text, re.M)
                assert line, f"{name} {action.option_strings[0]} has no help line"


def test_every_option_the_cli_page_names_exists():
    known = {s for c in commands().values() for a in c._actions for s in a.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", (ROOT / "docs" / "cli.md").read_text()))
    assert not named - known, f"docs/cli.md names options no command has: {sorted(named - known)}"
