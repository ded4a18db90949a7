"""`entmtp generate` and `entmtp chat`: their parsers (the engine's and the generation's flags, engine_args.py)
and their runs (chat's conversation loop: chat.py)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .constraints import Constraint
from .engine_args import add_engine_arguments, add_generation_arguments, engine_from_args, generation_options
from .errors import EntMTPError


def register(sub) -> None:
    """`generate` and `chat` on the subcommand parsers `sub`."""
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", help="the prompt; - or nothing reads it from stdin")
    g.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    g.add_argument(
        "--prediction",
        default=None,
        metavar="FILE",
        help="a file holding the output you expect (an edit's file, say): its text is drafted where the "
        "output follows it, and the output stays what it is without it (OpenAI's Predicted Outputs)",
    )
    _add_generation_flags(g)
    g.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.set_defaults(func=run_generate)
    ch = sub.add_parser("chat", help="an interactive multi-turn chat (one turn per line when piped)")
    _add_generation_flags(ch)
    ch.set_defaults(func=run_chat_command)


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    """What builds the engine, a system message, and the generation's options: generate's and chat's."""
    add_engine_arguments(p)
    p.add_argument("--system", default=None, help="a system message (uses the chat template)")
    add_generation_arguments(p)
    form = p.add_mutually_exclusive_group()  # structured outputs (constraints.py): the output follows ...
    form.add_argument("--json-schema", metavar="FILE", help="... the JSON Schema in FILE (JSON text)")
    form.add_argument("--json-object", action="store_true", help="... JSON: an object (OpenAI's JSON mode)")
    form.add_argument("--regex", metavar="PATTERN", help="... the regular expression PATTERN")
    form.add_argument("--grammar", metavar="FILE", help="... the Lark grammar in FILE (its `start` rule)")


def _options(args):
    """The generation's options from the flags, the response format's file read and its grammar checked
    before anything loads."""
    options = generation_options(args)
    if args.json_schema is not None:
        text = _read_text(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise EntMTPError(
                f"--json-schema {args.json_schema}: not JSON ({e}): give a JSON Schema file"
            ) from None
        return replace(options, response_format=Constraint.json_schema(schema, Path(args.json_schema).stem))
    if args.json_object:
        return replace(options, response_format=Constraint.json_object())
    if args.regex is not None:
        return replace(options, response_format=Constraint.regex(args.regex))
    if args.grammar is not None:
        return replace(options, response_format=Constraint.lark(_read_text(args.grammar, "--grammar")))
    return options


def run_generate(args) -> int:
    prompt = read_prompt(args)  # before loading anything: a bad prompt fails fast
    options = _options(args)  # and bad options
    if args.prediction is not None:
        options = replace(options, prediction=_read_text(args.prediction, "--prediction"))
    engine = engine_from_args(args)
    if args.system is not None and not getattr(engine.tokenizer, "chat_template", None):
        raise EntMTPError(
            "--system needs a chat template, and this model's tokenizer has none: drop --system"
        )
    chat = not args.no_chat
    if args.json:
        result = engine.generate(prompt, options, chat=chat)
        print(json.dumps(result.to_json()))
        return 0
    for event in engine.stream(prompt, options, chat=chat):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    result = event.result
    print(
        f"\n[{len(result.token_ids)} tokens, {result.num_steps} steps, "
        f"{result.mean_tokens_per_step:.2f} tokens/step, {result.tokens_per_second:.1f} tokens/s, "
        f"finish: {result.finish_reason}"
        + (
            f", prediction: {result.prediction.accepted} tokens accepted, {result.prediction.rejected} rejected"
            if result.prediction is not None
            else ""
        )
        + (f", accepted drafts: {result.drafts.describe()}" if result.drafts.drafted else "")
        + "]",
        file=sys.stderr,
    )
    return 0


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EntMTPError(
            f"{flag} {path}: cannot read it ({e.__class__.__name__}): give a UTF-8 text file"
        ) from e


def run_chat_command(args) -> int:
    from .chat import run_chat

    options = _options(args)
    engine = engine_from_args(args)
    interactive = sys.stdin.isatty()
    return run_chat(
        engine,
        sys.stdin,
        sys.stdout,
        sys.stderr,
        system=args.system,
        interactive=interactive,
        options=options,
    )


def read_prompt(args):
    """The prompt: the argument, `-` or nothing for stdin (when it is not a terminal), or --prompt-file;
    with --system, a system message and a user message."""
    if args.prompt_file is not None:
        if args.prompt not in (None, "-"):
            raise EntMTPError("give the prompt either as an argument or with --prompt-file, not both")
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise EntMTPError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from e
    elif args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    elif args.prompt is None:
        raise EntMTPError(
            'no prompt: give one as an argument (entmtp generate "..."), pipe it on stdin, or use --prompt-file'
        )
    else:
        text = args.prompt
    if args.system is None:
        return text
    if args.no_chat:
        raise EntMTPError("--system needs the chat template: drop --no-chat")
    if not text.strip():
        raise EntMTPError("the prompt is empty: give some text after --system")
    return [{"role": "system", "content": args.system}, {"role": "user", "content": text}]
