"""The decode batch: mlx-lm's ``BatchGenerator`` over the requests that are decoding.

A request whose whole prompt is in its cache joins the batch (``insert`` with that
cache, its first token, its sampler and processors) without waiting for the batch to
drain, and leaves it (``remove``) the moment it finishes or is preempted. Each step
feeds every row its latest token and samples the next (its sampling fused across the
rows: :mod:`~omlx_core.plugins.batched.decode_step`), or, where a
:class:`~omlx_core.plugins.batched.extensions.DraftVerify` drafts, verifies drafts.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from mlx_lm.generate import BatchGenerator, StopSequences

from omlx_core.plugins.batched.batch_state import DECODING, BatchState, SequenceState
from omlx_core.plugins.batched.decode_step import fuse_sampling
from omlx_core.plugins.batched.extensions import DraftVerify


class DecodeBatch:
    """The generator, and the rows of :attr:`BatchState.decoding` it decodes."""

    def __init__(self, *, model: Any, state: BatchState, eos_token_ids: Sequence[int],
                 prefill_step_size: int, fused_sampling: bool, drafts: DraftVerify) -> None:
        self.model = model
        self.state = state
        self.prefill_step_size = prefill_step_size
        self.fused_sampling = fused_sampling
        self.drafts = drafts
        self.eos = tuple(sorted(eos_token_ids))
        #: seconds of the latest decode step, averaged (``None``: none ran yet); the
        #: prefill planner keeps a chunk plus a step within the decode latency budget
        self.step_seconds: float | None = None
        self._default_stops = StopSequences([(t,) for t in self.eos])
        self.generator: BatchGenerator | None = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        size = self.state.max_batch_size
        generator = BatchGenerator(self.model, completion_batch_size=size, prefill_batch_size=size,
                                   prefill_step_size=self.prefill_step_size)
        if self.fused_sampling:
            fuse_sampling(generator, self._wants_logprobs)
        return generator

    def _wants_logprobs(self, uid: int) -> bool:
        sequence = self.state.decoding.get(uid)
        return sequence is None or sequence.request.sampling.logprobs is not None

    def stop_token_ids(self, sampling: Any) -> set[int]:
        return set(self.eos) | {int(t) for t in (sampling.stop_token_ids or ())}

    def join(self, sequence: SequenceState, first_token: int) -> None:
        """Hand ``sequence`` (its whole context in its cache) to the batch, which goes on
        from ``first_token``."""
        sampling = sequence.request.sampling
        stops = self._default_stops
        if sampling.stop_token_ids:
            stops = StopSequences([(t,) for t in sorted(self.stop_token_ids(sampling))])
        sequence.uid = self.generator.insert(  # type: ignore[union-attr]
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
        sequence.kv_lookahead = self.drafts.lookahead
        self.state.decoding[sequence.uid] = sequence

    def step(self) -> Sequence[Any]:
        """One step over every row: the responses (uid, token, logprobs, finish_reason,
        prompt_cache, all_tokens), a finished row's last."""
        decoding = self.state.decoding
        started = time.perf_counter()
        if self.drafts.drafting(decoding):
            responses = self.drafts.verify(self.generator, decoding)  # type: ignore[arg-type]
        else:
            _, responses = self.generator.next()  # type: ignore[union-attr]
        seconds = time.perf_counter() - started
        previous = self.step_seconds
        self.step_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        return responses

    def remove(self, uids: list[int], *, caches: bool) -> dict[int, tuple[list[Any], list[int]]]:
        """Take rows out of the batch; with ``caches``, their KV caches and tokens."""
        return self.generator.remove(uids, return_prompt_caches=caches) or {}  # type: ignore[union-attr]

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the rows' KV caches."""
        return int(self.generator.prompt_cache_nbytes)  # type: ignore[union-attr]

    def reset(self) -> None:
        """Start over with an empty batch (after a failed step)."""
        self.generator = self._new_generator()

    def close(self) -> None:
        """Drop the generator and with it every path to the weights."""
        self.generator = None
        self.model = None


__all__ = ["DecodeBatch"]
