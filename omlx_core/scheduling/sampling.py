"""Per-request samplers, logits processors and logprobs for mlx-lm's ``BatchGenerator``.

Every sampled request draws from its own key sequence: step ``n`` uses a key derived
from ``(seed, n)`` alone, so a seeded request samples the same tokens whatever else
shares its batch. Greedy requests share one sampler object, which lets the generator
take the argmax of the whole batch in one call.

Semantics follow the OpenAI/vLLM conventions: temperature scales the logits before
top-k/top-p/min-p filter them; presence and frequency penalties count completion
tokens only; the repetition penalty (HF style, divide positive and multiply negative
logits) covers prompt and completion. Reported logprobs are the log-softmax of the
logits after penalties and bias, before temperature and filtering.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from omlx_core.engine import SamplingParams, TokenLogprob

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
    """``None`` (the generator's shared greedy sampler) for temperature 0, else a seeded one."""
    if params.temperature == 0:
        return None
    return SeededSampler(params, seed, vocab_size)


class LogitBias:
    """A request's ``logit_bias`` as a logits processor: added to its row's logits.

    A class rather than a closure so the decode step can tell biases apart from other
    processors and add the whole batch's in one scatter (:mod:`.decode_step`)."""

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
    "LogitBias", "LogitsProcessor", "Sampler", "SeededSampler", "check_sampling", "greedy_sampler",
    "make_logits_processors", "make_sampler", "token_logprob",
]
