"""The memory guard's budget for the decode batch, and preemption.

Each decoding request holds a KV allowance the forward gate granted. Before a decode
step after which a request would hold more KV than it was allowed, the gate is asked
again (:meth:`~omlx_core.memory.gate.ForwardGate.check_decode`); when the growth does
not fit, it names the youngest requests to take out of the batch. Such a request is
**preempted** back to ``waiting``: it keeps its completion so far, sampler and
processors; its KV goes to the prefix cache as blocks (where the model's layers allow),
and it waits at the head of the queue until the gate lets it resume (``may_resume``).
Then it prefills its prompt and completion so far (mostly a prefix-cache hit) and goes
on: its client sees a pause, not an error. A prefilling request the gate refuses while
others run waits the same way (:meth:`DecodeBudgeter.requeue`).
"""

from __future__ import annotations

import logging

from omlx_core.memory.gate import DecodeRow, DecodeStep
from omlx_core.scheduling.batch_state import WAITING, BatchState, SequenceState
from omlx_core.scheduling.decode_batch import DecodeBatch
from omlx_core.scheduling.extensions import ChunkInputs
from omlx_core.scheduling.prefix_writer import PrefixCacheWriter

log = logging.getLogger(__name__)


class DecodeBudgeter:
    """Asks the gate before decode steps that grow KV past allowances; preempts and
    requeues the requests it names."""

    def __init__(self, *, state: BatchState, batch: DecodeBatch, writer: PrefixCacheWriter,
                 inputs: ChunkInputs) -> None:
        self.state = state
        self.batch = batch
        self.writer = writer
        self.inputs = inputs

    def budget(self) -> None:
        """Ask the gate before a decode step after which a request would hold more KV
        than it was allowed; preempt the requests it names."""
        state = self.state
        gate = state.gate
        if gate is None or not any(s.kv_allowance is None or s.kv_after_step > s.kv_allowance
                                   for s in state.decoding.values()):
            return
        step = DecodeStep(state.model_id, tuple(DecodeRow(s.request_id, s.kv_after_step, s.arrived)
                                                for s in state.decoding.values()),
                          limits=state.limits, model_config=state.model_config)
        try:
            plan = gate.check_decode(step)
        except Exception:
            log.exception("forward gate %r failed to budget a decode step; decoding on", gate)
            return
        preempt = set(plan.preempt)
        for sequence in state.decoding.values():
            sequence.kv_allowance = plan.allowed_tokens.get(sequence.request_id)
        if preempt:
            self.preempt([s for s in state.decoding.values() if s.request_id in preempt])

    def preempt(self, sequences: list[SequenceState]) -> None:
        """Take ``sequences`` out of the decode batch without ending them: their KV goes
        to the prefix cache (recomputed on resume where it cannot, or was evicted)."""
        extracted = self.batch.remove([s.uid for s in sequences], caches=True)  # type: ignore[misc]
        for sequence in sequences:
            del self.state.decoding[sequence.uid]  # type: ignore[arg-type]
            # Resuming feeds the prompt and every token handed out (the batch may not
            # have fed the newest yet); the token it sampled next is dropped with the
            # row and sampled again from the same KV.
            sequence.context = sequence.prompt + sequence.generated
            cache, tokens = extracted.get(sequence.uid, (None, None))  # type: ignore[arg-type]
            if cache is not None:
                self.writer.store_finished_blocks(sequence, cache, list(tokens))
            del cache
            sequence.uid = None
        self.requeue(sequences, tell_gate=False)

    def requeue(self, sequences: list[SequenceState], *, tell_gate: bool) -> None:
        """Put preempted ``sequences`` at the head of the queue, oldest first."""
        state = self.state
        for sequence in sequences:
            if sequence in state.prefilling:
                state.prefilling.remove(sequence)
            self.inputs.release(sequence)
            sequence.cache = None
            sequence.phase = WAITING
            sequence.preemptions += 1
            sequence.kv_allowance = None
            state.counters.preempted += 1
            if tell_gate and state.gate is not None:
                try:
                    state.gate.suspend(sequence.request_id)
                except Exception:
                    log.exception("forward gate %r failed to note the preemption of request %s",
                                  state.gate, sequence.request_id)
        for sequence in sorted(sequences, key=lambda s: s.arrived, reverse=True):
            state.waiting.appendleft(sequence)
        log.info("preempted request(s) %s of model %r: they resume when memory allows",
                 ", ".join(s.request_id for s in sequences), state.model_id)

    def may_resume(self, sequence: SequenceState) -> bool:
        """Whether the gate lets a preempted ``sequence`` prefill again."""
        gate = self.state.gate
        if gate is None:
            return True
        try:
            return bool(gate.may_resume(sequence.request_id))
        except Exception:
            log.exception("forward gate %r failed to say whether request %s may resume; "
                          "resuming it", gate, sequence.request_id)
            return True


__all__ = ["DecodeBudgeter"]
