"""The encode contract: what the serving pipeline asks of an engine that answers with
vectors (embeddings) or relevance scores (reranking) instead of tokens.

Such an engine is an :class:`EncodingEngine`: a
:class:`~omlx_core.engine.GuardedEngine` whose :attr:`~omlx_core.engine.Engine.tasks`
name ``"embed"`` or ``"rerank"``. It lives in the same model pool as the chat engines
(loaded on demand, least recently used first out, pinned, kept alive) and under the same
memory guard, and the serving pipeline (:meth:`omlx_core.serving.ServingPipeline.encode`)
is its only caller, for HTTP and benchmarks alike. What it gets and gives:

- the pipeline tokenizes every input with the engine's own :meth:`EncodingEngine.tokenize_input`
  (a query or a document: an embedding model may put an instruction before queries)
  or :meth:`EncodingEngine.tokenize_pair` (a query and a document scored together, for
  a reranker), checks them against :meth:`EncodingEngine.encoding_limits` (too long:
  HTTP 400 naming the limit, unless the client asked to truncate; a token id outside
  the vocabulary: 400), runs preflight on the longest input alone (an input that can
  never fit: 413) and admission on the largest forward the request makes
  (:func:`largest_forward`), then calls :meth:`EncodingEngine.encode`;
- the engine batches inputs of every request it holds into shared forwards (padded,
  with attention masks), at most ``max_batch_tokens`` padded tokens and
  ``max_batch_rows`` rows each, and asks the forward gate before every forward exactly
  as a prefill does: each row of a forward is a
  :class:`~omlx_core.memory.gate.PrefillChunk` of its padded length sharing the
  forward's number, in a :class:`~omlx_core.memory.gate.PrefillStep` with
  ``encode=True`` (nothing is cached, so nothing stays held after it);
- its handle yields one final :class:`EncodeOutput`: a float32 ``(inputs, dimensions)``
  matrix for ``"embed"`` (pooled, and normalised when the model says so), one score per
  input for ``"score"``, or an error (a memory refusal carries its rejection).

The generation half of the :class:`~omlx_core.engine.Engine` contract does not apply:
the pipeline never calls it on an engine without the ``"generate"`` task, and the
defaults here refuse with ``ValueError`` (HTTP 400) if anything does.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from omlx_core.engine import GenerationRequest, GuardedEngine, RequestHandle

if TYPE_CHECKING:
    import numpy as np

    from omlx_core.memory.types import RequestRejected

#: what a model may be served for (``[models.<id>] task``): chat and completions,
#: vectors, relevance scores
TASKS = ("generate", "embed", "rerank")
#: what an :class:`EncodeRequest` asks for: a vector per input, or a relevance score
ENCODE_KINDS = ("embed", "score")
#: how a sequence's token states become one vector (``[models.<id>] pooling``)
POOLINGS = ("mean", "cls", "last")


@dataclass(frozen=True)
class EncodeInput:
    """One sequence to encode, exactly as the engine will run it (special tokens,
    instruction and template included)."""

    token_ids: tuple[int, ...]
    #: segment of each token (a query/document pair of a cross-encoder); ``None``: all 0
    token_type_ids: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class EncodeRequest:
    """A tokenized encode request, ready for an engine."""

    request_id: str
    #: ``"embed"``: a vector per input; ``"score"``: a relevance score per input (each a
    #: query/document pair from :meth:`EncodingEngine.tokenize_pair`)
    kind: str
    inputs: Sequence[EncodeInput]


@dataclass(frozen=True)
class EncodeOutput:
    """The end of an encode request: its vectors or scores, or why it failed."""

    request_id: str
    finish_reason: str
    #: ``"embed"``: float32 ``(len(inputs), dimensions)``, rows in input order
    vectors: np.ndarray | None = None
    #: ``"score"``: one relevance score per input, in input order
    scores: tuple[float, ...] | None = None
    #: tokens encoded (the inputs' lengths, padding not counted)
    tokens: int = 0
    error: str | None = None
    #: with ``finish_reason="error"``: ``"invalid"`` or ``"internal"`` (see
    #: :data:`omlx_core.engine.ERROR_TYPES`), or a memory refusal in ``rejected``
    error_type: str | None = None
    rejected: RequestRejected | None = None

    @property
    def finished(self) -> bool:
        return True


@dataclass(frozen=True)
class EncodingLimits:
    """What a started encoding engine takes; the pipeline checks requests against it."""

    #: longest input in tokens (special tokens included)
    max_length: int
    #: every token id is below it
    vocab_size: int
    #: length of the vectors ``"embed"`` returns (0: the engine does not embed)
    dimensions: int
    #: most padded tokens and rows one forward takes
    max_batch_tokens: int
    max_batch_rows: int
    #: whether a vector's first ``n`` values are themselves an embedding (Matryoshka
    #: training), so ``dimensions`` may shorten it
    matryoshka: bool = False
    #: whether ``"embed"`` vectors come normalised to unit length
    normalized: bool = True
    #: how ``"score"`` is computed, in words for the response (``None``: it is not)
    scoring: str | None = None


def largest_forward(lengths: Sequence[int], limits: EncodingLimits) -> tuple[int, int]:
    """``(rows, padded length)`` of the largest forward an engine may run for inputs of
    ``lengths`` alone: its longest inputs, as many as one forward takes. Admission
    reserves its estimate; the forward gate judges the forwards actually run."""
    longest = max(lengths)
    by_tokens = max(1, limits.max_batch_tokens // longest)
    return min(len(lengths), by_tokens, limits.max_batch_rows), longest


class EncodingEngine(GuardedEngine):
    """An engine that embeds or scores (see the module docstring)."""

    tasks: frozenset[str] = frozenset({"embed"})

    @abc.abstractmethod
    def encoding_limits(self) -> EncodingLimits:
        """Lengths, vocabulary, dimensions and batch caps of the started engine."""

    @abc.abstractmethod
    def tokenize_input(self, text: str, *, role: str = "document",
                       truncate_to: int | None = None) -> EncodeInput:
        """The sequence the engine encodes for ``text``; ``role`` is ``"query"`` or
        ``"document"`` (a model with an instruction puts it before queries only).
        ``truncate_to``: cut the text so the sequence holds at most that many tokens."""

    def tokenize_pair(self, query: str, document: str, *,
                      truncate_to: int | None = None) -> EncodeInput:
        """The one sequence a reranker scores for ``query`` and ``document`` (an engine
        that scores by embedding each side leaves this out)."""
        raise ValueError(f"model {self.model.id!r} does not score query/document pairs")

    @abc.abstractmethod
    def encode(self, request: EncodeRequest) -> RequestHandle:
        """Queue ``request``; its one :class:`EncodeOutput` arrives through the handle.
        ``ValueError`` for a request it cannot serve as sent (HTTP 400)."""

    # -- the generation half of the contract does not apply ------------------------------

    def _generates_nothing(self) -> ValueError:
        return ValueError(f"model {self.model.id!r} is served for {', '.join(sorted(self.tasks))}"
                          "; it does not generate text")

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        raise self._generates_nothing()

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenize_input(text).token_ids)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        raise self._generates_nothing()

    def detokenizer(self) -> Any:
        raise self._generates_nothing()


__all__ = ["ENCODE_KINDS", "POOLINGS", "TASKS", "EncodeInput", "EncodeOutput", "EncodeRequest",
           "EncodingEngine", "EncodingLimits", "largest_forward"]
