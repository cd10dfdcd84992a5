"""Prompt-lookup speculation inside the decode batch: the batched engine's
:class:`~.extensions.DraftVerify`.

Each decode step, every row may carry draft tokens from the prompt-lookup drafter
(:class:`~.drafters.NgramDrafter`: the continuation of the latest earlier occurrence of
its last tokens in its prompt and output). One forward over the batch feeds every row
its pending token (the *anchor*, sampled last step) and its drafts, right-padded to the
step's common width ``W``; causal attention keeps the padding out of every real
position's logits. Each row then keeps its own longest prefix of drafts that equal the
tokens the target picks itself (:func:`~.acceptance.accepted_prefix`) plus the target's
token after them, and its KV cache is cut back to what it kept: the rows' shortest
rejection is trimmed from all of them, the rest of each row's is rolled into its left
padding (mlx-lm's ``BatchKVCache`` right padding, then ``finalize``).

**Exactness.** The target's token at every position is picked as the plain step picks
it: position 0 of every row through the plain step's own processing and sampling
(:class:`~.decode_step.FusedSamplingBatch`), later positions of a greedy row by argmax,
of a seeded row by its own sampler with the key plain decoding would use for that
token (its step counter is set back to the tokens it kept). So greedy rows emit plain
decoding's tokens and seeded rows plain decoding's samples; for a deterministic draft,
keeping a draft while it equals the target's own sample is rejection sampling with the
target's law (see :func:`~.acceptance.accepted_prefix`). A ``logit_bias`` depends on
nothing but the logits, so it is added at every position of a drafting row. Rows that
report logprobs or have other logits processors (penalties, a grammar: they read the
tokens before each position) never draft: their token is position 0's, exactly the
plain step's. Models with other cache layers than plain
``BatchKVCache`` (sliding windows, recurrent layers) never draft.

**Cost model.** A step that feeds ``W`` positions to each of ``B`` rows costs what the
:class:`StepCost` model, learned from the measured time of every decode step against
the tokens it fed, says ``B * W`` tokens cost. A row whose draft is ``L`` tokens long
and whose drafts were kept at a rate ``a`` per position (its drafter's record) is
expected to add ``a + a^2 + ...`` (up to ``min(L, W - 1)`` terms) tokens. The step
picks the width that gives the most tokens per second, and ``W = 1`` (the plain,
pipelined step) unless a wider one beats it: a batch of open-ended rows, whose drafts
keep missing, drafts nothing, and is not even held up to look (the anchors are only
read when the rows' records say a draft could pay).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from omlx_core.scheduling.acceptance import accepted_prefix
from omlx_core.scheduling.batch_state import SequenceState
from omlx_core.scheduling.decode_batch import Fed, Lane, finish_reason
from omlx_core.scheduling.drafters import NgramDrafter
from omlx_core.scheduling.sampling import BatchSampling, LogitBias, SeededSampler

log = logging.getLogger(__name__)

#: how much better (tokens per second) a wider step must look than the plain one: the
#: model's error (acceptance read from a short record, per-row work outside the forward)
#: must not turn a predicted gain into a loss (measured: a 1.05 margin lost 13 % at 8
#: rows on CPU, docs/bench-serving.md)
WIDER_STEP_GAIN = 1.2


class StepCost:
    """A decode step's seconds as ``fixed + per_token * tokens_fed``, fitted online by
    exponentially weighted least squares over the measured steps.

    While the steps seen all fed about as many tokens, the slope is not identified
    from them; it is then pulled toward ``prior_share`` of a one-token step per token
    (ridge regression toward that prior).

    A step is counted as at most ``outlier_ratio`` times what the model predicts for it.
    A step the OS preempted, measured at many times its cost, would otherwise set the
    slope from that one point for as long as only plain steps follow (their slope is
    not identified, so nothing corrects it): on a busy machine, one wide step held up
    for 10x its time stopped all drafting for about a hundred steps. A machine that
    really got slower still moves the model, by up to that ratio per step."""

    def __init__(self, *, prior_share: float = 0.1, decay: float = 0.98,
                 prior_weight: float = 4.0, outlier_ratio: float = 2.0) -> None:
        self.prior_share = prior_share
        self.decay = decay
        self.prior_weight = prior_weight
        self.outlier_ratio = outlier_ratio
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def measured(self) -> bool:
        return self._w > 0.5

    def observe(self, tokens: int, seconds: float) -> None:
        if self.measured:
            seconds = min(seconds, self.outlier_ratio * self.seconds(tokens))
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds."""
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        var_x = self._xx / w - mean_x * mean_x
        cov = self._xy / w - mean_x * mean_y
        # The prior slope: per_token = share * fixed, through the mean step.
        prior = self.prior_share * mean_y / (1.0 + self.prior_share * mean_x)
        ridge = self.prior_weight / w
        slope = (cov + ridge * prior) / (max(var_x, 0.0) + ridge)
        slope = max(slope, 1e-9)
        fixed = max(mean_y - slope * mean_x, 0.0)
        return fixed, slope

    def seconds(self, tokens: int) -> float:
        fixed, per_token = self.coefficients()
        return fixed + per_token * tokens


