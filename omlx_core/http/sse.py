"""Server-sent events, the response body that ends a generation when it is closed, and
the :class:`Responder` through which every generating route uses the serving pipeline.

The status line is on the wire before the first frame, so nothing in here may raise: an
error after the first byte is sent in-band by the API's formatter, and a bug in a
formatter becomes an error frame plus the stream's terminator rather than a truncated
200. Waitress calls :meth:`StreamBody.close` when the stream ends or the client hangs up,
and that aborts the request and frees its memory.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from omlx_core.serving import Generation, Job, ServingPipeline

if TYPE_CHECKING:
    import falcon

    from omlx_core.http.metrics import Metrics

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # Tell reverse proxies (nginx) not to buffer the stream.
    "X-Accel-Buffering": "no",
}


#: an SSE comment: clients ignore it, proxies and read timeouts see bytes
KEEPALIVE = b": keepalive\n\n"


def frame(data: Any, event: str | None = None) -> bytes:
    """One SSE event: ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode("utf-8")


class StreamBody:
    """The WSGI response iterable of one streamed generation."""

    def __init__(self, frames: Iterator[bytes], generation: Generation,
                 error_frames: Callable[[Exception], list[bytes]],
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
            self._pending = list(self._error_frames(
                RuntimeError(f"internal error while streaming: {exc}")))
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


class Responder:
    """The serving pipeline as the HTTP routes use it: start a job for a falcon request,
    answer with JSON or SSE, count what only HTTP sees (in-band errors, early closes)."""

    def __init__(self, pipeline: ServingPipeline, metrics: Metrics | None = None):
        self.pipeline = pipeline
        self.metrics = metrics
        self.keepalive_s = float(pipeline.context.config["server.stream_keepalive_s"])

    def start(self, job: Job, req: falcon.Request, *, stream: bool) -> Generation:
        """Start ``job``; a typed error propagates to the app's error handlers.

        A stream whose first token takes longer than ``server.stream_keepalive_s`` starts
        anyway and carries a keep-alive that often, so clients with read timeouts do not
        give up on a long prefill.
        """
        return self.pipeline.start(job, client_gone=req.env.get("waitress.client_disconnected"),
                                   first_output_wait_s=self.keepalive_s if stream else None)

    def respond(self, resp: Any, generation: Generation, *, stream: bool,
                collect: Callable[[Generation], Any], frames: Callable[[], Iterator[bytes]],
                error_frames: Callable[[Exception], list[bytes]]) -> None:
        """Answer with ``collect(generation)`` as one JSON document or, when ``stream``,
        with an SSE body of ``frames()`` that aborts the generation if the client leaves
        early."""
        if not stream:
            try:
                resp.media = collect(generation)
            finally:
                generation.close()
            return
        resp.content_type = "text/event-stream"
        resp.set_headers(SSE_HEADERS)
        resp.stream = StreamBody(frames(), generation, error_frames, self._early_close)

    def stream_error(self, generation: Generation,
                     error_frames: Callable[[Exception], list[bytes]]) -> list[bytes]:
        """The frames that end a stream whose generation failed after the first byte."""
        if self.metrics is not None:
            self.metrics.stream_errors.labels(generation.model_id).inc()
        return error_frames(generation.failure or RuntimeError("generation failed"))

    def _early_close(self, generation: Generation) -> None:
        """A stream closed before its end: the client hung up (unless the watcher saw it first)."""
        if generation.request_id in self.pipeline.in_flight:
            self.pipeline.events.disconnected(generation.request_id)
