"""Attention over query-row blocks on several CPU streams, for long prefill chunks on the CPU backend.

On the CPU backend ``mx.fast.scaled_dot_product_attention`` has no fused kernel: it runs
mlx's fallback graph (scaled queries, one score matmul with grouped heads reshaped, a
``where`` for the mask, a softmax, the value matmul). The matmuls go to BLAS, which uses
every core; the mask and the softmax are scalar loops on the one thread of the stream
(mlx's CPU ``simd`` width is 1 off Apple silicon), and at a 4k context the softmax's
exponentials alone are most of a chunk's time while the other cores idle
(docs/long-prefill-profile.md has the figures).

Softmax rows are independent, so a causal chunk's query rows are split into blocks: the
blocks' matmuls run on the calling stream (BLAS spreads each over the cores), each
block's mask and softmax on a CPU stream of its own (one thread each), and the blocks'
outputs are joined. A block of rows attends only the keys up to its last row: the keys
after it are masked for every row of the block, so they are left out rather than scored
and masked. Scores of masked keys become exact zeros in the softmax either way, so the
probabilities are the same; only the value matmul's summation may round differently in
the last bit. The left-out keys also pay for the joined output, so the peak memory never
passes mlx-lm's; calls where they would not (array masks, thin chunks, wide heads) are
not split.

:func:`install_cpu_attention` puts :func:`row_block_attention` in place of mlx-lm's
``scaled_dot_product_attention`` in the modules of a loaded model's layers. It
dispatches per call: anything but a causal CPU-stream prefill large enough to pay for
the split (decoding, short chunks, array masks, quantized caches, attention sinks, GPU
streams) goes to mlx-lm's own function unchanged.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import mlx.core as mx

__all__ = [
    "MAX_ROW_BLOCKS",
    "MIN_SPLIT_SCORES",
    "MIN_BLOCK_ROWS",
    "available_cores",
    "install_cpu_attention",
    "row_block_attention",
    "row_blocks",
]

#: The most CPU streams one attention call is spread over: each block's matmuls still
#: use the BLAS thread pool, so more blocks than this only oversubscribe the cores.
MAX_ROW_BLOCKS = 4

#: Score elements (heads x rows x keys) below which one stream does the whole call: a
#: split costs a cross-stream wait and a concatenate, which a decode step or a short
#: chunk would not earn back.
MIN_SPLIT_SCORES = 1 << 20

#: Fewest query rows in a block: thinner blocks make the score matmuls inefficient.
MIN_BLOCK_ROWS = 32

_INSTALLED_MARK = "_omlx_row_block_attention"

_streams = threading.local()


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def row_blocks(rows: int, heads: int, keys: int, cores: int | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` query-row blocks one attention call is split into.

    One block (no split) when the call is too small to pay for a split or one core is all
    there is; else as many near-equal blocks as cores, up to :data:`MAX_ROW_BLOCKS`, each
    at least :data:`MIN_BLOCK_ROWS` rows.
    """
    cores = available_cores() if cores is None else cores
    count = min(cores, MAX_ROW_BLOCKS, rows // MIN_BLOCK_ROWS)
    if count < 2 or heads * rows * keys < MIN_SPLIT_SCORES:
        return [(0, rows)]
    bounds = [rows * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _cpu_streams(count: int) -> list[mx.Stream]:
    """``count`` CPU streams for the calling thread: its default one, then extra ones."""
    extra = getattr(_streams, "extra", None)
    if extra is None:
        extra = _streams.extra = []
    while len(extra) < count - 1:
        extra.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *extra[: count - 1]]


def _causal_masked(scores: mx.array) -> mx.array:
    """``scores`` with the causal mask applied as mlx's fallback applies it: the dtype's
    lowest value where a key lies after the query (the rows end where the keys end)."""
    rows, keys = scores.shape[-2], scores.shape[-1]
    mask = mx.arange(keys - rows, keys)[:, None] >= mx.arange(keys)[None]
    return mx.where(mask, scores, mx.finfo(scores.dtype).min)


def row_block_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                        scale: float, mask: Any, sinks: mx.array | None = None, *,
                        fallback: Callable[..., mx.array], cores: int | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` contract, split over query-row blocks on
    CPU streams where that pays; ``fallback`` (mlx-lm's function) does everything else.
    ``cores`` overrides :func:`available_cores`.

    Each block is mlx's CPU fallback graph on its rows (scaled queries, grouped heads
    reshaped, score matmul, mask, softmax, value matmul). The matmuls all stay on the
    calling stream: OpenBLAS already spreads one over the cores, and two at once from two
    threads spin on its lock. Each block's mask and softmax run on a stream of their own.
    """
    if (
        sinks is not None
        or hasattr(cache, "bits")  # quantized keys and values: tuples, not arrays
        or not (isinstance(mask, str) and mask == "causal")
        or mx.default_device().type != mx.cpu
        or not queries.dtype == keys.dtype == values.dtype
    ):
        return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    batch, heads, rows, head_dim = queries.shape
    kv_heads, key_count = keys.shape[1], keys.shape[-2]
    blocks = row_blocks(rows, heads, key_count, cores)
    # The blocks' outputs are joined while the scores are still held: one more output,
    # heads·rows·head_dim. The keys a causal block leaves out, heads·rows²·(P-1)/(2P),
    # must pay for it, or the peak would pass mlx-lm's (and the memory estimate's).
    pays_for_join = rows * (len(blocks) - 1) >= 2 * len(blocks) * head_dim
    if len(blocks) == 1 or not pays_for_join:
        return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    repeats = heads // kv_heads
    # The queries are the last rows before key_count: row r sits at position offset + r.
    offset = key_count - rows
    scaled, block_keys, block_values = [], [], []
    for start, stop in blocks:
        scaled.append((queries[..., start:stop, :] * scale).reshape(
            batch, kv_heads, repeats, stop - start, head_dim))
        # Keys past a block's last row are masked for all its rows: left out.
        visible = offset + stop
        block_keys.append(mx.expand_dims(keys[..., :visible, :], 2))
        block_values.append(mx.expand_dims(values[..., :visible, :], 2))
    # mlx schedules a graph level by level from the inputs, so the calling stream runs
    # every block's score matmul before any mask or softmax: the other streams start their
    # softmax while it still scores. (Forcing that order with mx.depends kept each score
    # block referenced, so the in-place mask and softmax copied it instead.)
    scores = [q @ k.swapaxes(-1, -2) for q, k in zip(scaled, block_keys)]
    probabilities = []
    for block_scores, stream in zip(scores, _cpu_streams(len(blocks))):
        with mx.stream(stream):
            probabilities.append(mx.softmax(_causal_masked(block_scores), axis=-1, precise=True))
    outputs = [(p @ v).reshape(batch, heads, -1, values.shape[-1])
               for p, v in zip(probabilities, block_values)]
    return mx.concatenate(outputs, axis=-2)


def _attention_modules(model: Any) -> list[Any]:
    """The Python modules of ``model``'s layers that call mlx-lm's shared attention function."""
    from mlx_lm.models import base

    found = {}
    for _, layer in model.named_modules():
        module = sys.modules.get(type(layer).__module__)
        if module is None or module.__name__ in found:
            continue
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is base.scaled_dot_product_attention or getattr(current, _INSTALLED_MARK, False):
            found[module.__name__] = module
    return list(found.values())


def install_cpu_attention(model: Any) -> list[str]:
    """Route ``model``'s attention through :func:`row_block_attention`; the names of the
    model-family modules now doing so (installing twice changes nothing).

    The name is a module global of each mlx-lm model family, so every model of the family
    in this process takes the route; it is the same attention, and off the CPU backend
    the route is mlx-lm's own function.
    """
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return row_block_attention(queries, keys, values, cache, scale, mask, sinks,
                                   fallback=original)

    setattr(scaled_dot_product_attention, _INSTALLED_MARK, True)
    installed = []
    for module in _attention_modules(model):
        if not getattr(module.scaled_dot_product_attention, _INSTALLED_MARK, False):
            module.scaled_dot_product_attention = scaled_dot_product_attention
        installed.append(module.__name__)
    return installed
