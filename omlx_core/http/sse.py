"""Server-sent events, the response body that ends a generation when it is closed, and
the :class:`Responder` through which every generating route uses the serving pipeline.

The status line is on the wire before the first frame, so nothing in here may raise: an
error after the first byte (memory that stayed short, a refusal of the engine, a bug in
a formatter) is sent in-band by the API's formatter, as an error frame plus the stream's
terminator rather than a truncated 200. A stream begins only after its request passed
every check that refuses it for good, so a 413 is always a status. Waitress calls
:meth:`StreamBody.close` when the stream ends or the client hangs up, and that aborts
the request and frees its memory.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

from omlx_core.serving import Generation, Job, RequestAborted, ServingPipeline

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


class PendingStart:
    """:meth:`ServingPipeline.start` on a thread of its own, so that a stream can begin,
    and carry keep-alives, while its request still waits for memory or its first token:
    a client with a read timeout does not give up on a request that is waiting its turn,
    and the request thread is free to answer its status line.

    ``start`` is given the callable to call once the request has passed every check
    that refuses it for good (:meth:`wait_checked`); the thread runs in the context of
    the request's thread (what it set for the request, such as the grammar compile
    queue's client, holds)."""

    def __init__(self, start: Callable[[Callable[[], None]], Generation]):
        self.generation: Generation | None = None
        self.error: BaseException | None = None
        self._checked = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._run, start), name="omlx-start",
                         daemon=True).start()

    def _run(self, start: Callable[[Callable[[], None]], Generation]) -> None:
        try:
            generation = start(self._checked.set)
        except BaseException as exc:  # handed to whoever waits: a status, or an error frame
            self.error = exc
        else:
            with self._lock:
                self.generation = generation
                abandoned = self._abandoned
            if abandoned:
                generation.close()
        finally:
            self._checked.set()
            self._done.set()

    def wait(self, timeout_s: float | None) -> bool:
        """Whether the start has ended (with a generation or an error) within ``timeout_s``."""
        return self._done.wait(timeout_s)

    def wait_checked(self, timeout_s: float | None) -> bool:
        """Whether the request passed its checks (or the start ended) within ``timeout_s``."""
        return self._checked.wait(timeout_s)

    def abandon(self) -> None:
        """The client left: close the generation now, or as soon as the start ends."""
        with self._lock:
            self._abandoned = True
            generation = self.generation
        if generation is not None:
            generation.close()


class StreamBody:
    """The WSGI response iterable of one streamed request: keep-alives while its start
    is pending, then the frames of its generation."""

    def __init__(self, pending: PendingStart, frames: Callable[[Generation], Iterator[bytes]],
                 error_frames: Callable[[Exception], list[bytes]], *, keepalive_s: float,
                 on_early_close: Callable[[Generation], None] | None = None,
                 on_start_error: Callable[[], None] | None = None):
        self._start = pending
        self._make_frames = frames
        self._frames: Iterator[bytes] | None = None
        self._error_frames = error_frames
        self._keepalive_s = keepalive_s
        self._on_early_close = on_early_close
        self._on_start_error = on_start_error
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
        if self._frames is None:
            if not self._start.wait(self._keepalive_s):
                return KEEPALIVE
            if self._start.generation is None:
                return self._end_in_error(self._start.error)
            self._frames = self._make_frames(self._start.generation)
        try:
            return next(self._frames)
        except StopIteration:
            self._done = True
            raise
        except Exception as exc:
            log.exception("formatting the stream of request %s failed",
                          self._start.generation.request_id)
            return self._end_in_error(RuntimeError(f"internal error while streaming: {exc}"))

    def _end_in_error(self, error: BaseException | None) -> bytes:
        """The stream's last frames: ``error`` in the API's own shape (a refusal that came
        after the status line, e.g. a model load that failed or never found room)."""
        self._done = True
        if self._frames is None and self._on_start_error is not None:
            self._on_start_error()
        if not isinstance(error, Exception):
            error = RuntimeError(f"the request ended before it started: {error!r}")
        self._pending = list(self._error_frames(error))
        if not self._pending:
            raise StopIteration
        return self._pending.pop(0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        generation = self._start.generation
        if generation is None:
            self._start.abandon()
            return
        try:
            close_frames = getattr(self._frames, "close", None)
            if close_frames is not None:
                close_frames()
        finally:
            if not self._done and self._on_early_close is not None:
                self._on_early_close(generation)
            generation.close()


class Responder:
    """The serving pipeline as the HTTP routes use it: start a job for a falcon request,
    answer with JSON or SSE, count what only HTTP sees (in-band errors, early closes)."""

    def __init__(self, pipeline: ServingPipeline, metrics: Metrics | None = None):
        self.pipeline = pipeline
        self.metrics = metrics
        self.keepalive_s = float(pipeline.context.config["server.stream_keepalive_s"])

    def serve(self, req: falcon.Request, resp: Any, job: Job, *, stream: bool,
              collect: Callable[[Generation], Any],
              frames: Callable[[Generation], Iterator[bytes]],
              error_frames: Callable[[Exception], list[bytes]]) -> None:
        """Start ``job`` and answer with ``collect(generation)`` as one JSON document or,
        when ``stream``, with an SSE body of ``frames(generation)`` that aborts the
        generation if the client leaves early.

        Every check that refuses a request for good (its model's load, tokenizing, the
        preflight: a 413) raises here and becomes its HTTP status, however long its
        model takes to load: no byte goes out before it. So does whatever refuses it
        within ``server.stream_keepalive_s`` after that (a full queue). A stream whose
        start takes longer (memory it waits for, a long prefill before the first token)
        starts anyway and carries a keep-alive that often; what refuses it after that (a
        retryable 503) ends the stream in-band.
        """
        client_gone = req.env.get("waitress.client_disconnected")
        if not stream:
            generation = self.pipeline.start(job, client_gone=client_gone)
            try:
                resp.media = collect(generation)
            finally:
                generation.close()
            return
        pending = PendingStart(lambda checked: self.pipeline.start(
            job, client_gone=client_gone, first_output_wait_s=self.keepalive_s,
            on_checked=checked))
        while not pending.wait_checked(self.keepalive_s):
            if client_gone is not None and client_gone():
                pending.abandon()
                raise RequestAborted("the client left before its request started")
        if pending.wait(self.keepalive_s) and pending.error is not None:
            raise pending.error
        resp.content_type = "text/event-stream"
        resp.set_headers(SSE_HEADERS)
        resp.stream = StreamBody(pending, frames, error_frames, keepalive_s=self.keepalive_s,
                                 on_early_close=self._early_close,
                                 on_start_error=lambda: self._count_stream_error(job.model_id))

    def stream_error(self, generation: Generation,
                     error_frames: Callable[[Exception], list[bytes]]) -> list[bytes]:
        """The frames that end a stream whose generation failed after the first byte."""
        self._count_stream_error(generation.model_id)
        return error_frames(generation.failure or RuntimeError("generation failed"))

    def _count_stream_error(self, model_id: str) -> None:
        """A stream of ``model_id`` ended with an in-band error."""
        if self.metrics is not None:
            self.metrics.stream_errors.labels(model_id).inc()

    def _early_close(self, generation: Generation) -> None:
        """A stream closed before its end: the client hung up (unless the watcher saw it first)."""
        if generation.request_id in self.pipeline.in_flight:
            self.pipeline.events.disconnected(generation.request_id)
