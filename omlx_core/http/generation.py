"""One generation request from validated input to its last output, API-neutral.

Everything that can refuse a request runs in :meth:`Generations.start`, inside the
falcon responder and so before the status line is committed: model lookup, the
tokenization the engine will use, context checks, the memory guard's preflight (413)
and admission (503), submission, and the first output (an engine failure before the
first token is still an HTTP error: 503 with ``Retry-After`` when the engine reports a
memory shortage, ``error_type="memory"``, and 500 for anything else). Only a started
:class:`Generation` is streamed; an error after its first byte goes in-band.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping, Sequence

from omlx_core.engine import Engine, GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from omlx_core.http.errors import APIError, bad_request
from omlx_core.http.inflight import InFlight
from omlx_core.memory.types import AdmissionQueueFullError, PrefillMemoryExceededError

if TYPE_CHECKING:
    from omlx_core.http.metrics import Metrics
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)

ABORTED = "the request was aborted before it finished (the server is shutting down or the client left)"


@dataclass
class Job:
    """What to generate: exactly one of ``messages``, ``text`` or ``token_ids`` is the prompt."""

    model_id: str
    sampling: SamplingParams
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    #: False when max_tokens came from the server's default and may be shortened to fit
    max_tokens_given: bool = True
    #: the request parameter that carries the prompt, for error messages
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    id_prefix: str = "req-"


@dataclass
class Delta:
    """New text of a request and the logprobs of the tokens that produced it."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


def memory_rejection_error(error: PrefillMemoryExceededError) -> APIError:
    rejection = error.rejection
    breakdown = rejection.breakdown
    return APIError(413, str(error), code="prefill_memory_exceeded", param=None, extra={
        "estimated_bytes": rejection.estimated_bytes,
        "limit_bytes": rejection.limit_bytes,
        "binding_ceiling": rejection.binding,
        "ceilings": breakdown.ceilings() if breakdown is not None else {},
        "base_bytes": getattr(rejection, "base_bytes", 0),
        "prompt_tokens": rejection.prompt_tokens,
        "stage": rejection.stage,
        "advice": list(error.advice),
    })


def memory_shortage_error(reason: str, retry_after_s: float) -> APIError:
    """503 for a request a memory guard stopped while it ran: it fit at preflight and
    admission, but memory is short right now, so the same request can succeed later."""
    retry_after = max(1, int(round(retry_after_s)))
    return APIError(
        503, f"memory is short right now, so the request was stopped before its first token: "
             f"{reason}", code="memory_pressure", headers={"Retry-After": str(retry_after)},
        extra={"reason": reason, "stage": "forward", "retry_after_s": retry_after,
               "advice": [
                   "the request fit the memory limit when it was admitted; memory in use grew "
                   "since (other requests, other processes)",
                   f"retry after {retry_after} s, or send fewer concurrent or shorter requests"]})


def queue_full_error(error: AdmissionQueueFullError) -> APIError:
    retry_after = max(1, int(round(error.retry_after_s)))
    return APIError(503, str(error), code="admission_queue_full",
                    headers={"Retry-After": str(retry_after)},
                    extra={"retry_after_s": error.retry_after_s, "queue_size": error.queue_size})


