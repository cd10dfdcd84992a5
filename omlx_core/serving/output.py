"""The output processor: from an engine's token ids to the text a client may see.

Engines speak tokens (:mod:`omlx_core.engine`); the serving pipeline owns text. One
:class:`OutputProcessor` per request detokenizes the token ids an engine streams with
the engine's own streaming detokenizer, matches the request's stop strings and builds
the bytes of every logprob entry, so no engine deals in text.

Two kinds of text are held back before they reach a client: the bytes of a character
split across tokens (the streaming detokenizer holds those), and text that could be
the beginning of a stop string, until it either completes the stop string (it and
everything after it are dropped) or can no longer become one. A token's logprob entry
is released together with the text the token starts, so the logprobs a client sees
cover exactly the text it sees; tokens whose text starts at or past a stop string never
reach it at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from omlx_core.engine import TokenLogprob


class StopMatcher:
    """Finds stop strings in streamed text without ever releasing part of one."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in dict.fromkeys(stop) if s)
        self._held = ""
        #: the stop string that matched (the earliest in the text), once one has
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text safe to emit, whether a stop string matched)``; after a match the
        stop string and whatever followed it are dropped."""
        if not self.stop:
            return text, False
        pending = self._held + text
        found = [(i, s) for s in self.stop if (i := pending.find(s)) >= 0]
        if found:
            self._held = ""
            cut, self.matched = min(found, key=lambda item: item[0])
            return pending[:cut], True
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """The held text, released because no more text will come."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@dataclass(frozen=True)
class LogprobEntry:
    """A token's log probability with the exact bytes it stands for; ``top`` holds the
    most likely alternatives (entries with an empty ``top`` of their own)."""

    token_id: int
    logprob: float
    bytes: bytes
    top: tuple["LogprobEntry", ...] = ()


@dataclass(frozen=True)
class ProcessedText:
    """What one step of a request adds for its client."""

    text: str = ""
    logprobs: tuple[LogprobEntry, ...] = ()

    def __add__(self, other: "ProcessedText") -> "ProcessedText":
        return ProcessedText(self.text + other.text, self.logprobs + other.logprobs)


@dataclass
class _HeldLogprob:
    #: where the token's text starts in the request's whole detokenized text
    start: int
    entry: LogprobEntry


class OutputProcessor:
    """One request's completion: token ids in, client-ready text and logprobs out.

    :param detokenizer: a fresh streaming detokenizer of the engine
        (:meth:`omlx_core.engine.Engine.detokenizer`).
    :param stop: the request's stop strings.
    :param token_bytes: the bytes of a token id (:meth:`Engine.token_bytes`), asked only
        for tokens that carry logprobs.
    :param track_token_starts: keep in :attr:`token_starts` where each token's text
        starts in the text, so that the tokens of a part of it (the model's thinking)
        can be counted.
    """

    def __init__(self, detokenizer: Any, stop: Sequence[str] = (),
                 token_bytes: Callable[[int], bytes] | None = None, *,
                 track_token_starts: bool = False) -> None:
        self._detokenizer = detokenizer
        self._stops = StopMatcher(stop)
        self._token_bytes = token_bytes
        #: characters the detokenizer produced so far, and of them released to the client
        self._produced = 0
        self._released = 0
        self._held: list[_HeldLogprob] = []
        #: generated tokens taken into the completion: every token up to and including
        #: the one that completed a stop string, none after it
        self.completion_tokens = 0
        #: with ``track_token_starts``: for each completion token, the offset in the
        #: whole detokenized text where its text starts
        self.token_starts: list[int] | None = [] if track_token_starts else None
        self._finished = False

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched: no more output is taken."""
        return self._stops.matched is not None

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> ProcessedText:
        """Take an engine output's tokens; tokens after a stop string are dropped."""
        if self._finished or self.stopped:
            return ProcessedText()
        text: list[str] = []
        entries = list(logprobs or ())
        for position, token in enumerate(token_ids):
            self.completion_tokens += 1
            if self.token_starts is not None:
                self.token_starts.append(self._produced)
            if position < len(entries):
                self._held.append(_HeldLogprob(self._produced, self._entry(entries[position])))
            self._detokenizer.add_token(int(token))
            text.append(self._feed(self._detokenizer.last_segment))
            if self.stopped:
                break
        return ProcessedText("".join(text), self._release_logprobs())

    def finish(self) -> ProcessedText:
        """Flush the detokenizer and the held text: the engine generates no more.

        The tail can still complete a stop string (the detokenizer holds back a final
        space or a split character), so :attr:`stopped` may turn true here.
        """
        if self._finished or self.stopped:
            return ProcessedText()
        self._finished = True
        self._detokenizer.finalize()
        text = self._feed(self._detokenizer.last_segment)
        if not self.stopped:
            tail = self._stops.flush()
            self._released += len(tail)
            text += tail
            held, self._held = self._held, []
            return ProcessedText(text, tuple(h.entry for h in held))
        return ProcessedText(text, self._release_logprobs())

    def _feed(self, segment: str) -> str:
        self._produced += len(segment)
        safe, _matched = self._stops.feed(segment)
        self._released += len(safe)
        return safe

    def _release_logprobs(self) -> tuple[LogprobEntry, ...]:
        """The held entries of tokens whose text starts in the released text; after a
        stop string, the rest are dropped."""
        released = [h for h in self._held if h.start < self._released]
        self._held = [] if self.stopped else [h for h in self._held if h.start >= self._released]
        return tuple(h.entry for h in released)

    def _entry(self, logprob: TokenLogprob) -> LogprobEntry:
        bytes_of = self._token_bytes or (lambda _token: b"")
        return LogprobEntry(logprob.token_id, logprob.logprob, bytes_of(logprob.token_id),
                            tuple(LogprobEntry(t, v, bytes_of(t)) for t, v in logprob.top))


__all__ = ["LogprobEntry", "OutputProcessor", "ProcessedText", "StopMatcher"]
