"""Which prompt chunks a scheduler step prefills, which share a forward, and what the
forward gate says about them.

Each step prefills at most ``plugin.batched.prefill_step_size`` prompt tokens in all,
split into chunks, then runs one decode step: a long prompt never stalls the running
streams for more than one chunk budget. While requests decode that were decoding before
the prompt arrived, that budget shrinks to what keeps the step (its prefill and its
decode step) within ``plugin.batched.max_decode_gap_ms``: :class:`ChunkCost`, learned
from the measured time of every prefill step, predicts a chunk's seconds from its size
and the context it attends over (a chunk late in a long prompt costs several times one
at its start), and the largest budget predicted to fit is taken (at least
:data:`MIN_CHUNK` tokens, so a prompt always moves on). A prediction is a mean, and the
budget is a bound on the gaps running streams see: so it is scaled by how far steps
recently ran over their predictions (:meth:`ChunkCost.margin`, their 90th percentile),
which grows on a loaded machine and shrinks back on a quiet one. When nothing decodes,
the budget is the whole step again. Chunk ends fall on ``plugin.batched.block_size`` boundaries
where they can, so full blocks (and, for models with non-cuttable layers, their boundary
states) go into the prefix cache as prefill crosses them; for such models a chunk also
ends at each of the request's cache points (the end of the system prompt, the start of
the last message: ``GenerationRequest.cache_points``), whose state is kept as a tail.
Chunks cover all prompt tokens but the last, which the first-token forward feeds.
Chunks of different requests with similar lengths share one forward where the model's
caches allow (:mod:`~omlx_core.scheduling.batch_prefill`); each request keeps its own
cache. A chunk fed as input embeddings (:class:`~.extensions.ChunkInputs`) runs alone.

**Forward gate seam.** Before a step's prefill forwards run, the planned chunks are
handed to the installed :class:`~omlx_core.memory.gate.ForwardGate` as one
:class:`~omlx_core.memory.gate.PrefillStep`: request ids, chunk token counts,
cached-token counts, the inputs each forward encodes first, the decode batch size and
the latest limit snapshot (:meth:`PrefillPlanner.ask_gate`). The gate is also asked after
each forward (the post-forward backstop, :meth:`PrefillPlanner.check_after_forward`):
once per shared forward, which then loses at most one request, the one holding the
most KV. A restored prefix is evaluated at admission, so the gate's current-use
reading already holds it. See :mod:`omlx_core.memory.gate` for the contract.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import numpy as np

from omlx_core.memory.gate import PrefillChunk, PrefillStep
from omlx_core.scheduling.batch_prefill import can_batch, group_spans
from omlx_core.scheduling.batch_state import BatchState, SequenceState
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.scheduling.decode_batch import DecodeBatch
from omlx_core.scheduling.extensions import ChunkInputs
from omlx_core.scheduling.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from omlx_core.memory.types import RequestRejected

log = logging.getLogger(__name__)

#: a request's chunk ``[start, end)`` of its context
Chunk = tuple[SequenceState, int, int]

#: fewest prompt tokens a step prefills under the decode latency budget
MIN_CHUNK = 16


#: the share of recent prefill steps whose over-run of their prediction the budget
#: absorbs (:meth:`ChunkCost.margin`)
MARGIN_QUANTILE = 0.9


class ChunkCost:
    """A prefill step's seconds as ``per_forward * forwards + per_token * tokens +
    per_attended * sum(chunk tokens * context they attend over)``, fitted online by
    exponentially weighted least squares (with a little ridge, so the first few steps
    give a usable answer) over every measured prefill step; and how far the latest
    ``window`` steps ran over what the fit predicted for them."""

    def __init__(self, *, decay: float = 0.97, ridge: float = 1e-6, window: int = 32) -> None:
        self.decay = decay
        self.ridge = ridge
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self.steps = 0
        #: measured over predicted seconds of the latest steps predicted before they ran
        self._ratios: deque[float] = deque(maxlen=window)

    @staticmethod
    def features(chunks: list[tuple[int, int]], forwards: int) -> np.ndarray:
        """``chunks``: (start, end) of each chunk of a step run in ``forwards`` forwards."""
        tokens = sum(end - start for start, end in chunks)
        attended = sum((end - start) * (start + end) / 2.0 for start, end in chunks)
        # Scaled so the three columns are of like size for the solver.
        return np.array([float(forwards), tokens / 256.0, attended / 65536.0])

    def observe(self, features: np.ndarray, seconds: float) -> None:
        if self.steps >= 2:
            predicted = float(features @ self.coefficients())
            if predicted > 0:
                self._ratios.append(seconds / predicted)
        self._xx = self.decay * self._xx + np.outer(features, features)
        self._xy = self.decay * self._xy + features * seconds
        self.steps += 1

    def coefficients(self) -> np.ndarray:
        scale = max(float(np.trace(self._xx)), 1e-12)
        beta = np.linalg.solve(self._xx + self.ridge * scale * np.eye(3), self._xy)
        return np.maximum(beta, 0.0)

    def seconds(self, start: int, tokens: int) -> float:
        """Predicted seconds of one forward over ``tokens`` prompt tokens from ``start``."""
        return float(self.features([(start, start + tokens)], 1) @ self.coefficients())

    def margin(self) -> float:
        """What a prediction is multiplied by to bound most steps rather than their mean:
        the :data:`MARGIN_QUANTILE` of recent measured-over-predicted ratios, at least 1
        (1 until eight steps were predicted)."""
        if len(self._ratios) < 8:
            return 1.0
        return max(1.0, float(np.quantile(np.array(self._ratios), MARGIN_QUANTILE)))


class PrefillPlanner:
    """Plans a step's chunks and forwards, and asks the gate about them."""

    def __init__(self, *, state: BatchState, prefix_cache: PrefixCache, layout: CacheLayout,
                 prefill_step_size: int, inputs: ChunkInputs, batch: DecodeBatch | None = None,
                 max_decode_gap_s: float = 0.0) -> None:
        self.state = state
        self.prefix_cache = prefix_cache
        self.layout = layout
        self.prefill_step_size = prefill_step_size
        self.inputs = inputs
        self.batch = batch
        self.max_decode_gap_s = max_decode_gap_s
        self.cost = ChunkCost()
        #: the features of the step planned last, for :meth:`observe`
        self._planned: np.ndarray | None = None

    def step_budget(self) -> int:
        """Prompt tokens this step may prefill: the whole step while nothing decodes,
        else the most that keep the step within the decode latency budget."""
        full = self.prefill_step_size
        state = self.state
        if (not state.decoding or self.max_decode_gap_s <= 0 or not state.prefilling
                or not self._streams_to_protect()):
            return full
        if self.cost.steps < 2:
            # Nothing measured yet: a small first chunk to learn from.
            return max(MIN_CHUNK, min(full, full // 4))
        decode_s = (self.batch.step_seconds if self.batch is not None else None) or 0.0
        # A decode step alone may take most of the budget (a loaded machine, a big
        # batch): the chunk then still gets half of it, or prefill would crawl at the
        # smallest chunk while the gap it buys is lost in the decode step anyway.
        room = max(self.max_decode_gap_s - decode_s, self.max_decode_gap_s / 2)
        room /= self.cost.margin()
        start = state.prefilling[0].prefilled
        low, high = MIN_CHUNK, full
        if self.cost.seconds(start, high) <= room:
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if self.cost.seconds(start, middle) <= room:
                low = middle
            else:
                high = middle
        return low

    def _streams_to_protect(self) -> bool:
        """Whether the budget applies: a row decodes that was decoding already when the
        request prefilled next arrived, or that request resumes after a preemption. The
        budget keeps running streams from stalling behind prompts that came after them;
        a prompt that was waiting first (a burst sent together, whose cached or shorter
        members already decode) is prefilled at whole steps, first come first served:
        each step still decodes once, so those rows wait at most one chunk."""
        head = self.state.prefilling[0]
        if head.preemptions:
            return True
        return any(0.0 < row.first_token_at < head.arrived for row in self.state.decoding.values())

    def observe(self, seconds: float) -> None:
        """The prefill step planned last took ``seconds``."""
        if self._planned is not None:
            self.cost.observe(self._planned, seconds)
            self._planned = None

    def _chunk_end(self, start: int, target: int, budget: int, points: Sequence[int] = ()) -> int:
        end = min(target, start + budget)
        if not self.prefix_cache.enabled:
            return end
        if self.layout.needs_boundaries:
            # Where later requests are likely to part from this one (the request's cache
            # points): its state is kept only where a chunk ends.
            cut = min((p for p in points if start < p < end), default=None)
            if cut is not None:
                return cut
        block = self.prefix_cache.block_size
        aligned = end - end % block
        if aligned <= start or aligned == end:
            return end
        # Budget-limited chunks end on a block boundary; a final chunk is split at its
        # last boundary only when that boundary needs a state captured there.
        if end < target or self.layout.needs_boundaries:
            return aligned
        return end

    def plan(self) -> list[Chunk]:
        """This step's chunks, in the order the prefilling requests were admitted."""
        plan: list[Chunk] = []
        budget = self.step_budget()
        for sequence in self.state.prefilling:
            position, target = sequence.prefilled, sequence.prefill_target
            points = sequence.request.cache_points
            while budget > 0 and position < target:
                reach = min(target, position + budget)
                end = self._chunk_end(position, target, budget, points)
                sliver = end < target and end % self.prefix_cache.block_size and end not in points
                if sliver and position in points and position != sequence.prefilled:
                    break  # the sliver of budget after a cache point: resume there next step
                plan.append((sequence, position, end))
                budget -= end - position
                position = end
                if end < reach < target and end not in points:
                    # Cut back to a block boundary: resume there next step rather than
                    # spend the sliver of budget left on a tiny unaligned chunk.
                    break
            if budget <= 0:
                break
        return plan

    def forward_groups(self, plan: list[Chunk]) -> list[list[Chunk]]:
        """``plan``'s chunks cut into the forwards that run them, in plan order.

        Chunks share a forward only if their requests' caches are all plain KVCache
        layers, the request has no other chunk in this step (its chunks must run in
        order) and the chunk feeds token ids; :func:`group_spans` bounds the padding
        and the cached prefix copied.
        """
        groups = self._forward_groups(plan)
        self._planned = (ChunkCost.features([(start, end) for _, start, end in plan], len(groups))
                         if plan else None)
        return groups

    def _forward_groups(self, plan: list[Chunk]) -> list[list[Chunk]]:
        chunks_of: dict[int, int] = {}
        for sequence, _, _ in plan:
            chunks_of[id(sequence)] = chunks_of.get(id(sequence), 0) + 1
        batchable = [i for i, (sequence, start, end) in enumerate(plan)
                     if chunks_of[id(sequence)] == 1 and can_batch(sequence.cache or ())
                     and not self.inputs.embeds(sequence, start, end)]
        if len(batchable) < 2:
            return [[chunk] for chunk in plan]
        spans = [(plan[i][1], plan[i][2] - plan[i][1]) for i in batchable]
        groups = [[batchable[j] for j in group]
                  for group in group_spans(spans, max_start=self.prefill_step_size)]
        alone = set(range(len(plan))) - set(batchable)
        groups += [[i] for i in sorted(alone)]
        return [[plan[i] for i in group] for group in sorted(groups, key=lambda group: group[0])]

    def step_of(self, plan: list[Chunk], groups: list[list[Chunk]] | None = None) -> PrefillStep:
        """What the gate is asked: the chunks in the order their forwards run (``groups``,
        when given), those sharing a forward numbered alike, each with the inputs its
        forward encodes first."""
        state = self.state
        groups = groups if groups is not None else [[chunk] for chunk in plan]
        encoding: set[int] = set()
        chunks = []
        for index, group in enumerate(groups):
            for sequence, start, end in group:
                images = 0
                if id(sequence) not in encoding:
                    images = self.inputs.encodes(sequence, start, end)
                    if images:
                        encoding.add(id(sequence))
                chunks.append(PrefillChunk(sequence.request_id, end - start, start, len(sequence.context),
                                           sequence.reused, forward=index if len(group) > 1 else None,
                                           images=images))
        return PrefillStep(
            model_id=state.model_id,
            chunks=tuple(chunks),
            decoding=len(state.decoding),
            chunk_size=self.prefill_step_size,
            limits=state.limits,
            running=state.running(),
            model_config=state.model_config,
        )

    def ask_gate(self, plan: list[Chunk], groups: list[list[Chunk]] | None = None
                 ) -> tuple[dict[str, RequestRejected], str | None]:
        """The gate's refusals, and the error that makes them all internal failures
        (a gate that raised) or ``None``."""
        gate = self.state.gate
        if gate is None:
            return {}, None
        try:
            refused = gate.check_prefill(self.step_of(plan, groups))
        except Exception as exc:
            log.exception("forward gate %r failed; refusing this prefill step", gate)
            # A broken guard is a bug, not a memory shortage the client could wait out.
            return {}, f"memory check before prefill failed: {type(exc).__name__}: {exc}"
        return dict(refused), None

    def check_after_forward(self, members: list[Chunk]) -> tuple[SequenceState, RequestRejected] | None:
        """The request the post-forward backstop stops after a forward over ``members``'
        chunks, with its reason, if any. Asked once per forward: of several requests it
        refuses, only the one holding the most KV is stopped; freeing that is the
        likeliest to bring use back under the limit, and the next check before a
        forward still guards the others."""
        gate = self.state.gate
        if gate is None:
            return None
        # The forward's transient sits in mlx's buffer cache until emptied; a reading
        # that included it would count memory already free.
        mx.clear_cache()
        try:
            refused = gate.check_after_prefill(self.step_of(members, [members]))
        except Exception:
            log.exception("post-forward memory check %r failed; requests %s go on", gate,
                          ", ".join(s.request_id for s, _, _ in members))
            return None
        stoppable = [(end, sequence) for sequence, _, end in members
                     if sequence.request_id in (refused or {})]
        if not stoppable:
            return None
        _, sequence = max(stoppable, key=lambda item: item[0])
        return sequence, refused[sequence.request_id]


__all__ = ["Chunk", "ChunkCost", "MIN_CHUNK", "PrefillPlanner"]
