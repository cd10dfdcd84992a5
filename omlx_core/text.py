"""Deprecated: stop strings and detokenization moved to :mod:`omlx_core.serving.output`.

Engines speak tokens now; the serving pipeline's output processor owns text. This module
stays only until the batched scheduler stops importing :class:`TextAssembler` (helper
``sched``'s change); delete it at that merge. Nothing new may import it.
"""

from __future__ import annotations

from typing import Any, Sequence


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


class TextAssembler:
    """One request's completion text: tokens in, emit-ready text out."""

    def __init__(self, detokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._detokenizer = detokenizer
        self._stops = StopMatcher(stop)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def add(self, token: int) -> tuple[str, bool]:
        """Add a generated token; ``(new text to emit, whether a stop string matched)``."""
        self._detokenizer.add_token(token)
        return self._stops.feed(self._detokenizer.last_segment)

    def finish(self) -> tuple[str, bool]:
        """Flush the detokenizer and the held text at the end of generation.

        The tail can still complete a stop string (the detokenizer holds back a final
        space or split character), so the same ``(text, matched)`` pair is returned.
        """
        self._detokenizer.finalize()
        text, matched = self._stops.feed(self._detokenizer.last_segment)
        if matched:
            return text, True
        return text + self._stops.flush(), False
