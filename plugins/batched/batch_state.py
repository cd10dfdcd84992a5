"""What the scheduler's parts share: one request's state and the batch's.

A request moves through four phases:

``waiting``
    queued (:attr:`BatchState.waiting`); the scheduler admits it in arrival order while
    fewer than ``max_batch_size`` requests are prefilling or decoding.
``prefilling``
    its prompt goes into its own KV cache chunk by chunk
    (:mod:`~omlx_core.plugins.batched.prefill_planner`,
    :mod:`~omlx_core.plugins.batched.prefill_runner`).
``decoding``
    the whole prompt is in the cache; the request is a row of the decode batch
    (:mod:`~omlx_core.plugins.batched.decode_batch`).
``done``
    its final output (``finish_reason`` and usage) is in its queue
    (:mod:`~omlx_core.plugins.batched.output_emitter`).

A decoding request can also be preempted back to ``waiting``
(:mod:`~omlx_core.plugins.batched.decode_budget`).
"""

from __future__ import annotations

import queue
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from omlx_core.engine import GenerationRequest

if TYPE_CHECKING:
    from omlx_core.memory.gate import ForwardGate
    from omlx_core.memory.types import LimitSnapshot

WAITING, PREFILLING, DECODING, DONE = "waiting", "prefilling", "decoding", "done"


@dataclass(eq=False)
class SequenceState:
    """One request's state inside the scheduler."""

    request: GenerationRequest
    outputs: queue.SimpleQueue
    prompt: list[int]
    seed: int
    phase: str = WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    cache: list[Any] | None = None
    prefilled: int = 0
    reused: int = 0
    stored_blocks: int = 0
    uid: int | None = None
    completion_tokens: int = 0
    #: ``time.monotonic()`` when the request reached the scheduler
    arrived: float = 0.0
    #: the request's sampler (``None``: greedy) and logits processors, made for its
    #: first token and handed on to the decode batch
    sampler: Any = None
    processors: tuple[Any, ...] = ()
    #: the grammar the output must follow (an ``omlx_core.grammar.GrammarConstraint``)
    grammar: Any = None
    #: what prefill feeds: the prompt, or after a preemption the prompt and the
    #: completion so far (all of which were in the KV cache it gave up)
    context: list[int] = field(default_factory=list)
    #: KV tokens the memory guard lets the request hold before it is asked again
    #: (``None``: not asked yet since it joined the decode batch)
    kv_allowance: int | None = None
    #: KV tokens beyond the next one a decode step may add to the request (the drafts
    #: a step verifies: :attr:`~.extensions.DraftVerify.lookahead`)
    kv_lookahead: int = 0
    #: times the request was preempted
    preemptions: int = 0
    #: the completion's token ids so far
    generated: list[int] = field(default_factory=list)
    #: ``time.monotonic()`` when its latest prefill began and its first token came
    prefill_started: float = 0.0
    first_token_at: float = 0.0
    #: draft tokens verified for the request and how many of them the model kept (its
    #: usage reports both: :class:`omlx_core.engine.Usage`)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def max_tokens(self) -> int:
        return int(self.request.sampling.max_tokens)  # type: ignore[arg-type]

    @property
    def prefill_target(self) -> int:
        """Tokens prefilled in chunks: all but the last, which the first-token forward
        feeds (:meth:`~.prefill_runner.PrefillRunner.first_tokens`)."""
        return len(self.context) - 1

    @property
    def kv_after_step(self) -> int:
        """KV tokens the request may hold once the next decode step has fed its latest
        token (and, while it verifies, drafts)."""
        return len(self.prompt) + self.completion_tokens + self.kv_lookahead


def new_sequence(request: GenerationRequest) -> SequenceState:
    """The scheduler state of a validated request."""
    seed = request.sampling.seed
    if seed is None:
        seed = secrets.randbits(63)
    prompt = [int(t) for t in request.prompt_tokens]
    return SequenceState(request=request, outputs=queue.SimpleQueue(), prompt=prompt,
                         seed=int(seed), context=prompt)


@dataclass
class StepCounters:
    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    #: model forwards that ran prefill chunks (several chunks can share one)
    prefill_forwards: int = 0
    #: forwards that fed prompts' last tokens and sampled their first tokens
    first_token_forwards: int = 0
    prompt_tokens_prefilled: int = 0
    tokens_generated: int = 0
    #: requests taken out of the decode batch to let older ones grow
    preempted: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})


class BatchState:
    """One model's requests by phase, the memory guard's latest word, the counters.

    Only the MLX thread changes it, except :attr:`limits` and :attr:`gate`, which the
    enforcer replaces whole (each decision reads them once)."""

    def __init__(self, *, model_id: str, model_config: Mapping[str, Any], max_batch_size: int) -> None:
        self.model_id = model_id
        self.model_config = model_config
        self.max_batch_size = max_batch_size
        self.waiting: deque[SequenceState] = deque()
        self.prefilling: list[SequenceState] = []
        #: the decode batch's rows by their uid in it
        self.decoding: dict[int, SequenceState] = {}
        #: every request admitted and not done, by request id
        self.by_id: dict[str, SequenceState] = {}
        self.gate: ForwardGate | None = None
        self.limits: LimitSnapshot | None = None
        self.counters = StepCounters()

    def running(self) -> int:
        """Requests prefilling or decoding."""
        return len(self.prefilling) + len(self.decoding)

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.prefilling) - len(self.decoding)


__all__ = ["BatchState", "SequenceState", "StepCounters", "new_sequence",
           "DECODING", "DONE", "PREFILLING", "WAITING"]
