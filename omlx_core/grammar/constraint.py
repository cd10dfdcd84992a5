"""Per-request grammar state for decoding: mask a row of logits, advance with each token.

A batched decode step keeps one :class:`GrammarConstraint` per constrained row and
masks only that row's logits, so the other rows sample exactly as they would without
it. :class:`GrammarLogitsProcessor` adapts a constraint to mlx-lm's logits-processor
protocol, which is how ``BatchGenerator`` applies per-row processors.

All mlx work here runs on whichever thread calls :meth:`GrammarConstraint.mask_logits`
(the MLX thread); constructing a constraint touches no mlx.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np

from omlx_core.grammar.compiler import Compiled
from omlx_core.grammar.xgrammar_import import import_xgrammar

log = logging.getLogger(__name__)

__all__ = ["GrammarConstraint", "GrammarLogitsProcessor", "apply_token_bitmask", "mask_batch"]


def apply_token_bitmask(logits: Any, bitmask: np.ndarray) -> Any:
    """``logits`` with every token whose bit is clear in ``bitmask`` set to ``-inf``.

    ``bitmask`` is xgrammar's packed int32 layout (bit ``i % 32`` of word ``i // 32``
    allows token ``i``), one row per row of ``logits``: ``(rows, words)`` for ``(rows,
    vocab)`` logits, or one row for ``(vocab,)``. The bits are unpacked in MLX, so only
    ``vocab / 8`` bytes per row cross to the device.
    """
    import mlx.core as mx

    width = logits.shape[-1]
    bitmask = np.ascontiguousarray(bitmask.reshape(-1, bitmask.shape[-1]))
    if width > bitmask.shape[-1] * 32:
        raise ValueError(
            f"the logits are {width} wide but the grammar's token bitmask covers "
            f"{bitmask.shape[-1] * 32} tokens; build the grammar compiler with "
            "vocab_size set to the model's logits width")
    rows = 1 if logits.ndim == 1 else logits.shape[0]
    if bitmask.shape[0] != rows:
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {rows} rows of logits")
    words = mx.array(bitmask.view(np.uint32))
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(rows, -1)[:, :width].astype(mx.bool_)
    if logits.ndim == 1:
        allowed = allowed[0]
    return mx.where(allowed, logits, mx.array(-math.inf, dtype=logits.dtype))


def mask_batch(logits: Any, constraints: Sequence[GrammarConstraint | None]) -> Any:
    """``(rows, vocab)`` logits with each constrained row masked by its constraint, in
    one MLX operation; a ``None`` row, and a row whose grammar allows every token, keep
    their logits bit for bit."""
    if len(constraints) != logits.shape[0]:
        raise ValueError(f"{len(constraints)} constraints for {logits.shape[0]} rows of logits")
    masks = [None if c is None else c.fill_bitmask() for c in constraints]
    if all(mask is None for mask in masks):
        return logits
    words = next(mask for mask in masks if mask is not None).shape[-1]
    # All bits set: the -inf select leaves such a row's values untouched.
    batch = np.full((len(masks), words), -1, dtype=np.int32)
    for row, mask in enumerate(masks):
        if mask is not None:
            batch[row] = mask[0]
    return apply_token_bitmask(logits, batch)


class GrammarConstraint:
    """The grammar state of one output: which tokens may come next, and what was accepted.

    ``mask_logits`` before each sample, ``accept`` with the sampled token; a speculative
    engine that drafts ahead calls ``accept`` per drafted token and ``rollback`` for the
    ones the verifier rejects. Once the grammar's end and a stop token have been
    accepted the constraint is terminated and the output is complete.
    """

    def __init__(self, compiled: Compiled) -> None:
        xgr = import_xgrammar()
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._bitmask = np.full((1, math.ceil(self.vocab_size / 32)), -1, dtype=np.int32)
        self.stop_token_ids: tuple[int, ...] = tuple(
            int(t) for t in compiled.grammar.tokenizer_info.stop_token_ids)
        self._stop_mask: np.ndarray | None = None
        # Accepted token ids since the start (or the last reset), less rollbacks.
        self._accepted: list[int] = []

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since the start (or the last reset), less rollbacks."""
        return len(self._accepted)

    def fill_bitmask(self) -> np.ndarray | None:
        """The packed int32 mask row of the tokens allowed next, or ``None`` when every
        token is allowed (nothing to apply). Does not change the state; the array is
        reused by the next call, so copy it to keep it."""
        if self._matcher.is_terminated():
            return self.stop_bitmask()
        need_apply = self._matcher.fill_next_token_bitmask(self._bitmask)
        forbidden = self.compiled.forbidden_bitmask
        guard = self.compiled.utf8_guard
        after = guard.after(self._accepted[-1]) if guard is not None and self._accepted else None
        if after is not None:
            forbidden = after if forbidden is None else forbidden | after
        if forbidden is not None:
            allowed = self._bitmask & ~forbidden
            # A grammar that spells a control token out as text (a regex for
            # "<|im_start|>") keeps it: an all-forbidden row would sample garbage.
            if allowed.any():
                np.copyto(self._bitmask, allowed)
                need_apply = True
        if not need_apply:
            return None
        return self._bitmask

    def stop_bitmask(self) -> np.ndarray:
        """A mask row that allows the stop tokens only."""
        if self._stop_mask is None:
            mask = np.zeros_like(self._bitmask)
            words = mask.view(np.uint32)
            for token in self.stop_token_ids:
                words[0, token // 32] |= np.uint32(1 << (token % 32))
            self._stop_mask = mask
        return self._stop_mask

    def mask_logits(self, logits: Any) -> Any:
        """``logits`` (one row, ``(vocab,)`` or ``(1, vocab)``) with the tokens the grammar
        forbids next set to ``-inf``. After termination only the stop tokens remain."""
        bitmask = self.fill_bitmask()
        if bitmask is None:
            return logits
        return apply_token_bitmask(logits, bitmask)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; ``False`` (state unchanged) when the grammar forbids it."""
        accepted = bool(self._matcher.accept_token(int(token_id)))
        if accepted:
            self._accepted.append(int(token_id))
        return accepted

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by each of ``token_ids`` in turn; the number accepted before the first
        refusal (the rest are not tried)."""
        for count, token in enumerate(token_ids):
            if not self.accept(token):
                return count
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (those a verifier rejected)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {self.num_accepted} have been accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._accepted[len(self._accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        """Whether the grammar has ended and a stop token was accepted: the output is done."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """Whether the text so far is a complete match (a stop token may come next)."""
        return bool(self._matcher.is_completed())

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._matcher.reset()
        self._accepted.clear()

    def processor(self, prompt_length: int | None = None) -> GrammarLogitsProcessor:
        """An mlx-lm logits processor driving this constraint (see :class:`GrammarLogitsProcessor`)."""
        return GrammarLogitsProcessor(self, prompt_length=prompt_length)


class GrammarLogitsProcessor:
    """``processor(tokens, logits) -> logits`` for mlx-lm's ``generate_step`` and
    ``BatchGenerator`` (per-row ``logits_processors``).

    mlx-lm passes the whole context: on the first call the prompt alone, then the prompt
    followed by every generated token, the newest last. So each call first accepts the
    tokens that appeared since the last call, then masks. ``prompt_length`` tells the
    prompt apart when the first call does not see it whole; by default the first call's
    context is the prompt. A context shorter than the last one means the engine took
    tokens back (speculative rejection): the constraint rolls back to match.

    A generated token the grammar refuses can only come from a sampler that ignored the
    mask; the output can no longer match, so from then on only stop tokens are allowed
    and the row ends. ``violations`` counts such tokens.
    """

    def __init__(self, constraint: GrammarConstraint, *, prompt_length: int | None = None) -> None:
        self.constraint = constraint
        self._prompt_length = prompt_length
        self._seen: int | None = None
        # Per generated position: whether the constraint accepted it, so a rollback over
        # positions undoes exactly the accepted ones.
        self._accepted: list[bool] = []
        # Index in _accepted of the first refused token, while it has not been taken back.
        self._violation_at: int | None = None
        self.violations = 0

    def __call__(self, tokens: Any, logits: Any) -> Any:
        # The mask needs the newest token on the host, which waits for the step that
        # sampled it; start this step's forward first, so it computes meanwhile instead
        # of after the mask is built (in a decode batch, the whole batch's forward).
        import mlx.core as mx

        mx.async_eval(logits)
        length = int(tokens.shape[0])
        if self._seen is None:
            self._seen = length if self._prompt_length is None else self._prompt_length
            self._prompt_length = self._seen
        if length < self._seen:
            self._take_back(self._seen - length)
        elif length > self._seen:
            for token in tokens[self._seen:].tolist():
                self._advance(int(token))
        self._seen = length
        if self._violation_at is not None:
            return apply_token_bitmask(logits, self.constraint.stop_bitmask())
        return self.constraint.mask_logits(logits)

    def _advance(self, token: int) -> None:
        if self._violation_at is not None or self.constraint.is_terminated():
            self._accepted.append(False)
            return
        accepted = self.constraint.accept(token)
        self._accepted.append(accepted)
        if not accepted:
            self._violation_at = len(self._accepted) - 1
            self.violations += 1
            log.warning("token %d does not fit the grammar (the sampler ignored the mask); "
                        "ending the constrained output", token)

    def _take_back(self, count: int) -> None:
        count = min(count, len(self._accepted))
        undone = self._accepted[len(self._accepted) - count:]
        del self._accepted[len(self._accepted) - count:]
        self.constraint.rollback(sum(undone))
        if self._violation_at is not None and self._violation_at >= len(self._accepted):
            self._violation_at = None
