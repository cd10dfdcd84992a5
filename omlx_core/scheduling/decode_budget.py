"""The memory guard's budget for the decode batch.

Each decoding request holds a KV allowance the forward gate granted. Before a decode
step after which a request would hold more KV than it was allowed, the gate is asked
again (:meth:`~omlx_core.memory.gate.ForwardGate.check_decode`); when the growth does
not fit, it names the youngest requests to take out of the batch. The scheduler then
**preempts** them back to ``waiting``: each keeps its completion so far, sampler and
processors; its KV goes to the prefix cache as blocks (where the model's layers allow),
and it waits at the head of the queue until the gate lets it resume
(:meth:`DecodeBudgeter.may_resume`). Then it prefills its prompt and completion so far
(mostly a prefix-cache hit) and goes on: its client sees a pause, not an error. A
prefilling request the gate refuses while others run waits the same way.
"""

from __future__ import annotations

import logging

from omlx_core.memory.gate import DecodeRow, DecodeStep
from omlx_core.scheduling.batch_state import BatchState, SequenceState

log = logging.getLogger(__name__)


class DecodeBudgeter:
    """Asks the gate before decode steps that grow KV past allowances."""

    def __init__(self, *, state: BatchState) -> None:
        self.state = state

    def budget(self) -> list[SequenceState]:
        """Ask the gate before a decode step after which a request would hold more KV
        than it was allowed; return the requests it names to preempt."""
        state = self.state
        gate = state.gate
        if gate is None or not any(s.kv_allowance is None or s.kv_after_step > s.kv_allowance
                                   for s in state.decoding.values()):
            return []
        step = DecodeStep(state.model_id, tuple(DecodeRow(s.request_id, s.kv_after_step, s.arrived)
                                                for s in state.decoding.values()),
                          limits=state.limits, model_config=state.model_config)
        try:
            plan = gate.check_decode(step)
        except Exception:
            log.exception("forward gate %r failed to budget a decode step; decoding on", gate)
            return []
        for sequence in state.decoding.values():
            sequence.kv_allowance = plan.allowed_tokens.get(sequence.request_id)
        preempt = set(plan.preempt)
        return [s for s in state.decoding.values() if s.request_id in preempt]

    def tell_suspended(self, sequence: SequenceState) -> None:
        """Tell the gate that ``sequence``, refused before a prefill forward, waits."""
        gate = self.state.gate
        if gate is None:
            return
        try:
            gate.suspend(sequence.request_id)
        except Exception:
            log.exception("forward gate %r failed to note the preemption of request %s",
                          gate, sequence.request_id)

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
