"""The console the commands print their tables and progress bars on."""

from __future__ import annotations

from rich.console import Console

LOG_WIDTH = (
    160  # characters of a table written to a log or a pipe (rich's default there is 80: it cuts columns)
)


def wide_console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr), full width when it is no terminal."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(width=LOG_WIDTH, stderr=stderr)
