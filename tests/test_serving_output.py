"""The serving pipeline's output processor: incremental detokenization, stop strings
(never emitted, not even in part; tokens past them dropped) and logprob bytes."""

from __future__ import annotations

import pytest

from omlx_core.engine import TokenLogprob
from omlx_core.serving.output import OutputProcessor, StopMatcher


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


def test_a_stop_prefix_that_spans_multibyte_characters_is_held_and_cut():
    text = "café → 日本"
    processor = OutputProcessor(_ByteDetokenizer(), stop=["→ 日"])
    emitted = [processor.add([byte]).text for byte in text.encode()]
    assert processor.stopped and processor.stop_sequence == "→ 日"
    assert "".join(emitted) == "café "
    assert all("\ufffd" not in piece for piece in emitted)
    # Every token up to the one that completed the stop string counts; none after it.
    assert processor.completion_tokens == len("café → 日".encode())


def test_tokens_past_a_stop_string_in_the_same_output_are_dropped():
    processor = OutputProcessor(_ByteDetokenizer(), stop=["lo w"])
    first = processor.add(list(b"hel"))
    second = processor.add(list(b"lo world, and more"))
    assert first.text + second.text == "hel"
    assert processor.stopped and processor.completion_tokens == len("hello w")
    assert processor.add(list(b"ignored")).text == "" and processor.finish().text == ""
    assert processor.completion_tokens == len("hello w")


def _logprobs(tokens: bytes) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5, ((t, -0.5), (0x21, -2.0))) for t in tokens]


def test_logprobs_carry_bytes_and_follow_the_text_they_start():
    processor = OutputProcessor(_ByteDetokenizer(), stop=["o w"], token_bytes=lambda t: bytes([t]))
    step = processor.add(list(b"hell"), _logprobs(b"hell"))
    # "hell" is released; nothing is held back: "l" cannot start "o w".
    assert step.text == "hell" and [e.bytes for e in step.logprobs] == [b"h", b"e", b"l", b"l"]
    assert step.logprobs[0].top[1].bytes == b"!" and step.logprobs[0].top[1].logprob == -2.0
    held = processor.add(list(b"o"), _logprobs(b"o"))
    assert held.text == "" and held.logprobs == (), "a possible stop start is held with its logprob"
    cut = processor.add(list(b" wor"), _logprobs(b" wor"))
    assert processor.stopped and cut.text == "" and cut.logprobs == ()
    released = processor.add(list(b"ld"), _logprobs(b"ld"))
    assert released.text == "" and released.logprobs == ()


def test_held_text_and_logprobs_are_released_when_no_stop_comes():
    processor = OutputProcessor(_ByteDetokenizer(), stop=["o w"], token_bytes=lambda t: bytes([t]))
    step = processor.add(list(b"hello"), _logprobs(b"hello"))
    assert step.text == "hell" and len(step.logprobs) == 4
    tail = processor.finish()
    assert tail.text == "o" and [e.bytes for e in tail.logprobs] == [b"o"]
    assert not processor.stopped


def test_a_stop_string_the_detokenizer_held_back_is_matched_at_finish():
    class _HoldsLast(_ByteDetokenizer):
        """Holds the last byte back until finalize, like mlx-lm's BPE detokenizer a space."""

        def add_token(self, token: int) -> None:
            if self.pending is not None:
                super().add_token(self.pending)
            self.pending = token

        def finalize(self) -> None:
            if self.pending is not None:
                super().add_token(self.pending)
                self.pending = None
            super().finalize()

    detokenizer = _HoldsLast()
    detokenizer.pending = None
    processor = OutputProcessor(detokenizer, stop=["!"])
    assert processor.add(list(b"hi!")).text == "hi"
    assert not processor.stopped
    assert processor.finish().text == "" and processor.stop_sequence == "!"


@pytest.mark.parametrize("text", ["naïve café 日本語 👍 done", "ß∂ƒ©˙∆˚¬…æ", "emoji 🧑‍🍳 chef"])
def test_real_streaming_detokenizer_never_splits_a_character(tiny_model_path, text):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path("llama"))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    # The tiny test vocabulary is small enough that non-ASCII characters span tokens.
    assert len(tokens) > len(text.split())
    processor = OutputProcessor(tokenizer.detokenizer)
    pieces = [processor.add([t]).text for t in tokens]
    tail = processor.finish().text
    assert not processor.stopped
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + tail == text


def test_the_matched_stop_string_is_named() -> None:
    matcher = StopMatcher(["b", "abc", "world"])
    assert matcher.feed("xa") == ("x", False)
    assert matcher.feed("bc") == ("", True) and matcher.matched == "abc"  # earliest start wins
    later = StopMatcher(["world"])
    assert later.feed("Hello wor") == ("Hello ", False)
    assert later.feed("ld and more") == ("", True) and later.matched == "world"
