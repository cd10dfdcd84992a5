"""The engine contract: what the serving pipeline may ask of every engine plugin.

An engine owns one loaded model. The serving pipeline (:mod:`omlx_core.serving`) is
its only caller in a server: it tokenizes with the engine's own tokenizer, checks the
request against :meth:`Engine.limits`, runs the memory guard, submits a
:class:`GenerationRequest` and reads :class:`GenerationOutput` items from the returned
:class:`RequestHandle` until one carries a ``finish_reason``. Closing the handle (or
:meth:`Engine.abort`) cancels the request.

**Engines speak tokens.** Outputs carry token ids (and logprobs), never text: the
pipeline's output processor (:mod:`omlx_core.serving.output`) detokenizes them with a
fresh :meth:`Engine.detokenizer`, matches the request's stop strings, builds logprob
bytes with :meth:`Engine.token_bytes`, and aborts the request (:meth:`Engine.abort`)
as soon as a stop string matched; tokens past it never reach a client.

**What ``submit`` must honour.** Every engine honours the fields of
:data:`REQUIRED_SAMPLING`: ``max_tokens`` (always set by the pipeline, never past the
room :meth:`Engine.limits` leaves; ``finish_reason="length"``), and the end-of-sequence
tokens and ``stop_token_ids`` (``finish_reason="stop"``; the stop token itself is not
put in ``token_ids``). ``sampling.stop`` (strings) is the pipeline's: engines ignore
it. The optional fields an engine honours are listed in its
:attr:`Engine.supported_sampling` (a complete ``grammar`` ends the request with
``"stop"``); the pipeline refuses a request that sets any other with HTTP 400, so an
engine never silently ignores a parameter. ``submit`` raises ``ValueError`` for a
request it cannot serve as sent (HTTP 400); anything else it raises is an engine
failure (HTTP 500).

**The host.** An engine is built as ``factory(model, host)``; the
:class:`~omlx_core.host.EngineHost` is its whole view of the server: settings, the MLX
thread, memory limits and the forward gate, lower cache tiers, and the sinks for
boundary snapshots and finished requests.

**Threads.** The pipeline calls an engine from many threads at once (one per HTTP
request). mlx work belongs on the process's one MLX thread (``host.thread``): an
engine attaches a :class:`~omlx_core.mlx_thread.Worker` to it and ``submit`` only
validates and enqueues. Nothing on the MLX thread may sleep or block on another thread.

**Memory.** An engine is memory-guarded when it is a :class:`GuardedEngine`: it
describes how it allocates (:meth:`GuardedEngine.memory_hints`) and asks the forward
gate before every prefill forward. The limits and the gate reach the object the
``resolve_scheduler`` hook finds for the engine (a
:class:`~omlx_core.memory.gate.MemoryReceiver`): its plugin's scheduler, or by default
``host.memory``, which an engine scheduling its own prefills reads. The server
refuses to start an engine that is not guarded, unless the operator lists its name in
``memory.unguarded_engines``; such an engine still gets preflight and admission, from
the conservative :func:`assumed_hints`, but no forward gate.
"""

from __future__ import annotations

import abc
import contextlib
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    from omlx_core.host import EngineHost
    from omlx_core.memory.types import RequestRejected
    from omlx_core.models.registry import ModelSpec

FINISH_REASONS = ("stop", "length", "abort", "error")

#: What kind of failure a ``finish_reason="error"`` output without a memory rejection
#: reports (``error_type``): ``"invalid"``: the request cannot be served as sent;
#: ``"internal"``: an engine bug. ``None`` reads as internal.
ERROR_TYPES = ("invalid", "internal")

#: Sampling fields every request may set and every engine serves (``stop`` strings
#: through the pipeline's output processor, the rest in the engine itself).
REQUIRED_SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                               "stop", "stop_token_ids"})
#: Sampling fields an engine may honour; it lists the ones it does in ``supported_sampling``.
OPTIONAL_SAMPLING = frozenset({"repetition_penalty", "presence_penalty", "frequency_penalty",
                               "logit_bias", "logprobs", "grammar"})


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy decoding.

    ``max_tokens`` is ``None`` only before the serving pipeline has settled it (from the
    request, else ``engine.max_tokens``, shortened to the context where allowed); an
    engine always receives a number.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    # None: no logprobs; 0: the chosen token's; k > 0: also the k most likely.
    logprobs: int | None = None
    #: constrain the output to a grammar (an :class:`omlx_core.grammar.GrammarSpec`: a
    #: JSON schema, any JSON, a regex, EBNF, a tool-call structure, a reasoning model's
    #: thinking followed by its constrained answer); the output ends when the grammar is
    #: complete. An engine that honours it masks every step's logits with the grammar's
    #: mask for that step (:class:`omlx_core.grammar.GrammarConstraint`): a thinking
    #: budget is a token limit inside the grammar, enforced by that mask alone. It raises
    #: :class:`omlx_core.grammar.GrammarError` from ``submit`` for one it cannot compile.
    grammar: Any = None

    def optional_fields_set(self) -> set[str]:
        """The :data:`OPTIONAL_SAMPLING` fields that differ from their neutral value."""
        neutral = SamplingParams()
        return {name for name in OPTIONAL_SAMPLING if getattr(self, name) != getattr(neutral, name)}


