"""The forward gate: where a memory guard can refuse a prefill chunk before its forward runs.

Once per scheduler step that has prefill work, the scheduler plans the chunks it is
about to run (at most ``engine.prefill_step_size`` tokens in all), describes them in a
:class:`PrefillStep` and, if a gate is installed
(:meth:`~omlx_core.plugins.batched.scheduler.Scheduler.set_forward_gate`), calls
``gate.check_prefill(step)`` *before any of those forwards runs*. The gate answers with
the request ids it refuses, each with a reason. A refused request ends at once with
``finish_reason="error"`` and that reason as its error; its partial KV cache is dropped;
every other chunk of the step runs as planned and the decode batch keeps going.

What the gate can rely on:

- forwards run one after another in the listed order. A chunk whose ``forward`` is
  ``None`` runs alone over its request's cache; chunks with the same ``forward`` number
  (several requests' chunks, adjacent in the list) share one forward, so their
  transient buffers (attention scores, activations) exist together. Only one forward's
  transients exist at a time, while each chunk's KV (``new_tokens``) stays resident
  afterwards. A shared forward also copies each member's cached prefix (at most
  ``chunk_size`` tokens: a chunk over a longer one runs alone) into its batch buffer
  and back out. When the gate refuses anything in a step with shared forwards, the
  scheduler asks again with every chunk alone (all ``forward`` ``None``) and acts on
  that second answer, so a refusal of a shared forward is provisional: a gate should
  not count or report it as final;
- a forward evaluates the cache state only, never the chunk's logits (a request's
  last prompt token is fed after the step's chunks, in a one-token forward whose
  logits are one row per request, as a decode step's are; requests share such a
  forward only when their cached prefixes are within ``chunk_size`` tokens and close
  in length, so its copy is bounded like a chunk forward's; it is not gated);
- ``limits`` is the latest :class:`~omlx_core.memory.types.LimitSnapshot` given to
  the scheduler's ``apply_memory_limits``, read once for this step;
- it is called on the MLX thread: it must be quick and must not wait on that thread.

An exception raised by the gate refuses every chunk of the step (the requests end with
an error naming the exception): a guard that cannot decide must not let a forward run.

**Post-forward backstop (optional).** A gate that also has ``check_after_prefill(step)``
is called once after each forward is evaluated (and mlx's buffer cache emptied), with
a :class:`PrefillStep` holding that forward's chunks (one, or several sharing a
``forward`` number). Of the ids it returns, the one whose request holds the most KV
(cached plus new tokens) ends at once with ``finish_reason="error"``,
``error_type="memory"`` and the given reason, and its cache is freed; the other
requests go on (the next check before a forward still guards them). It catches what
the estimate before the forward missed. An exception raised there is logged and lets
the requests go on (the forward has already run; the next check before a forward still
guards them).

Refusals from either check reach the client as ``error_type="memory"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    from omlx_core.memory.types import LimitSnapshot


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


@dataclass(frozen=True)
class PrefillStep:
    """Everything a gate is asked to judge in one scheduler step."""

    model_id: str
    chunks: tuple[PrefillChunk, ...]
    #: sequences in the decode batch during this step (their KV is already resident)
    decoding: int
    #: ``engine.prefill_step_size``: the most tokens one step prefills in all
    chunk_size: int
    limits: LimitSnapshot | None = None
    model_config: Mapping[str, Any] = field(default_factory=dict, compare=False)


class ForwardGate(Protocol):
    """What the scheduler calls before each step's prefill forwards."""

    def check_prefill(self, step: PrefillStep) -> Mapping[str, str] | None:
        """Request ids to refuse, each with the reason shown to the client; ``None`` or
        an empty mapping lets every chunk run."""


class PostForwardCheck(Protocol):
    """The optional backstop a :class:`ForwardGate` may also implement (the scheduler
    looks it up with ``getattr``)."""

    def check_after_prefill(self, step: PrefillStep) -> Mapping[str, str] | None:
        """Request ids to stop now that ``step``'s forward (one chunk, or several sharing
        it) has run, each with the reason shown to the client; ``None`` or an empty
        mapping lets them go on. Of several, only the request holding the most KV is
        stopped."""
