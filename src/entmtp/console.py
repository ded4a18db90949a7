"""Where the commands speak: `say` for a one-line note on stderr, `wide_console` for tables and progress bars."""

from __future__ import annotations

import sys

from rich.console import Console

LOG_WIDTH = (
    160  # characters of a table written to a log or a pipe (rich's default there is 80: it cuts columns)
)


def say(msg: str) -> None:
    """One line to the user on stderr ("entmtp: ..."): the default `log` of whatever builds or loads."""
    print(f"entmtp: {msg}", file=sys.stderr)


def wide_console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr), full width when it is no terminal."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(width=LOG_WIDTH, stderr=stderr)
