"""What a request's queue receives: its tokens as they are sampled, then its end.

Every generated token goes out at once as a :class:`~omlx_core.engine.GenerationOutput`
with its id and, when asked, its logprob. A stop token (an end-of-sequence token, or
one of the request's ``stop_token_ids``) ends the request with ``finish_reason="stop"``
and is not handed out; ``max_tokens`` ends it with ``"length"``. The final output
carries the usage. The scheduler decides when (:meth:`~.scheduler.Scheduler._finish`):
a decode step hands out every row's token before it ends the rows that finished, so no
stream's token waits for another request's blocks to be stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from omlx_core.engine import GenerationOutput, TokenLogprob, Usage
from omlx_core.scheduling.batch_state import SequenceState, StepCounters
from omlx_core.scheduling.sampling import token_logprob

if TYPE_CHECKING:
    from omlx_core.memory.types import RequestRejected


class OutputEmitter:
    """Puts a request's tokens and final output on its queue."""

    def __init__(self, counters: StepCounters) -> None:
        self.counters = counters

    def hand_out(self, sequence: SequenceState, token: int, logprobs_row: mx.array | None,
                 finish_reason: str | None) -> None:
        """Count one generated token and hand it out, unless it is the stop token that
        ends the request (``finish_reason="stop"``)."""
        # Once per row and decode step: kept to this one call.
        sequence.completion_tokens += 1
        sequence.generated.append(token)
        self.counters.tokens_generated += 1
        if finish_reason == "stop":
            return
        top = sequence.request.sampling.logprobs
        sequence.outputs.put(GenerationOutput(
            sequence.request_id, token_ids=(token,),
            logprobs=None if top is None else (token_logprob(logprobs_row, token, top),)))

    def reject_duplicate(self, sequence: SequenceState) -> None:
        """End a request whose id is already running here, before it was admitted."""
        sequence.outputs.put(GenerationOutput(
            sequence.request_id, finish_reason="error",
            error=f"request id {sequence.request_id!r} is already running on this engine",
            error_type="invalid", usage=Usage(len(sequence.prompt), 0)))

    def final(self, sequence: SequenceState, reason: str, *, token_ids: tuple[int, ...] = (),
              logprobs: tuple[TokenLogprob, ...] | None = None, error: str | None = None,
              error_type: str | None = None, rejected: RequestRejected | None = None) -> None:
        """Put the final output, with the usage, on the queue."""
        sequence.outputs.put(GenerationOutput(
            sequence.request_id, finish_reason=reason, token_ids=token_ids, logprobs=logprobs,
            error=error, error_type=error_type, rejected=rejected, usage=self.usage(sequence)))

    @staticmethod
    def usage(sequence: SequenceState) -> Usage:
        return Usage(len(sequence.prompt), sequence.completion_tokens, sequence.reused,
                     sequence.drafted, sequence.accepted)


__all__ = ["OutputEmitter"]
