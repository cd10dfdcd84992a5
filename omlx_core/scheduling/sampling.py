"""Per-request samplers and logits processors, and a decode step's sampling of all its rows.

Every sampled request draws from its own key sequence: step ``n`` uses a key derived
from ``(seed, n)`` alone, so a seeded request samples the same tokens whatever else
shares its batch. Greedy requests have no sampler: their tokens come from one argmax over the batch.

Semantics follow the OpenAI/vLLM conventions: temperature scales the logits before
top-k/top-p/min-p filter them; presence and frequency penalties count completion
tokens only; the repetition penalty (HF style, divide positive and multiply negative
logits) covers prompt and completion. Reported logprobs are the log-softmax of the
logits after penalties and bias, before temperature and filtering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from omlx_core.engine import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from omlx_core.scheduling.batch_state import SequenceState

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

MASK64 = (1 << 64) - 1


def mix64(value: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


class SeededSampler:
    """Samples one sequence's rows with keys that depend on its seed and step only."""

    def __init__(self, params: SamplingParams, seed: int, vocab_size: int) -> None:
        self.inverse_temperature = 1.0 / params.temperature
        self.top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        self.top_p = params.top_p if 0.0 < params.top_p < 1.0 else 0.0
        self.min_p = params.min_p if params.min_p > 0.0 else 0.0
        self.seed_hash = mix64(seed & MASK64)
        self.step = 0

    def next_key(self) -> mx.array:
        key = mx.random.key(mix64(self.seed_hash ^ self.step))
        self.step += 1
        return key

    def __call__(self, logprobs: mx.array) -> mx.array:
        key = self.next_key()
        logits = logprobs * self.inverse_temperature
        if self.top_k:
            logits = apply_top_k(logits, self.top_k)
        if self.top_p:
            logits = apply_top_p(logits, self.top_p)
        if self.min_p:
            logits = apply_min_p(logits, self.min_p)
        return mx.random.categorical(logits, key=key)


def make_sampler(params: SamplingParams, seed: int, vocab_size: int) -> Sampler | None:
    """``None`` (greedy: the argmax) for temperature 0, else a seeded sampler."""
    if params.temperature == 0:
        return None
    return SeededSampler(params, seed, vocab_size)


class LogitBias:
    """A request's ``logit_bias`` as a logits processor: added to its row's logits.

    A class rather than a closure so the decode step can tell biases apart from other
    processors and add the whole batch's in one scatter (:class:`BatchSampling`)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.indices = mx.array(list(bias.keys()), dtype=mx.int32)
        self.values = mx.array(list(bias.values()), dtype=mx.float32)

    def __call__(self, _context: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, self.indices].add(self.values.astype(logits.dtype))


def _repetition_processor(penalty: float) -> LogitsProcessor:
    def apply_repetition_penalty(context: mx.array, logits: mx.array) -> mx.array:
        if context.shape[0] == 0:
            return logits
        selected = logits[:, context]
        logits[:, context] = mx.where(selected < 0, selected * penalty, selected / penalty)
        return logits

    return apply_repetition_penalty


def _presence_processor(penalty: float, prompt_length: int) -> LogitsProcessor:
    def apply_presence_penalty(context: mx.array, logits: mx.array) -> mx.array:
        if context.shape[0] <= prompt_length:
            return logits
        completion = context[prompt_length:]
        # Assignment through repeated indices writes once: a flat penalty per token.
        logits[:, completion] = logits[:, completion] - penalty
        return logits

    return apply_presence_penalty


def _frequency_processor(penalty: float, prompt_length: int) -> LogitsProcessor:
    def apply_frequency_penalty(context: mx.array, logits: mx.array) -> mx.array:
        if context.shape[0] <= prompt_length:
            return logits
        # Scatter-add accumulates repeated indices: the penalty times the count.
        return logits.at[:, context[prompt_length:]].subtract(penalty)

    return apply_frequency_penalty


def make_logits_processors(params: SamplingParams, prompt_length: int) -> tuple[LogitsProcessor, ...]:
    """The processors a request needs, in application order (bias, then penalties).

    Each receives the tokens in the sequence's context (prompt then completion) and a
    ``(1, vocab)`` row of logits; ``prompt_length`` tells completion tokens apart.
    """
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(LogitBias({int(k): float(v) for k, v in params.logit_bias.items()}))
    if params.repetition_penalty != 1.0:
        processors.append(_repetition_processor(params.repetition_penalty))
    if params.presence_penalty:
        processors.append(_presence_processor(params.presence_penalty, prompt_length))
    if params.frequency_penalty:
        processors.append(_frequency_processor(params.frequency_penalty, prompt_length))
    return tuple(processors)


class _BiasScatter:
    """The batch's logit biases as one scatter: row, column and value of every entry."""

    def __init__(self, biases: Sequence[tuple[int, LogitBias]]) -> None:
        self.rows = mx.concatenate([mx.full((b.indices.size,), row, dtype=mx.int32)
                                    for row, b in biases])
        self.columns = mx.concatenate([b.indices for _, b in biases])
        self.values = mx.concatenate([b.values for _, b in biases])
        # The biases stay referenced with the key, so their ids are not reused.
        self.biases = [b for _, b in biases]

    def apply(self, logits: mx.array) -> mx.array:
        return logits.at[self.rows, self.columns].add(self.values.astype(logits.dtype))


