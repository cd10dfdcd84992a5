"""What an engine is: the contract between the front end and every engine plugin.

An engine owns one loaded model. The HTTP layer tokenizes with the engine's own
tokenizer, submits a :class:`GenerationRequest`, and reads :class:`GenerationOutput`
items from the returned :class:`RequestHandle` until one carries a ``finish_reason``.
Closing the handle (or calling :meth:`Engine.abort`) cancels the request.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    from omlx_core.models.registry import ModelSpec

FINISH_REASONS = ("stop", "length", "abort", "error")

#: What kind of failure a ``finish_reason="error"`` output reports (``error_type``):
#: ``"memory"``: the request fit at admission but memory ran short while it ran (a
#: memory guard stopped it; retrying later can succeed); ``"invalid"``: the request
#: cannot be served as sent; ``"internal"``: an engine bug. ``None`` reads as internal.
ERROR_TYPES = ("memory", "invalid", "internal")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    # None: no logprobs; 0: the chosen token's; k > 0: also the k most likely.
    logprobs: int | None = None


@dataclass
class GenerationRequest:
    """A tokenized request, ready for an engine."""

    request_id: str
    prompt_tokens: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


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

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationOutput:
    """A step of one request: new text (possibly empty) and, on the last one, why it ended."""

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    #: with ``finish_reason="error"``: one of :data:`ERROR_TYPES` (``None``: internal)
    error_type: str | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle(abc.ABC):
    """Iterates a request's outputs; closing it aborts the request."""

    request_id: str

    @abc.abstractmethod
    def __iter__(self) -> Iterator[GenerationOutput]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Abort the request if it has not finished, and release its resources."""

    def __enter__(self) -> "RequestHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Engine(abc.ABC):
    """One loaded model, serving many requests."""

    #: the model this engine serves
    model: ModelSpec

    @abc.abstractmethod
    def start(self) -> None:
        """Load weights and start the engine's worker; returns when it can take requests."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Abort outstanding requests and stop the worker."""

    @abc.abstractmethod
    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of ``messages`` with the model's chat template and a generation prompt."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt, as the engine will prefill it."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; its outputs arrive through the handle."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request within one engine step and free its cache. Unknown ids are ignored."""

    def cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """Prompt tokens whose KV is already resident and would not be prefilled again."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and ``/health`` (queue depth, batch size, cache hits...)."""
        return {}
