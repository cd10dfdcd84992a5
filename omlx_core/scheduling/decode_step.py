"""The decode batch's sampling, fused across its rows.

mlx-lm's ``GenerationBatch`` samples a step row by row wherever a row has a logits
processor (a ``logit_bias`` is one), and computes the log-softmax of every row every
step, whether or not anything reads it. On a CPU mlx's ``exp`` is a scalar polynomial,
so that log-softmax is most of the step outside the model's forward: 16 rows over
SmolLM2's 49,152-token vocabulary are 786k ``exp`` calls (see
``docs/decode-step-profile.md``). :class:`FusedSamplingBatch` runs the same step with
the same model call, cache and pipelining (the next step's tokens are computed while
the host reads the current ones), and differs only in how it turns logits into tokens:

- every row's logit bias is added in one scatter over the batch; a bias is always its
  row's first processor (:func:`~.sampling.make_logits_processors`), so what comes
  after it (penalties, a grammar) still sees the biased row, as before;
- the greedy rows' tokens come from one ``argmax`` over the batch's logits;
- the log-softmax is computed only for rows that sample or report logprobs.

With float32 logits a greedy token is the argmax of the processed logits, where mlx-lm
takes the argmax of their log-softmax. Subtracting the log-sum-exp is monotone, so the
two are the same token unless its rounding makes the two largest logits equal (they
differ by less than a float32 step at the log-softmax's magnitude, ~1e-6), where
mlx-lm's pick is the lower token id and ours the larger logit. Lower-precision logits
(bfloat16, float16) round that subtraction coarsely, so there greedy rows still pick
from the log-softmax, as mlx-lm does. Either way the token does not depend on whether
the request asks for logprobs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.sample_utils import greedy_sampler

from omlx_core.scheduling.sampling import LogitBias

log = logging.getLogger(__name__)

#: what the step reads and writes of mlx-lm's ``GenerationBatch``; another mlx-lm
#: version without them keeps its own step
_BATCH_FIELDS = ("model", "uids", "prompt_cache", "tokens", "samplers", "fallback_sampler",
                 "logits_processors", "_token_context", "_current_tokens", "_current_logprobs",
                 "_next_tokens", "_next_logprobs")


def _always(_uid: int) -> bool:
    return True


class _BiasScatter:
    """The batch's logit biases as one scatter: row, column and value of every entry."""

    def __init__(self, biases: Sequence[tuple[int, LogitBias]]) -> None:
        self.rows = mx.concatenate([mx.full((b.indices.size,), row, dtype=mx.int32)
                                    for row, b in biases])
        self.columns = mx.concatenate([b.indices for _, b in biases])
        self.values = mx.concatenate([b.values for _, b in biases])

    def apply(self, logits: mx.array) -> mx.array:
        return logits.at[self.rows, self.columns].add(self.values.astype(logits.dtype))


