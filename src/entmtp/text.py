"""Token ids to text for a stream: incremental detokenization, stop strings, and where a generation ends.

Shared by `generate`, `chat`, `stream` and the server, so every face cuts a completion at the same place."""

from __future__ import annotations

from .errors import EntMTPError


def find_end(new: list[int], eos_ids: set[int], detok: Detokenizer) -> tuple[int, str | None]:
    """How many of `new` to keep, and why generation ends (None: it goes on)."""
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return i + 1, "eos"  # keep the EOS token itself, like transformers' generate
    cut = detok.stop_cut(new)
    if cut is not None:
        return cut, "stop"
    return len(new), None


class Detokenizer:
    """Incremental text: emits what new tokens add (held back while it ends in an incomplete UTF-8
    character), decoding only the tokens since the previous emission's (their text is the part to skip), so
    a step costs the same at any output length: decoding the whole output every step cost 0.1 ms per token
    already at 64 tokens and grew with the output. Stop strings end the text just before them."""

    def __init__(self, tokenizer, stop: list[str]):
        if any(not s for s in stop):
            raise EntMTPError("stop strings must be non-empty")
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters emitted
        self.start = self.read = 0  # ids[start:read]: the tokens of the previous emission; ids[:read] emitted
        self.stopped_at: int | None = None

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_cut(self, new: list[int]) -> int | None:
        if not self.stop:
            return None
        for i in range(1, len(new) + 1):  # the first token that completes a stop string
            text = self._text(self.ids + new[:i])
            hits = [text.find(s) for s in self.stop if s in text]
            if hits:
                self.stopped_at = min(hits)
                return i
        return None

    def push(self, new: list[int]) -> str:
        self.ids += new
        if self.stopped_at is not None:  # the last push: the rest of the text up to the stop string
            text = self.final_text()
            delta, self.sent = text[self.sent :], len(text)
            return delta
        text = self._text(self.ids[self.start :])
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self._text(self.ids[self.start : self.read])) :]
        self.sent += len(delta)
        self.start, self.read = self.read, len(self.ids)
        return delta

    def final_text(self) -> str:
        text = self._text(self.ids)
        return text[: self.stopped_at] if self.stopped_at is not None else text
