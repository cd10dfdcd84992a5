"""The forward gate: where a memory guard refuses a prefill chunk before its forward runs.

This is the part of the engine contract (:mod:`omlx_core.engine`) that an engine's
scheduler implements for the memory guard. The guard gives every engine's
:class:`MemoryReceiver` (found through the ``resolve_scheduler`` hook) the latest
:class:`~omlx_core.memory.types.LimitSnapshot` on every enforcer poll, and one
:class:`ForwardGate` to ask before prefill forwards.

Once per scheduler step that has prefill work, the scheduler plans the chunks it is
about to run, describes them in a :class:`PrefillStep` and calls
``gate.check_prefill(step)`` *before any of those forwards runs*. The gate answers with
the request ids it refuses, each with a :class:`~omlx_core.memory.types.RequestRejected`
(stage ``"forward"``). A refusal with ``wait`` set (the memory is held by what gives it
back by itself: requests of the engine that run on past the step, or a helper's work in
flight) preempts the request (``gate.suspend``): it waits, its finished chunks in the
prefix cache, until ``may_resume`` lets it back. Any other refused request ends at once
with ``finish_reason="error"`` and that rejection on its final output
(:attr:`~omlx_core.engine.GenerationOutput.rejected`). Either way its partial KV cache
is dropped; every other chunk of the step runs as planned.

What the gate can rely on:

- forwards run one after another in the listed order. A chunk whose ``forward`` is
  ``None`` runs alone over its request's cache; chunks with the same ``forward`` number
  (several requests' chunks, adjacent in the list) share one forward, so their
  transient buffers exist together. Only one forward's transients exist at a time,
  while each chunk's KV (``new_tokens``) stays resident afterwards. A shared forward
  also copies each member's cached prefix into its batch buffer and back out. When the
  gate refuses anything in a step with shared forwards, a scheduler may ask again with
  every chunk alone (all ``forward`` ``None``) and act on that second answer, so a
  refusal of a shared forward is provisional: a gate does not count it as final;
- ``limits`` is the latest snapshot given to ``apply_memory_limits``, read once;
- it is called on the MLX thread: it must be quick and must not wait on that thread.

An exception raised by the gate refuses every chunk of the step (the requests end with
an error naming the exception): a guard that cannot decide must not let a forward run.

**Decode growth and preemption.** Admission reserves a request's prompt and the KV of
its first completion tokens, not all ``max_tokens`` of them: decode grows in blocks.
Before a decode step after which some request would hold more KV tokens than the gate
last allowed it (:attr:`DecodePlan.allowed_tokens`; none yet for a request that just
joined the batch), the scheduler calls ``gate.check_decode(step)`` with every request
in its decode batch. The gate grows the allowances it can and names the requests to
**preempt**, youngest first. A preempted request leaves the decode batch at once
without ending: its KV goes to the prefix cache (or is dropped, to be recomputed), it
waits at the head of the scheduler's queue, and ``gate.may_resume(request_id)`` says
when it may prefill its prompt and completion so far again and go on. Its client sees
only a pause. The default implementations allow everything: a gate that does not
budget decode never preempts.

**Restoring cached KV.** A request that starts from a cached prefix gets its own copy
of that prefix's KV before any forward, and blocks of a lower tier (the SSD cache) are
read into memory to make it. Before anything is read or copied, the scheduler asks
``gate.room_for_restore(restore)`` with the bytes the restore brings in
(:class:`CacheRestore`); the gate answers how many of them fit now (after reclaiming
caches if they do not) and the scheduler reuses the longest prefix that fits in that,
or none: the request then prefills more, and its chunks are judged like any other.
The default lets everything in.

**Post-forward backstop.** ``gate.check_after_prefill(step)`` is called once after each
forward is evaluated (and mlx's buffer cache emptied), with a :class:`PrefillStep`
holding that forward's chunks. Of the ids it returns, the one whose request holds the
most KV (cached plus new tokens) ends at once with its rejection, and its cache is
freed; the others go on (the next check before a forward still guards them). An
exception raised there is logged and lets the requests go on.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from omlx_core.memory.types import LimitSnapshot, RequestRejected


@dataclass(frozen=True)
class PrefillChunk:
    """One forward the scheduler is about to run: ``new_tokens`` over ``cached_tokens``."""

    request_id: str
    #: prompt tokens this forward adds to the request's KV cache
    new_tokens: int
    #: tokens already in the request's KV cache (reused prefix plus earlier chunks)
    cached_tokens: int
    #: the request's whole prompt length
    prompt_tokens: int
    #: of ``cached_tokens``, how many came from the prefix cache rather than a forward
    reused_tokens: int = 0
    #: chunks with the same number share one forward; ``None``: this chunk runs alone
    forward: int | None = None
    #: images the forward encodes first (a vision model's prompt): their vision-tower
    #: activations and the prompt's merged embeddings come on top of the chunk's peak
    images: int = 0


@dataclass(frozen=True)
class PrefillStep:
    """Everything a gate is asked to judge in one scheduler step."""

    model_id: str
    chunks: tuple[PrefillChunk, ...]
    #: sequences in the decode batch during this step (their KV is already resident)
    decoding: int
    #: the engine's prefill step: the most tokens one step prefills in all
    chunk_size: int
    limits: LimitSnapshot | None = None
    #: requests of the engine prefilling or decoding in this step; while some that the
    #: gate does not refuse run on, a refused request waits for them (``wait``), so a
    #: gate counts only refusals with nothing to wait for as final
    running: int = 1
    model_config: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: the forwards encode (embeddings, relevance scores): each chunk is one row of a
    #: padded batch at the forward's width, nothing is cached and nothing stays held
    #: after the forward but its pooled outputs
    encode: bool = False


Refusals = Mapping[str, "RequestRejected"]


@dataclass(frozen=True)
class CacheRestore:
    """A request about to start from cached KV, before any of it is read or copied."""

    model_id: str
    request_id: str
    #: bytes the restore brings into memory if all of the cached prefix is reused: the
    #: request's own copy of its KV (in whole cache growth steps) and, while each is
    #: copied, the largest block read from a lower tier
    nbytes: int
    limits: LimitSnapshot | None = None


@dataclass(frozen=True)
class DecodeRow:
    """One request in the decode batch."""

    request_id: str
    #: KV tokens the request holds once the next decode step has run
    kv_tokens: int
    #: ``time.monotonic()`` when the request reached the engine: the youngest (latest)
    #: is preempted first
    arrived: float


@dataclass(frozen=True)
class DecodeStep:
    """The decode batch, when a request is about to grow past its allowance."""

    model_id: str
    rows: tuple[DecodeRow, ...]
    limits: LimitSnapshot | None = None
    model_config: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class DecodePlan:
    """The gate's answer to a :class:`DecodeStep`."""

    #: KV tokens each request may hold before the scheduler asks again (requests the
    #: plan does not name: ask again at the next step)
    allowed_tokens: Mapping[str, int]
    #: requests to take out of the decode batch now, to resume later
    preempt: tuple[str, ...] = ()


