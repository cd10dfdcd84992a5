"""The scheduler's declared extension points, each with the behaviour text models get.

An engine that serves more than token prompts, or decodes more than one token per row
and step, hands the :class:`~.scheduler.Scheduler` its own implementations; it never
overrides the scheduler's methods.

- :class:`ChunkInputs`: what a prefill chunk's forward feeds (token ids, or input
  embeddings for a chunk that reaches an image), and what it encodes first.
- :class:`CacheKey`: what the prefix cache keys a request's tokens by.
- :class:`DraftVerify`: draft tokens for the decoding rows, verified in the decode
  step's forward.
- :class:`StepSync`: how the processes that serve one model together (``mx.distributed``
  ranks) agree on each step's arrivals, aborts and forward-gate answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

# The decode batch's own extension point is declared beside it, and listed here.
from omlx_core.scheduling.decode_batch import DraftVerify, NoDrafts
from omlx_core.scheduling.block_hashes import salted_keys

if TYPE_CHECKING:
    import mlx.core as mx

    from omlx_core.memory.gate import ForwardGate
    from omlx_core.scheduling.batch_state import SequenceState


@runtime_checkable
class ChunkInputs(Protocol):
    """The inputs of a prefill chunk's forward over context positions ``[start, end)``.

    Asked on the MLX thread only. A chunk fed as embeddings runs in a forward of its
    own (shared forwards feed token ids)."""

    def embeds(self, sequence: SequenceState, start: int, end: int) -> bool:
        """Whether the chunk's forward feeds input embeddings (:meth:`embeddings`)."""
        ...

    def encodes(self, sequence: SequenceState, start: int, end: int) -> int:
        """How many inputs (images) the chunk's forward encodes before it runs, for the
        forward gate (:attr:`~omlx_core.memory.gate.PrefillChunk.images`); 0 when it
        encodes nothing or already did."""
        ...

    def embeddings(self, sequence: SequenceState, start: int, end: int) -> mx.array:
        """The ``(end - start, hidden)`` input embeddings of the chunk's positions; may
        encode first, and may drop what no later chunk needs."""
        ...

    def release(self, sequence: SequenceState) -> None:
        """Drop what is held for ``sequence``: it finished, or gave its cache up."""
        ...

    def stats(self) -> Mapping[str, Any]:
        """Counters merged into the scheduler's :meth:`~.scheduler.Scheduler.stats`."""
        ...

    def close(self) -> None:
        """The scheduler shut down: drop every path to weights."""
        ...


class TokenInputs:
    """Every chunk feeds its token ids: nothing to encode or hold."""

    def embeds(self, sequence: SequenceState, start: int, end: int) -> bool:
        return False

    def encodes(self, sequence: SequenceState, start: int, end: int) -> int:
        return 0

    def embeddings(self, sequence: SequenceState, start: int, end: int) -> mx.array:
        raise TypeError("token prompts feed token ids; TokenInputs.embeds is never true")

    def release(self, sequence: SequenceState) -> None:
        pass

    def stats(self) -> Mapping[str, Any]:
        return {}

    def close(self) -> None:
        pass


@runtime_checkable
class CacheKey(Protocol):
    """What the prefix cache keys ``tokens`` by: they are a prefix of ``sequence``'s
    prompt followed by its completion. Equal keys must mean equal KV, so a prompt that
    holds more than its tokens (images) keys that in; the key of a prefix is the prefix
    of the key."""

    def __call__(self, sequence: SequenceState, tokens: Sequence[int]) -> Sequence[int]: ...


def token_key(sequence: SequenceState, tokens: Sequence[int]) -> Sequence[int]:
    """A text prompt's tokens are its key, in its ``cache_salt``'s key space."""
    return salted_keys(tokens, sequence.request.cache_salt)


@runtime_checkable
class StepSync(Protocol):
    """Makes every process that serves one model take the same steps.

    A model sharded over several processes runs each forward on all of them at once, so
    each must admit, prefill, preempt and abort exactly what the others do. The
    scheduler hands what it drained this step to :meth:`exchange` and applies what that
    returns; it asks the forward gate :meth:`gate` returns (one that answers the same on
    every process); it steps when :meth:`has_work` says so. Asked on the MLX thread,
    except :meth:`gate`.
    """

    def exchange(self, arrivals: list[SequenceState], aborts: list[str]
                 ) -> tuple[list[SequenceState], list[str]]:
        """The step's new requests and aborted request ids, as every process applies them."""
        ...

    def has_work(self, local: bool) -> bool:
        """Whether to step now; ``local`` is this scheduler's own answer."""
        ...

    def wake_at(self, local: float | None) -> float | None:
        """When :meth:`has_work` turns true (``time.monotonic()``); ``local`` is this
        scheduler's own answer."""
        ...

    def gate(self, gate: ForwardGate | None) -> ForwardGate | None:
        """The forward gate the scheduler asks, given the one the memory guard installed."""
        ...

    def failed(self, exc: BaseException) -> None:
        """A step raised ``exc`` (the scheduler then fails its in-flight requests)."""
        ...

    def close(self) -> None:
        """The scheduler shut down."""
        ...


class LocalSteps:
    """One process serves the model: its steps are its own."""

    def exchange(self, arrivals: list[SequenceState], aborts: list[str]
                 ) -> tuple[list[SequenceState], list[str]]:
        return arrivals, aborts

    def has_work(self, local: bool) -> bool:
        return local

    def wake_at(self, local: float | None) -> float | None:
        return local

    def gate(self, gate: ForwardGate | None) -> ForwardGate | None:
        return gate

    def failed(self, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["CacheKey", "ChunkInputs", "DraftVerify", "LocalSteps", "NoDrafts", "StepSync",
           "TokenInputs", "token_key"]
