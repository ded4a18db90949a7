"""The detokenizer and where a completion ends (text.py): a stream's pieces are always a prefix of the whole
completion's text, so a stop string is never streamed before the token that completes it."""

from __future__ import annotations

import torch

from conftest import ByteTokenizer
from entmtp.text import Detokenizer, find_end


def _run(tok, ids: list[int], stop: list[str], eos: set[int], sizes: list[int]):
    """What the engine does with the tokens of each step: (streamed pieces, final text, reason)."""
    detok, pieces, i, reason = Detokenizer(tok, stop), [], 0, None
    for size in sizes:
        new = ids[i : i + size]
        i += size
        cut, reason = find_end(new, eos, detok)
        final = reason is not None or i >= len(ids)
        pieces.append(detok.push(new[:cut], final=final))
        if final:
            break
    return pieces, detok.final_text(), reason


def test_a_multi_token_stop_string_is_never_streamed():
    tok = ByteTokenizer()
    ids = list(b"The sky is blue because of the air.")
    pieces, text, reason = _run(tok, ids, ["is blue because"], set(), [1] * len(ids))
    assert reason == "stop" and text == "The sky " == "".join(pieces)
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert text.startswith(so_far), so_far  # before: "The sky is blue" streamed, then cut


def test_held_text_that_turns_out_not_to_be_a_stop_is_released():
    tok = ByteTokenizer()
    ids = list(b"is blue sky is blue")
    pieces, text, reason = _run(tok, ids, ["is blue because"], set(), [2] * 10)
    assert reason is None and "".join(pieces) == text == "is blue sky is blue"
    assert pieces[-1] == "is blue"  # the last push releases the held tail (it waited for "because")


def test_streams_add_up_to_the_final_text_with_stops_eos_and_split_characters():
    """Random bytes (many incomplete characters), random stops taken from the text, random step sizes, an
    EOS id: every prefix of the stream is a prefix of the final text, and the whole stream is the text."""
    tok, rng = ByteTokenizer(), torch.Generator().manual_seed(0)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (), generator=rng))

    for trial in range(300):
        ids = torch.randint(32, 256, (randint(5, 60),), generator=rng).tolist()
        ids += list("é ✓ 😀 ab".encode())[: randint(0, 14)]
        whole = tok.decode(ids)
        a = randint(0, max(1, len(whole) - 4))
        stop = [whole[a : a + randint(2, 6)]] if trial % 3 else []
        stop = [s for s in stop if s and "\ufffd" not in s]
        eos = {ids[randint(0, len(ids))]} if trial % 5 == 0 else set()
        sizes = [randint(1, 5) for _ in ids]
        pieces, text, reason = _run(tok, ids, stop, eos, sizes)
        so_far = ""
        for piece in pieces:
            so_far += piece
            assert text.startswith(so_far), (ids, stop, so_far, text)
        assert so_far == text, (ids, stop, eos, pieces, text)
        assert reason == "stop" or not text.endswith("\ufffd")  # before a stop: an invalid byte, kept
        if stop and reason == "stop":
            assert text == whole[: whole.find(stop[0])] or stop[0] not in text


def test_a_character_split_by_the_last_token_is_dropped_in_the_text_as_in_the_stream():
    tok = ByteTokenizer()
    ids = list("ok é".encode())[:-1]  # max_tokens stopped inside the two bytes of "é"
    detok = Detokenizer(tok, [])
    assert detok.push(ids, final=True) + "" == "ok " == detok.final_text()


def test_a_stop_string_before_an_eos_token_in_the_same_step_ends_the_text():
    tok = ByteTokenizer()
    detok = Detokenizer(tok, ["cd"])
    new = list(b"abcdef") + [0]
    cut, reason = find_end(new, {0}, detok)
    assert (cut, reason) == (4, "stop")
    assert detok.push(new[:cut], final=True) == "ab" == detok.final_text()