#: an allowance that never runs out (a gate with no budget for decode)
UNLIMITED_TOKENS = 1 << 62


def refusal_waits(running: int, refused: int, position: int) -> bool:
    """Whether a request refused before a forward waits rather than ends: the refusal at
    ``position`` (0-based, in the step's order) of ``refused`` requests refused in a
    step of ``running``. It waits while some request the step does not refuse runs on
    (it gives its memory back when it ends); when none does, every refused request but
    the last waits for the last one, which ends (its memory freed, the others are
    judged again without it)."""
    return running > refused or position < refused - 1


class ForwardGate(abc.ABC):
    """What a scheduler asks before (and after) each step's prefill forwards."""

    @abc.abstractmethod
    def check_prefill(self, step: PrefillStep) -> Refusals:
        """Request ids to refuse, each with its rejection; empty lets every chunk run."""

    @abc.abstractmethod
    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        """Request ids to stop now that ``step``'s forward has run; empty lets them go
        on. Of several, only the request holding the most KV is stopped."""

    def check_decode(self, step: DecodeStep) -> DecodePlan:
        """How far each request of the decode batch may grow, and whom to preempt."""
        return DecodePlan({row.request_id: UNLIMITED_TOKENS for row in step.rows})

    def may_resume(self, request_id: str) -> bool:
        """Whether a preempted request may prefill again and rejoin the batch now."""
        return True

    def room_for_restore(self, restore: CacheRestore) -> int:
        """How many of ``restore.nbytes`` may be brought into memory now (all of them
        when the answer is at least that): the scheduler reuses no more of the cached
        prefix than fits. The default lets everything in."""
        return restore.nbytes

    def suspend(self, request_id: str) -> None:
        """The scheduler preempted ``request_id`` on its own (a refused resume prefill):
        it holds no memory until :meth:`may_resume` lets it back."""


class MemoryReceiver(abc.ABC):
    """The object the enforcer publishes limits to: what ``resolve_scheduler`` returns.

    ``apply_memory_limits`` is called from the enforcer's thread on every poll;
    ``set_forward_gate`` once (and again if the guard is replaced). Both must only
    store what they are given: the scheduler reads it on its own thread.
    """

    @abc.abstractmethod
    def apply_memory_limits(self, snapshot: LimitSnapshot) -> None:
        """Keep the latest limit snapshot; the next decision reads it."""

    @abc.abstractmethod
    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        """Install (or with ``None`` remove) the gate asked before prefill forwards."""


__all__ = ["CacheRestore", "DecodePlan", "DecodeRow", "DecodeStep", "ForwardGate", "MemoryReceiver",
           "PrefillChunk", "PrefillStep", "Refusals", "UNLIMITED_TOKENS", "refusal_waits"]
