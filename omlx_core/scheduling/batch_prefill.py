"""Several requests' prefill chunks in one forward of the model.

A forward costs a fixed part (reading every weight once) plus a part per token. Short
prompts arriving together each pay the fixed part when prefilled one by one; in one
forward they pay it once.

The rows of a batched forward are laid out so that every real token sits where it
would in the request's own forward:

- row ``i`` holds its ``start`` cached tokens right-aligned at column ``width`` (the
  longest cached prefix of the batch), left-padded with zeros that the attention mask
  hides, then its chunk, right-padded to the longest chunk;
- its RoPE offset is its own ``start``, so positions are those of the request alone;
- a real query attends to its own prefix and to the chunk's tokens up to itself: left
  padding is masked and right padding lies in its causal future. A padding query sees
  at least the row's real tokens, so no attention row is empty (no NaN can leak out).

Afterwards each request's cache gets exactly its own tokens back: columns
``[width - start, width + length)`` of its row, copied so the batch buffer is freed.

Only plain ``KVCache`` layers can be laid out this way; :func:`can_batch` says whether
a model's layers all are. Padding still changes the shapes the matmuls see, so results
can differ from a request's own forward in the last bits of a float, as the rows of a
batched decode step already do; the positions, masks and cache contents are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

#: token id the right padding is filled with; never attended by a real token
PAD_TOKEN = 0

#: Padded token slots a forward may carry beyond a quarter of its real new tokens:
#: tiny chunks cost about the fixed part of a forward whatever their padding.
PADDING_SLACK = 16


def can_batch(cache: Sequence[Any]) -> bool:
    """Whether every layer of a request's ``cache`` is a plain ``KVCache`` (not a
    subclass: rotating, quantized and chunked caches keep state a padded row corrupts)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


@dataclass(frozen=True)
class PrefillRow:
    """One request's chunk in a batched forward."""

    #: the request's own per-layer caches, holding ``start`` tokens
    cache: Sequence[KVCache]
    #: the chunk's prompt tokens
    tokens: Sequence[int]
    #: tokens already in ``cache``
    start: int


def padded_slots(spans: Sequence[tuple[int, int]]) -> int:
    """Padding slots (query rows plus left-padded key columns) a forward over ``spans``
    (``(start, length)`` each) carries beyond the real tokens."""
    width = max(start for start, _ in spans)
    longest = max(length for _, length in spans)
    return sum((longest - length) + (width - start) for start, length in spans)


def group_spans(spans: Sequence[tuple[int, int]], *, max_start: int) -> list[list[int]]:
    """Partition the chunk indices of ``spans`` (``(start, length)`` each) into forwards.

    Chunks over a cached prefix longer than ``max_start`` tokens run alone: their prefix
    would be copied into the batch buffer and back. The others are sorted by length and
    cut into runs whose padding stays within a quarter of their new tokens plus
    :data:`PADDING_SLACK`. Groups come back ordered by their first index, each ascending.
    """
    groups: list[list[int]] = []
    eligible = sorted((i for i, (start, length) in enumerate(spans) if start <= max_start and length > 0),
                      key=lambda i: (spans[i][1], spans[i][0]))
    current: list[int] = []
    for index in eligible:
        candidate = current + [index]
        new_tokens = sum(spans[i][1] for i in candidate)
        if current and padded_slots([spans[i] for i in candidate]) > new_tokens // 4 + PADDING_SLACK:
            groups.append(current)
            candidate = [index]
        current = candidate
    if current:
        groups.append(current)
    grouped = {i for group in groups for i in group}
    groups += [[i] for i in range(len(spans)) if i not in grouped]
    return sorted((sorted(group) for group in groups), key=lambda group: group[0])


class _RowsCache(BatchKVCache):
    """One layer's batch cache over rows of different cached lengths, exactly sized.

    ``BatchKVCache`` supplies the per-row offsets RoPE reads and the mask that hides
    left padding; this one starts from the rows' own prefixes and grows by exact
    concatenation instead of ``BatchKVCache.step``-sized zero blocks, since it lives for
    one forward.
    """

    def __init__(self, layers: Sequence[KVCache], starts: Sequence[int]) -> None:
        width = max(starts)
        super().__init__([width - start for start in starts])
        self.offset = mx.array(list(starts))
        self._idx = width
        if width:
            reference = next(layer for layer, start in zip(layers, starts) if start == width)
            self.keys = _stack_right_aligned([layer.keys for layer in layers], starts, width, reference.keys)
            self.values = _stack_right_aligned([layer.values for layer in layers], starts, width,
                                               reference.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys, self.values


def _stack_right_aligned(arrays: Sequence[mx.array | None], starts: Sequence[int], width: int,
                         reference: mx.array) -> mx.array:
    _, heads, _, dim = reference.shape
    rows = []
    for array, start in zip(arrays, starts):
        parts = []
        if start < width:
            parts.append(mx.zeros((1, heads, width - start, dim), dtype=reference.dtype))
        if start:
            parts.append(array[..., :start, :])
        rows.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
    return mx.concatenate(rows, axis=0)


def prefill_together(model: Any, rows: Sequence[PrefillRow], *,
                     logits: bool = False) -> list[mx.array] | None:
    """Run every row's chunk through one forward of ``model`` and extend each row's own
    cache by exactly its chunk's keys and values (evaluated).

    Without ``logits`` it evaluates only the caches. With it, it returns each row's
    ``(1, vocab)`` logits at its last real token: the output layer then runs over every
    position of the batch, so ask for them only for short chunks (a prompt's last token).
    On an exception no row's cache has changed.
    """
    starts = [row.start for row in rows]
    lengths = [len(row.tokens) for row in rows]
    for row in rows:
        if any(layer.offset != row.start for layer in row.cache):
            raise ValueError(f"a cache holds {[layer.offset for layer in row.cache][:1]} tokens, "
                             f"not the row's start {row.start}")
    width, longest = max(starts), max(lengths)
    layers = len(rows[0].cache)
    batch = [_RowsCache([row.cache[i] for row in rows], starts) for i in range(layers)]
    tokens = mx.array([list(row.tokens) + [PAD_TOKEN] * (longest - len(row.tokens)) for row in rows])
    output = model(tokens, cache=batch)
    last = [output[index:index + 1, length - 1, :] for index, length in enumerate(lengths)] if logits else []
    extracted = []
    for index, (start, length) in enumerate(zip(starts, lengths)):
        begin, end = width - start, width + length
        extracted.append([(mx.contiguous(layer.keys[index:index + 1, :, begin:end, :]),
                           mx.contiguous(layer.values[index:index + 1, :, begin:end, :]))
                          for layer in batch])
    mx.eval(extracted, last)
    del batch, output
    for row, kv, start, length in zip(rows, extracted, starts, lengths):
        for layer, (keys, values) in zip(row.cache, kv):
            layer.keys, layer.values = keys, values
            layer.offset = start + length
    return last if logits else None


__all__ = ["PAD_TOKEN", "PADDING_SLACK", "PrefillRow", "can_batch", "group_spans", "padded_slots",
           "prefill_together"]