class StopMatcher:
    """Cuts generated text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for s in self.stops if (i := self._pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.matched = next(s for s in self.stops if self._pending.find(s) == cut)
            out, self._pending = self._pending[:cut], ""
            return out
        # Release everything before the earliest suffix that could still become a stop string.
        start = max(0, len(self._pending) - self._hold)
        while start < len(self._pending) and not any(
                s.startswith(self._pending[start:]) for s in self.stops):
            start += 1
        out, self._pending = self._pending[:start], self._pending[start:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class Generation:
    """A submitted, primed request. Iterate :meth:`deltas`; read the outcome afterwards."""

    def __init__(self, *, request_id: str, engine: Engine, model_id: str, prompt_tokens: int,
                 sampling: SamplingParams, handle: Any, first: GenerationOutput,
                 outputs: Iterator[GenerationOutput], release: Callable[[], None],
                 metrics: Metrics | None):
        self.request_id = request_id
        self.engine = engine
        self.model_id = model_id
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.sampling = sampling
        self.finish_reason: str | None = None
        self.error: str | None = None
        #: the engine's ``error_type`` when it ended the request with an error
        self.error_type: str | None = None
        self.stop_sequence: str | None = None
        self._handle = handle
        self._first: GenerationOutput | None = first
        self._outputs = outputs
        self._release = release
        self._metrics = metrics
        self._closed = False
        self._lock = threading.Lock()

    def deltas(self) -> Iterator[Delta]:
        """New text as it arrives; sets ``finish_reason`` (and ``error``) when it ends."""
        stopper = StopMatcher(self.sampling.stop)
        engine_usage = None
        try:
            for output in self._all_outputs():
                self.completion_tokens += len(output.token_ids)
                text = stopper.feed(output.text)
                if stopper.matched is not None:
                    self.stop_sequence = stopper.matched
                    self.finish_reason = "stop"
                    self.close()  # the engine may not know this stop string; end it here
                    yield Delta(text, output.logprobs or ())
                    break
                if output.usage is not None:
                    engine_usage = output.usage
                if output.finished:
                    text += stopper.flush()
                    if text or output.logprobs:
                        yield Delta(text, output.logprobs or ())
                    self._finish(output)
                    break
                if text or output.logprobs:
                    yield Delta(text, output.logprobs or ())
            else:
                # A handle closed from outside (shutdown, disconnect watcher) just stops.
                self.finish_reason, self.error = "error", ABORTED
        except Exception as exc:
            log.exception("engine failed while generating request %s", self.request_id)
            self.finish_reason, self.error = "error", f"the engine failed: {exc}"
        finally:  # also when the client hung up and the stream was closed mid-way
            if engine_usage is not None and self.stop_sequence is None:
                self.completion_tokens = engine_usage.completion_tokens
                self.cached_tokens = engine_usage.cached_tokens
            if self._metrics is not None:
                self._metrics.completion_tokens.labels(self.model_id).inc(self.completion_tokens)
                if self.cached_tokens:
                    self._metrics.cached_prompt_tokens.labels(self.model_id).inc(self.cached_tokens)

    def _all_outputs(self) -> Iterator[GenerationOutput]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        yield from self._outputs

    def _finish(self, output: GenerationOutput) -> None:
        reason = output.finish_reason
        if reason == "error":
            self.finish_reason = "error"
            self.error = output.error or "the engine reported an error"
            self.error_type = output.error_type
        elif reason == "abort":
            self.finish_reason, self.error = "error", ABORTED
        else:
            self.finish_reason = reason

    def close(self) -> None:
        """Abort the request if it is still running and release its memory reservation."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._handle.close()
        finally:
            self._release()


