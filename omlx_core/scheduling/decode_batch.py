"""The decode batch: mlx-lm's ``BatchGenerator`` over the requests that are decoding.

A request whose whole prompt is in its cache joins the batch (``insert`` with that
cache, its first token, its sampler and processors) without waiting for the batch to
drain, and leaves it (``remove``) the moment it finishes or is preempted. Each step
feeds every row its latest token and samples the next (its sampling fused across the
rows: :mod:`~omlx_core.scheduling.decode_step`), or, where a
:class:`~omlx_core.scheduling.extensions.DraftVerify` drafts, verifies drafts.

**Lanes.** mlx-lm's batch left-pads every row's KV cache to its longest row, and a
decode step reads all of it: a 5,000-token prompt joining eight 300-token streams made
every one of them read 5,000 positions a step (0.33 s a step instead of 0.07-0.09 s on
the CPU), and the join itself (every row padded and copied) stalled them 1.7 s. So the batch
runs one generator per *lane*: a row joins the lane where it adds the fewest bytes a
step reads (:func:`pick_lane`), and opens its own lane when padding it into any would
read more than a forward of its own, whose fixed cost is the weights read once more.
On a CPU or GPU a decode step is bound by the bytes it reads, so that is its cost. Rows
of like lengths (the common case) share one lane and one forward; each step runs every
lane's forward, one after another on the same stream, each pipelined as before.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import KVCache

from omlx_core.scheduling.batch_state import DECODING, BatchState, SequenceState
from omlx_core.scheduling.decode_step import fuse_sampling
from omlx_core.scheduling.extensions import DraftVerify


#: uids of different lanes never meet: a lane's generator counts from its number times this
LANE_UIDS = 1 << 40


def pick_lane(lanes: Sequence[Sequence[int]], length: int, fixed_tokens: float) -> int | None:
    """The lane a row of ``length`` KV tokens joins (an index into ``lanes``, each lane
    given as its rows' KV lengths), or ``None`` for a lane of its own.

    A lane's step reads ``rows x longest`` KV positions (left padding included) plus the
    weights, ``fixed_tokens`` in the same unit. Joining a lane adds the positions its
    padded batch grows by; a lane of its own adds the row's positions and the weights.
    The cheapest wins; a tie joins."""
    best, cost = None, fixed_tokens + length
    for index, rows in enumerate(lanes):
        longest = max(rows, default=0)
        added = (len(rows) + 1) * max(longest, length) - len(rows) * longest
        if added <= cost:
            best, cost = index, added
    return best


class _Lane:
    """One generator and the uids of the rows in it."""

    def __init__(self, generator: BatchGenerator) -> None:
        self.generator = generator
        self.uids: set[int] = set()


class DecodeBatch:
    """The lanes' generators, and the rows of :attr:`BatchState.decoding` they decode."""

    def __init__(self, *, model: Any, state: BatchState, eos_token_ids: Sequence[int],
                 prefill_step_size: int, fused_sampling: bool, drafts: DraftVerify,
                 lanes: bool = True) -> None:
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
        self.lanes: list[_Lane] = []
        #: lanes whose rows all left, kept for the next lane to open: a generator is made
        #: once per lane the batch ever needed at once (as one was, before lanes)
        self._idle: list[_Lane] = []
        self._lanes_opened = 0
        #: a forward's fixed cost in KV positions (the weights' bytes over a position's),
        #: measured at the first join; without ``lanes``, every row shares one lane
        self._fixed_tokens: float | None = None if lanes else float("inf")

    def new_generator(self) -> BatchGenerator:
        """A generator for a new lane (empty; its step fused where configured)."""
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
        lane = self._lane_for(sequence)
        sequence.uid = lane.generator.insert(
            [[first_token]],
            max_tokens=[sequence.max_tokens - sequence.completion_tokens - 1],
            caches=[sequence.cache],
            all_tokens=[list(sequence.context)],
            samplers=[sequence.sampler],
            logits_processors=[sequence.processors],
            stop_sequences=[stops],
        )[0]
        lane.uids.add(sequence.uid)
        sequence.cache = None
        sequence.phase = DECODING
        sequence.first_token_at = sequence.first_token_at or time.monotonic()
        sequence.kv_allowance = None
        sequence.kv_lookahead = self.drafts.lookahead
        self.state.decoding[sequence.uid] = sequence

    @staticmethod
    def _length(sequence: SequenceState) -> int:
        return len(sequence.prompt) + sequence.completion_tokens

    def _lane_for(self, sequence: SequenceState) -> _Lane:
        if self._fixed_tokens is None:
            self._fixed_tokens = self._forward_in_positions(sequence.cache or [])
        decoding = self.state.decoding
        lengths = [[self._length(decoding[uid]) for uid in lane.uids if uid in decoding]
                   for lane in self.lanes]
        index = pick_lane(lengths, self._length(sequence), self._fixed_tokens)
        if index is not None:
            return self.lanes[index]
        if self._idle:
            lane = self._idle.pop()
        else:
            self._lanes_opened += 1
            lane = _Lane(self.new_generator())
            # Disjoint uids: the scheduler keys rows by uid across lanes.
            lane.generator._uid_count = self._lanes_opened * LANE_UIDS
        self.lanes.append(lane)
        return lane

    def _forward_in_positions(self, cache: Sequence[Any]) -> float:
        """The weights' bytes over one KV position's bytes (its plain KV layers'); with
        no plain KV layer padding costs nothing, and every row shares one lane."""
        per_position = 0
        for layer in cache:
            if type(layer) is KVCache and layer.keys is not None:
                per_position += (layer.keys.nbytes // layer.keys.shape[2]
                                 + layer.values.nbytes // layer.values.shape[2])
        if not per_position:
            return float("inf")
        weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        return weights / per_position

    def step(self) -> Sequence[Any]:
        """One step over every row (each lane's forward in turn): the responses (uid,
        token, logprobs, finish_reason, prompt_cache, all_tokens), a finished row's last."""
        decoding = self.state.decoding
        started = time.perf_counter()
        drafting = self.drafts.drafting(decoding)
        responses: list[Any] = []
        for lane in self.lanes:
            if drafting:
                rows = {uid: decoding[uid] for uid in lane.uids if uid in decoding}
                lane_responses = self.drafts.verify(lane.generator, rows)
            else:
                _, lane_responses = lane.generator.next()
            for response in lane_responses:
                if response.finish_reason is not None:
                    lane.uids.discard(response.uid)
            responses.extend(lane_responses)
        self._close_empty_lanes()
        seconds = time.perf_counter() - started
        previous = self.step_seconds
        self.step_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        return responses

    def remove(self, uids: list[int], *, caches: bool) -> dict[int, tuple[list[Any], list[int]]]:
        """Take rows out of the batch; with ``caches``, their KV caches and tokens."""
        removed: dict[int, tuple[list[Any], list[int]]] = {}
        for lane in self.lanes:
            mine = [uid for uid in uids if uid in lane.uids]
            if mine:
                removed.update(lane.generator.remove(mine, return_prompt_caches=caches) or {})
                lane.uids.difference_update(mine)
        self._close_empty_lanes()
        return removed

    def _close_empty_lanes(self) -> None:
        self._idle += [lane for lane in self.lanes if not lane.uids]
        self.lanes = [lane for lane in self.lanes if lane.uids]

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the rows' KV caches."""
        return sum(int(lane.generator.prompt_cache_nbytes) for lane in self.lanes)

    def reset(self) -> None:
        """Start over with an empty batch (after a failed step)."""
        self.lanes, self._idle = [], []

    def close(self) -> None:
        """Drop the generators and with them every path to the weights."""
        self.reset()
        self.model = None


__all__ = ["DecodeBatch"]
