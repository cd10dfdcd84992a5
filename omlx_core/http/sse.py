"""Server-sent events, and the response body that ends a generation when it is closed.

The status line is on the wire before the first frame, so nothing in here may raise: an
error after the first byte is sent in-band by the API's formatter, and a bug in a
formatter becomes an error frame plus the stream's terminator rather than a truncated
200. Waitress calls :meth:`StreamBody.close` when the stream ends or the client hangs up,
and that aborts the request and frees its memory.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterator

from omlx_core.http.generation import Generation, Generations

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # Tell reverse proxies (nginx) not to buffer the stream.
    "X-Accel-Buffering": "no",
}


def frame(data: Any, event: str | None = None) -> bytes:
    """One SSE event: ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode("utf-8")


class StreamBody:
    """The WSGI response iterable of one streamed generation."""

    def __init__(self, frames: Iterator[bytes], generation: Generation,
                 error_frames: Callable[[str], list[bytes]],
                 on_early_close: Callable[[Generation], None] | None = None):
        self._frames = frames
        self._generation = generation
        self._error_frames = error_frames
        self._on_early_close = on_early_close
        self._pending: list[bytes] = []
        self._done = False
        self._closed = False

    def __iter__(self) -> "StreamBody":
        return self

    def __next__(self) -> bytes:
        if self._pending:
            return self._pending.pop(0)
        if self._done:
            raise StopIteration
        try:
            return next(self._frames)
        except StopIteration:
            self._done = True
            raise
        except Exception as exc:
            log.exception("formatting the stream of request %s failed",
                          self._generation.request_id)
            self._done = True
            self._pending = list(self._error_frames(f"internal error while streaming: {exc}"))
            if not self._pending:
                raise StopIteration from None
            return self._pending.pop(0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close_frames = getattr(self._frames, "close", None)
            if close_frames is not None:
                close_frames()
        finally:
            if not self._done and self._on_early_close is not None:
                self._on_early_close(self._generation)
            self._generation.close()


def respond(resp: Any, generations: Generations, generation: Generation, *, stream: bool,
            collect: Callable[[Generation], Any], frames: Callable[[], Iterator[bytes]],
            error_frames: Callable[[str], list[bytes]]) -> None:
    """Answer with ``collect(generation)`` as one JSON document or, when ``stream``, with an
    SSE body of ``frames()`` that aborts the generation if the client leaves early."""
    if not stream:
        try:
            resp.media = collect(generation)
        finally:
            generation.close()
        return
    resp.content_type = "text/event-stream"
    resp.set_headers(SSE_HEADERS)
    resp.stream = StreamBody(frames(), generation, error_frames, generations.early_close)