class FusedSamplingBatch(GenerationBatch):
    """mlx-lm's decode batch with the step's sampling done once for the whole batch."""

    #: whether the request decoding as ``uid`` reports logprobs (set by the owner)
    wants_logprobs: Callable[[int], bool] = staticmethod(_always)

    _scatter_key: tuple[Any, ...] | None = None
    _scatter: _BiasScatter | None = None

    def _bias_scatter(self, biases: list[tuple[int, LogitBias]]) -> _BiasScatter | None:
        """One scatter per batch composition: built again only when rows or biases change."""
        if not biases:
            return None
        key = tuple((row, id(bias)) for row, bias in biases)
        if key != self._scatter_key:
            self._scatter = _BiasScatter(biases)
            # the biases stay referenced with the key, so their ids are not reused
            self._scatter_key, self._scatter_biases = key, [b for _, b in biases]
        return self._scatter

    def _processed_logits(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        rows = len(self.uids)
        processors = self.logits_processors or [()] * rows
        biases: list[tuple[int, LogitBias]] = []
        rest: dict[int, Sequence[Any]] = {}
        for row, row_processors in enumerate(processors):
            row_processors = tuple(row_processors or ())
            first = 0
            while first < len(row_processors) and isinstance(row_processors[first], LogitBias):
                biases.append((row, row_processors[first]))
                first += 1
            if first < len(row_processors):
                rest[row] = row_processors[first:]
        scatter = self._bias_scatter(biases)
        if scatter is not None:
            logits = scatter.apply(logits)
        contexts: list[mx.array] = []
        if rest:
            processed = []
            for row in range(rows):
                row_logits = logits[row:row + 1]
                if row in rest:
                    context = self._token_context[row].update_and_fetch(inputs[row:row + 1])
                    contexts.append(context)
                    for processor in rest[row]:
                        row_logits = processor(context, row_logits)
                processed.append(row_logits)
            logits = mx.concatenate(processed, axis=0)
        return logits, contexts

    def _sample(self, logits: mx.array) -> tuple[mx.array, list[mx.array | None]]:
        rows = len(self.uids)
        samplers = [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * rows)]
        greedy = [s is greedy_sampler for s in samplers]
        # Below float32 a rounding step of the log-softmax is coarse enough to tie logits
        # that differ, so greedy rows pick from the log-softmax there, as mlx-lm does.
        from_logits = logits.dtype == mx.float32
        wanted = [not g or not from_logits or self.wants_logprobs(uid)
                  for g, uid in zip(greedy, self.uids)]
        logprobs: list[mx.array | None] = [None] * rows
        batch_logprobs = None
        if all(wanted):
            batch_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            logprobs = list(batch_logprobs)
        elif any(wanted):
            chosen = [row for row in range(rows) if wanted[row]]
            subset = logits[mx.array(chosen)]
            for row, row_logprobs in zip(chosen, subset - mx.logsumexp(subset, axis=-1, keepdims=True)):
                logprobs[row] = row_logprobs
        picked_from = logits if from_logits else batch_logprobs
        if all(greedy):
            return mx.argmax(picked_from, axis=-1), logprobs
        argmax = mx.argmax(picked_from, axis=-1) if any(greedy) else None
        tokens = [argmax[row:row + 1] if greedy[row] else samplers[row](logprobs[row][None])
                  for row in range(rows)]
        return mx.concatenate(tokens, axis=0), logprobs

    def _step(self) -> tuple[list[int], list[mx.array | None]]:
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logits, contexts = self._processed_logits(logits, inputs)
        self._next_tokens, self._next_logprobs = self._sample(logits)
        mx.async_eval(self._next_tokens, [lp for lp in self._next_logprobs if lp is not None],
                      contexts)
        # The current step's tokens were computed during the previous call; reading them
        # now lets this step's forward run meanwhile.
        mx.eval(inputs, [lp for lp in self._current_logprobs if lp is not None])
        tokens = inputs.tolist()
        for row_tokens, token in zip(self.tokens, tokens):
            row_tokens.append(token)
        return tokens, self._current_logprobs


def fuse_sampling(generator: BatchGenerator, wants_logprobs: Callable[[int], bool]) -> bool:
    """Give ``generator`` (new, empty) a :class:`FusedSamplingBatch` for its decode batch.

    Returns False, leaving mlx-lm's step, when this mlx-lm's batch lacks what the step
    uses. Rows join the batch through ``GenerationBatch.extend``, which keeps its class.
    """
    batch = getattr(generator, "_generation_batch", None)
    if batch is None or len(batch) or not all(hasattr(batch, f) for f in _BATCH_FIELDS):
        log.warning("mlx-lm %s's decode batch is not the one the fused sampling step "
                    "was written for; using mlx-lm's own step", _mlx_lm_version())
        return False
    fused = FusedSamplingBatch.empty(batch.model, batch.fallback_sampler)
    fused.wants_logprobs = wants_logprobs
    generator._generation_batch = fused
    return True


def _mlx_lm_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:  # pragma: no cover - mlx-lm is a dependency
        return "?"


__all__ = ["FusedSamplingBatch", "fuse_sampling"]
