"""The decode batch: the requests whose whole prompt is in their cache, a token a step.

**A lane** (:class:`Lane`) is the rows one forward decodes: their caches merged into one
batch cache per layer (each row left-padded to the lane's longest; mlx-lm's cache
classes merge, filter, extend and extract themselves, and
:class:`~.kv_cache.BatchQuantizedKVCache` does for quantized KV), and the token each
row feeds next. A step feeds every row that token and samples the next one for all of
them together (:class:`~.sampling.BatchSampling`), **pipelined**: the next tokens are
computed while the host hands out the tokens the forward just fed (sampled the step
before), so the host's work overlaps the model's. A request joins with its first token
(sampled by prefill, handed out already): the lane's next forward feeds it with the
others, so a join costs no forward of its own. A row leaves when it finishes, is
aborted or is preempted; its cache is extracted first when the prefix cache wants it.

**Lanes.** A batch cache left-pads every row to its longest, and a decode step reads
all of it: a 5,000-token prompt joining eight 300-token streams made every one of them
read 5,000 positions a step (0.33 s a step instead of 0.07-0.09 s on the CPU). So a
row joins the lane where it adds the fewest bytes a step reads (:func:`pick_lane`), and
opens its own lane when padding it into any would read more than a forward of its own,
whose fixed cost is the weights read once more. Rows of like lengths (the common case)
share one lane and one forward; each step runs every lane's forward in turn.

**Speculation.** Where a :class:`~.extensions.DraftVerify` drafts
(:mod:`~.speculation`), a lane's step feeds each row its token and drafts in one
forward and keeps what the model agrees with; it is asked every step and runs the plain
step where drafting does not pay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from omlx_core.memory.usage import FreedHeap
from omlx_core.scheduling.batch_state import SequenceState
from omlx_core.scheduling.kv_cache import merge_layers, position_bytes, reserve_positions
from omlx_core.scheduling.sampling import BatchSampling, split_processors


def buffer_sizes(layer: Any) -> list[int]:
    """The bytes of each array a cache layer holds."""
    return [a.nbytes for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)]


#: decode steps between handing mlx's buffer cache back (what mlx-lm's generator does)
CLEAR_CACHE_EVERY = 512


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


def finish_reason(sequence: SequenceState, before: int, token: int) -> str | None:
    """Why ``token`` ends ``sequence`` (``"stop"``, ``"length"``) or ``None``, when
    ``before`` of its tokens were handed out earlier in the same step."""
    if token in sequence.stop_ids:
        return "stop"
    if sequence.completion_tokens + before + 1 >= sequence.max_tokens:
        return "length"
    return None


@dataclass
class Emitted:
    """One token a step hands out; ``finish_reason`` set on a request's last."""

    sequence: SequenceState
    token: int
    logprobs: mx.array | None
    finish_reason: str | None = None


@dataclass
class Finished:
    """A request the step finished: it left its lane; ``cache`` holds its prompt and
    completion (for the prefix cache)."""

    sequence: SequenceState
    reason: str
    cache: list[Any]


Fed = list[tuple[SequenceState, int, "mx.array | None"]]


