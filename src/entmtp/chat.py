"""An interactive multi-turn chat over an `Engine`: the chat template, streamed replies, a speed line per reply.

Lines starting with "/" are commands: /reset forgets the conversation, /exit (or end of input) leaves. When
the input is not a terminal every line is one user turn, so a conversation can be scripted:

    printf 'My name is Ada.\\nWhat is my name?\\n' | entmtp chat
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TextIO

from .engine import Engine
from .errors import PromptError

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"


def run_chat(
    engine: Engine,
    lines: Iterable[str],
    out: TextIO,
    info: TextIO,
    *,
    system: str | None = None,
    interactive: bool = False,
    **generate,
) -> int:
    """Read user turns from `lines`, stream each reply to `out`, and a speed line per reply to `info`.
    `generate`: keyword arguments of `Engine.stream` (`options=GenerationOptions(...)`, or its fields)."""
    if not getattr(engine.tokenizer, "chat_template", None):
        raise PromptError(
            "this model's tokenizer has no chat template, which `entmtp chat` needs: use `entmtp generate "
            "--no-chat` for plain continuation, or a chat (instruct) model"
        )
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if interactive:
        print(HELP, file=info)
    for line in _prompts(lines, out, interactive):
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(start)
            print("[conversation reset]", file=info)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}: {HELP}", file=info)
            continue
        messages.append({"role": "user", "content": text})
        try:
            for event in engine.stream(messages, **generate):
                out.write(event.text)
                out.flush()
        except PromptError as e:  # e.g. the conversation outgrew the context window: say so, keep going
            messages.pop()
            print(f"entmtp: {e} (/reset starts over)", file=info, flush=True)
            continue
        result = event.result
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": result.text})
        print(
            f"[{len(result.token_ids)} tokens, {result.mean_tokens_per_step:.2f} tokens/step, "
            f"{result.tokens_per_second:.1f} tokens/s, context {result.prompt_tokens + len(result.token_ids)} "
            f"tokens]",
            file=info,
            flush=True,
        )
    return 0


def _prompts(lines: Iterable[str], out: TextIO, interactive: bool):
    """The user's lines; on a terminal each is asked for with a prompt."""
    if not interactive:
        yield from lines
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            out.write("\n")
            return
