"""Drafters: what proposes the tokens a verify forward checks.

A drafter keeps per-request state (:class:`DraftState`) next to the target's cache and
follows one invariant: what it has seen is every committed token except the last, the
*anchor*, which is the first token of the next verify forward. ``propose`` returns up to
``limit`` tokens to follow the anchor; ``commit`` is told which of them the target kept.

- :class:`NgramDrafter` (``ngram``, prompt lookup): the continuation of the most recent
  earlier occurrence of the last ``n`` tokens in the prompt and output so far. No
  weights, nearly free, and right wherever the output copies its input (summaries,
  rewrites, code edits, extraction). The batched engine drafts with it in its decode
  batch (:mod:`.speculation`); the dflash engine on its primary path.
- The dflash engine's own drafters (a draft model, the block-diffusion draft) build on
  :class:`Drafter` in ``omlx_core.plugins.dflash``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from omlx_core.engine import SamplingParams
from omlx_core.scheduling.acceptance import KeyStream, target_log_probs


@dataclass
class Draft:
    """Proposed tokens and, for a sampled draft, the log-distribution each came from."""

    tokens: list[int]
    log_probs: mx.array | None = None


@dataclass
class DraftState:
    """A drafter's per-request state."""

    #: committed tokens the drafter has not folded in yet (the anchor excluded)
    pending: list[int] = field(default_factory=list)
    extra: Any = None


@dataclass(frozen=True)
class DraftFootprint:
    """What a drafter allocates, for the memory estimate."""

    #: bytes of draft weights not yet in memory (loaded ones are in the idle baseline)
    pending_weight_bytes: int = 0
    #: bytes of draft weights in memory
    weight_bytes: int = 0
    #: draft cache bytes per committed token
    kv_bytes_per_token: int = 0
    #: bytes of one draft forward over ``chunk`` tokens beyond its KV (activations,
    #: logits), per token of the chunk
    transient_bytes_per_token: int = 0


class Drafter(abc.ABC):
    """Proposes tokens for one request at a time (the primary path is one request)."""

    #: the name it is chosen by in ``plugin.dflash.drafter``
    name: str = ""
    #: tokens one verify forward checks: the anchor and at most ``block_size - 1`` drafts
    block_size: int = 8
    #: most tokens (prompt and completion) the drafter can serve; ``None``: no limit
    context_window: int | None = None
    #: target layers whose hidden states the drafter reads (``None``: none)
    target_layer_ids: tuple[int, ...] | None = None

    def load(self, target: Any) -> None:
        """Load weights on the MLX thread, once the target is loaded."""

    def begin(self, prompt: Sequence[int]) -> DraftState:
        return DraftState()

    def prefill(self, state: DraftState, tokens: Sequence[int], hidden: mx.array | None) -> None:
        """Fold in a prefill chunk's ``tokens`` (with their target hidden states when
        :attr:`target_layer_ids` is set), right after the target's forward over them."""

    @abc.abstractmethod
    def propose(self, state: DraftState, history: Sequence[int], limit: int,
                sampling: SamplingParams, keys: KeyStream | None) -> Draft:
        """Up to ``limit`` tokens to follow ``history`` (whose last token is the anchor)."""

    def commit(self, state: DraftState, fed: Sequence[int], kept: int,
               hidden: mx.array | None) -> None:
        """The verify forward fed ``fed`` (anchor and drafts); its first ``kept`` stay.
        ``hidden``: their target hidden states when :attr:`target_layer_ids` is set."""
        state.pending.extend(fed[:kept])

    def end(self, state: DraftState) -> None:
        """Release the request's draft state."""

    def footprint(self) -> DraftFootprint:
        return DraftFootprint()


#: acceptance assumed for a prompt-lookup draft before a request has shown its own, by
#: the length of the suffix that matched (longer matches copy more reliably)
NGRAM_PRIOR_ACCEPTANCE = {1: 0.3, 2: 0.5, 3: 0.65, 4: 0.75}


def best_draft_length(acceptance: float, most: int, token_cost: float) -> int:
    """The draft length that maximizes expected tokens per unit of verify cost.

    Drafts ``1..k`` are accepted with probability ``acceptance ** i`` each (a prefix), so
    a cycle emits ``1 + sum(acceptance ** i)`` tokens and costs ``1 + token_cost * k``
    one-token forwards. ``0`` (a plain decode step) unless drafting beats it.
    """
    best, best_rate = 0, 1.0
    expected, power = 1.0, 1.0
    for k in range(1, most + 1):
        power *= acceptance
        expected += power
        rate = expected / (1.0 + token_cost * k)
        if rate > best_rate * 1.02:
            best, best_rate = k, rate
    return best


