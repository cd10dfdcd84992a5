"""What a request's queue receives: its tokens as they are sampled, then its end.

Every generated token goes out at once as a :class:`~omlx_core.engine.GenerationOutput`
with its id and, when asked, its logprob. A stop token (an end-of-sequence token, or
one of the request's ``stop_token_ids``) ends the request with ``finish_reason="stop"``
and is not handed out; ``max_tokens`` ends it with ``"length"``. The final output
carries the usage; before it goes out, the request has released everything it held
and the ``finish_listener`` (the ``on_request_finished`` sink) has been told. A decode
step hands out every row's token before it ends the rows that finished, so no stream's
token waits for another request's blocks to be stored.

A request the pipeline aborts (its client left, or a stop string matched its text)
leaves its KV behind as a stopped one does: the blocks its prompt and completion
filled go into the prefix cache, so the next chat turn is a prefix hit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import mlx.core as mx

from omlx_core.engine import GenerationOutput, TokenLogprob, Usage
from omlx_core.plugins.batched.batch_state import DECODING, DONE, PREFILLING, WAITING, BatchState, SequenceState
from omlx_core.plugins.batched.decode_batch import DecodeBatch
from omlx_core.plugins.batched.extensions import ChunkInputs
from omlx_core.plugins.batched.prefix_writer import PrefixCacheWriter
from omlx_core.plugins.batched.sampling import token_logprob

if TYPE_CHECKING:
    from omlx_core.memory.types import RequestRejected

log = logging.getLogger(__name__)


class OutputEmitter:
    """Hands out tokens and endings, and releases what an ended request held."""

    def __init__(self, *, state: BatchState, batch: DecodeBatch, writer: PrefixCacheWriter,
                 inputs: ChunkInputs, finish_listener: Callable[[str, str], None] | None) -> None:
        self.state = state
        self.counters = state.counters
        self.batch = batch
        self.writer = writer
        self.inputs = inputs
        #: called with (request id, finish reason) once a request has released everything
        self.finish_listener = finish_listener

    def accept(self, sequence: SequenceState, token: int, logprobs_row: mx.array,
               finish_reason: str | None, cache: list[Any] | None, tokens: Sequence[int] | None) -> None:
        """Hand out one generated token (:meth:`hand_out`) and, when ``finish_reason``
        is set, end the request (:meth:`end`)."""
        self.hand_out(sequence, token, logprobs_row, finish_reason)
        if finish_reason is not None:
            self.end(sequence, finish_reason, cache, tokens)

    def hand_out(self, sequence: SequenceState, token: int, logprobs_row: mx.array,
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

    def end(self, sequence: SequenceState, finish_reason: str, cache: list[Any] | None,
            tokens: Sequence[int] | None) -> None:
        """End a request the generator finished (``"stop"``: a stop token, ``"length"``),
        its tokens handed out: ``cache`` holds ``tokens``, for the prefix cache, and the
        row has left the decode batch."""
        self._left_batch(sequence)
        self.writer.store_finished_blocks(sequence, cache or [], tokens or ())
        self.finish(sequence, finish_reason, remove=False)

    def _left_batch(self, sequence: SequenceState) -> None:
        """The generator finished ``sequence``'s row and dropped it."""
        if sequence.phase == DECODING:
            del self.state.decoding[sequence.uid]  # type: ignore[index]

    def abort(self, sequence: SequenceState, *, store: bool = True) -> None:
        """End ``sequence`` at the pipeline's word; with ``store``, the blocks a decoding
        request completed go into the prefix cache as a stopped request's do (prefill
        stored its prompt's blocks as it crossed them)."""
        if sequence.phase == WAITING:
            try:
                self.state.waiting.remove(sequence)
            except ValueError:
                pass
        self.finish(sequence, "abort", store=store)

    def reject_duplicate(self, sequence: SequenceState) -> None:
        """End a request whose id is already running here, before it was admitted."""
        sequence.outputs.put(GenerationOutput(
            sequence.request_id, finish_reason="error",
            error=f"request id {sequence.request_id!r} is already running on this engine",
            error_type="invalid", usage=Usage(len(sequence.prompt), 0)))

    def finish(self, sequence: SequenceState, reason: str, *, token_ids: tuple[int, ...] = (),
               logprobs: tuple[TokenLogprob, ...] | None = None, error: str | None = None,
               error_type: str | None = None, rejected: RequestRejected | None = None,
               remove: bool = True, store: bool = False) -> None:
        """Emit the final output and release everything the request holds: with
        ``remove``, its row leaves the decode batch (with ``store``, its blocks go into
        the prefix cache first)."""
        if sequence.phase == DONE:
            return
        # Counted before the request leaves its phase: whoever sees the engine idle sees
        # every ending counted.
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self.inputs.release(sequence)
        state = self.state
        if sequence.phase == PREFILLING:
            if sequence in state.prefilling:
                state.prefilling.remove(sequence)
            sequence.cache = None
        elif sequence.phase == DECODING and sequence.uid is not None:
            # The row counts as running until its blocks are stored: whoever sees the
            # engine idle sees every request's ending done.
            if remove and sequence.uid in state.decoding:
                extracted = self.batch.remove([sequence.uid], caches=store)
                if store and sequence.uid in extracted:
                    cache, tokens = extracted[sequence.uid]
                    self.writer.store_finished_blocks(sequence, cache, tokens)
            state.decoding.pop(sequence.uid, None)
        sequence.phase = DONE
        state.by_id.pop(sequence.request_id, None)
        if self.finish_listener is not None:
            # Before the final output: whoever sees the request end sees its cleanup begun.
            try:
                self.finish_listener(sequence.request_id, reason)
            except Exception:
                log.exception("on_request_finished listener failed for request %s",
                              sequence.request_id)
        usage = Usage(len(sequence.prompt), sequence.completion_tokens, sequence.reused,
                      draft_tokens=sequence.draft_tokens,
                      accepted_draft_tokens=sequence.accepted_draft_tokens)
        sequence.outputs.put(self._final_output(
            sequence, reason, token_ids=token_ids, logprobs=logprobs, error=error,
            error_type=error_type, rejected=rejected, usage=usage))

    def _final_output(self, sequence: SequenceState, reason: str, **fields: Any) -> GenerationOutput:
        return GenerationOutput(sequence.request_id, finish_reason=reason, **fields)


__all__ = ["OutputEmitter"]
