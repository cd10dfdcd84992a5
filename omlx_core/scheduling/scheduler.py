"""The scheduler: continuous batching with chunked, gated prefill, for one model.

It is a :class:`~omlx_core.mlx_thread.Worker`: every call below except
:meth:`Scheduler.enqueue`, :meth:`Scheduler.abort`, :meth:`Scheduler.expecting`,
:meth:`Scheduler.apply_memory_limits`, :meth:`Scheduler.set_forward_gate` and the
read-only counters runs on the MLX thread.

**One step** (:meth:`Scheduler.step`) reads top to bottom:

1. give back cached memory the process is over its limit by (:mod:`.cache_fit`);
2. take in arrivals and aborts (:mod:`.inbox`; with the other ranks, ``step_sync``);
3. **admit** waiting requests in arrival order while fewer than ``max_batch_size`` run:
   each starts from its own KV cache holding the longest reusable cached prefix the
   forward gate has room for (:class:`~.prefix_restore.PrefixRestorer`); one whose
   prompt is mostly blocks another request is prefilling right now waits for them;
4. **prefill** this step's chunks behind the forward gate
   (:class:`~.prefill_planner.PrefillPlanner` cuts them to the decode latency budget,
   :class:`~.prefill_runner.PrefillRunner` runs them), then hand out the first tokens
   of the requests whose prompt is done, which join the decode batch;
5. **decode**: ask the gate for the rows' KV growth (:mod:`.decode_budget`; preempt the
   requests it names), run every lane's forward, sample or verify
   (:class:`~.decode_batch.DecodeBatch`), hand out every row's tokens, then **retire**
   the rows that finished (their blocks into the prefix cache, their final output).

A request's phase (:class:`~.batch_state.Phase`) changes only here: ``_to_prefilling``,
``_to_decoding``, ``_to_waiting`` and ``_finish``.

An engine extends it through declared extension points (:mod:`.extensions`): what a
chunk's forward feeds (``inputs``), what the prefix cache keys tokens by
(``cache_key``), draft/verify for the decoding rows (``drafts``), and how processes
serving one model together agree on each step (``step_sync``).

**Memory limits.** The scheduler is the engine's
:class:`~omlx_core.memory.gate.MemoryReceiver` (the ``resolve_scheduler`` hook returns
it): :meth:`Scheduler.apply_memory_limits` stores the enforcer's latest immutable
:class:`~omlx_core.memory.types.LimitSnapshot`; each decision reads it once.
:meth:`Scheduler.set_forward_gate` installs the gate asked before prefill forwards and
decode growth.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping

import mlx.core as mx

from omlx_core.engine import RequestProgress
from omlx_core.memory.gate import CacheRestore, ForwardGate, MemoryReceiver
from omlx_core.scheduling.batch_state import (
    DECODING,
    DONE,
    PREFILLING,
    WAITING,
    BatchState,
    SequenceState,
    new_sequence,
    progress_of,
)
from omlx_core.scheduling.cache_fit import CacheFitter
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.scheduling.decode_batch import DecodeBatch, Finished
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
from omlx_core.scheduling.inbox import Inbox
from omlx_core.scheduling.kv_cache import FULL_PRECISION, KVFormat
from omlx_core.scheduling.output_emitter import OutputEmitter
from omlx_core.scheduling.prefill_planner import PrefillPlanner
from omlx_core.scheduling.prefill_runner import PrefillRunner
from omlx_core.scheduling.prefix_cache import PrefixCache
from omlx_core.scheduling.prefix_restore import PrefixRestorer, Restored, follows_a_prefill
from omlx_core.scheduling.prefix_writer import PrefixCacheWriter

if TYPE_CHECKING:
    from omlx_core.memory.types import BoundarySnapshot, LimitSnapshot, RequestRejected

log = logging.getLogger(__name__)

#: how soon a preempted request the gate did not let resume asks again
RESUME_RETRY_S = 0.05


class Scheduler(MemoryReceiver):
    """Owns one model's batch: queues, prefill, decode, outputs, prefix cache."""

    def __init__(self, *, model: Any, tokenizer: Any, model_id: str, model_config: Mapping[str, Any],
                 vocab_size: int, max_batch_size: int, prefill_step_size: int,
                 prefix_cache: PrefixCache, wake: Callable[[], None],
                 boundary_listener: Callable[[BoundarySnapshot], None] | None = None,
                 finish_listener: Callable[[str, str], None] | None = None,
                 batch_window_s: float = 0.0, batch_window_max_s: float = 0.0,
                 inputs: ChunkInputs | None = None, cache_key: CacheKey = token_key,
                 drafts: DraftVerify | None = None, max_decode_gap_s: float = 0.0,
                 step_sync: StepSync | None = None, decode_lanes: bool = True,
                 kv_format: KVFormat = FULL_PRECISION) -> None:
        self.model_id = model_id
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.prefix_cache = prefix_cache
        self.kv_format = kv_format
        self.layout = CacheLayout(model, kv_format)
        self.cache_key = cache_key
        self.inputs = inputs if inputs is not None else TokenInputs()
        self.step_sync = step_sync if step_sync is not None else LocalSteps()
        self.finish_listener = finish_listener
        self.inbox = Inbox(model_id=model_id, wake=wake, batch_window_s=batch_window_s,
                           batch_window_max_s=batch_window_max_s)
        #: when a preempted request the gate did not let resume asks again
        self._resume_at: float | None = None

        self.state = state = BatchState(model_id=model_id, model_config=model_config,
                                        max_batch_size=max_batch_size)
        state.gate = self.step_sync.gate(None)
        self.counters = state.counters
        self.drafts = drafts if drafts is not None else NoDrafts()
        self.decode = DecodeBatch(model=model, state=state, drafts=self.drafts, lanes=decode_lanes)
        self.fitter = CacheFitter(prefix_cache)
        self.restorer = PrefixRestorer(prefix_cache, self.layout)
        self.writer = PrefixCacheWriter(prefix_cache=prefix_cache, layout=self.layout,
                                        cache_key=cache_key, model_id=model_id,
                                        boundary_listener=boundary_listener)
        self.emitter = OutputEmitter(self.counters)
        self.budgeter = DecodeBudgeter(state=state)
        self.planner = PrefillPlanner(state=state, prefix_cache=prefix_cache, layout=self.layout,
                                      prefill_step_size=prefill_step_size, inputs=self.inputs,
                                      batch=self.decode, max_decode_gap_s=max_decode_gap_s)
        self.prefill = PrefillRunner(model=model, state=state, vocab_size=vocab_size,
                                     eos_token_ids=tokenizer.eos_token_ids, planner=self.planner,
                                     inputs=self.inputs, writer=self.writer, finish=self._finish,
                                     requeue=lambda sequences: self._to_waiting(sequences, tell_gate=True))

    # -- called from any thread ------------------------------------------------------

    def enqueue(self, sequence: SequenceState) -> None:
        self.inbox.put(sequence)

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    def expecting(self) -> ContextManager[None]:
        """Count a request on its way here while the block runs (the batch window waits
        for it: :meth:`~.inbox.Inbox.window_closes`)."""
        return self.inbox.expecting()

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
        return len(self.inbox) + len(self.state.waiting)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "queue_depth": self.queue_depth(), "running": len(self.state.decoding),
            "prefilling": len(self.state.prefilling), "max_batch_size": self.max_batch_size,
            "steps": c.steps, "decode_steps": c.decode_steps, "decode_lanes": len(self.decode.lanes),
            "prefill_chunks": c.prefill_chunks, "prefill_forwards": c.prefill_forwards,
            "first_token_forwards": c.first_token_forwards,
            "prompt_tokens_prefilled": c.prompt_tokens_prefilled,
            "tokens_generated": c.tokens_generated, "preempted": c.preempted,
            "finished": dict(c.finished), "prefix_cache": self.prefix_cache.stats(),
            **self.inputs.stats(), **self.drafts.stats(),
        }

    def progress(self) -> list[RequestProgress]:
        """Each request taken in, with its phase; read from any thread (copies only)."""
        arrivals = list(self.inbox.arrivals)
        # A request moving from the inbox to the table may be in both copies.
        held = {s.request_id: s for s in arrivals + list(self.state.by_id.values())}
        return progress_of(held.values(), list(self.state.waiting) + arrivals)

    # -- the Worker protocol (MLX thread) --------------------------------------------

    def has_work(self) -> bool:
        """Whether there is work to do now: not while the batch window is open."""
        return self.step_sync.has_work(self._has_local_work())

    def _has_local_work(self) -> bool:
        state = self.state
        if self.inbox.aborts or state.prefilling or state.decoding:
            return True
        if self.inbox.arrivals:
            closes = self.inbox.window_closes(state)
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
        return self.step_sync.wake_at(self.inbox.window_closes(self.state) or self._resume_at)

    def step(self) -> None:
        self.counters.steps += 1
        self.fitter.fit(self.state.limits, bool(self.state.decoding), self.decode.kv_nbytes)
        self._drain_inbox(sync=True)
        self._admit()
        if self.state.prefilling:
            self._prefill()
        if self.state.decoding:
            self._decode()

    def fail(self, exc: BaseException) -> None:
        """End every in-flight request with an error and start over with an empty batch."""
        self.step_sync.failed(exc)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        state = self.state
        for sequence in list(state.by_id.values()):
            if sequence.phase in (PREFILLING, DECODING):
                self._finish(sequence, "error", error=message, error_type="internal", in_batch=False)
        state.decoding.clear()
        state.prefilling.clear()
        self.decode.reset()
        mx.clear_cache()

    def shutdown(self) -> None:
        """Abort everything (MLX thread); the scheduler takes no requests afterwards."""
        self.inbox.stop()
        self._drain_inbox()
        self.step_sync.close()
        for sequence in list(self.state.by_id.values()):
            # The model goes away with the engine: nothing is worth caching for it.
            self._finish(sequence, "abort")
        # Drop every path to the weights so the engine can return them to the system.
        self.decode.close()
        self.inputs.close()
        self.prefill.model = None
        self.layout = self.planner.layout = self.writer.layout = None  # type: ignore[assignment]
        self.restorer.layout = None  # type: ignore[assignment]

    # -- 2. arrivals and aborts --------------------------------------------------------

    def _drain_inbox(self, *, sync: bool = False) -> None:
        state = self.state
        arrivals, aborts = self.inbox.drain()
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
                # Its blocks go into the prefix cache as a finished request's do.
                self._finish(sequence, "abort", store=True)

    # -- 3. admission ----------------------------------------------------------------

    def _admit(self) -> None:
        self._resume_at = None
        state = self.state
        followers: list[SequenceState] = []
        try:
            while state.waiting and state.free_slots() > 0:
                sequence = state.waiting[0]
                if sequence.preemptions and not self.budgeter.may_resume(sequence):
                    # It resumes before anything queued behind it starts.
                    self._resume_at = time.monotonic() + RESUME_RETRY_S
                    return
                state.waiting.popleft()
                if not self.prefix_cache.enabled:
                    self._to_prefilling(sequence, Restored(self.layout.new_cache()))
                    continue
                prefix = list(self.cache_key(sequence, sequence.context[:sequence.prefill_target]))
                sequence.block_hashes = self.prefix_cache.hashes(prefix)
                if follows_a_prefill(sequence, state.prefilling, self.prefix_cache):
                    followers.append(sequence)
                    continue
                # The copy is made (and evaluated: resident, in the gate's current-use
                # reading) here, within the room the gate gave for it.
                self._to_prefilling(sequence, self.restorer.start(
                    sequence.block_hashes, prefix, self._restore_room(sequence.request_id)))
        finally:
            # Followers keep their places at the head of the queue.
            state.waiting.extendleft(reversed(followers))

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

    # -- 4. prefill ------------------------------------------------------------------

    def _prefill(self) -> None:
        started = time.perf_counter()
        firsts = self.prefill.step()
        self.planner.observe(time.perf_counter() - started)
        for first in firsts:
            sequence = first.sequence
            if sequence.phase is not PREFILLING:
                continue
            try:
                self.emitter.hand_out(sequence, first.token, first.logprobs, first.finish_reason)
                if first.finish_reason is None:
                    self.writer.store_prompt_end(sequence)
                    self._to_decoding(sequence, first.token)
                else:
                    self.writer.store_finished_blocks(sequence, sequence.cache or [], sequence.context)
                    self._finish(sequence, first.finish_reason)
            except Exception as exc:
                self._failed(sequence, exc)

    # -- 5. decode and retire ----------------------------------------------------------

    def _decode(self) -> None:
        preempt = self.budgeter.budget()
        if preempt:
            self._preempt(preempt)
        if not self.state.decoding:
            return
        emitted, finished = self.decode.step()
        self.counters.decode_steps += 1
        # Every row's token goes out first; the finished rows' blocks are stored after
        # (about 20 ms a row), so no stream's token waits for them.
        for out in emitted:
            if out.sequence.phase is not DECODING:
                continue
            try:
                self.emitter.hand_out(out.sequence, out.token, out.logprobs, out.finish_reason)
            except Exception as exc:
                self._failed(out.sequence, exc)
        for row in finished:
            self._retire(row)

    def _retire(self, row: Finished) -> None:
        """A row the decode step finished (it left its lane): store its blocks, end it."""
        sequence = row.sequence
        if sequence.phase is not DECODING:
            return
        try:
            self.writer.store_finished_blocks(sequence, row.cache, sequence.prompt + sequence.generated)
        except Exception as exc:
            self._failed(sequence, exc)
            return
        self._finish(sequence, row.reason, in_batch=False)

    def _preempt(self, sequences: list[SequenceState]) -> None:
        """Take ``sequences`` out of the decode batch without ending them: their KV goes
        to the prefix cache (recomputed on resume where it cannot, or was evicted)."""
        extracted = self.decode.remove(sequences, caches=True)
        for sequence in sequences:
            del self.state.decoding[sequence.request_id]
            # Resuming feeds the prompt and every token handed out (the batch may not
            # have fed the newest yet); the token it sampled next is dropped with the
            # row and sampled again from the same KV.
            sequence.context = sequence.prompt + sequence.generated
            cache = extracted.pop(sequence.request_id, None)
            if cache is not None:
                self.writer.store_finished_blocks(sequence, cache, sequence.context)
        self._to_waiting(sequences, tell_gate=False)

    def _failed(self, sequence: SequenceState, exc: Exception) -> None:
        log.exception("request %s failed while handling its token", sequence.request_id)
        self._finish(sequence, "error", error=f"{type(exc).__name__}: {exc}", error_type="internal")

    # -- the phase transitions -----------------------------------------------------------

    def _to_prefilling(self, sequence: SequenceState, restored: Restored) -> None:
        sequence.phase = PREFILLING
        sequence.prefill_started = time.monotonic()
        sequence.cache = restored.cache
        sequence.prefilled = restored.blocks * self.prefix_cache.block_size + restored.tail_tokens
        if not sequence.preemptions:
            sequence.reused = sequence.prefilled
        sequence.stored_blocks = restored.blocks
        self.state.prefilling.append(sequence)

    def _to_decoding(self, sequence: SequenceState, first_token: int) -> None:
        self.state.prefilling.remove(sequence)
        self.decode.join(sequence, first_token, sequence.cache)  # type: ignore[arg-type]
        sequence.cache = None
        sequence.phase = DECODING
        sequence.first_token_at = sequence.first_token_at or time.monotonic()
        self.state.decoding[sequence.request_id] = sequence

    def _to_waiting(self, sequences: list[SequenceState], *, tell_gate: bool) -> None:
        """Put preempted ``sequences`` (out of the decode batch, or refused before a
        prefill forward) at the head of the queue, oldest first."""
        state = self.state
        for sequence in sequences:
            if sequence in state.prefilling:
                state.prefilling.remove(sequence)
            self.inputs.release(sequence)
            sequence.cache = sequence.history = sequence.draft = None
            sequence.fed_token_out = False
            sequence.phase = WAITING
            sequence.preemptions += 1
            sequence.kv_allowance = None
            state.counters.preempted += 1
            if tell_gate:
                self.budgeter.tell_suspended(sequence)
        for sequence in sorted(sequences, key=lambda s: s.arrived, reverse=True):
            state.waiting.appendleft(sequence)
        log.info("preempted request(s) %s of model %r: they resume when memory allows",
                 ", ".join(s.request_id for s in sequences), state.model_id)

    def _finish(self, sequence: SequenceState, reason: str, *, store: bool = False,
                in_batch: bool = True, error: str | None = None, error_type: str | None = None,
                rejected: RequestRejected | None = None) -> None:
        """End ``sequence`` and release everything it holds: a decoding row ``in_batch``
        leaves its lane (with ``store``, its blocks go into the prefix cache first).
        The final output goes out last: whoever sees it sees the request's cleanup done."""
        if sequence.phase is DONE:
            return
        # Counted before the request leaves its phase: whoever sees the engine idle sees
        # every ending counted.
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self.inputs.release(sequence)
        state = self.state
        if sequence.phase is PREFILLING:
            if sequence in state.prefilling:
                state.prefilling.remove(sequence)
            sequence.cache = None
        elif sequence.phase is DECODING:
            # The row counts as running until its blocks are stored: whoever sees the
            # engine idle sees every request's ending done.
            if in_batch and sequence.request_id in state.decoding:
                extracted = self.decode.remove([sequence], caches=store)
                if sequence.request_id in extracted:
                    self.writer.store_finished_blocks(sequence, extracted[sequence.request_id],
                                                      sequence.prompt + sequence.generated)
            state.decoding.pop(sequence.request_id, None)
        elif sequence in state.waiting:
            state.waiting.remove(sequence)
        sequence.phase = DONE
        sequence.history = sequence.draft = None
        state.by_id.pop(sequence.request_id, None)
        if self.finish_listener is not None:
            # Before the final output: whoever sees the request end sees its cleanup begun.
            try:
                self.finish_listener(sequence.request_id, reason)
            except Exception:
                log.exception("on_request_finished listener failed for request %s",
                              sequence.request_id)
        self.emitter.final(sequence, reason, error=error, error_type=error_type, rejected=rejected)


__all__ = ["Scheduler", "SequenceState", "new_sequence", "DECODING", "DONE", "PREFILLING", "WAITING"]