class Lane:
    """Rows decoded by one forward (see the module): their batch cache and the tokens
    they feed next, in row order."""

    def __init__(self) -> None:
        self.rows: list[SequenceState] = []
        #: one batch cache per model layer (``None`` until a row joins)
        self.cache: list[Any] | None = None
        #: ``(rows,)`` token ids each row feeds next: sampled last step (possibly still
        #: being computed) or, for a row that just joined, its first token
        self.fed: mx.array | None = None
        #: the log-probabilities those tokens were sampled from (``None`` where not kept)
        self.fed_logprobs: list[mx.array | None] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def plain_kv(self) -> bool:
        """Whether every layer is a full-precision attention batch cache (one whose rows
        can be cut back one by one: what speculation needs)."""
        return bool(self.cache) and all(type(layer) is BatchKVCache for layer in self.cache)

    def add(self, sequence: SequenceState, token: int, cache: list[Any]) -> None:
        """``sequence`` joins with its own ``cache`` and feeds ``token`` next. The cache
        is merged in layer by layer, each evaluated (and the request's copy of it let go:
        ``cache`` is emptied, the freed heap pages handed back) before the next, so a
        join holds one layer twice at most, never the batch's whole KV (see
        :meth:`take_out`)."""
        first = self.cache is None
        if first:
            self.cache = []
        heap = FreedHeap()
        for index, layer in enumerate(cache):
            freed = buffer_sizes(layer)
            merged = merge_layers([[layer]])[0]
            cache[index] = None
            if first:
                self.cache.append(merged)
            else:
                freed += buffer_sizes(self.cache[index]) + buffer_sizes(merged)
                self.cache[index].extend(merged)
                merged = self.cache[index]
            mx.eval(merged.state)
            heap.freed(freed)
        fed = mx.array([token], dtype=mx.uint32)
        self.fed = fed if self.fed is None else mx.concatenate([self.fed.astype(mx.uint32), fed])
        self.fed_logprobs.append(None)
        self.rows.append(sequence)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the rows at ``rows`` (ascending)."""
        kept = set(rows)
        self.take_out([i for i in range(len(self.rows)) if i not in kept], caches=False)

    def take_out(self, leaving: Sequence[int], *, caches: bool = True) -> dict[int, list[Any]]:
        """Take the rows at ``leaving`` out of the lane; with ``caches``, their caches by
        row index (compact copies). Cutting rows out of a batch cache copies the rest
        (mlx has no in-place row removal), and extracting a row copies it: done for all
        layers at once, the old batch and the copies would all be alive at the next
        evaluation, the whole KV twice. So it goes layer by layer, each evaluated before
        the next and its old batch let go right after (filtered away, or dropped when no
        row stays; its heap pages handed back, :class:`~omlx_core.memory.usage.FreedHeap`):
        one layer is held twice at most. (When the last rows retired
        together, keeping every layer's batch until the end held the whole KV twice:
        the KV benchmark's full-precision peak over its ceiling.)"""
        if not leaving:
            return {}
        gone = set(leaving)
        kept = [i for i in range(len(self.rows)) if i not in gone]
        taken: dict[int, list[Any]] = {i: [] for i in leaving} if caches else {}
        layers = self.cache or []
        heap = FreedHeap()
        for index in range(len(layers)):
            layer = layers[index]
            freed = buffer_sizes(layer)
            extracted = {i: layer.extract(i) for i in taken}
            if kept:
                layer.filter(kept)
            mx.eval([c.state for c in extracted.values()], layer.state if kept else [])
            if not kept:
                layers[index] = None
            heap.freed(freed)
            for i, row_cache in extracted.items():
                taken[i].append(row_cache)
        self.rows = [self.rows[i] for i in kept]
        self.fed_logprobs = [self.fed_logprobs[i] for i in kept]
        if not kept:
            self.cache, self.fed = None, None
        elif self.fed is not None:
            self.fed = self.fed[mx.array(kept)]
        return taken

    def reserve(self, count: int) -> None:
        """Grow the batch cache, where it must, so the next forward's ``count`` positions
        per row fit without the forward growing it (:func:`~.kv_cache.reserve_positions`):
        one layer at a time, each evaluated and its old buffers handed back before the
        next, so a growth holds one layer twice at most."""
        heap = FreedHeap()
        for layer in self.cache or ():
            freed = buffer_sizes(layer)
            if reserve_positions(layer, count):
                mx.eval(layer.state)
                heap.freed(freed)

    @property
    def nbytes(self) -> int:
        return sum(int(layer.nbytes) for layer in self.cache or ())

    def plain_step(self, model: Any, sampling: BatchSampling) -> Fed:
        """Feed every row its token, start computing the next ones, and return the fed
        tokens (each row's, with its logprobs) once they are read."""
        fed = self.fed
        logits = model(fed[:, None], cache=self.cache)[:, -1, :]  # type: ignore[index]
        logits, histories = sampling.process(self.rows, logits, fed)  # type: ignore[arg-type]
        next_tokens, next_logprobs = sampling.sample(self.rows, logits)
        mx.async_eval(next_tokens, [lp for lp in next_logprobs if lp is not None], histories)
        # This step's tokens were computed during the previous one; reading them now
        # lets this step's forward run meanwhile.
        mx.eval(fed, [lp for lp in self.fed_logprobs if lp is not None])
        out = list(zip(self.rows, fed.tolist(), self.fed_logprobs))  # type: ignore[union-attr]
        self.fed, self.fed_logprobs = next_tokens, next_logprobs
        return out


@runtime_checkable
class DraftVerify(Protocol):
    """Draft tokens for the decode batch's rows, verified in the step's one forward.

    Once per decode step the decode batch asks :meth:`drafting` with all the rows by
    request id. When it answers ``False`` every lane runs the plain step: one token per
    row. When it answers ``True`` the decode batch calls :meth:`verify` instead, once for
    each lane (:class:`~.decode_batch.Lane`: its rows, their batch cache and the token
    each feeds next), which owns that lane's step: it drafts, feeds every row its token
    and drafts in one forward, keeps each row's longest accepted prefix, rolls the rest
    back out of that row's KV cache, and leaves in ``lane.fed`` each row's next token
    (the one sampled after what it kept). Where drafting does not pay it runs the lane's
    plain step (``lane.plain_step``).

    The tokens must be those plain decoding gives under the rows' samplers and logits
    processors (greedy: identical; sampling: the same distribution). The decode batch
    applies stop tokens and ``max_tokens`` to what it returns, in order, and drops a
    row's tokens after the one that ends it.
    """

    #: KV tokens beyond one that a step may add to a row (a verify forward feeds the
    #: token and drafts): the memory guard's decode budget covers them
    lookahead: int

    def drafting(self, rows: Mapping[str, SequenceState]) -> bool:
        """Whether this step verifies drafts."""
        ...

    def verify(self, lane: "Lane", model: Any, sampling: BatchSampling
               ) -> list[tuple[SequenceState, int, mx.array | None]]:
        """Run one step over ``lane``; return the tokens it fed and kept, each with its
        row and logprobs (``None`` where not computed), each row's in order, starting with
        the token the lane fed it."""
        ...

    def stats(self) -> Mapping[str, Any]:
        """Counters merged into the scheduler's :meth:`~.scheduler.Scheduler.stats`."""
        ...


class NoDrafts:
    """No row drafts: every step is the plain one."""

    lookahead = 0

    def stats(self) -> Mapping[str, Any]:
        return {}

    def drafting(self, rows: Mapping[str, SequenceState]) -> bool:
        return False

    def verify(self, lane: "Lane", model: Any, sampling: BatchSampling
               ) -> list[tuple[SequenceState, int, mx.array | None]]:
        raise TypeError("NoDrafts never drafts; the plain decode step runs")


class DecodeBatch:
    """The lanes, and the rows of :attr:`BatchState.decoding` they decode."""

    def __init__(self, *, model: Any, state: Any, drafts: DraftVerify, lanes: bool = True) -> None:
        self.model = model
        self.state = state
        self.drafts = drafts
        self.sampling = BatchSampling()
        #: seconds of the latest decode step, averaged (``None``: none ran yet); the
        #: prefill planner keeps a chunk plus a step within the decode latency budget
        self.step_seconds: float | None = None
        self.lanes: list[Lane] = []
        self._steps = 0
        #: a forward's fixed cost in KV positions (the weights' bytes over a position's),
        #: measured at the first join; without ``lanes``, every row shares one lane
        self._fixed_tokens: float | None = None if lanes else float("inf")

    # -- rows joining and leaving -----------------------------------------------------

    def join(self, sequence: SequenceState, first_token: int, cache: list[Any]) -> None:
        """Take ``sequence`` in (``cache``: its whole context; ``first_token``: handed out
        already, fed by the next step)."""
        _, others = split_processors(sequence.processors)
        sequence.history = TokenBuffer(list(sequence.context)) if others else None
        sequence.fed_token_out = True
        sequence.kv_allowance = None
        sequence.kv_lookahead = self.drafts.lookahead
        self._lane_for(sequence, cache).add(sequence, first_token, cache)

    def _lane_for(self, sequence: SequenceState, cache: list[Any]) -> Lane:
        if self._fixed_tokens is None:
            self._fixed_tokens = self._forward_in_positions(cache)
        lengths = [[row.length for row in lane.rows] for lane in self.lanes]
        index = pick_lane(lengths, sequence.length, self._fixed_tokens)
        if index is not None:
            return self.lanes[index]
        self.lanes.append(Lane())
        return self.lanes[-1]

    def _forward_in_positions(self, cache: Sequence[Any]) -> float:
        """The weights' bytes over one KV position's bytes; with no attention layer
        padding costs nothing, and every row shares one lane."""
        per_position = position_bytes(cache)
        if not per_position:
            return float("inf")
        weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        return weights / per_position

    def remove(self, sequences: Iterable[SequenceState], *, caches: bool) -> dict[str, list[Any]]:
        """Take ``sequences`` out of their lanes; with ``caches``, return their caches by
        request id (each holding its prompt and completion so far)."""
        leaving = {id(s) for s in sequences}
        removed: dict[str, list[Any]] = {}
        for lane in self.lanes:
            rows = list(lane.rows)
            out = lane.take_out([i for i, row in enumerate(rows) if id(row) in leaving],
                                caches=caches)
            for index, row_cache in out.items():
                removed[rows[index].request_id] = row_cache
        self.lanes = [lane for lane in self.lanes if lane.rows]
        return removed

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the rows' KV caches."""
        return sum(lane.nbytes for lane in self.lanes)

    # -- the step --------------------------------------------------------------------

    def step(self) -> tuple[list[Emitted], list[Finished]]:
        """One step over every lane: the tokens handed out (each row's in order), and the
        rows that finished (they have left their lanes)."""
        started = time.perf_counter()
        emitted: list[Emitted] = []
        finished: list[Finished] = []
        with mx.stream(generation_stream):
            drafting = self.drafts.drafting(self.state.decoding)
            for lane in self.lanes:
                lane.reserve(1 + self.drafts.lookahead)
                fed = (self.drafts.verify(lane, self.model, self.sampling) if drafting else None)
                if fed is None:
                    fed = lane.plain_step(self.model, self.sampling)
                self._hand_out(lane, fed, emitted, finished)
        self.lanes = [lane for lane in self.lanes if lane.rows]
        self._steps += 1
        if self._steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        seconds = time.perf_counter() - started
        previous = self.step_seconds
        self.step_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        return emitted, finished

    @staticmethod
    def _hand_out(lane: Lane, fed: Fed,
                  emitted: list[Emitted], finished: list[Finished]) -> None:
        """Turn the tokens a lane fed into outputs, in order; a row's first token after it
        joined was handed out already, and a row's tokens after its last are dropped."""
        counts: dict[int, int] = {}
        ended: dict[int, str] = {}
        for sequence, token, logprobs in fed:
            key = id(sequence)
            if key in ended:
                continue
            if sequence.fed_token_out:
                sequence.fed_token_out = False
                continue
            before = counts.get(key, 0)
            reason = finish_reason(sequence, before, token)
            counts[key] = before + 1
            emitted.append(Emitted(sequence, token, logprobs, reason))
            if reason is not None:
                ended[key] = reason
        if not ended:
            return
        rows = list(lane.rows)
        out = lane.take_out([i for i, sequence in enumerate(rows) if id(sequence) in ended])
        for index, row_cache in out.items():
            finished.append(Finished(rows[index], ended[id(rows[index])], row_cache))

    def reset(self) -> None:
        """Start over with an empty batch (after a failed step)."""
        self.lanes = []

    def close(self) -> None:
        """Drop the lanes and with them every path to the weights."""
        self.reset()
        self.model = None


def warm_up(model: Any, make_cache: Any) -> None:
    """Run what a first request runs, once, with throwaway rows: a prefill chunk and a
    first-token forward per row, two rows joining one lane (merge, extend), a few
    pipelined steps with greedy and logprob rows, one row leaving (filter). Whatever a
    first request would pay once (the attention and SwiGLU routes and CPU kernels, the
    BLAS threads, the first shapes' buffers) is paid here, before the server says ready.
    ``make_cache()``: a fresh request cache in the model's KV format."""
    from omlx_core.engine import GenerationRequest, SamplingParams
    from omlx_core.scheduling.batch_state import new_sequence

    with mx.stream(generation_stream):
        lane, sampling = Lane(), BatchSampling()
        for index, length in enumerate((24, 9)):
            params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=index or None)
            row = new_sequence(GenerationRequest(f"warm-up-{index}", [1] * length, params))
            cache = make_cache()
            model(mx.array(row.prompt[:-1])[None], cache=cache)
            mx.eval([layer.state for layer in cache])
            logits = model(mx.array(row.prompt[-1:])[None], cache=cache)[:, -1, :]
            lane.add(row, int(mx.argmax(logits, axis=-1).item()), cache)
        for _ in range(3):
            lane.plain_step(model, sampling)
        lane.keep([1])
        lane.plain_step(model, sampling)
        mx.eval(lane.fed)
    mx.clear_cache()


__all__ = ["CLEAR_CACHE_EVERY", "DecodeBatch", "DraftVerify", "Emitted", "Fed", "Finished", "Lane", "NoDrafts",
           "finish_reason", "pick_lane"]
