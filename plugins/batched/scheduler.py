"""The batched engine's scheduler: continuous batching with chunked, gated prefill.

It is a :class:`~omlx_core.mlx_thread.Worker`: every call below except
:meth:`Scheduler.enqueue`, :meth:`Scheduler.abort`, :meth:`Scheduler.apply_memory_limits`,
:meth:`Scheduler.set_forward_gate` and the read-only counters runs on the MLX thread.

A request moves through four phases:

``waiting``
    queued; admitted in arrival order while fewer than ``plugin.batched.max_batch_size``
    sequences are prefilling or decoding. Admission looks up the prefix cache and
    starts the request's own KV cache from the longest reusable cached prefix.
``prefilling``
    each :meth:`Scheduler.step` prefills at most ``plugin.batched.prefill_step_size`` prompt
    tokens in all, split into chunks, then runs one decode step: a long prompt never
    stalls the running streams for more than one chunk budget. Chunks of different
    requests with similar lengths share one forward where the model's caches allow
    (:mod:`~omlx_core.plugins.batched.batch_prefill`); each request keeps its own
    cache. Chunk ends fall on ``plugin.batched.block_size`` boundaries where they can, so full
    blocks (and, for models with non-cuttable layers, their boundary states) go into
    the prefix cache as prefill crosses them. Chunks cover all prompt tokens but the
    last. At the end of the step every request whose chunks are done has its last
    prompt token fed (shared one-token forwards where caches allow, grouped like chunks
    so that a long cached prefix is never copied into a batch buffer; one token of
    logits each) and its first token sampled and handed out at once.
``decoding``
    the whole prompt is in the cache; the request joins mlx-lm's ``BatchGenerator``
    (``insert`` with that cache, its first token, its sampler and processors) without
    waiting for the batch to drain, and leaves it (``remove``) the moment it finishes.
``done``
    its final output (``finish_reason`` and usage) is in its queue.

A decoding request can also be **preempted** back to ``waiting``: when its KV (or an
older request's) is about to grow past what the memory guard reserved and the growth
does not fit, the guard's gate names the youngest requests to take out of the decode
batch (:meth:`~omlx_core.memory.gate.ForwardGate.check_decode`). Such a request keeps its
text, sampler and processors; its KV goes to the prefix cache as blocks (where the
model's layers allow), and it waits at the head of the queue until the gate lets it
resume (``may_resume``). Then it prefills its prompt and completion so far (mostly a
prefix-cache hit) and goes on: its client sees a pause, not an error.

**Forward gate seam.** Before a step's prefill forwards run, the planned chunks are
handed to the installed :class:`~omlx_core.memory.gate.ForwardGate`
(``set_forward_gate``) as one :class:`~omlx_core.memory.gate.PrefillStep`: request
ids, chunk token counts, cached-token counts, the decode batch size and the latest
limit snapshot. A request the gate refuses while other requests of this engine run is
preempted (see below: it waits for them to give the memory back; its finished chunks
stay in the prefix cache); one refused alone ends with ``finish_reason="error"`` and the
gate's :class:`~omlx_core.memory.types.RequestRejected`. Either way its cache is
dropped, and the other chunks and streams go on. The gate is also asked after each forward (the
post-forward backstop): once per shared forward, which then loses at most one request,
the one holding the most KV. A restored prefix is evaluated at admission, so the gate's
current-use reading already holds it. See :mod:`omlx_core.memory.gate` for the contract.

**Memory limits.** The scheduler is the engine's
:class:`~omlx_core.memory.gate.MemoryReceiver` (the ``resolve_scheduler`` hook returns
it): :meth:`Scheduler.apply_memory_limits` stores the enforcer's latest immutable
:class:`~omlx_core.memory.types.LimitSnapshot`; each decision reads it once
(:attr:`Scheduler.limits`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences, generation_stream
from mlx_lm.sample_utils import greedy_sampler

from omlx_core.engine import (
    GenerationOutput,
    GenerationRequest,
    RequestProgress,
    TokenLogprob,
    Usage,
)
from omlx_core.memory.gate import (
    DecodeRow,
    DecodeStep,
    ForwardGate,
    MemoryReceiver,
    PrefillChunk,
    PrefillStep,
)
from omlx_core.memory.usage import trim_heap
from omlx_core.plugins.batched.batch_prefill import PrefillRow, can_batch, group_spans, prefill_together
from omlx_core.plugins.batched.cache_layout import CacheLayout
from omlx_core.plugins.batched.decode_step import fuse_sampling
from omlx_core.plugins.batched.prefix_cache import CachedBlock, PrefixCache
from omlx_core.plugins.batched.sampling import make_logits_processors, make_sampler, token_logprob
from omlx_core.text import TextAssembler

if TYPE_CHECKING:
    from omlx_core.memory.types import BoundarySnapshot, LimitSnapshot, RequestRejected

log = logging.getLogger(__name__)

WAITING, PREFILLING, DECODING, DONE = "waiting", "prefilling", "decoding", "done"
#: how soon a preempted request the gate did not let resume asks again
RESUME_RETRY_S = 0.05


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
    text: TextAssembler | None = None
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
        """Tokens prefilled in chunks: all but the last, which :meth:`Scheduler._first_tokens`
        feeds in a one-token forward that samples the first token."""
        return len(self.context) - 1

    @property
    def kv_after_step(self) -> int:
        """KV tokens the request holds once the next decode step has fed its latest token."""
        return len(self.prompt) + self.completion_tokens


@dataclass
class _Counters:
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


class Scheduler(MemoryReceiver):
    """Owns one model's batch: queues, prefill, decode, outputs, prefix cache."""

    def __init__(self, *, model: Any, tokenizer: Any, model_id: str, model_config: Mapping[str, Any],
                 vocab_size: int, max_batch_size: int, prefill_step_size: int,
                 prefix_cache: PrefixCache,
                 wake: Callable[[], None],
                 boundary_listener: Callable[[BoundarySnapshot], None] | None = None,
                 finish_listener: Callable[[str, str], None] | None = None,
                 batch_window_s: float = 0.0, batch_window_max_s: float = 0.0,
                 fused_sampling: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.model_config = model_config
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.batch_window_s = batch_window_s
        self.batch_window_max_s = max(batch_window_s, batch_window_max_s)
        #: requests the pipeline is preparing for this engine (:meth:`expecting`)
        self._expected = 0
        self.fused_sampling = fused_sampling
        self.prefix_cache = prefix_cache
        self.layout = CacheLayout(model)
        self.boundary_listener = boundary_listener
        #: called with (request id, finish reason) once a request has released everything
        self.finish_listener = finish_listener
        self._wake = wake
        self._gate: ForwardGate | None = None
        self._limits: LimitSnapshot | None = None
        #: the snapshot :attr:`_host_freed` counts from
        self._host_freed_snapshot: LimitSnapshot | None = None
        #: bytes given back since that snapshot beyond what mlx reports (host copies of
        #: queued lower-tier writes): the snapshot's process reading still holds them
        self._host_freed = 0

        self._inbox: deque[SequenceState] = deque()
        self._abort_inbox: deque[str] = deque()
        self._waiting: deque[SequenceState] = deque()
        self._prefilling: list[SequenceState] = []
        self._decoding: dict[int, SequenceState] = {}
        self._by_id: dict[str, SequenceState] = {}
        self._stopped = False
        #: when a preempted request the gate did not let resume asks again
        self._resume_at: float | None = None
        self._lock = threading.Lock()
        self.counters = _Counters()
        self._eos = tuple(sorted(tokenizer.eos_token_ids))
        self._default_stops = StopSequences([(t,) for t in self._eos])
        self._generator = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        generator = BatchGenerator(self.model, completion_batch_size=self.max_batch_size,
                                   prefill_batch_size=self.max_batch_size,
                                   prefill_step_size=self.prefill_step_size)
        if self.fused_sampling:
            fuse_sampling(generator, self._wants_logprobs)
        return generator

    def _wants_logprobs(self, uid: int) -> bool:
        sequence = self._decoding.get(uid)
        return sequence is None or sequence.request.sampling.logprobs is not None

    # -- called from any thread ------------------------------------------------------

    def enqueue(self, sequence: SequenceState) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"engine for model {self.model_id!r} is shut down; "
                                   "start it again before submitting requests")
            sequence.arrived = time.monotonic()
            self._inbox.append(sequence)
        self._wake()

    def abort(self, request_id: str) -> None:
        self._abort_inbox.append(request_id)
        self._wake()

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """Count a request on its way here (tokenized and checked by the pipeline) while
        the block runs: an open batch window waits for it (:meth:`_window_closes`)."""
        with self._lock:
            self._expected += 1
        try:
            yield
        finally:
            with self._lock:
                self._expected -= 1
            self._wake()

    def apply_memory_limits(self, snapshot: LimitSnapshot | None) -> None:
        """Keep the enforcer's latest limit snapshot; the next decision reads it."""
        self._limits = snapshot

    @property
    def limits(self) -> LimitSnapshot | None:
        return self._limits

    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        """Install (or with ``None`` remove) the gate asked before every prefill step."""
        self._gate = gate

    @property
    def forward_gate(self) -> ForwardGate | None:
        return self._gate

    def queue_depth(self) -> int:
        return len(self._inbox) + len(self._waiting)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "queue_depth": self.queue_depth(),
            "running": len(self._decoding),
            "prefilling": len(self._prefilling),
            "max_batch_size": self.max_batch_size,
            "steps": c.steps,
            "decode_steps": c.decode_steps,
            "prefill_chunks": c.prefill_chunks,
            "prefill_forwards": c.prefill_forwards,
            "first_token_forwards": c.first_token_forwards,
            "prompt_tokens_prefilled": c.prompt_tokens_prefilled,
            "tokens_generated": c.tokens_generated,
            "preempted": c.preempted,
            "finished": dict(c.finished),
            "prefix_cache": self.prefix_cache.stats(),
        }

    def progress(self) -> list[RequestProgress]:
        """Each request taken in, with its phase; read from any thread (copies only)."""
        now = time.monotonic()
        queued = {s.request_id: i for i, s in enumerate(list(self._waiting) + list(self._inbox), 1)}
        rows = []
        # A request moving from the inbox to the table may be in both copies.
        held = {s.request_id: s for s in list(self._inbox) + list(self._by_id.values())}
        for sequence in held.values():
            phase = sequence.phase
            rows.append(RequestProgress(
                request_id=sequence.request_id, phase=phase if phase != DONE else DECODING,
                prompt_tokens=len(sequence.prompt), prefilled_tokens=sequence.prefilled,
                prefill_tokens=max(0, len(sequence.context) - 1),
                completion_tokens=sequence.completion_tokens, max_tokens=sequence.max_tokens,
                queue_position=queued.get(sequence.request_id) if phase == WAITING else None,
                preempted=phase == WAITING and sequence.preemptions > 0,
                age_s=now - sequence.arrived if sequence.arrived else 0.0,
                prefill_s=now - sequence.prefill_started if phase == PREFILLING else 0.0,
                decode_s=now - sequence.first_token_at if sequence.first_token_at else 0.0))
        return rows

    # -- the Worker protocol (MLX thread) --------------------------------------------

    def has_work(self) -> bool:
        """Whether there is work to do now: not while the batch window is open."""
        if self._abort_inbox or self._prefilling or self._decoding:
            return True
        if self._inbox:
            closes = self._window_closes()
            return closes is None or time.monotonic() >= closes
        if self._resume_at is not None and time.monotonic() < self._resume_at:
            return False
        return bool(self._waiting and self._free_slots() > 0)

    def wake_at(self) -> float | None:
        """When the batch window closes, or a preempted request at the head of the queue
        asks again whether it may resume (a ``time.monotonic()`` time), or ``None``.

        A window that closed since :meth:`has_work` said no still answers its (past)
        time: the MLX thread asks the two one after the other, and a ``None`` here would
        leave it asleep with a request waiting."""
        return self._window_closes() or self._resume_at

    def step(self) -> None:
        self.counters.steps += 1
        self._fit_prefix_cache()
        self._drain_inbox()
        self._admit()
        if self._prefilling:
            self._prefill_step()
        if self._decoding:
            self._decode_step()

    def fail(self, exc: BaseException) -> None:
        """End every in-flight request with an error and start over with an empty batch."""
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        for sequence in list(self._by_id.values()):
            if sequence.phase in (PREFILLING, DECODING):
                self._finish(sequence, "error", error=message, error_type="internal", remove=False)
        self._decoding.clear()
        self._prefilling.clear()
        self._generator = self._new_generator()
        mx.clear_cache()

    def shutdown(self) -> None:
        """Abort everything (MLX thread); the scheduler takes no requests afterwards."""
        with self._lock:
            self._stopped = True
        self._drain_inbox()
        for sequence in list(self._by_id.values()):
            self._abort_sequence(sequence)
        # Drop every path to the weights so the engine can return them to the system.
        self._generator = None  # type: ignore[assignment]
        self.model = self.layout = None  # type: ignore[assignment]

    def _fit_prefix_cache(self) -> None:
        """Give back cached memory (the lower tier's queued host copies, then prefix-cache
        blocks) that would take the process over its limit.

        Cached blocks count as available memory: a prefill's forward gate reclaims them
        before a chunk that needs the room. Decode steps ask no gate, so while requests
        decode the blocks also leave free the margin (the step's transients) and room
        for one copy of the decode batch's KV (a cache that grows copies itself). Use is
        read cheaply between polls: what mlx holds now, the rest of the process as of
        the last poll (:meth:`~omlx_core.memory.types.LimitSnapshot.over_by`). That
        reading still holds host copies dropped since the poll, so they are subtracted.
        """
        limits = self._limits
        if limits is None or not self.prefix_cache.reclaimable_bytes():
            return
        keep_free = 0
        if self._decoding:
            keep_free = limits.margin_bytes + int(self._generator.prompt_cache_nbytes)
        if self._host_freed_snapshot is not limits:
            self._host_freed_snapshot, self._host_freed = limits, 0
        over = limits.over_by(int(mx.get_active_memory() + mx.get_cache_memory()), keep_free)
        over -= self._host_freed
        if over > 0:
            held = self.prefix_cache.nbytes
            freed = self.prefix_cache.release(over)
            self._host_freed += max(0, freed - (held - self.prefix_cache.nbytes))
            # Buffers freed by mlx can sit in the heap's free pages: hand them back too.
            trim_heap()

    # -- inbox and admission ---------------------------------------------------------

    def _window_closes(self) -> float | None:
        """When the batch window over the inbox closes (closed already, perhaps), or
        ``None`` when the inbox waits for no window.

        On an idle engine, new requests wait ``batch_window_s`` after the first of them
        arrived: requests sent together reach the server a few milliseconds apart, and
        those that arrive in the window are prefilled in one forward instead of waiting
        for the first one's whole step. While more requests are on their way (the
        pipeline tokenizes and checks each first: tens of milliseconds apart when sent
        together), the window stays open for them, up to ``batch_window_max_s``. It
        closes early once the new requests fill the free slots. Nothing sleeps: :meth:`has_work` says no until then and the
        MLX thread wakes at :meth:`wake_at`, free for other engines and tasks meanwhile.
        """
        inbox = self._inbox
        if (not inbox or self.batch_window_s <= 0 or self._prefilling or self._decoding
                or len(inbox) + len(self._waiting) >= self._free_slots()):
            return None
        # Only the MLX thread (which asks this) takes requests out of the inbox.
        # A request submitted stays counted until its expecting() block ends, a moment
        # later: that end wakes the MLX thread, which then finds the window closed.
        longest = self.batch_window_max_s if self._expected else self.batch_window_s
        return inbox[0].arrived + longest

    def _drain_inbox(self) -> None:
        while self._inbox:
            sequence = self._inbox.popleft()
            if sequence.request_id in self._by_id:
                self._emit(sequence, GenerationOutput(
                    sequence.request_id, finish_reason="error",
                    error=f"request id {sequence.request_id!r} is already running on this engine",
                    error_type="invalid",
                    usage=Usage(len(sequence.prompt), 0)))
                continue
            self._by_id[sequence.request_id] = sequence
            self._waiting.append(sequence)
        while self._abort_inbox:
            request_id = self._abort_inbox.popleft()
            sequence = self._by_id.get(request_id)
            if sequence is not None:
                self._abort_sequence(sequence)

    def cache_key(self, sequence: SequenceState) -> list[int]:
        """What the prefix cache keys ``sequence``'s context by: its tokens here; an
        engine whose prompts hold more than tokens (images) keys that in as well."""
        return sequence.context

    def _free_slots(self) -> int:
        return self.max_batch_size - len(self._prefilling) - len(self._decoding)

    def _admit(self) -> None:
        self._resume_at = None
        while self._waiting and self._free_slots() > 0:
            sequence = self._waiting[0]
            if sequence.preemptions and self._gate is not None and not self._may_resume(sequence):
                # It resumes before anything queued behind it starts.
                self._resume_at = time.monotonic() + RESUME_RETRY_S
                return
            self._waiting.popleft()
            sequence.phase = PREFILLING
            sequence.prefill_started = time.monotonic()
            if sequence.text is None:
                sequence.text = TextAssembler(self.tokenizer.detokenizer, sequence.request.sampling.stop)
            blocks: list[CachedBlock] = []
            tail, tail_tokens = None, 0
            if self.prefix_cache.enabled:
                prefix = self.cache_key(sequence)[:sequence.prefill_target]
                sequence.block_hashes = self.prefix_cache.hashes(prefix)
                # Tails are only ever stored for models whose every layer can be cut.
                blocks, tail, tail_tokens = self.prefix_cache.lookup_prefix(sequence.block_hashes, prefix)
            sequence.cache = self.layout.restore(blocks, tail, tail_tokens)
            if blocks or tail_tokens:
                # Restoring concatenates blocks lazily: without this the first chunk's
                # forward would also materialize the whole copy, a transient no estimate
                # counts. Evaluated here it is resident, in the gate's current-use reading.
                mx.eval([layer.state for layer in sequence.cache])
            sequence.prefilled = len(blocks) * self.prefix_cache.block_size + tail_tokens
            if not sequence.preemptions:
                sequence.reused = sequence.prefilled
            sequence.stored_blocks = len(blocks)
            self._prefilling.append(sequence)

    def _may_resume(self, sequence: SequenceState) -> bool:
        try:
            return bool(self._gate.may_resume(sequence.request_id))  # type: ignore[union-attr]
        except Exception:
            log.exception("forward gate %r failed to say whether request %s may resume; "
                          "resuming it", self._gate, sequence.request_id)
            return True

    # -- prefill ---------------------------------------------------------------------

    def _chunk_end(self, start: int, target: int, budget: int) -> int:
        end = min(target, start + budget)
        block = self.prefix_cache.block_size
        aligned = end - end % block
        if not self.prefix_cache.enabled or aligned <= start or aligned == end:
            return end
        # Budget-limited chunks end on a block boundary; a final chunk is split at its
        # last boundary only when that boundary needs a state captured there.
        if end < target or self.layout.needs_boundaries:
            return aligned
        return end

    def _plan_prefill(self) -> list[tuple[SequenceState, int, int]]:
        plan: list[tuple[SequenceState, int, int]] = []
        budget = self.prefill_step_size
        for sequence in self._prefilling:
            position, target = sequence.prefilled, sequence.prefill_target
            while budget > 0 and position < target:
                reach = min(target, position + budget)
                end = self._chunk_end(position, target, budget)
                plan.append((sequence, position, end))
                budget -= end - position
                position = end
                if end < reach < target:
                    # Cut back to a block boundary: resume there next step rather than
                    # spend the sliver of budget left on a tiny unaligned chunk.
                    break
            if budget <= 0:
                break
        return plan

    def _prefill_step_of(self, plan: list[tuple[SequenceState, int, int]],
                         groups: list[list[tuple[SequenceState, int, int]]] | None = None
                         ) -> PrefillStep:
        """What the gate is asked: the chunks in the order their forwards run (``groups``,
        when given), those sharing a forward numbered alike."""
        groups = groups if groups is not None else [[chunk] for chunk in plan]
        return PrefillStep(
            model_id=self.model_id,
            chunks=tuple(PrefillChunk(s.request_id, end - start, start, len(s.context), s.reused,
                                      forward=index if len(group) > 1 else None)
                         for index, group in enumerate(groups) for s, start, end in group),
            decoding=len(self._decoding),
            chunk_size=self.prefill_step_size,
            limits=self._limits,
            running=len(self._prefilling) + len(self._decoding),
            model_config=self.model_config,
        )

    def _ask_gate(self, plan: list[tuple[SequenceState, int, int]],
                  groups: list[list[tuple[SequenceState, int, int]]] | None = None
                  ) -> tuple[dict[str, RequestRejected], str | None]:
        """The gate's refusals, and the error that makes them all internal failures
        (a gate that raised) or ``None``."""
        gate = self._gate
        if gate is None:
            return {}, None
        try:
            refused = gate.check_prefill(self._prefill_step_of(plan, groups))
        except Exception as exc:
            log.exception("forward gate %r failed; refusing this prefill step", gate)
            # A broken guard is a bug, not a memory shortage the client could wait out.
            return {}, f"memory check before prefill failed: {type(exc).__name__}: {exc}"
        return dict(refused), None

    def _check_after_forward(self, members: list[tuple[SequenceState, int, int]]
                             ) -> tuple[SequenceState, RequestRejected] | None:
        """The request the post-forward backstop stops after a forward over ``members``'
        chunks, with its reason, if any. Asked once per forward: of several requests it
        refuses, only the one holding the most KV is stopped; freeing that is the
        likeliest to bring use back under the limit, and the next check before a
        forward still guards the others."""
        gate = self._gate
        if gate is None:
            return None
        # The forward's transient sits in mlx's buffer cache until emptied; a reading
        # that included it would count memory already free.
        mx.clear_cache()
        try:
            refused = gate.check_after_prefill(self._prefill_step_of(members, [members]))
        except Exception:
            log.exception("post-forward memory check %r failed; requests %s go on", self._gate,
                          ", ".join(s.request_id for s, _, _ in members))
            return None
        stoppable = [(end, sequence) for sequence, _, end in members
                     if sequence.request_id in (refused or {})]
        if not stoppable:
            return None
        _, sequence = max(stoppable, key=lambda item: item[0])
        return sequence, refused[sequence.request_id]

    def _prefill_step(self) -> None:
        plan = self._plan_prefill()
        groups = self._forward_groups(plan)
        refused, broken = self._ask_gate(plan, groups)
        if refused and any(len(group) > 1 for group in groups):
            # A shared forward holds its chunks' transients at once. When the gate says
            # that does not fit, ask again for one forward per chunk before refusing.
            groups = [[chunk] for chunk in plan]
            refused, broken = self._ask_gate(plan, groups)
        if broken is not None:
            for sequence in {id(s): s for s, _, _ in plan}.values():
                self._finish(sequence, "error", error=broken, error_type="internal")
        for request_id, rejected in refused.items():
            sequence = self._by_id.get(request_id)
            if sequence is not None and sequence.phase == PREFILLING:
                if len(self._prefilling) + len(self._decoding) > 1:
                    # Others hold the memory it needs and will give it back: it waits for
                    # them (its finished chunks stay in the prefix cache), not fails.
                    self._requeue([sequence], tell_gate=True)
                else:
                    # Alone and still short: memory went elsewhere (another process);
                    # waiting on this engine would not bring it back.
                    self._finish(sequence, "error", error=str(rejected), rejected=rejected)
        for group in groups:
            if len(group) == 1:
                self._prefill_alone(*group[0])
            else:
                self._prefill_together(group)
        self._first_tokens()
        mx.clear_cache()

    def _forward_groups(self, plan: list[tuple[SequenceState, int, int]]
                        ) -> list[list[tuple[SequenceState, int, int]]]:
        """``plan``'s chunks cut into the forwards that run them, in plan order.

        Chunks share a forward only if their requests' caches are all plain KVCache
        layers and the request has no other chunk in this step (its chunks must run in
        order); :func:`group_spans` bounds the padding and the cached prefix copied.
        """
        chunks_of: dict[int, int] = {}
        for sequence, _, _ in plan:
            chunks_of[id(sequence)] = chunks_of.get(id(sequence), 0) + 1
        batchable = [i for i, (sequence, _, _) in enumerate(plan)
                     if chunks_of[id(sequence)] == 1 and can_batch(sequence.cache or ())]
        if len(batchable) < 2:
            return [[chunk] for chunk in plan]
        spans = [(plan[i][1], plan[i][2] - plan[i][1]) for i in batchable]
        groups = [[batchable[j] for j in group]
                  for group in group_spans(spans, max_start=self.prefill_step_size)]
        alone = set(range(len(plan))) - set(batchable)
        groups += [[i] for i in sorted(alone)]
        return [[plan[i] for i in group] for group in sorted(groups, key=lambda group: group[0])]

    def _prefill_alone(self, sequence: SequenceState, start: int, end: int) -> None:
        if sequence.phase != PREFILLING:
            return
        try:
            self._prefill_chunk(sequence, start, end)
        except Exception as exc:
            # The chunk's forward touched only this request's own cache.
            self._prefill_failed(sequence, exc)

    def _prefill_together(self, group: list[tuple[SequenceState, int, int]]) -> None:
        """One forward over several requests' chunks; one by one if it fails."""
        members = [chunk for chunk in group if chunk[0].phase == PREFILLING]
        if len(members) > 1:
            rows = [PrefillRow(s.cache, s.context[start:end], start) for s, start, end in members]
            try:
                with mx.stream(generation_stream):
                    prefill_together(self.model, rows)
            except Exception:
                # Nothing was written to the requests' caches: each can still run alone.
                log.exception("batched prefill of requests %s failed; prefilling them one by one",
                              ", ".join(s.request_id for s, _, _ in members))
            else:
                self.counters.prefill_forwards += 1
                del rows  # a request stopped below must not stay referenced here
                stopped = self._check_after_forward(members)
                for sequence, start, end in members:
                    try:
                        self._chunk_done(sequence, start, end, stopped)
                    except Exception as exc:
                        self._prefill_failed(sequence, exc)
                return
        for chunk in members:
            self._prefill_alone(*chunk)

    def _prefill_failed(self, sequence: SequenceState, exc: Exception, what: str = "prefill") -> None:
        log.exception("%s of request %s failed", what, sequence.request_id)
        self._finish(sequence, "error", error=f"{what} failed: {type(exc).__name__}: {exc}",
                     error_type="internal")

    def _prefill_chunk(self, sequence: SequenceState, start: int, end: int) -> None:
        with mx.stream(generation_stream):
            self.model(mx.array(sequence.context[start:end])[None], cache=sequence.cache)
            mx.eval([layer.state for layer in sequence.cache])
        self.counters.prefill_forwards += 1
        self._chunk_done(sequence, start, end, self._check_after_forward([(sequence, start, end)]))

    def _chunk_done(self, sequence: SequenceState, start: int, end: int,
                    stopped: tuple[SequenceState, RequestRejected] | None) -> None:
        """Account for a chunk whose forward has run and store its blocks; after the
        last one the request waits for :meth:`_first_tokens` at the end of the step.
        ``stopped``: the request the post-forward backstop stops after this forward,
        with the reason (:meth:`_check_after_forward`)."""
        sequence.prefilled = end
        self.counters.prefill_chunks += 1
        self.counters.prompt_tokens_prefilled += end - start
        if stopped is not None and stopped[0] is sequence:
            self._finish(sequence, "error", error=str(stopped[1]), rejected=stopped[1])
            return
        self._store_prefill_blocks(sequence)
        if end == sequence.prefill_target:
            self._store_tail(sequence.cache, self.cache_key(sequence)[:end], sequence.block_hashes)

    def _store_prefill_blocks(self, sequence: SequenceState) -> None:
        """Put the blocks prefill just completed into the prefix cache."""
        if not self.prefix_cache.enabled:
            return
        block_size = self.prefix_cache.block_size
        complete = sequence.prefilled // block_size
        at_boundary = sequence.prefilled % block_size == 0
        blocks = []
        for index in range(sequence.stored_blocks, complete):
            block_hash = sequence.block_hashes[index]
            captures_here = at_boundary and index == complete - 1 and self.layout.needs_boundaries
            existing = self.prefix_cache.get(block_hash)
            if existing is not None and (existing.reusable_end or not captures_here):
                continue
            boundary = self.layout.capture(sequence.cache) if captures_here else None
            parent = sequence.block_hashes[index - 1] if index else self.prefix_cache.root
            kv = self.layout.cut(sequence.cache, index * block_size, (index + 1) * block_size)
            blocks.append(self.layout.make_block(
                block_hash, parent, index, block_size, kv, boundary,
                self.cache_key(sequence)[index * block_size:(index + 1) * block_size]))
            if boundary is not None and self.boundary_listener is not None:
                self._announce_boundary(sequence, blocks[-1])
        self.prefix_cache.insert(blocks, chain=sequence.block_hashes[:complete])
        sequence.stored_blocks = complete

    def _announce_boundary(self, sequence: SequenceState, block: CachedBlock) -> None:
        from omlx_core.memory.types import BoundarySnapshot

        snapshot = BoundarySnapshot(sequence.request_id, block.index, block.end_token,
                                    block.block_hash, block.boundary or (), self.model_id)
        try:
            self.boundary_listener(snapshot)  # type: ignore[misc]
        except Exception:
            log.exception("on_boundary_snapshot listener failed; the snapshot is dropped")

    def _store_finished_blocks(self, sequence: SequenceState, cache: list[Any], tokens: list[int]) -> None:
        """Cache the full blocks a finished request's prompt and completion filled.

        Only for models whose every layer can be cut: a boundary state at a block end
        inside the completion was never captured.
        """
        if not self.prefix_cache.enabled or self.layout.needs_boundaries or not cache:
            return
        # The cache holds every token of ``tokens`` (its offset equals their count); the
        # clamp only guards against a cache shorter than them, whose KV it cannot cover.
        tokens = list(tokens[:cache[0].offset])
        block_size = self.prefix_cache.block_size
        hashes = self.prefix_cache.extend_hashes(sequence.block_hashes[:sequence.stored_blocks], tokens)
        blocks = []
        for index in range(sequence.stored_blocks, len(hashes)):
            if self.prefix_cache.get(hashes[index]) is not None:
                continue
            parent = hashes[index - 1] if index else self.prefix_cache.root
            kv = self.layout.cut(cache, index * block_size, (index + 1) * block_size)
            blocks.append(self.layout.make_block(hashes[index], parent, index, block_size, kv, None,
                                                 tokens[index * block_size:(index + 1) * block_size]))
        self.prefix_cache.insert(blocks, chain=hashes)
        self._store_tail(cache, tokens, hashes)

    def _store_tail(self, cache: list[Any], tokens: list[int], hashes: list[bytes]) -> None:
        """Keep the tokens after the last full block of ``tokens`` (all in ``cache``;
        ``hashes``: the chain of their full blocks) as a prefix-cache tail, so the next
        request continuing them reuses them all."""
        if not self.prefix_cache.enabled or self.layout.needs_boundaries or not cache:
            return
        full = len(tokens) // self.prefix_cache.block_size
        if full * self.prefix_cache.block_size == len(tokens):
            return
        parent = hashes[full - 1] if full else self.prefix_cache.root
        start = full * self.prefix_cache.block_size
        self.prefix_cache.insert_tail(self.layout.make_tail(parent, tokens[start:], cache, start))

    # -- first token -----------------------------------------------------------------

    def _first_tokens(self) -> None:
        """Feed the last prompt token of every request whose prefill is done, sample its
        first token and hand it out now, then let the request join the decode batch.

        The decode batch would hand out a joining request's first token only at the
        decode step after the one it joins in; sampling it here saves the client that
        step. Requests whose caches allow it and whose cached prefix is at most
        ``prefill_step_size`` tokens share one forward; a longer one runs alone, since a
        shared forward copies every row's prefix (right-aligned to the longest) into its
        batch buffer. The copy is thus at most ``max_batch_size`` x ``prefill_step_size``
        tokens of KV, the padding the decode batch these requests join next holds too.
        (Unlike chunks, one-token rows are not split to bound padding: the padding here is
        that bounded copy, and another forward costs far more.)
        """
        ready = [s for s in self._prefilling if s.prefilled == s.prefill_target]
        if not ready:
            return
        logits: dict[int, mx.array] = {}
        members = [s for s in ready
                   if can_batch(s.cache or ()) and s.prefill_target <= self.prefill_step_size]
        if len(members) > 1:
            rows = [PrefillRow(s.cache, s.context[-1:], s.prefill_target) for s in members]
            try:
                with mx.stream(generation_stream):
                    found = prefill_together(self.model, rows, logits=True)
            except Exception:
                log.exception("first-token forward of requests %s failed; feeding them one by one",
                              ", ".join(s.request_id for s in members))
            else:
                self.counters.first_token_forwards += 1
                logits.update((id(s), row) for s, row in zip(members, found))
        for sequence in ready:
            if id(sequence) in logits:
                continue
            try:
                with mx.stream(generation_stream):
                    row = self.model(mx.array(sequence.context[-1:])[None], cache=sequence.cache)[:, -1, :]
                    mx.eval(row, [layer.state for layer in sequence.cache])
            except Exception as exc:
                self._prefill_failed(sequence, exc, "first-token forward")
                continue
            self.counters.first_token_forwards += 1
            logits[id(sequence)] = row
        for sequence in ready:
            if id(sequence) not in logits or sequence.phase != PREFILLING:
                continue
            self._prefilling.remove(sequence)
            try:
                self._first_token(sequence, logits[id(sequence)])
            except Exception as exc:
                log.exception("request %s failed while sampling its first token", sequence.request_id)
                self._finish(sequence, "error", error=f"{type(exc).__name__}: {exc}",
                             error_type="internal")

    def _first_token(self, sequence: SequenceState, logits: mx.array) -> None:
        """Sample from the last prompt token's ``(1, vocab)`` logits, as the decode batch
        would (same processors, same sampler, which it then goes on with). A resumed
        request samples its next completion token with the sampler and processors it
        had."""
        sampling = sequence.request.sampling
        if not sequence.preemptions:
            sequence.sampler = make_sampler(sampling, sequence.seed, self.vocab_size)
            sequence.processors = make_logits_processors(sampling, len(sequence.prompt))
            if sequence.grammar is not None:
                # Last: the mask applies to the logits after bias and penalties.
                sequence.processors += (sequence.grammar.processor(prompt_length=len(sequence.prompt)),)
        if sequence.processors:
            context = mx.array(sequence.context)
            for processor in sequence.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int((sequence.sampler or greedy_sampler)(logprobs).item())
        finish_reason = None
        if token in self._stop_token_ids(sampling):
            finish_reason = "stop"
        elif sequence.completion_tokens + 1 >= sequence.max_tokens:
            finish_reason = "length"
        cache = sequence.cache
        if finish_reason is None:
            self._start_decoding(sequence, token)
        self._accept(sequence, token, logprobs[0], finish_reason, cache, sequence.context)

    def _stop_token_ids(self, sampling: Any) -> set[int]:
        return set(self._eos) | {int(t) for t in (sampling.stop_token_ids or ())}

    # -- decode ----------------------------------------------------------------------

    def _start_decoding(self, sequence: SequenceState, first_token: int) -> None:
        """Hand ``sequence`` (its whole prompt in its cache) to the decode batch, which
        goes on from ``first_token``."""
        sampling = sequence.request.sampling
        stops = self._default_stops
        if sampling.stop_token_ids:
            stops = StopSequences([(t,) for t in sorted(self._stop_token_ids(sampling))])
        sequence.uid = self._generator.insert(
            [[first_token]],
            max_tokens=[sequence.max_tokens - sequence.completion_tokens - 1],
            caches=[sequence.cache],
            all_tokens=[list(sequence.context)],
            samplers=[sequence.sampler],
            logits_processors=[sequence.processors],
            stop_sequences=[stops],
        )[0]
        sequence.cache = None
        sequence.phase = DECODING
        sequence.first_token_at = sequence.first_token_at or time.monotonic()
        sequence.kv_allowance = None
        self._decoding[sequence.uid] = sequence

    def _decode_step(self) -> None:
        self._budget_decode()
        if not self._decoding:
            return
        _, responses = self._generator.next()
        self.counters.decode_steps += 1
        for response in responses:
            sequence = self._decoding.get(response.uid)
            if sequence is None:
                continue
            try:
                self._on_token(sequence, response)
            except Exception as exc:
                log.exception("request %s failed while handling its token", sequence.request_id)
                self._finish(sequence, "error", error=f"{type(exc).__name__}: {exc}",
                             error_type="internal")

    def _budget_decode(self) -> None:
        """Ask the gate before a decode step after which a request would hold more KV
        than it was allowed; preempt the requests it names."""
        gate = self._gate
        if gate is None or not any(s.kv_allowance is None or s.kv_after_step > s.kv_allowance
                                   for s in self._decoding.values()):
            return
        step = DecodeStep(self.model_id, tuple(DecodeRow(s.request_id, s.kv_after_step, s.arrived)
                                               for s in self._decoding.values()),
                          limits=self._limits, model_config=self.model_config)
        try:
            plan = gate.check_decode(step)
        except Exception:
            log.exception("forward gate %r failed to budget a decode step; decoding on", gate)
            return
        preempt = set(plan.preempt)
        for sequence in self._decoding.values():
            sequence.kv_allowance = plan.allowed_tokens.get(sequence.request_id)
        if preempt:
            self._preempt([s for s in self._decoding.values() if s.request_id in preempt])

    def _preempt(self, sequences: list[SequenceState]) -> None:
        """Take ``sequences`` out of the decode batch without ending them: their KV goes
        to the prefix cache (recomputed on resume where it cannot, or was evicted)."""
        uids = [s.uid for s in sequences]
        extracted = self._generator.remove(uids, return_prompt_caches=True)
        for sequence in sequences:
            del self._decoding[sequence.uid]
            # Resuming feeds the prompt and every token handed out (the batch may not
            # have fed the newest yet); the token it sampled next is dropped with the
            # row and sampled again from the same KV.
            sequence.context = sequence.prompt + sequence.generated
            cache, tokens = extracted.get(sequence.uid, (None, None))
            if cache is not None:
                self._store_finished_blocks(sequence, cache, list(tokens))
            del cache
            sequence.uid = None
        self._requeue(sequences, tell_gate=False)

    def _requeue(self, sequences: list[SequenceState], *, tell_gate: bool) -> None:
        """Put preempted ``sequences`` at the head of the queue, oldest first."""
        for sequence in sequences:
            if sequence in self._prefilling:
                self._prefilling.remove(sequence)
            sequence.cache = None
            sequence.phase = WAITING
            sequence.preemptions += 1
            sequence.kv_allowance = None
            self.counters.preempted += 1
            if tell_gate and self._gate is not None:
                try:
                    self._gate.suspend(sequence.request_id)
                except Exception:
                    log.exception("forward gate %r failed to note the preemption of request %s",
                                  self._gate, sequence.request_id)
        for sequence in sorted(sequences, key=lambda s: s.arrived, reverse=True):
            self._waiting.appendleft(sequence)
        log.info("preempted request(s) %s of model %r: they resume when memory allows",
                 ", ".join(s.request_id for s in sequences), self.model_id)

    def _on_token(self, sequence: SequenceState, response: Any) -> None:
        self._accept(sequence, int(response.token), response.logprobs, response.finish_reason,
                     response.prompt_cache, response.all_tokens)

    def _accept(self, sequence: SequenceState, token: int, logprobs_row: mx.array,
                finish_reason: str | None, cache: list[Any] | None, tokens: list[int] | None) -> None:
        """Hand out one generated token. ``finish_reason`` (``"stop"``: a stop token,
        ``"length"``) ends the request; ``cache`` then holds ``tokens``, for the prefix
        cache. A request still in the decode batch is taken out of it."""
        sequence.completion_tokens += 1
        sequence.generated.append(token)
        self.counters.tokens_generated += 1
        assert sequence.text is not None
        decoding = sequence.phase == DECODING
        if finish_reason == "stop":
            # An end-of-sequence or stop token: it ends the text and is not part of it.
            if decoding:
                del self._decoding[sequence.uid]
            text, _ = sequence.text.finish()
            self._store_finished_blocks(sequence, cache or [], tokens or [])
            self._finish(sequence, "stop", text=text, remove=False)
            return
        text, stopped = sequence.text.add(token)
        logprobs = None
        top = sequence.request.sampling.logprobs
        if top is not None:
            logprobs = (token_logprob(logprobs_row, token, top),)
        if stopped:
            self._finish(sequence, "stop", text=text, token_ids=(token,), logprobs=logprobs,
                         store=True)
        elif finish_reason == "length":
            if decoding:
                del self._decoding[sequence.uid]
            tail, stopped_in_tail = sequence.text.finish()
            self._store_finished_blocks(sequence, cache or [], tokens or [])
            self._finish(sequence, "stop" if stopped_in_tail else "length", text=text + tail,
                         token_ids=(token,), logprobs=logprobs, remove=False)
        else:
            self._emit(sequence, GenerationOutput(sequence.request_id, text, (token,), logprobs))

    # -- endings ---------------------------------------------------------------------

    def _abort_sequence(self, sequence: SequenceState) -> None:
        if sequence.phase == WAITING:
            try:
                self._waiting.remove(sequence)
            except ValueError:
                pass
        self._finish(sequence, "abort")

    def _finish(self, sequence: SequenceState, reason: str, *, text: str = "",
                token_ids: tuple[int, ...] = (), logprobs: tuple[TokenLogprob, ...] | None = None,
                error: str | None = None, error_type: str | None = None,
                rejected: RequestRejected | None = None, remove: bool = True,
                store: bool = False) -> None:
        """Emit the final output and release everything the request holds."""
        if sequence.phase == DONE:
            return
        if sequence.phase == PREFILLING:
            if sequence in self._prefilling:
                self._prefilling.remove(sequence)
            sequence.cache = None
        elif sequence.phase == DECODING and sequence.uid is not None:
            if remove and self._decoding.pop(sequence.uid, None) is not None:
                extracted = self._generator.remove([sequence.uid], return_prompt_caches=store)
                if store and sequence.uid in extracted:
                    cache, tokens = extracted[sequence.uid]
                    self._store_finished_blocks(sequence, cache, tokens)
            self._decoding.pop(sequence.uid, None)
        sequence.phase = DONE
        self._by_id.pop(sequence.request_id, None)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        usage = Usage(len(sequence.prompt), sequence.completion_tokens, sequence.reused)
        if self.finish_listener is not None:
            # Before the final output: whoever sees the request end sees its cleanup begun.
            try:
                self.finish_listener(sequence.request_id, reason)
            except Exception:
                log.exception("on_request_finished listener failed for request %s",
                              sequence.request_id)
        stop_sequence = sequence.text.stop_sequence if sequence.text is not None else None
        self._emit(sequence, GenerationOutput(sequence.request_id, text, token_ids, logprobs,
                                              finish_reason=reason, error=error,
                                              error_type=error_type, rejected=rejected,
                                              stop_sequence=stop_sequence, usage=usage))

    @staticmethod
    def _emit(sequence: SequenceState, output: GenerationOutput) -> None:
        sequence.outputs.put(output)


def new_sequence(request: GenerationRequest) -> SequenceState:
    """The scheduler state of a validated request."""
    seed = request.sampling.seed
    if seed is None:
        seed = secrets.randbits(63)
    prompt = [int(t) for t in request.prompt_tokens]
    return SequenceState(request=request, outputs=queue.SimpleQueue(), prompt=prompt,
                         seed=int(seed), context=prompt)


__all__ = ["Scheduler", "SequenceState", "new_sequence", "DECODING", "DONE", "PREFILLING", "WAITING"]
