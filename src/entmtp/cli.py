"""Command line: `entmtp generate`, `chat`, `serve`, `doctor`, `trees`, `step-costs`, `bench`, `calibrate`,
`train-heads`, `eval-heads`.

This module only dispatches: each subcommand's parser and run live with the code they drive, and register
themselves on the subcommand parsers (`register(sub)`):

  generate, chat           generate.py (the engine's and generation's flags: engine_args.py)
  serve                    server/command.py
  doctor                   doctor.py
  trees                    here (one table)
  step-costs (profile)     step_costs.py
  bench                    bench/command.py
  calibrate                calibration/command.py
  train-heads, eval-heads  train/command.py

Settings are declared once, as dataclass fields whose metadata makes their flags (settings.py): `EngineSpec`
(build/), `GenerationOptions` (accept.py), `Lookup` (lookup.py) and the training settings (train/).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys

from .errors import EntMTPError


def engine_spec(args):
    """The `EngineSpec` that generate, chat and serve's flags name (engine_args.py)."""
    from .engine_args import engine_spec as spec

    return spec(args)


def register_trees(sub) -> None:
    t = sub.add_parser("trees", help="list the named trees")
    t.set_defaults(func=cmd_trees)


def cmd_trees(args) -> int:
    from .tree import list_trees, load_tree

    print(f"{'name':<16} {'nodes':>5}  per depth")
    for name in list_trees():
        t = load_tree(name)
        print(f"{name:<16} {t.num_nodes:>5}  {'/'.join(map(str, t.nodes_per_depth))}")
    return 0


def _module(name: str):
    """The `register` of module `name`, imported when the parser is built."""
    return lambda sub: importlib.import_module(name).register(sub)


# in the order `entmtp --help` lists the subcommands
_SUBCOMMANDS = (
    _module("entmtp.generate"),  # generate, chat
    _module("entmtp.server.command"),
    _module("entmtp.doctor"),
    register_trees,
    _module("entmtp.step_costs"),
    _module("entmtp.bench.command"),
    _module("entmtp.calibration.command"),
    _module("entmtp.train.command"),  # train-heads, eval-heads
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="entmtp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"entmtp {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show library logs and progress bars (transformers)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _SUBCOMMANDS:
        register(sub)
    for command in sub.choices.values():  # every option's help says its default
        command.formatter_class = _with_defaults(command.formatter_class)
        for action in command._actions:
            if action.help is None and action.option_strings:  # argparse prints no line for it otherwise
                action.help = ""
    return parser


def _with_defaults(formatter: type) -> type:
    """`formatter` whose help lines end with the option's default, unless the help already shows it or
    there is none to show (a switch, no default)."""

    class DefaultsShown(formatter):
        def _format_action(self, action):
            if action.help == "" and _shows(action):  # a line for an option whose only help is its default
                action = copy.copy(action)
                action.help = "default: %(default)s"
            return super()._format_action(action)

        def _get_help_string(self, action):
            text = action.help or ""
            if "default" in text.lower() or not _shows(action):  # shown already ("default: all of them")
                return text
            return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    return DefaultsShown


def _shows(action: argparse.Action) -> bool:
    """Whether an option has a default to show: a value (not a switch's False, not None)."""
    if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
        return False
    switches = argparse._StoreTrueAction | argparse._StoreFalseAction | argparse._VersionAction
    return not isinstance(action, switches)


def _quiet_libraries() -> None:
    """No transformers / Hub logs or progress bars (e.g. "Loading weights") unless -v: stdout stays ours."""
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what reports quote as the command
    if not args.verbose:
        _quiet_libraries()
    try:
        return args.func(args)
    except EntMTPError as e:
        print(f"entmtp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
