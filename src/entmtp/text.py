"""Token ids to text for a stream: incremental detokenization, stop strings, and where a generation ends.

Shared by `generate`, `chat`, `stream` and the server, so every face cuts a completion at the same place and
a stream's pieces always add up to the whole completion's text."""

from __future__ import annotations

from .errors import EntMTPError


def find_end(new: list[int], eos_ids: set[int], detok: Detokenizer) -> tuple[int, str | None]:
    """How many of `new` to keep, and why generation ends (None: it goes on). A stop string completed
    before an EOS token in the same step ends the text there, as it would have one step earlier."""
    eos = next((i for i, tok in enumerate(new) if tok in eos_ids), None)
    cut = detok.stop_cut(new if eos is None else new[:eos])
    if cut is not None:
        return cut, "stop"
    if eos is not None:
        return eos + 1, "eos"  # keep the EOS token itself, like transformers' generate
    return len(new), None


class Detokenizer:
    """Incremental text: emits what new tokens add, decoding only the tokens since the previous emission's
    (their text is the part to skip), so a step costs the same at any output length: decoding the whole
    output every step cost 0.1 ms per token already at 64 tokens and grew with the output.

    Two kinds of text are held back until the next push decides them: an incomplete UTF-8 character (the
    text ends in U+FFFD), and a tail that could begin a stop string ("is blue" while the stop is
    "is blue because"), so a stream never shows the start of a stop string that a later token completes.
    The last push (`final=True`) releases what is held; a trailing incomplete character is dropped there
    and in `final_text` alike. Stop strings end the text just before them.

    `incremental` False (a caller that reads only the final text, `Engine.generate`): without stop strings,
    pushes return nothing and the last one the whole text, decoded once (a step's two decodes cost ~0.1 ms,
    1% of a llama.cpp step); with stop strings it stays incremental, which finding them needs."""

    def __init__(self, tokenizer, stop: list[str], incremental: bool = True):
        if any(not s for s in stop):
            raise EntMTPError("stop strings must be non-empty")
        self.tokenizer, self.stop = tokenizer, stop
        self.incremental = incremental or bool(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters emitted
        self.held = ""  # decoded text not emitted yet: it could begin a stop string
        self.start = self.read = 0  # ids[start:read]: the tokens of the previous emission; ids[:read] decoded
        self.stopped_at: int | None = None  # character offset of the stop string in the whole text

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_cut(self, new: list[int]) -> int | None:
        """How many of `new` it takes to complete a stop string (None: none completes). Only the held text
        and what `new` adds can hold one: emitted text never ends in the beginning of a stop string."""
        if not self.stop:
            return None
        skip = len(self._text(self.ids[self.start : self.read]))
        for i in range(1, len(new) + 1):  # the first token that completes a stop string
            tail = self.held + self._text(self.ids[self.start :] + new[:i])[skip:]
            hits = [tail.find(s) for s in self.stop if s in tail]
            if hits:
                self.stopped_at = self.sent + min(hits)
                return i
        return None

    def push(self, new: list[int], final: bool = False) -> str:
        """The text that `new` adds, less what is held back; `final`: the generation ends with these."""
        self.ids += new
        if self.stopped_at is not None or (
            final and not self.incremental
        ):  # the last push: the rest of the text
            # (up to the stop string)
            text = self.final_text()
            delta, self.sent, self.held = text[self.sent :], len(text), ""
            return delta
        if not self.incremental:
            return ""
        text = self._text(self.ids[self.start :])
        if text.endswith("\ufffd"):
            if not final:
                return ""
            text = text.rstrip("\ufffd")  # a character max_tokens split: dropped, as final_text does
        skip = len(self._text(self.ids[self.start : self.read]))
        self.held += text[skip:]
        self.start, self.read = self.read, len(self.ids)
        keep = 0 if final else self._stop_prefix(self.held)
        delta, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent += len(delta)
        return delta

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string begins with (0: none)."""
        for k in range(min(len(text), max((len(s) for s in self.stop), default=0)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0

    def tokens_before_stop(self, ids: list[int]) -> int:
        """How many of the output `ids` (all of it, the stop string's completing token included) begin before
        the stop string: the tokens that write the text, the last of which may reach into the stop string.
        The engine keeps no token of the step that completed the stop string past these."""
        if self.stopped_at is None:
            return len(ids)
        lo, hi = 0, len(ids)  # the fewest tokens whose text reaches the stop string (a text's length grows
        while lo < hi:  # with its tokens: a binary search, a few decodes at any output length)
            mid = (lo + hi) // 2
            if len(self._text(ids[:mid])) >= self.stopped_at:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def final_text(self) -> str:
        """The whole completion's text: up to the stop string, without a trailing incomplete character."""
        text = self._text(self.ids)
        return text[: self.stopped_at] if self.stopped_at is not None else text.rstrip("\ufffd")