@dataclass
class _Row:
    """One decoding row's part in a step."""

    index: int
    sequence: SequenceState
    anchor: int = 0
    drafts: tuple[int, ...] = ()
    acceptance: float = 0.0


def _may_draft(sequence: SequenceState) -> bool:
    """Whether a row's tokens can be verified several at a time: its processors read
    nothing but logits (a logit bias), and it reports no logprobs."""
    return (sequence.request.sampling.logprobs is None and sequence.grammar is None
            and all(isinstance(p, LogitBias) for p in sequence.processors)
            and (sequence.sampler is None or isinstance(sequence.sampler, SeededSampler)))


class PromptLookupDrafts:
    """Every row that may draft carries prompt-lookup drafts; one forward verifies all.

    :param max_drafts: most draft tokens a row carries in one step (the step's width is
        at most ``max_drafts + 1``).
    :param cost: the step cost model (learned from this engine's steps by default).
    """

    def __init__(self, *, max_drafts: int = 6, drafter: NgramDrafter | None = None,
                 cost: StepCost | None = None) -> None:
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.max_drafts = max_drafts
        #: KV tokens beyond one a step may add to a row: every row is fed the step's width
        self.lookahead = max_drafts
        # The step's width is chosen for the whole batch here, so the drafter proposes
        # its whole match (no per-request cost cut).
        self.drafter = drafter or NgramDrafter(block_size=max_drafts + 1, token_cost=0.0)
        self.cost = cost or StepCost()
        self._verified_last = False
        self.steps = 0
        self.verify_steps = 0
        self.drafted = 0
        self.accepted = 0

    # -- DraftVerify -------------------------------------------------------------------

    def drafting(self, rows: Mapping[str, SequenceState]) -> bool:
        """Every step runs here (a plain one where drafting does not pay), so the cost
        model sees every step; ``False`` only for an empty batch."""
        return bool(rows)

    def verify(self, lane: Lane, model: Any, sampling: BatchSampling) -> Fed:
        self.steps += 1
        candidates = self._candidates(lane)
        if candidates and self._may_pay(len(lane), candidates):
            fed = self._draft_step(lane, model, sampling, candidates)
            if fed is not None:
                return fed
        else:
            for row in candidates:
                self.drafter.skip(row.sequence.draft)
        size = len(lane)
        started = time.perf_counter()
        fed = lane.plain_step(model, sampling)
        # The plain step returns once the previous step's tokens are read, its own forward
        # still running: right after a verify step (which left nothing running) that is
        # no step's cost, so it is not measured.
        if size and not self._verified_last:
            self.cost.observe(size, time.perf_counter() - started)
        self._verified_last = False
        return fed

    def stats(self) -> dict[str, Any]:
        fixed, per_token = self.cost.coefficients() if self.cost.measured else (0.0, 0.0)
        return {"speculation": {"steps": self.steps, "verify_steps": self.verify_steps,
                                "drafted": self.drafted, "accepted": self.accepted,
                                "step_fixed_s": round(fixed, 6),
                                "step_per_token_s": round(per_token, 6)}}

    # -- which rows may draft ----------------------------------------------------------

    def _candidates(self, lane: Lane) -> list[_Row]:
        """The rows that may carry drafts this step (none unless the lane's caches can be
        cut back row by row)."""
        if not lane.plain_kv:
            return []
        candidates = []
        for index, sequence in enumerate(lane.rows):
            if not _may_draft(sequence):
                continue
            if sequence.draft is None:
                sequence.draft = self.drafter.begin(sequence.prompt + sequence.generated)
            candidates.append(_Row(index, sequence))
        return candidates

    def _expected(self, acceptance: float, drafts: int) -> float:
        """Tokens a row's ``drafts`` add on average."""
        total, power = 0.0, 1.0
        for _ in range(drafts):
            power *= acceptance
            total += power
        return total

    def _best_width(self, size: int, gains: Sequence[tuple[float, int]]) -> int:
        """The width (1: a plain step) that emits the most tokens per second for a batch
        of ``size`` rows, ``gains`` being the drafting rows' acceptance and draft length."""
        plain = size / self.cost.seconds(size)
        best, best_rate = 1, plain * WIDER_STEP_GAIN
        longest = max((length for _, length in gains), default=0)
        for width in range(2, min(longest, self.max_drafts) + 2):
            tokens = size + sum(self._expected(a, min(length, width - 1)) for a, length in gains)
            rate = tokens / self.cost.seconds(size * width)
            if rate > best_rate:
                best, best_rate = width, rate
        return best

    def _may_pay(self, size: int, candidates: list[_Row]) -> bool:
        """Whether drafting could beat the plain step at the rows' best records: if not,
        the step stays plain and pipelined (the anchors are not read)."""
        if not self.cost.measured:
            return False
        outlook = [(self.drafter.outlook(row.sequence.draft, row.sequence.prompt + row.sequence.generated),
                    self.max_drafts) for row in candidates]
        return self._best_width(size, outlook) > 1

    # -- the drafting step -------------------------------------------------------------

    def _draft_step(self, lane: Lane, model: Any, sampling: BatchSampling,
                    candidates: list[_Row]) -> Fed | None:
        """Propose, pick the width, verify, accept, roll back; ``None`` when no width
        beats the plain step after all (the caller runs that)."""
        anchors = lane.fed
        mx.eval(anchors)
        anchor_ids = anchors.tolist()  # type: ignore[union-attr]
        for row in candidates:
            row.anchor = int(anchor_ids[row.index])
            history = row.sequence.prompt + row.sequence.generated + [row.anchor]
            draft = self.drafter.propose(row.sequence.draft, history, self.max_drafts,
                                         row.sequence.request.sampling, None)
            row.drafts = tuple(draft.tokens)
            row.acceptance = self.drafter.acceptance(row.sequence.draft)
        size = len(lane)
        width = self._best_width(size, [(row.acceptance, len(row.drafts)) for row in candidates
                                        if row.drafts])
        if width == 1:
            for row in candidates:
                self.drafter.skip(row.sequence.draft)
            return None
        started = time.perf_counter()
        fed = self._verify(lane, model, sampling, candidates, anchor_ids, width)
        self.cost.observe(size * width, time.perf_counter() - started)
        self._verified_last = True
        self.verify_steps += 1
        return fed

    def _verify(self, lane: Lane, model: Any, sampling: BatchSampling, candidates: list[_Row],
                anchor_ids: list[int], width: int) -> Fed:
        rows = lane.rows
        size = len(rows)
        anchors = lane.fed
        drafts: list[tuple[int, ...]] = [()] * size
        by_index = {}
        for row in candidates:
            row.drafts = row.drafts[:width - 1]
            drafts[row.index] = row.drafts
            by_index[row.index] = row
        inputs = mx.array([[anchor_ids[i], *drafts[i]] + [0] * (width - 1 - len(drafts[i]))
                           for i in range(size)], dtype=anchors.dtype)  # type: ignore[union-attr]
        logits = model(inputs, cache=lane.cache)
        # Position 0 of every row: exactly the plain step's processing and sampling.
        first, histories = sampling.process(rows, logits[:, 0, :], anchors)  # type: ignore[arg-type]
        first_tokens, first_logprobs = sampling.sample(rows, first)
        later: dict[int, mx.array] = {}
        steps_before: dict[int, int] = {}
        for row in candidates:
            k = len(row.drafts)
            if not k:
                continue
            row_logits = logits[row.index, 1:k + 1]
            for bias in row.sequence.processors:
                row_logits = bias(None, row_logits)
            sampler = row.sequence.sampler
            if isinstance(sampler, SeededSampler):
                steps_before[row.index] = sampler.step
                row_logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                later[row.index] = mx.concatenate([sampler(row_logprobs[j:j + 1]) for j in range(k)])
            elif row_logits.dtype == mx.float32:
                later[row.index] = mx.argmax(row_logits, axis=-1)
            else:
                later[row.index] = mx.argmax(row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True),
                                             axis=-1)
        mx.eval(first_tokens, [lp for lp in first_logprobs if lp is not None], histories, later)
        first_ids = first_tokens.tolist()

        anchor_logprobs = lane.fed_logprobs
        fed: Fed = []
        kept_fed: list[int] = []
        pending: list[int] = []
        pending_logprobs: list[mx.array | None] = []
        for i, sequence in enumerate(rows):
            row = by_index.get(i)
            targets = [first_ids[i]] + (later[i].tolist() if i in later else [])
            accepted = accepted_prefix(drafts[i], targets)
            if i in steps_before:
                # The sampler drew for every drafted position; plain decoding draws once
                # per token kept, so the next draw uses the key after the last one kept.
                sequence.sampler.step = steps_before[i] + accepted
            emitted = [anchor_ids[i], *drafts[i][:accepted]]
            # A row's tokens after the one that ends it are never handed out.
            skip = 1 if sequence.fed_token_out else 0
            count = len(emitted)
            for position, token in enumerate(emitted[skip:]):
                if finish_reason(sequence, position, token) is not None:
                    count = skip + position + 1
                    break
            if row is not None and row.drafts:
                kept = min(accepted, count - 1)
                self.drafter.commit(sequence.draft, (anchor_ids[i], *row.drafts), 1 + kept, None)
                self.drafted += len(row.drafts)
                self.accepted += kept
                sequence.drafted += len(row.drafts)
                sequence.accepted += kept
            elif row is not None:
                self.drafter.skip(sequence.draft)
            kept_fed.append(count)
            pending.append(targets[accepted])
            pending_logprobs.append(first_logprobs[i] if not drafts[i] else None)
            for j, token in enumerate(emitted[:count]):
                fed.append((sequence, token, anchor_logprobs[i] if j == 0 else None))
        self._roll_back(lane.cache, [width - kept for kept in kept_fed])  # type: ignore[arg-type]
        lane.fed = mx.array(pending, dtype=anchors.dtype)  # type: ignore[union-attr]
        lane.fed_logprobs = pending_logprobs
        return fed

    @staticmethod
    def _roll_back(cache: Sequence[BatchKVCache], rejected: list[int]) -> None:
        """Cut each row's KV back by its own ``rejected`` count of fed positions: the
        rows' shortest rejection is trimmed from all of them, and each row's content is
        moved right by the rest of its own, its left padding growing by as much."""
        shortest = min(rejected)
        rest = [r - shortest for r in rejected]
        for layer in cache:
            if shortest:
                layer.trim(shortest)
            if any(rest):
                roll_rows(layer, rest)