def split_processors(processors: Sequence[Any]) -> tuple[list[LogitBias], tuple[Any, ...]]:
    """A row's leading logit biases, and the processors after them."""
    first = 0
    while first < len(processors) and isinstance(processors[first], LogitBias):
        first += 1
    return list(processors[:first]), tuple(processors[first:])


class BatchSampling:
    """A decode step's rows turned from logits into tokens together.

    - every row's logit bias is added in one scatter over the batch (a bias is always its
      row's first processor, :func:`make_logits_processors`, so what comes after it,
      penalties or a grammar, still sees the biased row);
    - the greedy rows' tokens come from one ``argmax`` over the batch's logits;
    - the log-softmax is computed only for rows that sample or report logprobs.

    With float32 logits a greedy token is the argmax of the processed logits (mlx-lm
    takes the argmax of their log-softmax: subtracting the log-sum-exp is monotone, so
    the two are the same token unless rounding ties the two largest logits, ~1e-6
    apart). Lower-precision logits (bfloat16, float16) round that subtraction coarsely,
    so there greedy rows pick from the log-softmax, as mlx-lm does. Either way the token
    does not depend on whether the request asks for logprobs.
    """

    def __init__(self) -> None:
        self._scatter_key: tuple[Any, ...] | None = None
        self._scatter: _BiasScatter | None = None

    def _bias_scatter(self, biases: list[tuple[int, LogitBias]]) -> _BiasScatter | None:
        """One scatter per batch composition: built again only when rows or biases change."""
        if not biases:
            return None
        key = tuple((row, id(bias)) for row, bias in biases)
        if key != self._scatter_key:
            self._scatter, self._scatter_key = _BiasScatter(biases), key
        return self._scatter

    def process(self, rows: Sequence[SequenceState], logits: mx.array, fed: mx.array
                ) -> tuple[mx.array, list[mx.array]]:
        """``logits`` (one row per request) after each request's processors; ``fed``: the
        tokens the forward fed, which the processors' histories take in. Also returns
        the histories read (to evaluate with the step)."""
        biases: list[tuple[int, LogitBias]] = []
        rest: dict[int, tuple[Any, ...]] = {}
        for index, sequence in enumerate(rows):
            row_biases, others = split_processors(sequence.processors)
            biases += [(index, bias) for bias in row_biases]
            if others:
                rest[index] = others
        scatter = self._bias_scatter(biases)
        if scatter is not None:
            logits = scatter.apply(logits)
        histories: list[mx.array] = []
        if rest:
            processed = []
            for index, sequence in enumerate(rows):
                row_logits = logits[index:index + 1]
                if index in rest:
                    history = sequence.history.update_and_fetch(fed[index:index + 1])
                    histories.append(history)
                    for processor in rest[index]:
                        row_logits = processor(history, row_logits)
                processed.append(row_logits)
            logits = mx.concatenate(processed, axis=0)
        return logits, histories

    def sample(self, rows: Sequence[SequenceState], logits: mx.array
               ) -> tuple[mx.array, list[mx.array | None]]:
        """Each row's next token, and its logprobs where it samples or reports them."""
        count = len(rows)
        greedy = [s.sampler is None for s in rows]
        # Below float32 a rounding step of the log-softmax is coarse enough to tie logits
        # that differ, so greedy rows pick from the log-softmax there, as mlx-lm does.
        from_logits = logits.dtype == mx.float32
        wanted = [not g or not from_logits or s.request.sampling.logprobs is not None
                  for g, s in zip(greedy, rows)]
        logprobs: list[mx.array | None] = [None] * count
        batch_logprobs = None
        if all(wanted):
            batch_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            logprobs = list(batch_logprobs)
        elif any(wanted):
            chosen = [index for index in range(count) if wanted[index]]
            subset = logits[mx.array(chosen)]
            for index, row in zip(chosen, subset - mx.logsumexp(subset, axis=-1, keepdims=True)):
                logprobs[index] = row
        picked_from = logits if from_logits else batch_logprobs
        if all(greedy):
            return mx.argmax(picked_from, axis=-1), logprobs
        argmax = mx.argmax(picked_from, axis=-1) if any(greedy) else None
        tokens = [argmax[index:index + 1] if greedy[index]  # type: ignore[index]
                  else rows[index].sampler(logprobs[index][None])  # type: ignore[index]
                  for index in range(count)]
        return mx.concatenate(tokens, axis=0), logprobs


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """The chosen token's logprob and, when ``top > 0``, the ``top`` most likely tokens."""
    if top <= 0:
        return TokenLogprob(token, logprobs[token].item())
    top = min(top, logprobs.shape[-1])
    top_ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    top_values = logprobs[top_ids]
    chosen = logprobs[token]
    mx.eval(top_ids, top_values, chosen)
    ranked = sorted(zip(top_ids.tolist(), top_values.tolist()), key=lambda item: -item[1])
    return TokenLogprob(token, chosen.item(), tuple(ranked))


