"""One request's state in the scheduler, and the batch's.

A request moves through four :class:`Phase` values, and only the
:class:`~omlx_core.scheduling.scheduler.Scheduler` moves it (its ``_to_*`` methods and
``_finish``):

``WAITING``
    queued (:attr:`BatchState.waiting`); the scheduler admits it in arrival order while
    fewer than ``max_batch_size`` requests are prefilling or decoding.
``PREFILLING``
    its prompt goes into its own KV cache chunk by chunk
    (:mod:`~omlx_core.scheduling.prefill_planner`, :mod:`~omlx_core.scheduling.prefill_runner`).
``DECODING``
    the whole prompt is in the cache; the request is a row of a lane of the decode batch
    (:mod:`~omlx_core.scheduling.decode_batch`), which feeds it one token (or a token
    and its drafts) a step.
``DONE``
    its final output (``finish_reason`` and usage) is in its queue.

A decoding or prefilling request can also go back to ``WAITING`` (preempted by the
memory guard, :mod:`~omlx_core.scheduling.decode_budget`).

Everything the scheduler knows of a request lives in its :class:`SequenceState`: its
tokens, sampler and logits processors, stop tokens, KV cache while it prefills, draft
state and counters. The decode batch's lanes hold the rows' caches merged (a batch
cache needs one array per layer for all its rows) and the tokens each row feeds next.
"""

from __future__ import annotations

import enum
import queue
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from omlx_core.engine import GenerationRequest, RequestProgress

if TYPE_CHECKING:
    from omlx_core.memory.gate import ForwardGate
    from omlx_core.memory.types import LimitSnapshot


class Phase(enum.Enum):
    """Where a request is in the scheduler (see the module)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


WAITING, PREFILLING, DECODING, DONE = Phase.WAITING, Phase.PREFILLING, Phase.DECODING, Phase.DONE


@dataclass(eq=False)
class SequenceState:
    """One request's state inside the scheduler."""

    request: GenerationRequest
    outputs: queue.SimpleQueue
    prompt: list[int]
    seed: int
    phase: Phase = Phase.WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    #: its own KV cache, while it prefills (a decoding row's is in its lane's batch cache)
    cache: list[Any] | None = None
    prefilled: int = 0
    reused: int = 0
    stored_blocks: int = 0
    completion_tokens: int = 0
    #: ``time.monotonic()`` when the request reached the scheduler
    arrived: float = 0.0
    #: the request's sampler (``None``: greedy) and logits processors, made for its
    #: first token and kept for every later one
    sampler: Any = None
    processors: tuple[Any, ...] = ()
    #: tokens that end it with ``finish_reason="stop"`` (end of sequence and the
    #: request's ``stop_token_ids``)
    stop_ids: frozenset[int] = frozenset()
    #: the grammar the output must follow (an ``omlx_core.grammar.GrammarConstraint``)
    grammar: Any = None
    #: what prefill feeds: the prompt, or after a preemption the prompt and the
    #: completion so far (all of which were in the KV cache it gave up)
    context: list[int] = field(default_factory=list)
    #: the tokens its logits processors read (context and every token fed since), kept
    #: as an mlx buffer while it decodes with processors other than a logit bias
    history: Any = None
    #: KV tokens the memory guard lets the request hold before it is asked again
    #: (``None``: not asked yet since it joined the decode batch)
    kv_allowance: int | None = None
    #: KV tokens beyond the next one a decode step may add to the request (the drafts
    #: a step verifies: :attr:`~.extensions.DraftVerify.lookahead`)
    kv_lookahead: int = 0
    #: whether the token its lane feeds it next was handed out already (its first
    #: token, sampled by prefill): the step that feeds it hands nothing out for it
    fed_token_out: bool = False
    #: the speculation's state for this request (a drafter's), while it decodes
    draft: Any = None
    #: draft tokens verified for it, and how many of them were kept
    drafted: int = 0
    accepted: int = 0
    #: times the request was preempted
    preemptions: int = 0
    #: the completion's token ids so far
    generated: list[int] = field(default_factory=list)
    #: ``time.monotonic()`` when its latest prefill began and its first token came
    prefill_started: float = 0.0
    first_token_at: float = 0.0

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
    def length(self) -> int:
        """Tokens of prompt and completion so far."""
        return len(self.prompt) + self.completion_tokens

    @property
    def kv_after_step(self) -> int:
        """KV tokens the request may hold once the next decode step has fed its latest
        token (and, while it verifies, drafts)."""
        return self.length + self.kv_lookahead


def new_sequence(request: GenerationRequest) -> SequenceState:
    """The scheduler state of a validated request."""
    seed = request.sampling.seed
    if seed is None:
        seed = secrets.randbits(63)
    prompt = [int(t) for t in request.prompt_tokens]
    return SequenceState(request=request, outputs=queue.SimpleQueue(), prompt=prompt,
                         seed=int(seed), context=prompt)


def progress_of(sequences: Iterable[SequenceState], queued: Sequence[SequenceState]
                ) -> list[RequestProgress]:
    """What the dashboard shows of ``sequences`` (``queued``: the waiting ones, in line)."""
    now = time.monotonic()
    places = {s.request_id: i for i, s in enumerate(queued, 1)}
    rows = []
    for sequence in sequences:
        phase = sequence.phase
        rows.append(RequestProgress(
            request_id=sequence.request_id,
            phase=(DECODING if phase is DONE else phase).value,
            prompt_tokens=len(sequence.prompt), prefilled_tokens=sequence.prefilled,
            prefill_tokens=max(0, len(sequence.context) - 1),
            completion_tokens=sequence.completion_tokens, max_tokens=sequence.max_tokens,
            queue_position=places.get(sequence.request_id) if phase is WAITING else None,
            preempted=phase is WAITING and sequence.preemptions > 0,
            age_s=now - sequence.arrived if sequence.arrived else 0.0,
            prefill_s=now - sequence.prefill_started if phase is PREFILLING else 0.0,
            decode_s=now - sequence.first_token_at if sequence.first_token_at else 0.0))
    return rows


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
        #: the decode batch's rows by request id
        self.decoding: dict[str, SequenceState] = {}
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


__all__ = ["BatchState", "Phase", "SequenceState", "StepCounters", "new_sequence", "progress_of",
           "DECODING", "DONE", "PREFILLING", "WAITING"]