def roll_rows(layer: BatchKVCache, shifts: list[int]) -> None:
    """What mlx-lm's ``prepare(right_padding=shifts)`` then ``finalize()`` do to a
    ``BatchKVCache``: each row's kept positions moved right by its shift, its left
    padding grown by as much (what lies in the padding is masked, never read).

    mlx-lm rolls with a gather over every element of the buffer, a scalar loop on the
    CPU backend. On the CPU only the rows that shift move, and only their kept
    positions, in place in the buffer mlx holds (the cache is its only holder: the
    verify forward is evaluated): 8 rows of a 768-position buffer over 30 layers take
    15 ms, against 59 ms as slice copies in mlx and ~120 ms gathered."""
    if mx.default_device() == mx.cpu and _roll_in_place(layer, shifts):
        return
    size = layer.keys.shape[2]

    def rolled(buffer: mx.array) -> mx.array:
        rows = []
        for index, shift in enumerate(shifts):
            row = buffer[index:index + 1]
            rows.append(mx.concatenate([row[:, :, size - shift:], row[:, :, :size - shift]], axis=2)
                        if shift else row)
        return mx.concatenate(rows, axis=0)

    layer.keys = rolled(layer.keys)
    layer.values = rolled(layer.values)
    _grow_padding(layer, shifts)


def _roll_in_place(layer: BatchKVCache, shifts: list[int]) -> bool:
    """:func:`roll_rows` through writable NumPy views of the evaluated buffers; ``False``
    (nothing changed) where mlx's buffers cannot be viewed so."""
    mx.eval(layer.keys, layer.values, layer.left_padding)
    try:
        views = [np.array(buffer, copy=False) for buffer in (layer.keys, layer.values)]
    except (TypeError, ValueError):  # a dtype NumPy has no view of (bfloat16)
        return False
    if not all(view.flags.writeable and view.flags.c_contiguous for view in views):
        return False
    end = layer.size()
    starts = layer.left_padding.tolist()
    for view in views:
        for row, shift in enumerate(shifts):
            if shift:
                start = starts[row]
                # Overlapping ranges: NumPy copies through a buffer where it must.
                view[row, :, start + shift:end] = view[row, :, start:end - shift]
    _grow_padding(layer, shifts)
    return True


def _grow_padding(layer: BatchKVCache, shifts: list[int]) -> None:
    padding = mx.array(shifts)
    layer.offset = layer.offset - padding
    layer.left_padding = layer.left_padding + padding


__all__ = ["PromptLookupDrafts", "StepCost", "roll_rows"]