class Generations:
    """Starts generation requests against the engines of a :class:`ServerContext`."""

    def __init__(self, context: ServerContext, metrics: Metrics | None = None,
                 in_flight: InFlight | None = None):
        self.context = context
        self.metrics = metrics
        self.in_flight = in_flight if in_flight is not None else InFlight(
            on_disconnect=self._count_disconnect)
        self.default_max_tokens = int(context.config.get("engine.max_tokens", 512) or 512)
        self.max_context = int(context.config.get("engine.max_context", 0) or 0)
        # The guard's high-water window (two polls): a shortage read now has aged out by then.
        self.memory_retry_after_s = 2 * float(context.config.get("memory.poll_interval_s", 1.0) or 1.0)

    def generation_error(self, generation: Generation) -> APIError:
        """The HTTP error for a generation that ended with an error before any byte was sent."""
        if generation.error_type == "memory":
            return memory_shortage_error(generation.error or "memory ran short",
                                         self.memory_retry_after_s)
        return APIError(500, generation.error or "generation failed", code="engine_error")

    def _count_disconnect(self, request_id: str) -> None:
        if self.metrics is not None:
            self.metrics.client_disconnects.inc()

    def early_close(self, generation: Generation) -> None:
        """A stream closed before its end: the client hung up (unless the watcher saw it first)."""
        if generation.request_id in self.in_flight:
            self._count_disconnect(generation.request_id)

    def stream_error(self, generation: Generation) -> None:
        if self.metrics is not None:
            self.metrics.stream_errors.labels(generation.model_id).inc()

    def engine(self, model_id: str) -> Engine:
        engine = self.context.engines.get(model_id)
        if engine is None:
            served = ", ".join(sorted(self.context.engines)) or "none"
            raise APIError(404, f"model {model_id!r} is not served here; served models: {served} "
                                "(GET /v1/models lists them)", code="model_not_found", param="model")
        return engine

    def context_limit(self, engine: Engine) -> int | None:
        if self.max_context > 0:
            return self.max_context
        config: Mapping[str, Any] = getattr(engine.model, "config", {}) or {}
        text_config = config.get("text_config") or {}
        limit = config.get("max_position_embeddings") or text_config.get("max_position_embeddings")
        return int(limit) if limit else None

    def start(self, job: Job, environ: Mapping[str, Any] | None = None) -> Generation:
        """Run every check, submit, and wait for the first output; raises :class:`APIError`."""
        arrived = time.monotonic()
        engine = self.engine(job.model_id)
        tokens = self._tokenize(engine, job)
        sampling = self._fit_to_context(engine, job, len(tokens))
        self._check_token_ids(engine, sampling)
        request_id = job.id_prefix + uuid.uuid4().hex
        release = self._reserve(engine, request_id, tokens, sampling.max_tokens)
        try:
            handle = engine.submit(GenerationRequest(request_id, tokens, sampling))
        except ValueError as exc:  # the engine's own check of an unservable request
            release()
            raise bad_request(f"the engine cannot serve this request: {exc}") from None
        except BaseException as exc:
            release()
            if isinstance(exc, Exception):
                raise self._error_before_first_output(exc, job) from exc
            raise
        try:
            client_gone = (environ or {}).get("waitress.client_disconnected")
            self.in_flight.add(request_id, handle, client_gone)
            outputs = iter(handle)
            first = next(outputs, None)
        except BaseException as exc:
            self._abandon(request_id, handle, release)
            if isinstance(exc, Exception) and not isinstance(exc, APIError):
                raise self._error_before_first_output(exc, job) from exc
            raise
        # A handle closed from outside (disconnect watcher, shutdown) ends without output.
        if first is None or first.finish_reason == "abort":
            self._abandon(request_id, handle, release)
            raise APIError(503, "the request was aborted before its first token (the client "
                                "disconnected or the server is shutting down)", code="aborted")
        if first.finish_reason == "error":
            self._abandon(request_id, handle, release)
            if first.error_type == "memory":
                raise memory_shortage_error(first.error or "memory ran short",
                                            self.memory_retry_after_s)
            raise APIError(500, "the engine failed before the first token: "
                                f"{first.error or 'finished with an error'}", code="engine_error")
        if self.metrics is not None:
            self.metrics.ttft.labels(job.model_id).observe(time.monotonic() - arrived)
            self.metrics.prompt_tokens.labels(job.model_id).inc(len(tokens))

        def release_all() -> None:
            self.in_flight.remove(request_id)
            release()

        return Generation(request_id=request_id, engine=engine, model_id=job.model_id,
                          prompt_tokens=len(tokens), sampling=sampling, handle=handle,
                          first=first, outputs=outputs, release=release_all,
                          metrics=self.metrics)

    def _abandon(self, request_id: str, handle: Any, release: Callable[[], None]) -> None:
        self.in_flight.remove(request_id)
        try:
            if handle is not None:
                handle.close()
        finally:
            release()

    def _error_before_first_output(self, exc: Exception, job: Job) -> APIError:
        if isinstance(exc, PrefillMemoryExceededError):
            self._count_rejection(exc)
            return memory_rejection_error(exc)
        if isinstance(exc, AdmissionQueueFullError):
            if self.metrics is not None:
                self.metrics.queue_full.inc()
            return queue_full_error(exc)
        log.error("engine failed before the first token of a request for %s", job.model_id,
                  exc_info=exc)
        return APIError(500, f"the engine failed before the first token: {type(exc).__name__}: "
                             f"{exc}", code="engine_error")

    def _count_rejection(self, error: PrefillMemoryExceededError) -> None:
        if self.metrics is not None:
            rejection = error.rejection
            self.metrics.rejections.labels(rejection.binding or "unknown", rejection.stage).inc()

    def _tokenize(self, engine: Engine, job: Job) -> list[int]:
        try:
            if job.messages is not None:
                tokens = engine.tokenize_chat(job.messages)
            elif job.text is not None:
                tokens = engine.tokenize(job.text)
            else:
                tokens = list(job.token_ids or [])
                vocab = self._vocab_size(engine)
                if vocab is not None and any(t >= vocab for t in tokens):
                    raise bad_request(f"{job.prompt_param} has token ids outside the vocabulary "
                                      f"(0..{vocab - 1})", job.prompt_param)
        except APIError:
            raise
        except Exception as exc:
            if not _is_template_error(exc):
                raise
            raise bad_request(f"the model's chat template rejected these messages: {exc}",
                              job.prompt_param) from None
        if not tokens:
            raise bad_request(f"{job.prompt_param} is empty after tokenization; give some text",
                              job.prompt_param)
        return list(tokens)

    def _vocab_size(self, engine: Engine) -> int | None:
        config: Mapping[str, Any] = getattr(engine.model, "config", {}) or {}
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        return int(vocab) if vocab else None

    def _fit_to_context(self, engine: Engine, job: Job, prompt_tokens: int) -> SamplingParams:
        sampling = job.sampling
        limit = self.context_limit(engine)
        if limit is None:
            return sampling
        if prompt_tokens >= limit:
            raise APIError(400, f"the prompt is {prompt_tokens} tokens, over this model's "
                                f"{limit}-token context; shorten it", code="context_length_exceeded",
                           param=job.prompt_param)
        room = limit - prompt_tokens
        if sampling.max_tokens > room:
            if job.max_tokens_given:
                raise APIError(400, f"{job.max_tokens_param}={sampling.max_tokens} does not fit: the "
                                    f"prompt is {prompt_tokens} tokens of a {limit}-token context, "
                                    f"so at most {room} can be generated",
                               code="context_length_exceeded", param=job.max_tokens_param)
            sampling = replace(sampling, max_tokens=room)
        return sampling

    def _check_token_ids(self, engine: Engine, sampling: SamplingParams) -> None:
        vocab = self._vocab_size(engine)
        if vocab is not None and any(t >= vocab for t in sampling.logit_bias):
            raise bad_request(f"logit_bias names token ids outside the vocabulary (0..{vocab - 1})",
                              "logit_bias")

    def _reserve(self, engine: Engine, request_id: str, tokens: list[int],
                 max_tokens: int) -> Callable[[], None]:
        """Preflight and admission; returns the callable that gives the reservation back."""
        guard = self.context.memory_guard
        if guard is None:
            return lambda: None
        try:
            guard.preflight(engine, request_id, tokens)
            if _accepts_keyword(guard.admit, "max_tokens"):
                # Reserve the KV the completion grows to, not just the prompt's.
                ticket: ContextManager[None] = guard.admit(engine, request_id, tokens,
                                                           max_tokens=max_tokens)
            else:
                ticket = guard.admit(engine, request_id, tokens)
            ticket.__enter__()
        except PrefillMemoryExceededError as exc:
            self._count_rejection(exc)
            raise memory_rejection_error(exc) from None
        except AdmissionQueueFullError as exc:
            if self.metrics is not None:
                self.metrics.queue_full.inc()
            raise queue_full_error(exc) from None
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                ticket.__exit__(None, None, None)

        return release


def _accepts_keyword(function: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _is_template_error(exc: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers needs jinja2
        TemplateError = ()  # type: ignore[assignment]
    return isinstance(exc, (TemplateError, ValueError, TypeError, KeyError))