@dataclass(frozen=True)
class ImagePart:
    """An image a chat message carries, as the client sent it: not decoded yet.

    In ``messages`` it is the content part ``{"type": "image", "image": ImagePart}``
    (chat templates render ``{"type": "image"}`` parts as the model's image
    placeholder). Exactly one of ``data`` and ``path`` is set.
    """

    #: its position among the request's images, from 0
    index: int
    #: where the client put it, for error messages: ``"messages[0].content[1]"``
    param: str
    #: the encoded image (a data URL's or an Anthropic base64 block's bytes)
    data: bytes | None = None
    #: a local file the client named (``file://`` URL or path); an engine reads it only
    #: inside a directory its operator allowed
    path: str | None = None


def images_of(messages: Sequence[Mapping[str, Any]] | None) -> list[ImagePart]:
    """The :class:`ImagePart` items of ``messages``, in order."""
    found: list[ImagePart] = []
    for message in messages or ():
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            found.extend(part["image"] for part in content
                         if isinstance(part, Mapping) and part.get("type") == "image"
                         and isinstance(part.get("image"), ImagePart))
    return found


@dataclass
class GenerationRequest:
    """A tokenized request, ready for an engine."""

    request_id: str
    prompt_tokens: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: what the engine's :meth:`Engine.prepare_images` made of the request's images
    #: (``None``: a text-only request)
    images: Any = None
    #: the client's ``cache_salt``: an engine with a prefix cache keeps this request's
    #: entries apart from those of every other salt and of unsalted requests, so what it
    #: reports as cached tells a client nothing of another's prompts (``None``: unsalted)
    cache_salt: str | None = None
    #: prompt positions where later requests are likely to part from this one (the end
    #: of the system prompt, the start of the last message: :meth:`Engine.cache_points`);
    #: an engine whose cache cannot be cut at any token keeps its state there
    cache_points: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    #: a speculative engine's drafted tokens for this request, and how many of them the
    #: target accepted (both 0 for an engine that does not speculate)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationOutput:
    """A step of one request: new token ids (possibly none) and, on the last one, why it ended."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    #: with ``finish_reason="error"`` and no ``rejected``: one of :data:`ERROR_TYPES`
    error_type: str | None = None
    #: with ``finish_reason="error"``: the memory guard stopped the request (a forward
    #: gate refusal or the post-forward backstop); retrying later can succeed
    rejected: RequestRejected | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle(abc.ABC):
    """Iterates a request's outputs; closing it aborts the request."""

    request_id: str

    @abc.abstractmethod
    def __iter__(self) -> Iterator[GenerationOutput]: ...

    def next_output(self, timeout: float | None = None) -> GenerationOutput | None:
        """The next output, waiting at most ``timeout`` seconds (``None``: as long as it
        takes); ``None`` when none came in time. An iteration that ends without a final
        output reads as ``finish_reason="abort"``.

        The pipeline waits with a timeout so a stream can be kept alive during a long
        prefill. This default reads :meth:`__iter__` on a helper thread; a handle backed
        by a queue overrides it with a timed ``get``.
        """
        import queue
        import threading

        pump = self.__dict__.get("_pumped")
        if pump is None:
            pump = self.__dict__["_pumped"] = queue.SimpleQueue()

            def run() -> None:
                try:
                    for output in self:
                        pump.put(output)
                        if output.finished:
                            return
                except Exception as exc:  # handed to the reader as an internal failure
                    pump.put(GenerationOutput(self.request_id, finish_reason="error",
                                              error=f"{type(exc).__name__}: {exc}",
                                              error_type="internal"))
                    return
                pump.put(GenerationOutput(self.request_id, finish_reason="abort"))

            threading.Thread(target=run, name=f"omlx-handle-{self.request_id}", daemon=True).start()
        try:
            return pump.get(timeout=timeout)
        except queue.Empty:
            return None

    @abc.abstractmethod
    def close(self) -> None:
        """Abort the request if it has not finished, and release its resources."""

    def __enter__(self) -> "RequestHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class QueuedRequestHandle(RequestHandle):
    """A handle over a queue the engine's worker puts a request's outputs on; closing it
    (or dropping the last reference) before the final output calls ``abort(request_id)``."""

    def __init__(self, request_id: str, outputs: "queue.SimpleQueue[GenerationOutput]",
                 abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._abort = abort
        self._finished = False
        self._closed = False

    @property
    def finished(self) -> bool:
        return self._finished

    def __iter__(self) -> Iterator[GenerationOutput]:
        while not self._finished and not self._closed:
            output = self.next_output()
            if output is not None:
                yield output

    def next_output(self, timeout: float | None = None) -> GenerationOutput | None:
        try:
            output = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        self._finished = output.finished
        return output

    def close(self) -> None:
        if not self._finished and not self._closed:
            self._abort(self.request_id)
        self._closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to abort
            pass


@dataclass(frozen=True)
class EngineLimits:
    """What a started engine can take; the pipeline checks requests against it."""

    #: longest prompt + completion in tokens; ``None``: the model sets no limit
    context_length: int | None
    #: logits width: every token id (prompt, ``logit_bias``, stop ids) is below it
    vocab_size: int
    #: requests it runs at once (a batch); more wait in its queue
    max_running: int = 1


@dataclass(frozen=True)
class RequestProgress:
    """Where one request stands inside an engine right now (:meth:`Engine.progress`)."""

    request_id: str
    #: ``"waiting"`` (queued in the engine, or preempted and waiting to resume),
    #: ``"prefilling"`` or ``"decoding"``; an encoding engine's ``"encoding"`` (its
    #: ``prefilled_tokens`` of ``prefill_tokens`` encoded so far)
    phase: str
    prompt_tokens: int
    #: of ``prefill_tokens``, those prefilled so far
    prefilled_tokens: int = 0
    prefill_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int = 0
    #: 1 for the next request the engine starts (``"waiting"`` only)
    queue_position: int | None = None
    #: taken out of the decode batch for memory; it resumes where it was
    preempted: bool = False
    #: seconds since the engine took the request, since its prefill began, since its
    #: first token (0 until then)
    age_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class MemoryHints:
    """How an engine allocates, for the memory estimate (``estimate_peak``).

    The defaults are the conservative reading: an engine that does not know better
    is costed as evaluating every prompt position's logits and copying a reused prefix.
    """

    #: most prompt tokens one prefill forward takes
    prefill_step_size: int
    #: bytes per activation element of the loaded model (4 for float32)
    activation_dtype_bytes: int = 4
    #: whether prefill evaluates the logits of every prompt position (not only the last)
    prefill_full_logits: bool = True
    #: whether a reused cached prefix stays where it is (True) or is copied into the
    #: request's own cache, allocated again (False)
    cached_kv_resident: bool = False
    #: whether requests share a padded decode batch (a decode lane pads every row's
    #: KV to its longest): each then costs as much as the largest
    decode_batch_padded: bool = True
    #: bits of the quantized KV cache of its plain attention layers (``None``: the
    #: activation dtype), and the quantization's group size
    kv_bits: int | None = None
    kv_group_size: int = 64


class Engine(abc.ABC):
    """One loaded model, serving many requests.

    Built by its plugin's factory as ``factory(model, host)``: ``host`` (an
    :class:`~omlx_core.host.EngineHost`) is all the engine may use of the server.
    """

    #: the model this engine serves
    model: ModelSpec
    #: what the engine may use of the server (``None`` only for an engine that did not
    #: call ``Engine.__init__``)
    host: EngineHost | None = None
    #: what the engine serves (:data:`omlx_core.encoding.TASKS`): ``"generate"`` (chat and
    #: completions, through :meth:`submit`), ``"embed"`` and ``"rerank"`` (vectors and
    #: relevance scores, through an :class:`~omlx_core.encoding.EncodingEngine`'s ``encode``)
    tasks: frozenset[str] = frozenset({"generate"})
    #: the :data:`OPTIONAL_SAMPLING` fields this engine honours
    supported_sampling: frozenset[str] = frozenset()
    #: whether chat messages may carry images (:class:`ImagePart` content parts); the
    #: pipeline refuses them with HTTP 400 for an engine that does not
    accepts_images: bool = False

    def __init__(self, model: ModelSpec, host: EngineHost) -> None:
        self.model = model
        self.host = host

    @abc.abstractmethod
    def start(self) -> None:
        """Load weights and start the engine's worker; returns when it can take requests."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Abort outstanding requests and stop the worker."""

    @abc.abstractmethod
    def limits(self) -> EngineLimits:
        """Context length, vocabulary and batch size of the started engine."""

    @abc.abstractmethod
    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of ``messages`` with the model's chat template and a generation prompt.

        A template that rejects the messages raises ``ValueError`` (or jinja2's
        ``TemplateError``): the pipeline answers HTTP 400.
        """

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt, as the engine will prefill it."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; its outputs arrive through the handle."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request within one engine step and free its cache. Unknown ids are ignored."""

    def check_images(self, images: Sequence[ImagePart]) -> None:
        """Refuse images that break the engine's limits without decoding any (their
        count, their encoded size, where a local file lies): ``ValueError`` naming the
        part (HTTP 400). Called only when :attr:`accepts_images`."""
        raise ValueError(f"this engine takes no images ({images[0].param} is one)")

    def prepare_images(self, images: Sequence[ImagePart]) -> Any:
        """Decode and check ``images`` after preflight let the request through; what it
        returns goes to :meth:`tokenize_chat` (``images=``) and
        :attr:`GenerationRequest.images`. ``ValueError`` naming the part for an image
        that is not one, is truncated, empty or too large (HTTP 400).

        Until then, :meth:`tokenize_chat` without ``images`` counts every image at the
        most tokens it can take, so preflight never undercounts a prompt it has not
        decoded yet."""
        raise ValueError(f"this engine takes no images ({images[0].param} is one)")

    def chat_template(self) -> str | None:
        """The model's chat template text, if it has one: the pipeline reads from it how
        the model writes tool calls and whether it renders tools itself."""
        return None

    @abc.abstractmethod
    def detokenizer(self) -> Any:
        """A fresh streaming detokenizer for one request's completion (mlx-lm's
        interface: ``reset()``, ``add_token(id)``, ``finalize()``, ``last_segment``). An
        engine on an mlx-lm ``TokenizerWrapper`` returns ``tokenizer.detokenizer``, which
        is a new instance on every access."""

    def special_tokens(self) -> frozenset[str]:
        """The text of the tokenizer's special tokens (so a tool-call marker that is one
        is matched as a token)."""
        return frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` stands for (for logprobs)."""
        from omlx_core.models.tokens import token_texts

        return token_texts(self.model.path).bytes_of(token_id)

    def cache_points(self, messages: Sequence[Mapping[str, Any]], prompt_tokens: Sequence[int],
                     **template_kwargs: Any) -> tuple[int, ...]:
        """Where in ``prompt_tokens`` (what :meth:`tokenize_chat` made of ``messages``) the
        next requests of the same conversation or client are likely to part from this
        one, for :attr:`GenerationRequest.cache_points`. An engine that reuses a cached
        prefix at any token needs none (the default); one whose model has layers that can
        be resumed only where their state was kept (recurrent, sliding-window) keeps it
        at these positions. A hint: a wrong one costs reuse, never correctness."""
        return ()

    def cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """Prompt tokens whose KV is already resident and would not be prefilled again."""
        return 0

    def expecting(self) -> ContextManager[None]:
        """Held by the pipeline from a request's arrival until it is submitted or refused.

        Requests sent together reach :meth:`submit` tens of milliseconds apart (each is
        tokenized and checked first); an engine that gathers requests into one prefill
        forward can wait for those on their way instead of guessing with a fixed window.
        """
        return contextlib.nullcontext()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and ``/health``; include ``queue_depth`` (requests
        waiting in the engine) and ``running``. Nested dicts are flattened."""
        return {}

    def kv_cache_format(self) -> str | None:
        """The KV cache's format in words (e.g. ``"8-bit (group 64)"``), shown by ``ps``,
        ``/v1/models`` and the dashboard; ``None``: the engine does not say."""
        return None

    def progress(self) -> list[RequestProgress]:
        """Each request the engine holds, with its phase and token counts (the
        dashboard's "requests now"). Called from any thread; an engine that cannot tell
        returns an empty list."""
        return []


class GuardedEngine(Engine):
    """An engine the memory guard protects at every stage (see the module docstring)."""

    @abc.abstractmethod
    def memory_hints(self) -> MemoryHints:
        """How the started engine allocates (read for every estimate)."""

    def reclaimable_bytes(self) -> int:
        """Memory the engine holds only to go faster and gives back on demand (a prefix
        cache): the guard counts it as available, never as in use."""
        return 0

    def reclaim(self, nbytes: int) -> int:
        """Give back at least ``nbytes`` of :meth:`reclaimable_bytes` if there is that
        much (least recently used first); returns the bytes freed. Called from any
        thread, the MLX thread included, when a request needs the room."""
        return 0


#: the prefill step assumed for an engine that states none: mlx-lm's ``generate_step``
#: default, which engines built on ``stream_generate`` use
ASSUMED_PREFILL_STEP = 2048


def assumed_hints() -> MemoryHints:
    """The hints of an engine that gives none (one the operator let run unguarded)."""
    return MemoryHints(prefill_step_size=ASSUMED_PREFILL_STEP)


def memory_hints_of(engine: Engine) -> MemoryHints:
    """``engine``'s own hints, or :func:`assumed_hints` for an unguarded engine."""
    if isinstance(engine, GuardedEngine):
        return engine.memory_hints()
    return assumed_hints()
