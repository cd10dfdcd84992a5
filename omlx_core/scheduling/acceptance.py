"""Which drafted tokens the target accepts, and the token it adds after them.

A verify forward scores ``[anchor, d_1 .. d_k]`` in one pass: row ``i`` of its logits is
the target's next-token distribution after ``d_1 .. d_i``. Under greedy decoding a
draft token is accepted while it equals the target's argmax, so the output is exactly
the target's own greedy output. Under sampling, ``d_i`` drawn from the draft's ``q`` is
accepted with probability ``min(1, p(d_i) / q(d_i))``; at the first rejection the token
is drawn from the residual ``max(p - q, 0)`` (renormalized), and after ``k`` acceptances
from ``p`` of the last row: the emitted tokens are distributed exactly as the target's
own samples (Leviathan et al., 2023; Chen et al., 2023). A draft without a distribution
(prompt lookup) is a point mass: ``q(d_i) = 1``.

``p`` is the target's sampling distribution after the request's temperature, top-k,
top-p and min-p, the same transforms the batched engine samples with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from omlx_core.engine import SamplingParams
from omlx_core.scheduling.sampling import MASK64, mix64


class KeyStream:
    """Random keys that depend on the request's seed and a counter only, so a seeded
    request draws the same numbers whatever else runs on the MLX thread."""

    def __init__(self, seed: int) -> None:
        self._seed_hash = mix64(seed & MASK64)
        self._count = 0

    def next(self) -> mx.array:
        key = mx.random.key(mix64(self._seed_hash ^ self._count))
        self._count += 1
        return key


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verify forward."""

    #: drafted tokens the target accepted (a prefix of the draft)
    accepted: int
    #: tokens to emit: the accepted drafts and then the target's own next token
    tokens: tuple[int, ...]


def target_log_probs(logits: mx.array, sampling: SamplingParams) -> mx.array:
    """Log of the target's sampling distribution per row of ``logits`` (``(n, vocab)``)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    scaled = logprobs / sampling.temperature
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        scaled = apply_top_k(scaled, sampling.top_k)
    if 0.0 < sampling.top_p < 1.0:
        scaled = apply_top_p(scaled, sampling.top_p)
    if sampling.min_p > 0.0:
        scaled = apply_min_p(scaled, sampling.min_p)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def accepted_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading ``drafts`` equal the target's own tokens: ``targets[i]`` is the
    token the target picks after the anchor and ``drafts[:i]``.

    For a deterministic draft (a point mass on ``d_i``) this is also exact rejection
    sampling when ``targets[i]`` is the target's own *sample* from ``p``: ``d_i`` is then
    kept with probability ``p(d_i) = min(1, p(d_i) / 1)``, and on a rejection the sample
    is distributed as ``p`` without ``d_i``, renormalized: the residual. So a seeded row
    that draws ``targets[i]`` with the key plain decoding would use emits plain
    decoding's very tokens.
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def accept_greedy(logits: mx.array, drafts: Sequence[int]) -> Verdict:
    """Accept drafts while they equal the target's argmax; then add the argmax."""
    choices = mx.argmax(logits, axis=-1).tolist()
    accepted = accepted_prefix(drafts, choices)
    return Verdict(accepted, tuple(drafts[:accepted]) + (int(choices[accepted]),))


def accept_sampled(logits: mx.array, drafts: Sequence[int], sampling: SamplingParams,
                   keys: KeyStream, draft_log_probs: mx.array | None = None) -> Verdict:
    """Rejection sampling of ``drafts`` against the target rows ``logits``.

    :param logits: ``(len(drafts) + 1, vocab)`` target logits of the verify forward.
    :param draft_log_probs: ``(len(drafts), vocab)`` log of the draft's distribution each
        token was drawn from; ``None`` for a deterministic draft (a point mass).
    """
    log_p = target_log_probs(logits, sampling)
    k = len(drafts)
    if k:
        index = mx.array(list(drafts))[:, None]
        p_draft = mx.exp(mx.take_along_axis(log_p[:k], index, axis=-1)[:, 0])
        if draft_log_probs is None:
            q_draft = mx.ones_like(p_draft)
        else:
            q_draft = mx.exp(mx.take_along_axis(draft_log_probs.astype(mx.float32), index,
                                                axis=-1)[:, 0])
        uniforms = mx.random.uniform(shape=(k,), key=keys.next())
        # u < p/q, written as u*q < p so that q == 0 never divides.
        passed = (uniforms * q_draft < p_draft).tolist()
    else:
        passed = []
    accepted = 0
    while accepted < k and passed[accepted]:
        accepted += 1
    key = keys.next()
    if accepted == k:
        token = int(mx.random.categorical(log_p[k], key=key).item())
    else:
        p = mx.exp(log_p[accepted])
        if draft_log_probs is None:
            q = mx.zeros_like(p).at[drafts[accepted]].add(1.0)
        else:
            q = mx.exp(draft_log_probs[accepted].astype(mx.float32))
        residual = mx.maximum(p - q, 0.0)
        total = residual.sum()
        # A residual of all zeros means p == q exactly, where rejection cannot happen;
        # float rounding can still get here, and then p itself is the right law.
        residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p)
        token = int(mx.random.categorical(mx.log(residual), key=key).item())
    return Verdict(accepted, tuple(drafts[:accepted]) + (token,))


__all__ = ["KeyStream", "Verdict", "accept_greedy", "accepted_prefix", "accept_sampled", "target_log_probs"]
