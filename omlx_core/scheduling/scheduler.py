"""The batched engine's scheduler: continuous batching with chunked, gated prefill.

It is a :class:`~omlx_core.mlx_thread.Worker`: every call below except
:meth:`Scheduler.enqueue`, :meth:`Scheduler.abort`, :meth:`Scheduler.apply_memory_limits`,
:meth:`Scheduler.set_forward_gate` and the read-only counters runs on the MLX thread.

It composes parts, each one idea in its own module, around one shared
:class:`~.batch_state.BatchState` (the phases a request moves through are described
there):

- admission and the batch window (here): requests are admitted in arrival order while
  fewer than ``plugin.batched.max_batch_size`` are prefilling or decoding; admission
  starts the request's own KV cache from the longest reusable cached prefix the forward
  gate has room for (:class:`~.prefix_restore.PrefixRestorer`); a request whose prompt
  is mostly blocks another request is prefilling right now waits until that one has
  stored them, then restores them instead of computing them twice;
- :class:`~.prefill_planner.PrefillPlanner`: the step's chunks, their shared forwards
  and the forward gate's word on them;
- :class:`~.prefill_runner.PrefillRunner`: the forwards, then the first tokens;
- :class:`~.decode_batch.DecodeBatch`: mlx-lm's ``BatchGenerator`` over the decoding rows;
- :class:`~.decode_budget.DecodeBudgeter`: KV allowances and preemption;
- :class:`~.prefix_writer.PrefixCacheWriter`: blocks, boundary states and tails into
  the prefix cache;
- :class:`~.output_emitter.OutputEmitter`: tokens, endings, usage.

An engine extends it through declared extension points (:mod:`.extensions`): what a
chunk's forward feeds (``inputs``), what the prefix cache keys tokens by
(``cache_key``), draft/verify for the decoding rows (``drafts``), and how processes
serving one model together agree on each step (``step_sync``).

**Memory limits.** The scheduler is the engine's
:class:`~omlx_core.memory.gate.MemoryReceiver` (the ``resolve_scheduler`` hook returns
it): :meth:`Scheduler.apply_memory_limits` stores the enforcer's latest immutable
:class:`~omlx_core.memory.types.LimitSnapshot`; each decision reads it once
(:attr:`Scheduler.limits`). :meth:`Scheduler.set_forward_gate` installs the gate asked
before prefill forwards and decode growth.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import mlx.core as mx

from omlx_core.engine import RequestProgress
from omlx_core.memory.gate import CacheRestore, ForwardGate, MemoryReceiver
from omlx_core.memory.usage import resident_now, trim_heap
from omlx_core.scheduling.batch_state import (
    DECODING,
    DONE,
    PREFILLING,
    WAITING,
    BatchState,
    SequenceState,
    new_sequence,
)
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.scheduling.decode_batch import DecodeBatch
from omlx_core.scheduling.decode_budget import DecodeBudgeter
from omlx_core.scheduling.extensions import (
    CacheKey,
    ChunkInputs,
    DraftVerify,
    LocalSteps,
    NoDrafts,
    StepSync,
    TokenInputs,
    token_key,
)
from omlx_core.scheduling.output_emitter import OutputEmitter
from omlx_core.scheduling.prefill_planner import PrefillPlanner
from omlx_core.scheduling.prefill_runner import PrefillRunner
from omlx_core.scheduling.prefix_cache import PrefixCache
from omlx_core.scheduling.prefix_restore import PrefixRestorer, Restored, follows_a_prefill
from omlx_core.scheduling.prefix_writer import PrefixCacheWriter

if TYPE_CHECKING:
    from omlx_core.memory.types import BoundarySnapshot, LimitSnapshot

log = logging.getLogger(__name__)

#: how soon a preempted request the gate did not let resume asks again
RESUME_RETRY_S = 0.05


class Scheduler(MemoryReceiver):
    """Owns one model's batch: queues, prefill, decode, outputs, prefix cache."""

    def __init__(self, *, model: Any, tokenizer: Any, model_id: str, model_config: Mapping[str, Any],
                 vocab_size: int, max_batch_size: int, prefill_step_size: int,
                 prefix_cache: PrefixCache,
                 wake: Callable[[], None],
                 boundary_listener: Callable[[BoundarySnapshot], None] | None = None,
                 finish_listener: Callable[[str, str], None] | None = None,
                 batch_window_s: float = 0.0, batch_window_max_s: float = 0.0,
                 fused_sampling: bool = True, inputs: ChunkInputs | None = None,
                 cache_key: CacheKey = token_key, drafts: DraftVerify | None = None,
                 max_decode_gap_s: float = 0.0, step_sync: StepSync | None = None,
                 decode_lanes: bool = True) -> None:
        self.model_id = model_id
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.batch_window_s = batch_window_s
        self.batch_window_max_s = max(batch_window_s, batch_window_max_s)
        self.prefix_cache = prefix_cache
        self.layout = CacheLayout(model)
        self.cache_key = cache_key
        self.inputs = inputs if inputs is not None else TokenInputs()
        self.step_sync = step_sync if step_sync is not None else LocalSteps()
        self._wake = wake
        #: requests the pipeline is preparing for this engine (:meth:`expecting`)
        self._expected = 0
        #: the snapshot :attr:`_host_freed` counts from
        self._host_freed_snapshot: LimitSnapshot | None = None
        #: bytes given back since that snapshot beyond what mlx reports (host copies of
        #: queued lower-tier writes): the snapshot's process reading still holds them
        self._host_freed = 0
        self._inbox: deque[SequenceState] = deque()
        self._abort_inbox: deque[str] = deque()
        self._stopped = False
        #: when a preempted request the gate did not let resume asks again
        self._resume_at: float | None = None
        self._lock = threading.Lock()

        self.state = state = BatchState(model_id=model_id, model_config=model_config,
                                        max_batch_size=max_batch_size)
        state.gate = self.step_sync.gate(None)
        self.counters = state.counters
        self.drafts = drafts if drafts is not None else NoDrafts()
        self.decode = DecodeBatch(model=model, state=state, eos_token_ids=tokenizer.eos_token_ids,
                                  prefill_step_size=prefill_step_size, fused_sampling=fused_sampling,
                                  drafts=self.drafts, lanes=decode_lanes)
        self.restorer = PrefixRestorer(prefix_cache, self.layout)
        self.writer = PrefixCacheWriter(prefix_cache=prefix_cache, layout=self.layout,
                                        cache_key=cache_key, model_id=model_id,
                                        boundary_listener=boundary_listener)
        self.emitter = OutputEmitter(state=state, batch=self.decode, writer=self.writer,
                                     inputs=self.inputs, finish_listener=finish_listener)
        self.budgeter = DecodeBudgeter(state=state, batch=self.decode, writer=self.writer,
                                       inputs=self.inputs)
        self.planner = PrefillPlanner(state=state, prefix_cache=prefix_cache, layout=self.layout,
                                      prefill_step_size=prefill_step_size, inputs=self.inputs,
                                      batch=self.decode, max_decode_gap_s=max_decode_gap_s)
        self.prefill = PrefillRunner(model=model, state=state, vocab_size=vocab_size,
                                     planner=self.planner, inputs=self.inputs, writer=self.writer,
                                     budgeter=self.budgeter, batch=self.decode, emitter=self.emitter)

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
        self.state.limits = snapshot

    @property
    def limits(self) -> LimitSnapshot | None:
        return self.state.limits

    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        """Install (or with ``None`` remove) the gate asked before every prefill step."""
        self.state.gate = self.step_sync.gate(gate)

    @property
    def forward_gate(self) -> ForwardGate | None:
        return self.state.gate

    def queue_depth(self) -> int:
        return len(self._inbox) + len(self.state.waiting)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "queue_depth": self.queue_depth(),
            "running": len(self.state.decoding),
            "prefilling": len(self.state.prefilling),
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
            **self.inputs.stats(),
            **self.drafts.stats(),
        }

    def progress(self) -> list[RequestProgress]:
        """Each request taken in, with its phase; read from any thread (copies only)."""
        now = time.monotonic()
        state = self.state
        queued = {s.request_id: i for i, s in enumerate(list(state.waiting) + list(self._inbox), 1)}
        rows = []
        # A request moving from the inbox to the table may be in both copies.
        held = {s.request_id: s for s in list(self._inbox) + list(state.by_id.values())}
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
        return self.step_sync.has_work(self._has_local_work())

    def _has_local_work(self) -> bool:
        state = self.state
        if self._abort_inbox or state.prefilling or state.decoding:
            return True
        if self._inbox:
            closes = self._window_closes()
            return closes is None or time.monotonic() >= closes
        if self._resume_at is not None and time.monotonic() < self._resume_at:
            return False
        return bool(state.waiting and state.free_slots() > 0)

    def wake_at(self) -> float | None:
        """When the batch window closes, or a preempted request at the head of the queue
        asks again whether it may resume (a ``time.monotonic()`` time), or ``None``.

        A window that closed since :meth:`has_work` said no still answers its (past)
        time: the MLX thread asks the two one after the other, and a ``None`` here would
        leave it asleep with a request waiting."""
        return self.step_sync.wake_at(self._window_closes() or self._resume_at)

    def step(self) -> None:
        self.counters.steps += 1
        self._fit_prefix_cache()
        self._drain_inbox(sync=True)
        self._admit()
        if self.state.prefilling:
            started = time.perf_counter()
            self.prefill.step()
            self.planner.observe(time.perf_counter() - started)
        if self.state.decoding:
            self._decode_step()

    def fail(self, exc: BaseException) -> None:
        """End every in-flight request with an error and start over with an empty batch."""
        self.step_sync.failed(exc)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        state = self.state
        for sequence in list(state.by_id.values()):
            if sequence.phase in (PREFILLING, DECODING):
                self.emitter.finish(sequence, "error", error=message, error_type="internal", remove=False)
        state.decoding.clear()
        state.prefilling.clear()
        self.decode.reset()
        mx.clear_cache()

    def shutdown(self) -> None:
        """Abort everything (MLX thread); the scheduler takes no requests afterwards."""
        with self._lock:
            self._stopped = True
        self._drain_inbox()
        self.step_sync.close()
        for sequence in list(self.state.by_id.values()):
            # The model goes away with the engine: nothing is worth caching for it.
            self.emitter.abort(sequence, store=False)
        # Drop every path to the weights so the engine can return them to the system.
        self.decode.close()
        self.inputs.close()
        self.prefill.model = None
        self.layout = self.planner.layout = self.writer.layout = None  # type: ignore[assignment]
        self.restorer.layout = None  # type: ignore[assignment]

    def _fit_prefix_cache(self) -> None:
        """Give back cached memory (the lower tier's queued host copies, then prefix-cache
        blocks) that would take the process over its limit.

        Cached blocks count as available memory: a prefill's forward gate reclaims them
        before a chunk that needs the room. Decode steps ask no gate, so while requests
        decode the blocks also leave free the margin (the step's transients) and room
        for one copy of the decode batch's KV (a cache that grows copies itself). Use is
        read cheaply between polls: what mlx holds now, the rest of the process as of
        the last poll (:meth:`~omlx_core.memory.types.LimitSnapshot.over_by`). That
        reading still holds host copies dropped since the poll, so they are subtracted;
        it misses host copies made since, so the resident set read now bounds it below.
        """
        limits = self.state.limits
        if limits is None or not self.prefix_cache.reclaimable_bytes():
            return
        keep_free = 0
        if self.state.decoding:
            keep_free = limits.margin_bytes + self.decode.kv_nbytes
        if self._host_freed_snapshot is not limits:
            self._host_freed_snapshot, self._host_freed = limits, 0
        over = limits.over_by(int(mx.get_active_memory() + mx.get_cache_memory()), keep_free)
        over -= self._host_freed
        # That reading misses what grew outside mlx since the poll (host copies queued
        # for the SSD tier above all): the resident set now is the truth when higher.
        resident = resident_now()
        if resident is not None and limits.hard_bytes is not None:
            over = max(over, resident + keep_free - limits.hard_bytes)
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
        closes early once the new requests fill the free slots. Nothing sleeps:
        :meth:`has_work` says no until then and the MLX thread wakes at
        :meth:`wake_at`, free for other engines and tasks meanwhile.
        """
        inbox, state = self._inbox, self.state
        if (not inbox or self.batch_window_s <= 0 or state.prefilling or state.decoding
                or len(inbox) + len(state.waiting) >= state.free_slots()):
            return None
        # Only the MLX thread (which asks this) takes requests out of the inbox.
        # A request submitted stays counted until its expecting() block ends, a moment
        # later: that end wakes the MLX thread, which then finds the window closed.
        longest = self.batch_window_max_s if self._expected else self.batch_window_s
        return inbox[0].arrived + longest

    def _drain_inbox(self, *, sync: bool = False) -> None:
        state = self.state
        arrivals = [self._inbox.popleft() for _ in range(len(self._inbox))]
        aborts = [self._abort_inbox.popleft() for _ in range(len(self._abort_inbox))]
        if sync:
            arrivals, aborts = self.step_sync.exchange(arrivals, aborts)
        for sequence in arrivals:
            if sequence.request_id in state.by_id:
                self.emitter.reject_duplicate(sequence)
                continue
            state.by_id[sequence.request_id] = sequence
            state.waiting.append(sequence)
        for request_id in aborts:
            sequence = state.by_id.get(request_id)
            if sequence is not None:
                self.emitter.abort(sequence)

    def _admit(self) -> None:
        self._resume_at = None
        state = self.state
        followers: list[SequenceState] = []
        try:
            self._admit_waiting(followers)
        finally:
            # Followers keep their places at the head of the queue.
            state.waiting.extendleft(reversed(followers))

    def _admit_waiting(self, followers: list[SequenceState]) -> None:
        state = self.state
        while state.waiting and state.free_slots() > 0:
            sequence = state.waiting[0]
            if sequence.preemptions and not self.budgeter.may_resume(sequence):
                # It resumes before anything queued behind it starts.
                self._resume_at = time.monotonic() + RESUME_RETRY_S
                return
            state.waiting.popleft()
            if self.prefix_cache.enabled:
                prefix = list(self.cache_key(sequence, sequence.context[:sequence.prefill_target]))
                sequence.block_hashes = self.prefix_cache.hashes(prefix)
                if follows_a_prefill(sequence, state.prefilling, self.prefix_cache):
                    followers.append(sequence)
                    continue
            sequence.phase = PREFILLING
            sequence.prefill_started = time.monotonic()
            if self.prefix_cache.enabled:
                # The copy is made (and evaluated: resident, in the gate's current-use
                # reading) here, within the room the gate gave for it.
                restored = self.restorer.start(sequence.block_hashes, prefix,
                                               self._restore_room(sequence.request_id))
            else:
                restored = Restored(self.layout.new_cache())
            sequence.cache = restored.cache
            sequence.prefilled = restored.blocks * self.prefix_cache.block_size + restored.tail_tokens
            if not sequence.preemptions:
                sequence.reused = sequence.prefilled
            sequence.stored_blocks = restored.blocks
            state.prefilling.append(sequence)

    def _restore_room(self, request_id: str) -> Callable[[int], int] | None:
        """What a request's restore asks how many bytes it may bring in (``None``: no
        gate, any); a gate that fails to answer gives none."""
        gate = self.state.gate
        if gate is None:
            return None

        def room(nbytes: int) -> int:
            try:
                return gate.room_for_restore(CacheRestore(self.model_id, request_id, nbytes,
                                                          self.state.limits))
            except Exception:
                log.exception("the forward gate failed to size the cached prefix of request %s; "
                              "it reuses none", request_id)
                return 0
        return room

    # -- decode ----------------------------------------------------------------------

    def _decode_step(self) -> None:
        self.budgeter.budget()
        decoding = self.state.decoding
        if not decoding:
            return
        responses = self.decode.step()
        self.counters.decode_steps += 1
        # Every row's token goes out first; the finished rows' blocks are stored after
        # (about 20 ms a row), so no stream's token waits for them.
        ending = []
        for response in responses:
            sequence = decoding.get(response.uid)
            if sequence is None:
                continue
            try:
                self.emitter.hand_out(sequence, int(response.token), response.logprobs,
                                      response.finish_reason)
            except Exception as exc:
                self._failed(sequence, exc)
                continue
            if response.finish_reason is not None:
                ending.append((sequence, response))
        for sequence, response in ending:
            try:
                self.emitter.end(sequence, response.finish_reason, response.prompt_cache,
                                 response.all_tokens)
            except Exception as exc:
                self._failed(sequence, exc)

    def _failed(self, sequence: SequenceState, exc: Exception) -> None:
        log.exception("request %s failed while handling its token", sequence.request_id)
        self.emitter.finish(sequence, "error", error=f"{type(exc).__name__}: {exc}",
                            error_type="internal")


__all__ = ["Scheduler", "SequenceState", "new_sequence", "DECODING", "DONE", "PREFILLING", "WAITING"]
