"""Stop strings and incremental detokenization of the batched engine."""

from __future__ import annotations

import pytest

from omlx_core.text import StopMatcher, TextAssembler


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_stop_string_split_across_pieces_is_never_emitted():
    emitted, stopped = feed_all(StopMatcher(["<END>"]), ["Hello <", "EN", "D> ignored"])
    assert stopped
    assert "".join(emitted) == "Hello "
    # Nothing that could still become the stop string left early.
    assert emitted[0] == "Hello "
    assert emitted[1] == ""


def test_held_text_is_released_when_it_cannot_become_a_stop_string():
    emitted, stopped = feed_all(StopMatcher(["<END>"]), ["a <E", "x", "yz"])
    assert not stopped
    assert emitted == ["a ", "<Ex", "yz", ""]


def test_earliest_of_several_stop_strings_wins():
    emitted, stopped = feed_all(StopMatcher(["world", "lo w"]), ["hello world"])
    assert stopped
    assert "".join(emitted) == "hel"


def test_trailing_partial_stop_is_flushed_at_the_end():
    emitted, stopped = feed_all(StopMatcher(["###"]), ["answer #", "#"])
    assert not stopped
    assert "".join(emitted) == "answer ##"


def test_no_stop_strings_passes_text_through():
    matcher = StopMatcher(["", ""])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""


class _ByteDetokenizer:
    """A streaming detokenizer over raw UTF-8 bytes: holds back split characters."""

    def __init__(self) -> None:
        self.buffer = b""
        self.text = ""
        self.offset = 0

    def add_token(self, token: int) -> None:
        self.buffer += bytes([token])
        try:
            self.text += self.buffer.decode("utf-8")
            self.buffer = b""
        except UnicodeDecodeError:
            pass

    def finalize(self) -> None:
        self.text += self.buffer.decode("utf-8", "replace")
        self.buffer = b""

    @property
    def last_segment(self) -> str:
        segment = self.text[self.offset:]
        self.offset = len(self.text)
        return segment


def test_assembler_holds_stop_prefix_that_spans_multibyte_characters():
    text = "café → 日本"
    assembler = TextAssembler(_ByteDetokenizer(), stop=["→ 日"])
    emitted = []
    for byte in text.encode():
        piece, stopped = assembler.add(byte)
        emitted.append(piece)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "café "
    assert all("\ufffd" not in piece for piece in emitted)


@pytest.mark.parametrize("text", ["naïve café 日本語 👍 done", "ß∂ƒ©˙∆˚¬…æ", "emoji 🧑‍🍳 chef"])
def test_real_streaming_detokenizer_never_splits_a_character(tiny_model_path, text):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path("llama"))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    # The tiny test vocabulary is small enough that non-ASCII characters span tokens.
    assert len(tokens) > len(text.split())
    assembler = TextAssembler(tokenizer.detokenizer)
    pieces = [assembler.add(t)[0] for t in tokens]
    tail, stopped = assembler.finish()
    assert not stopped
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + tail == text


def test_the_matched_stop_string_is_named() -> None:
    matcher = StopMatcher(["b", "abc", "world"])
    assert matcher.feed("xa") == ("x", False)
    assert matcher.feed("bc") == ("", True) and matcher.matched == "abc"  # earliest start wins
    later = StopMatcher(["world"])
    assert later.feed("Hello wor") == ("Hello ", False)
    assert later.feed("ld and more") == ("", True) and later.matched == "world"