class NgramDrafter(Drafter):
    """Prompt lookup: the longest ``n`` in ``[ngram_min, ngram_max]`` whose last
    ``n``-gram occurred earlier gives the continuation after its latest occurrence.

    How many of its tokens to draft follows the request's own record: the acceptance
    of earlier drafts from matches of the same length (starting from
    :data:`NGRAM_PRIOR_ACCEPTANCE`) against ``token_cost``, what one more verified
    position costs relative to a one-token forward. Where drafts keep missing (open-
    ended text) it stops drafting, so a miss costs nothing; the estimate drifts back
    toward the prior while it does not draft, so it tries again later.
    """

    name = "ngram"

    def __init__(self, *, block_size: int = 8, ngram_min: int = 1, ngram_max: int = 4,
                 token_cost: float = 0.1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min ({ngram_min}) must be >= 1 and <= ngram_max ({ngram_max})")
        self.block_size = block_size
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.token_cost = token_cost

    def prior(self, n: int) -> float:
        return NGRAM_PRIOR_ACCEPTANCE[min(n, max(NGRAM_PRIOR_ACCEPTANCE))]

    def begin(self, prompt: Sequence[int]) -> DraftState:
        # index[n][gram] = where the continuation of gram's latest occurrence starts
        lengths = range(self.ngram_min, self.ngram_max + 1)
        state = DraftState(extra=_NgramState({n: {} for n in lengths}, [],
                                             {n: self.prior(n) for n in lengths}))
        self._extend(state.extra, prompt)
        return state

    @staticmethod
    def _extend(lookup: "_NgramState", tokens: Sequence[int]) -> None:
        seen = lookup.seen
        for token in tokens:
            length = len(seen)
            for n, grams in lookup.index.items():
                if length >= n:
                    grams[tuple(seen[length - n:])] = length
            seen.append(int(token))

    def propose(self, state: DraftState, history: Sequence[int], limit: int,
                sampling: SamplingParams, keys: KeyStream | None) -> Draft:
        lookup: _NgramState = state.extra
        seen = lookup.seen
        if len(history) > len(seen):
            self._extend(lookup, history[len(seen):])
        lookup.last = None
        if limit <= 0:
            return Draft([])
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(seen) < n:
                continue
            start = lookup.index[n].get(tuple(seen[-n:]))
            if start is None:
                continue
            continuation = seen[start:start + limit]
            k = best_draft_length(lookup.acceptance[n], len(continuation), self.token_cost)
            if k == 0:
                # Not worth a wider forward now; drift back toward the prior.
                lookup.acceptance[n] += 0.05 * (self.prior(n) - lookup.acceptance[n])
                return Draft([])
            lookup.last = n
            return Draft(list(continuation[:k]))
        return Draft([])

    def outlook(self, state: DraftState, history: Sequence[int]) -> float:
        """The acceptance per drafted position the request's record gives the longest
        match of ``history``'s last tokens (0 without one): what a draft after the
        anchor that follows ``history``, not known yet, may expect."""
        lookup: _NgramState = state.extra
        seen = lookup.seen
        if len(history) > len(seen):
            self._extend(lookup, history[len(seen):])
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(seen) >= n and tuple(seen[-n:]) in lookup.index[n]:
                return lookup.acceptance[n]
        return 0.0

    def acceptance(self, state: DraftState) -> float:
        """The acceptance per drafted position expected of the draft just proposed."""
        lookup: _NgramState = state.extra
        return lookup.acceptance[lookup.last] if lookup.last is not None else 0.0

    def skip(self, state: DraftState) -> None:
        """No draft was verified for the request this step (none proposed, or not worth
        a wider forward): forget the proposal, and drift every estimate back toward its
        prior, so a request that stopped drafting tries again later."""
        lookup: _NgramState = state.extra
        lookup.last = None
        for n, estimate in lookup.acceptance.items():
            lookup.acceptance[n] = estimate + 0.05 * (self.prior(n) - estimate)

    def commit(self, state: DraftState, fed: Sequence[int], kept: int,
               hidden: mx.array | None) -> None:
        lookup: _NgramState = state.extra
        n, lookup.last = lookup.last, None
        drafted = len(fed) - 1
        if n is None or drafted == 0:
            return
        accepted = kept - 1
        trials = accepted + (1 if accepted < drafted else 0)
        observed = accepted / trials
        lookup.acceptance[n] = 0.7 * lookup.acceptance[n] + 0.3 * observed


@dataclass
class _NgramState:
    index: dict[int, dict[tuple[int, ...], int]]
    seen: list[int]
    #: acceptance per drafted position, by matched suffix length
    acceptance: dict[int, float]
    #: the matched length of the draft being verified
    last: int | None = None


__all__ = ["Draft", "DraftFootprint", "DraftState", "Drafter", "NGRAM_PRIOR_ACCEPTANCE", "NgramDrafter",
           "best_draft_length"]