def check_sampling(params: SamplingParams) -> None:
    """Raise ``ValueError`` naming the first parameter a request cannot be sampled with.

    Token ids are the pipeline's to check against the vocabulary (``Engine.limits``)."""
    problems: Sequence[tuple[bool, str]] = (
        (params.temperature < 0, f"temperature must be >= 0, got {params.temperature}"),
        (not 0.0 < params.top_p <= 1.0, f"top_p must be in (0, 1], got {params.top_p}"),
        (params.top_k < 0, f"top_k must be >= 0 (0 = off), got {params.top_k}"),
        (not 0.0 <= params.min_p <= 1.0, f"min_p must be in [0, 1], got {params.min_p}"),
        (params.max_tokens is None or params.max_tokens < 1,
         f"max_tokens must be >= 1, got {params.max_tokens}"),
        (params.repetition_penalty <= 0,
         f"repetition_penalty must be > 0 (1 = off), got {params.repetition_penalty}"),
        (params.logprobs is not None and params.logprobs < 0,
         f"logprobs must be >= 0 or unset, got {params.logprobs}"),
    )
    for failed, message in problems:
        if failed:
            raise ValueError(message)


__all__ = [
    "BatchSampling", "LogitBias", "LogitsProcessor", "Sampler", "SeededSampler", "check_sampling", "greedy_sampler",
    "make_logits_processors", "make_sampler", "split_processors", "token_logprob",
]
