"""One request from a job to its last output: the checks, in the order they run.

(Embedding and rerank jobs take :meth:`ServingPipeline.encode`, whose checks, in the
same order on the same pool and memory guard, are in :mod:`omlx_core.serving.encode`.)

:meth:`ServingPipeline.start` does everything that can refuse a request before any work
is done for it or any byte is sent, then submits it and waits for its first output:

1. the model (:class:`UnknownModel`): a lease on its engine from the model pool, which
   loads a model that is not resident (a refusal of stage ``"load"``, or
   :class:`~omlx_core.pool.ModelLoadFailed`); the request holds the lease until it ends,
   so its model is not unloaded under it. Then the sampling fields its engine honours
   (:class:`InvalidRequest` naming the parameter);
2. tokenization with the engine's own tokenizer and chat template;
3. the engine's :meth:`~omlx_core.engine.Engine.limits`: the context settles
   ``max_tokens`` (its default, ``engine.max_tokens``, lives here and nowhere else),
   the vocabulary bounds every token id a request names;
4. the memory guard: preflight (a request that can never fit) and admission (one that
   fits alone but not next to the running ones waits): :class:`RequestRejected`;
5. ``engine.submit`` and the first output: a request the engine stops before its first
   token (a forward-gate refusal, a failure) is still refused here, with no byte sent.

Only a started :class:`Generation` is streamed. After its first output, a failure ends
the stream in-band: :attr:`Generation.failure` holds the typed error. A streaming caller
may bound the wait for the first output (``first_output_wait_s``): a long prefill then
starts the stream anyway and :meth:`Generation.deltas` yields keep-alive deltas until
the first token, so no client sits minutes without a byte; a refusal after that point
ends the stream in-band like any other failure.

Engines stream token ids (the contract in :mod:`omlx_core.engine`); the pipeline owns
text. Each :class:`Generation` runs its outputs through an
:class:`~omlx_core.serving.output.OutputProcessor`: detokenized with the engine's own
detokenizer, stop strings matched (never emitted, not even in part), logprob bytes
built. When a stop string matches, the generation aborts the engine request at once
(the engine frees it within one step) and tokens past the stop never reach the caller;
the engine never sees the stop strings.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from omlx_core.engine import (
    Engine,
    EngineLimits,
    GenerationOutput,
    GenerationRequest,
    ImagePart,
    RequestHandle,
    SamplingParams,
    images_of,
)
from omlx_core.grammar import GrammarBusy, GrammarError
from omlx_core.grammar.tool_call_formats import ToolCallFormat
from omlx_core.memory.types import RequestRejected
from omlx_core.pool import Lease
from omlx_core.serving.errors import EngineFailed, InvalidRequest, RequestAborted, UnknownModel
from omlx_core.serving.inflight import InFlight
from omlx_core.serving.output import LogprobEntry, OutputProcessor, ProcessedText
from omlx_core.serving.reasoning import (
    ReasoningRequest,
    ReplySplitter,
    plan_reply,
    reasoning_tokens,
    reply_formats,
)
from omlx_core.serving.tools import PreparedTools, ToolRequest, prepare

if TYPE_CHECKING:
    from omlx_core.memory.admission import AdmissionTicket
    from omlx_core.serving.encode import EncodeJob, EncodeResult
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)

ABORTED = "the request was aborted before it finished (the server is shutting down or the client left)"
#: how long a generation ended by a stop string waits for the engine's final output
#: (its usage: cached and drafted tokens) after aborting it; engines answer an abort
#: within one step, so this bounds only a stuck engine
STOP_DRAIN_S = 30.0


# -- what goes in -------------------------------------------------------------------------


@dataclass
class Job:
    """What to generate: exactly one of ``messages``, ``text`` or ``token_ids`` is the prompt.

    ``sampling.max_tokens`` is ``None`` when the client gave none: the pipeline then uses
    ``engine.max_tokens``, shortened to the context. A given value that does not fit the
    context is refused, unless ``max_tokens_is_cap`` (clients that send a cap rather
    than a wish, like Anthropic's): then it is shortened too.
    """

    model_id: str
    sampling: SamplingParams
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    max_tokens_is_cap: bool = False
    #: functions the model may call (chat requests only)
    tools: ToolRequest | None = None
    #: what the request asks of the model's thinking (ignored by a model that does not
    #: reason)
    reasoning: ReasoningRequest | None = None
    #: extra arguments for the engine's chat template (the client's
    #: ``chat_template_kwargs``; the pipeline adds ``tools`` and the reasoning's)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the request parameters that carry the prompt and max_tokens, for error messages
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    id_prefix: str = "req-"
    #: how long the model stays resident once idle, from this request on (Ollama's
    #: ``keep_alive``: seconds, a duration string, -1 forever, 0 unload when idle);
    #: ``None`` leaves the model's setting as it is
    keep_alive: Any = None
    #: the client's prefix-cache salt (:attr:`GenerationRequest.cache_salt`)
    cache_salt: str | None = None


# -- what can go wrong before the first byte ------------------------------------------------


class ServingEvents:
    """What the pipeline reports as requests run (the HTTP front end counts them in
    ``/metrics``). Every method is a no-op here; override what you need. Called on the
    request's thread; must not raise."""

    def admitted(self, model_id: str, prompt_tokens: int, ttft_s: float) -> None:
        """A request produced its first output ``ttft_s`` after it arrived."""

    def rejected(self, model_id: str, error: RequestRejected) -> None:
        """A memory guard refused a request, at any stage, before or after its first byte."""

    def encoded(self, model_id: str, inputs: int, tokens: int, seconds: float) -> None:
        """An embedding or rerank request was answered ``seconds`` after it arrived."""

    def finished(self, model_id: str, completion_tokens: int, cached_tokens: int) -> None:
        """A started request ended (completed, failed or aborted)."""

    def disconnected(self, request_id: str) -> None:
        """A request's client went away before it finished."""


@dataclass
class Delta:
    """New text of a request and the logprobs (with their bytes) of the tokens that
    produced it; a ``keepalive`` delta carries nothing and says the request is still
    being prefilled. For a chat reply, ``text`` is content only, ``reasoning`` the
    model's thinking and ``tool_events`` the tool-call pieces
    (:mod:`omlx_core.grammar.toolcalls` start, arguments and end events)."""

    text: str
    logprobs: tuple[LogprobEntry, ...] = ()
    keepalive: bool = False
    tool_events: tuple[Any, ...] = ()
    reasoning: str = ""


# -- a started request ------------------------------------------------------------------------


class Generation:
    """A submitted request that has produced its first output. Iterate :meth:`deltas`;
    read the outcome afterwards; :meth:`close` aborts it if it is still running."""

    def __init__(self, *, request_id: str, engine: Engine, model_id: str, prompt_tokens: int,
                 sampling: SamplingParams, handle: RequestHandle, first: GenerationOutput | None,
                 release: Callable[[], None], events: ServingEvents,
                 arrived: float, keepalive_s: float | None = None,
                 splitter: ReplySplitter | None = None):
        self.request_id = request_id
        self.engine = engine
        self.model_id = model_id
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.completion_tokens = 0
        #: of the completion tokens, those of the model's thinking
        self.reasoning_tokens = 0
        #: a speculative engine's drafted tokens and how many the target accepted
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.sampling = sampling
        #: ``"stop"`` or ``"length"`` for a completed request, ``"error"`` otherwise
        self.finish_reason: str | None = None
        #: why a request ended with ``"error"``: a typed error for the front end to render
        self.failure: Exception | None = None
        #: with ``finish_reason="stop"``: the stop string that ended the text, if one did
        self.stop_sequence: str | None = None
        self._handle = handle
        self._splitter = splitter
        self._output = OutputProcessor(
            engine.detokenizer(), sampling.stop,
            engine.token_bytes if sampling.logprobs is not None else None,
            track_token_starts=splitter is not None and splitter.thinking is not None)
        self._first: GenerationOutput | None = first
        #: whether the first output has been seen (``admitted`` is reported then)
        self._started = first is not None
        self._arrived = arrived
        self._keepalive_s = keepalive_s
        self._release = release
        self._events = events
        self._closed = False
        self._lock = threading.Lock()

    @property
    def error(self) -> str | None:
        return None if self.failure is None else str(self.failure)

    @property
    def tool_calls(self) -> list[Any]:
        """The complete tool calls the output made (``ToolCall``: id, name, arguments)."""
        return self._splitter.calls if self._splitter is not None else []

    def speculative_usage(self) -> dict[str, Any] | None:
        """The ``speculative`` object every API's usage carries for a request its engine
        drafted for (drafted and accepted tokens, their ratio); ``None`` when it drafted
        nothing."""
        drafted, accepted = self.draft_tokens, self.accepted_draft_tokens
        if not drafted:
            return None
        return {"drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4)}

    def deltas(self) -> Iterator[Delta]:
        """New text as it arrives; sets ``finish_reason`` (and ``failure``) when it ends."""
        usage = None
        try:
            for output in self._all_outputs():
                if output is None:
                    yield Delta("", keepalive=True)
                    continue
                if output.usage is not None:
                    usage = output.usage
                processed = self._output.add(output.token_ids, output.logprobs)
                completed = output.finish_reason in ("stop", "length")
                if completed and not self._output.stopped:
                    processed += self._output.finish()
                ended = output.finished or self._output.stopped
                delta = self._delta(processed, ended)
                if delta.text or delta.reasoning or delta.logprobs or delta.tool_events:
                    yield delta
                if self._output.stopped:
                    usage = self._stop_engine(output) or usage
                    self.finish_reason = "stop"
                    self.stop_sequence = self._output.stop_sequence
                    break
                if output.finished:
                    self._finish(output)
                    break
        except Exception as exc:
            log.exception("engine failed while generating request %s", self.request_id)
            self.finish_reason = "error"
            self.failure = EngineFailed(_in_the_log("the engine failed while generating", exc))
        finally:  # also when the client hung up and the stream was closed mid-way
            self.completion_tokens = self._output.completion_tokens
            if self._splitter is not None and self._output.token_starts is not None:
                self.reasoning_tokens = reasoning_tokens(self._output.token_starts,
                                                         self._splitter.reasoning_spans())
            if usage is not None:
                if not self._output.stopped:
                    self.completion_tokens = usage.completion_tokens
                self.cached_tokens = usage.cached_tokens
                self.draft_tokens = usage.draft_tokens
                self.accepted_draft_tokens = usage.accepted_draft_tokens
            self._events.finished(self.model_id, self.completion_tokens, self.cached_tokens)

    def _delta(self, processed: ProcessedText, ended: bool) -> Delta:
        if self._splitter is None:
            return Delta(processed.text, processed.logprobs)
        split = self._splitter.feed(processed.text)
        if ended:
            split += self._splitter.finish()
        return Delta(split.content, processed.logprobs, tool_events=split.tool_events,
                     reasoning=split.reasoning)

    def _stop_engine(self, last: GenerationOutput) -> Any:
        """A stop string matched: abort the engine request (it frees it within a step)
        and wait for its final output, whose usage (cached, drafted tokens) is returned."""
        if last.finished:
            return last.usage
        self._handle.close()
        deadline = time.monotonic() + STOP_DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            output = self._handle.next_output(left)
            if output is not None and output.finished:
                return output.usage
        log.warning("the engine did not end request %s within %.0f s of its abort on a stop "
                    "string", self.request_id, STOP_DRAIN_S)
        return None

    def _all_outputs(self) -> Iterator[GenerationOutput | None]:
        """The outputs, with ``None`` for every keep-alive interval that passed without
        the first one."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while True:
            output = self._handle.next_output(None if self._started else self._keepalive_s)
            if output is not None:
                output = self._with_piled_up(output)
            if output is not None and not self._started:
                self._started = True
                self._events.admitted(self.model_id, self.prompt_tokens,
                                      time.monotonic() - self._arrived)
            yield output
            if output is not None and output.finished:
                return

    def _with_piled_up(self, output: GenerationOutput) -> GenerationOutput:
        """``output`` merged with the outputs already waiting behind it: a reader that fell
        behind the engine (a slow client, a busy machine) catches up in one delta."""
        piled = [output]
        while not piled[-1].finished:
            more = self._handle.next_output(0)
            if more is None:
                break
            piled.append(more)
        return output if len(piled) == 1 else merge_outputs(piled)

    def _finish(self, output: GenerationOutput) -> None:
        reason = output.finish_reason
        if reason in ("stop", "length"):
            self.finish_reason = reason
            return
        self.finish_reason = "error"
        self.failure = _failure_of(output)
        if isinstance(self.failure, RequestRejected):
            self._events.rejected(self.model_id, self.failure)

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


def merge_outputs(outputs: list[GenerationOutput]) -> GenerationOutput:
    """One output holding the token ids and logprobs of ``outputs``, in order, and the
    last one's ending."""
    last = outputs[-1]
    logprobs = [lp for o in outputs if o.logprobs for lp in o.logprobs]
    return replace(last, token_ids=tuple(t for o in outputs for t in o.token_ids),
                   logprobs=tuple(logprobs) if any(o.logprobs is not None for o in outputs) else None)


def _failure_of(output: GenerationOutput) -> Exception:
    """The typed error of a final output that is not a completion."""
    if output.finish_reason == "abort":
        return RequestAborted(output.error or ABORTED)
    if output.rejected is not None:
        return output.rejected
    message = output.error or "the engine reported an error"
    if output.error_type == "invalid":
        return InvalidRequest(f"the engine cannot serve this request: {message}")
    # An internal failure's text (an exception's) is the operator's, not the client's.
    log.error("the engine failed request %s: %s", output.request_id, message)
    return EngineFailed(f"the engine failed request {output.request_id}; the server log "
                        "has the details")


def _in_the_log(what: str, exc: BaseException) -> str:
    """A client's message for a failure whose details only the log keeps."""
    return f"{what} ({type(exc).__name__}); the server log has the details"


# -- the pipeline ----------------------------------------------------------------------------


def cache_points_of(engine: Engine, job: Job, tokens: list[int]) -> tuple[int, ...]:
    """The engine's :meth:`~omlx_core.engine.Engine.cache_points` of a chat request: a
    hint, so a template that renders the partial conversations it asks about differently
    (or not at all) costs reuse, never the request."""
    if job.messages is None:
        return ()
    try:
        return tuple(engine.cache_points(job.messages, tokens, **job.template_kwargs))
    except Exception:  # noqa: BLE001 - a hint; the request itself was tokenized fine
        log.debug("cache points of %s failed", job.model_id, exc_info=True)
        return ()


class ServingPipeline:
    """Starts requests against the engines of a :class:`ServerContext`.

    :param context: the running server (configuration, engines, memory guard).
    :param events: told of admissions, rejections, ends and disconnects.
    """

    def __init__(self, context: ServerContext, events: ServingEvents | None = None):
        self.context = context
        self.events = events or ServingEvents()
        self.in_flight = InFlight(on_disconnect=self.events.disconnected)
        config = context.config
        self.default_max_tokens = int(config["engine.max_tokens"])
        self.max_context = int(config["engine.max_context"])

    # -- lookups -------------------------------------------------------------------------

    def engine(self, model_id: str) -> Engine:
        """The engine of a resident model (:class:`UnknownModel` when none serves it)."""
        engine = self.context.engines.get(model_id)
        if engine is None:
            raise UnknownModel(model_id, self.available())
        return engine

    def available(self) -> list[str]:
        """Every model a request may name: the pool's, or the engines of a hand-built
        context; resident ones first, in the order they were loaded (the default first)."""
        resident = list(self.context.engines)
        pool = self.context.pool
        if pool is None:
            return resident
        return resident + [r.id for r in pool.records() if r.id not in self.context.engines]

    def lease(self, model_id: str, keep_alive: Any = None) -> Lease | _FixedLease:
        """A hold on ``model_id``'s engine, loading the model when it is not resident.

        :raises UnknownModel: no such model is available.
        :raises InvalidRequest: ``keep_alive`` is malformed.
        """
        pool = self.context.pool
        if pool is None or pool.record(model_id) is None:
            return _FixedLease(self.engine(model_id))
        try:
            return pool.acquire(model_id, keep_alive=keep_alive)
        except ValueError as exc:
            raise InvalidRequest(f"keep_alive: {exc}", "keep_alive",
                                 "invalid_keep_alive") from None

    def context_length(self, limits: EngineLimits) -> int | None:
        """``engine.max_context`` when the operator set it, else the engine's own."""
        return self.max_context or limits.context_length

    def count_tokens(self, job: Job) -> int:
        """The prompt tokens ``job`` would prefill (chat template applied), without running
        it: what Anthropic's ``count_tokens`` answers."""
        lease = self.lease(job.model_id, job.keep_alive)
        try:
            engine = lease.engine
            job, _ = self._with_tools(engine, job, self._formats(engine, job.model_id))
            images = images_of(job.messages)
            if images:
                self._require_image_support(engine, job, images)
            return len(self._tokenize(engine, job, engine.limits()))
        finally:
            lease.release()

    def encode(self, job: EncodeJob, *, client_gone: Callable[[], bool] | None = None
               ) -> EncodeResult:
        """Embed or rerank: ``job`` through every check, its engine and back (the order
        is in :mod:`omlx_core.serving.encode`); the same errors as :meth:`start`."""
        from omlx_core.serving.encode import run_encode

        return run_encode(self, job, client_gone)

    # -- starting a request --------------------------------------------------------------

    def start(self, job: Job, *, client_gone: Callable[[], bool] | None = None,
              first_output_wait_s: float | None = None,
              on_checked: Callable[[], None] | None = None) -> Generation:
        """Run every check, submit, and wait for the first output.

        With ``first_output_wait_s``, wait that long at most: a request still in prefill
        then starts anyway, and its deltas carry a keep-alive every as many seconds
        until the first output (and any refusal after that comes in-band).
        ``on_checked`` is called once every check that refuses a request for good has
        passed (its model loaded, its prompt tokenized and preflighted): only waits that
        can end in a retryable refusal (memory, the first token) are left, so a stream
        may begin then without a 413 ever coming after its status line.

        :raises InvalidRequest: the request cannot be served as sent (its subclass
            :class:`UnknownModel` for a model not served here).
        :raises RequestRejected: the memory guard refused it (its model's load,
            preflight, admission, or a forward gate before its first token).
        :raises ModelLoadFailed: its model failed to load.
        :raises EngineFailed: the engine failed before the first output.
        :raises RequestAborted: it was aborted before its first output.
        """
        arrived = time.monotonic()
        try:
            lease = self.lease(job.model_id, job.keep_alive)
        except RequestRejected as error:
            self.events.rejected(job.model_id, error)
            raise
        try:
            return self._start(job, lease, arrived, client_gone, first_output_wait_s,
                               on_checked)
        except BaseException:
            lease.release()
            raise

    def _start(self, job: Job, lease: Lease | _FixedLease, arrived: float,
               client_gone: Callable[[], bool] | None,
               first_output_wait_s: float | None,
               on_checked: Callable[[], None] | None = None) -> Generation:
        engine = lease.engine
        # The engine may hold a batch window open for this request until it is
        # submitted: requests sent together then share one prefill forward.
        with engine.expecting():
            limits = engine.limits()
            formats = self._formats(engine, job.model_id)
            job, tools = self._with_tools(engine, job, formats)
            self._check_supported(engine, job)
            request_id = job.id_prefix + uuid.uuid4().hex
            images = images_of(job.messages)
            prepared = None
            if images:
                prepared = self._prepare_images(engine, job, images, limits, request_id)
                job = replace(job, template_kwargs={**job.template_kwargs, "images": prepared})
            tokens = self._tokenize(engine, job, limits)
            sampling = self._settle_max_tokens(job, limits, len(tokens))
            splitter, grammar = self._reply(engine, job, formats[0], tools, tokens)
            if grammar is not sampling.grammar:
                self._check_grammar_supported(engine, job, had_grammar=sampling.grammar is not None)
                sampling = replace(sampling, grammar=grammar)
            self._check_token_ids(sampling, limits)
            points = cache_points_of(engine, job, tokens)
            release = self._reserve(engine, request_id, tokens, sampling.max_tokens,
                                    images=len(images), on_checked=on_checked,
                                    salted=job.cache_salt is not None)
            try:
                # Stop strings are the output processor's: the engine never sees them.
                handle = engine.submit(GenerationRequest(request_id, tokens,
                                                         replace(sampling, stop=()),
                                                         images=prepared,
                                                         cache_salt=job.cache_salt,
                                                         cache_points=points))
            except GrammarError as exc:
                release()
                raise InvalidRequest(str(exc), exc.field, "invalid_grammar") from None
            except GrammarBusy:  # the compile queue is full now: 503, retry later
                release()
                raise
            except ValueError as exc:  # the engine's own check of an unservable request
                release()
                raise InvalidRequest(f"the engine cannot serve this request: {exc}") from None
            except Exception as exc:
                release()
                log.error("engine of %s failed to take a request", job.model_id, exc_info=exc)
                raise EngineFailed(_in_the_log("the engine failed to take the request",
                                               exc)) from exc
            except BaseException:
                release()
                raise
        first = self._first_output(request_id, handle, client_gone, release, job,
                                   first_output_wait_s)
        if first is not None:
            self.events.admitted(job.model_id, len(tokens), time.monotonic() - arrived)

        def release_all() -> None:
            self.in_flight.remove(request_id)
            try:
                release()
            finally:
                lease.release()

        return Generation(request_id=request_id, engine=engine, model_id=job.model_id,
                          prompt_tokens=len(tokens), sampling=sampling, handle=handle,
                          first=first, release=release_all, events=self.events,
                          arrived=arrived, keepalive_s=first_output_wait_s,
                          splitter=splitter)

    def _first_output(self, request_id: str, handle: RequestHandle,
                      client_gone: Callable[[], bool] | None, release: Callable[[], None],
                      job: Job, wait_s: float | None) -> GenerationOutput | None:
        """The first output; ``None`` when it did not come within ``wait_s``."""
        try:
            self.in_flight.add(request_id, handle, client_gone)
            first = handle.next_output(wait_s)
        except BaseException as exc:
            self._abandon(request_id, handle, release)
            if isinstance(exc, Exception):
                log.error("engine failed before the first output of a request for %s",
                          job.model_id, exc_info=exc)
                raise EngineFailed(_in_the_log("the engine failed before the first token",
                                               exc)) from exc
            raise
        if first is None:
            return None
        if first.finish_reason == "abort":
            self._abandon(request_id, handle, release)
            raise RequestAborted(first.error or "the request was aborted before its first token "
                                 "(the client disconnected or the server is shutting down)")
        if first.finished and first.finish_reason not in ("stop", "length"):
            self._abandon(request_id, handle, release)
            failure = _failure_of(first)
            if isinstance(failure, RequestRejected):
                self.events.rejected(job.model_id, failure)
            raise failure
        return first

    def _abandon(self, request_id: str, handle: RequestHandle, release: Callable[[], None]) -> None:
        self.in_flight.remove(request_id)
        try:
            handle.close()
        finally:
            release()

    # -- the checks ------------------------------------------------------------------------

    def _formats(self, engine: Engine, model_id: str) -> tuple[str, ToolCallFormat | None]:
        return reply_formats(self.context.config.models.get(model_id), engine.chat_template())

    def _with_tools(self, engine: Engine, job: Job, formats: tuple[str, ToolCallFormat | None]
                    ) -> tuple[Job, PreparedTools | None]:
        """``job`` with its tools rendered for the engine's template and their grammar,
        and the chat-template arguments of its reasoning (for a model that reasons)."""
        reasoning_format, tool_format = formats
        if job.messages is not None and job.reasoning is not None and reasoning_format != "none":
            derived = job.reasoning.template_kwargs(engine.chat_template())
            job = replace(job, template_kwargs={**derived, **job.template_kwargs})
        if job.tools is None or job.messages is None:
            return job, None
        if job.sampling.grammar is not None:
            raise InvalidRequest("response_format and tools cannot be used together; send one",
                                 "response_format")
        try:
            prepared = prepare(job.tools, job.messages, engine.chat_template(),
                               engine.special_tokens(), tool_format)
        except GrammarError as exc:
            raise InvalidRequest(str(exc), exc.field, "invalid_tools") from None
        job = replace(job, messages=prepared.messages,
                      template_kwargs={**job.template_kwargs, **prepared.template_kwargs},
                      sampling=replace(job.sampling, grammar=prepared.grammar))
        return job, prepared

    def _reply(self, engine: Engine, job: Job, reasoning_format: str, tools: PreparedTools | None,
               tokens: list[int]) -> tuple[ReplySplitter | None, Any]:
        """How a chat reply is split and the grammar it is generated under (a completion's
        text is not split)."""
        if job.messages is None:
            return None, job.sampling.grammar
        try:
            return plan_reply(engine, tokens, reasoning_format=reasoning_format, request=job.reasoning,
                              tools=tools, answer=job.sampling.grammar)
        except GrammarError as exc:
            raise InvalidRequest(str(exc), exc.field, "invalid_grammar") from None

    def _check_grammar_supported(self, engine: Engine, job: Job, *, had_grammar: bool) -> None:
        """A grammar the reply needs beyond what the request sent (its thinking budget)
        needs an engine that honours ``grammar``."""
        if "grammar" in engine.supported_sampling:
            return
        if had_grammar:
            self._check_supported(engine, job)
            return
        param = job.reasoning.budget_param if job.reasoning is not None else "grammar"
        raise InvalidRequest(
            f"the engine serving model {job.model_id!r} cannot cap the model's thinking: it "
            f"does not honour grammar; leave {param} out or serve the model with the "
            "'batched' engine", param)

    def _check_supported(self, engine: Engine, job: Job) -> None:
        unsupported = sorted(job.sampling.optional_fields_set() - set(engine.supported_sampling))
        if unsupported:
            raise InvalidRequest(
                f"the engine serving model {job.model_id!r} does not support "
                f"{', '.join(unsupported)}; leave {'them' if len(unsupported) > 1 else 'it'} "
                "unset or serve the model with the 'batched' engine", unsupported[0])

    def _prepare_images(self, engine: Engine, job: Job, images: list[ImagePart],
                        limits: EngineLimits, request_id: str) -> Any:
        """Check a chat request's images, preflight it with each image at the most tokens
        it can take, and only then decode them (:meth:`Engine.prepare_images`)."""
        self._require_image_support(engine, job, images)
        guard = self.context.memory_guard
        if guard is not None:
            # Before any image is decoded: the bound counts each at its largest.
            bound = self._tokenize(engine, job, limits)
            sampling = self._settle_max_tokens(job, limits, len(bound))
            try:
                guard.preflight(engine, request_id, bound, max_tokens=sampling.max_tokens or 0,
                                images=len(images))
            except RequestRejected as error:
                self.events.rejected(engine.model.id, error)
                raise
        try:
            return engine.prepare_images(images)
        except ValueError as exc:
            raise InvalidRequest(str(exc), _image_param(exc, images), "invalid_image") from None

    def _require_image_support(self, engine: Engine, job: Job, images: list[ImagePart]) -> None:
        """Refuse images a text-only engine would get, or that break the engine's limits
        before any is decoded (count, size, where a local file lies)."""
        if not engine.accepts_images:
            raise InvalidRequest(
                f"model {job.model_id!r} takes text only: its engine does not accept images "
                f"({images[0].param} is one); remove the image parts, or ask for a vision "
                "model (one served with engine = \"vlm\")", images[0].param, "images_not_supported")
        try:
            engine.check_images(images)
        except ValueError as exc:
            raise InvalidRequest(str(exc), _image_param(exc, images), "invalid_image") from None

    def _tokenize(self, engine: Engine, job: Job, limits: EngineLimits) -> list[int]:
        try:
            if job.messages is not None:
                tokens = engine.tokenize_chat(job.messages, **job.template_kwargs)
            elif job.text is not None:
                tokens = engine.tokenize(job.text)
            else:
                tokens = list(job.token_ids or [])
                if any(not 0 <= t < limits.vocab_size for t in tokens):
                    raise InvalidRequest(f"{job.prompt_param} has token ids outside the "
                                         f"vocabulary (0..{limits.vocab_size - 1})",
                                         job.prompt_param)
        except InvalidRequest:
            raise
        except Exception as exc:
            if not _is_template_error(exc):
                raise
            raise InvalidRequest(f"the model's chat template rejected these messages: {exc}",
                                 job.prompt_param) from None
        if not tokens:
            raise InvalidRequest(f"{job.prompt_param} is empty after tokenization; give some "
                                 "text", job.prompt_param)
        return list(tokens)

    def _settle_max_tokens(self, job: Job, limits: EngineLimits, prompt_tokens: int) -> SamplingParams:
        requested = job.sampling.max_tokens
        max_tokens = self.default_max_tokens if requested is None else requested
        limit = self.context_length(limits)
        if limit is not None:
            if prompt_tokens >= limit:
                raise InvalidRequest(f"the prompt is {prompt_tokens} tokens, over this model's "
                                     f"{limit}-token context; shorten it", job.prompt_param,
                                     "context_length_exceeded")
            room = limit - prompt_tokens
            if max_tokens > room:
                if requested is not None and not job.max_tokens_is_cap:
                    raise InvalidRequest(
                        f"{job.max_tokens_param}={max_tokens} does not fit: the prompt is "
                        f"{prompt_tokens} tokens of a {limit}-token context, so at most "
                        f"{room} can be generated", job.max_tokens_param, "context_length_exceeded")
                max_tokens = room
        return replace(job.sampling, max_tokens=max_tokens)

    def _check_token_ids(self, sampling: SamplingParams, limits: EngineLimits) -> None:
        vocab = limits.vocab_size
        for param, ids in (("logit_bias", sampling.logit_bias), ("stop_token_ids", sampling.stop_token_ids)):
            if any(not 0 <= int(t) < vocab for t in ids):
                raise InvalidRequest(f"{param} names token ids outside the vocabulary "
                                     f"(0..{vocab - 1})", param)

    def _reserve(self, engine: Engine, request_id: str, tokens: list[int],
                 max_tokens: int, images: int = 0,
                 on_checked: Callable[[], None] | None = None,
                 salted: bool = False) -> Callable[[], None]:
        """Preflight and admission; returns the callable that gives the reservation back.
        ``on_checked`` is called between the two."""
        guard = self.context.memory_guard
        if guard is None:
            if on_checked is not None:
                on_checked()
            return lambda: None
        try:
            guard.preflight(engine, request_id, tokens, max_tokens=max_tokens, images=images,
                            salted=salted)
            if on_checked is not None:
                on_checked()
            ticket: AdmissionTicket = guard.admit(engine, request_id, tokens, max_tokens=max_tokens,
                                                  images=images, salted=salted)
        except RequestRejected as error:
            self.events.rejected(engine.model.id, error)
            raise
        return ticket.release

    def close(self) -> int:
        """Abort every in-flight request (their streams end with an in-band error)."""
        aborted = self.in_flight.abort_all()
        self.in_flight.stop()
        return aborted


class _FixedLease:
    """The engine of a context built without a pool: nothing to hold or release."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def release(self) -> None:
        pass


def _image_param(exc: Exception, images: list[ImagePart]) -> str:
    """The image part an engine's message names (it starts with the part's param)."""
    message = str(exc)
    named = [part.param for part in images if message.startswith(part.param)]
    return max(named, key=len) if named else images[0].param


def _is_template_error(exc: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers needs jinja2
        TemplateError = ()  # type: ignore[assignment]
    # RecursionError: a template walking a structure the client nested thousands deep
    return isinstance(exc, (TemplateError, ValueError, TypeError, KeyError, RecursionError))
