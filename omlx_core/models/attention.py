"""Attention for prefill chunks and speculative steps on the CPU backend, with the softmax
on vector units.

On the CPU backend ``mx.fast.scaled_dot_product_attention`` has no fused kernel: it runs
mlx's fallback graph (scaled queries, one score matmul with the grouped heads reshaped,
a ``where`` for the mask, a softmax, the value matmul). The matmuls go to BLAS, which is
fast; the mask and the softmax are scalar loops on one thread (mlx's CPU ``simd`` width
is 1 off Apple silicon), and the softmax's exponential costs ~17 ns per score. At a 4k
context those exponentials are most of a prefill chunk's time (BENCHMARKS.md, "Long-
context prefill").

:func:`cpu_attention` keeps the two matmuls in mlx and does the mask and the softmax in
NumPy, whose float32 ``exp`` runs on the CPU's vector units, **in place** on the score
matrix mlx has just computed (a writable view of its buffer): the scores are evaluated,
masked, turned into probabilities where they lie, split by rows over the cores (NumPy
releases the GIL in its loops), and handed to the value matmul. The same arrays exist as
in mlx's fallback (the score matrix, then the output) but for its one-byte causal mask,
so the peak memory is the fallback's less that mask. The arithmetic is the fallback's:
``exp(s - max) * (1 / sum)`` in float32; the exponentials of the two libraries differ in
the last bit at most, so greedy outputs are unchanged
(``tests/test_models_attention.py``).

:func:`install_cpu_attention` puts it in place of mlx-lm's ``scaled_dot_product_attention``
in the modules of a loaded model's layers (not for a model with recurrent layers). It
dispatches per call. Chunks over at least :data:`MIN_KEYS` keys (or :data:`MIN_SCORES`
scores) and speculative steps of a few rows (:data:`MAX_VERIFY_ROWS`) take the NumPy
softmax above. Every other float32 call on the CPU backend, plain decode steps first,
runs on :mod:`~omlx_core.models.cpu_kernels`: a decode step's one query row per sequence
in the kernels' decode attention (scores, mask, softmax and values in one pass over a
head's keys: at 16 rows over 256 keys, ~1 ms of a step's 30 where mlx's ops took ~10),
anything else in :func:`kernel_attention`, the same graph as mlx's fallback with the
kernels' softmax (vectorized, and evaluated with the rest of the step, so a decode step
keeps its overlap with the next step's graph); mlx-lm's own function where those
kernels are not built. A float32 decode step over a quantized KV cache goes to the
kernels' quantized decode attention, which expands the key or value rows a block of 256
at a time with ``mx.dequantize``'s arithmetic (bit for bit the float32 kernel's result over the
dequantized cache); any other float32 call over one has its layer's keys and values
dequantized first and then goes the same way (mlx's quantized matmuls are scalar loops
on the CPU backend). Non-float32 activations, attention sinks and every GPU
stream (Metal and CUDA have fused kernels) go to mlx-lm's function unchanged. Around all
of it, a quantized KV cache (stored rotated: :mod:`~omlx_core.models.kv_rotation`) gets
its queries rotated in and its output rotated back; :func:`install_kv_rotation` does the
same around mlx-lm's function in the models the route leaves to mlx-lm. The memory estimate does not depend on whether a model takes the
route: it counts mlx's fallback (the kernels' graph holds the arrays the fallback holds,
the NumPy softmax the same less the mask).
Evaluating inside the forward is what the engine's prefill does after each chunk
anyway; a caller tracing the model under ``mx.compile`` would be refused by mlx
(omlx-core's engines do not compile the forward).
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from omlx_core.models import cpu_kernels
from omlx_core.models.kv_rotation import rotated_attention

__all__ = ["MAX_VERIFY_ROWS", "MIN_KEYS", "MIN_SCORES", "MIN_VERIFY_SCORES", "attention_caches_only",
           "available_cores", "cpu_attention", "family_modules", "install_cpu_attention",
           "install_kv_rotation", "install_route", "kernel_attention", "mask_in_place", "route_takes", "softmax_in_place"]

#: Fewest keys a multi-row call (a prefill chunk) attends over for the route to take it:
#: from there on the softmax is most of a chunk's time, even for the small chunks the
#: decode latency budget cuts a long prompt into beside running streams (16-40 rows).
#: A 256-token chunk of the default model over 1,024 keys: 1.74x; over 1,792: 2.08x.
#: (From 512 keys it pays too, 1.44x, but there a tiny VLM's prefill estimate came out
#: 1.19x its measured peak, past the estimator's bound: see :data:`MIN_SCORES`.)
MIN_KEYS = 1024

#: Score elements (batch x heads x rows x keys) from which a multi-row call over fewer
#: keys is taken too. The route pays from ~2^14 scores on (decode steps at a 2k context
#: included: 1.2-1.5x), but evaluating mid-forward also changes which of a layer's
#: intermediates are alive together, which the memory estimator models only where the
#: score matrix dominates: below these sizes a tiny model's measured peak fell up to
#: 20 % under its estimate. Plain decode steps (one row) stay in the graph (the CPU
#: kernels' softmax): evaluating mid-forward costs them the overlap with the next step's
#: graph, which is what the NumPy route saves (0.97-1.04x in mlx-lm's BatchGenerator).
MIN_SCORES = 1 << 22

#: Most query rows of a call counted as a speculative decoding step (each row's pending
#: token and its drafts, ``plugin.batched.max_draft_tokens`` + 1 at most by default).
#: Such a step evaluates its logits right after the forward, so evaluating mid-forward
#: loses no pipelining, and the route makes it 1.2-1.7x faster from a few hundred keys
#: (8 rows x 5 positions over 400 keys: 255 -> 213 ms; over 1,500: 442 -> 257 ms).
MAX_VERIFY_ROWS = 8

#: Score elements from which a call of at most :data:`MAX_VERIFY_ROWS` rows is taken
#: (one row at 400 keys: 1.07x).
MIN_VERIFY_SCORES = 1 << 14

#: Score rows one worker thread takes at least: thinner slices are not worth a hand-off.
_MIN_ROWS_PER_WORKER = 64

_INSTALLED_MARK = "_omlx_cpu_attention"
_ROTATION_MARK = "_omlx_kv_rotation"

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _workers() -> ThreadPoolExecutor:
    """The softmax's helper threads, all started the first time they are asked for
    (:func:`install_cpu_attention` asks at load): a ``ThreadPoolExecutor`` starts a
    thread at a submit that finds none idle, so each start task waits on the others until
    every thread is up. A server's thread count then does not grow at its first long
    prompt, hours into serving, where a soak's count reads it as a leak."""
    global _pool
    with _pool_lock:
        if _pool is None:
            count = max(available_cores() - 1, 1)
            pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="omlx-softmax")
            all_up = threading.Barrier(count)
            for started in [pool.submit(all_up.wait, 60) for _ in range(count)]:
                started.result()
            _pool = pool
        return _pool


def _softmax_rows(scores: np.ndarray) -> None:
    """Softmax over the last axis of 2-D float32 ``scores``, in place."""
    peak = scores.max(axis=-1, keepdims=True)
    np.subtract(scores, peak, out=scores)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    np.reciprocal(total, out=total)
    np.multiply(scores, total, out=scores)


def softmax_in_place(scores: np.ndarray, cores: int | None = None) -> None:
    """Softmax over the last axis of C-contiguous float32 ``scores``, in place, its rows
    split over ``cores`` threads (the calling one included)."""
    rows = scores.reshape(-1, scores.shape[-1])
    cores = available_cores() if cores is None else cores
    parts = max(1, min(cores, rows.shape[0] // _MIN_ROWS_PER_WORKER))
    if parts == 1:
        _softmax_rows(rows)
        return
    bounds = [rows.shape[0] * i // parts for i in range(parts + 1)]
    pool = _workers()
    futures = [pool.submit(_softmax_rows, rows[start:stop])
               for start, stop in zip(bounds[1:-1], bounds[2:])]
    _softmax_rows(rows[bounds[0]:bounds[1]])
    for future in futures:
        future.result()


#: what a hidden score becomes, as in mlx's fallback: the lowest float32 (not -inf, so a
#: row with every key hidden, a padding row, gets finite uniform weights, not NaNs)
_HIDDEN = np.finfo(np.float32).min


def _mask_view(mask: Any, heads: int, kv_heads: int) -> Any:
    """``mask`` shaped to broadcast over the scores' (batch, kv heads, repeats, rows,
    keys) view, as NumPy (:func:`_taken` lets only 2-D masks and 4-D ones with one head
    or every head through)."""
    values = np.asarray(mask)
    if values.ndim <= 2:
        return values
    if values.ndim != 4 or values.shape[1] not in (1, heads):
        raise ValueError(f"an attention mask of shape {values.shape} does not broadcast over "
                         f"{heads} heads")
    groups = (1, 1) if values.shape[1] == 1 else (kv_heads, heads // kv_heads)
    return values.reshape(values.shape[:1] + groups + values.shape[2:])


def mask_in_place(scores: np.ndarray, mask: Any) -> None:
    """Apply ``mask`` to ``scores`` (batch, kv heads, repeats, rows, keys) in place, as
    mlx's fallback does: ``"causal"`` hides the keys after each query (the rows end where
    the keys end), a boolean array hides its ``False`` entries, any other array is added."""
    if mask is None:
        return
    if isinstance(mask, str):
        rows, keys = scores.shape[-2], scores.shape[-1]
        # Only the last ``rows`` keys can lie after a query.
        block = scores[..., keys - rows:]
        # ``where=`` broadcasts a (rows, rows) mask: no index arrays (a 2048-row chunk's
        # would take 32 MiB outside mlx's accounting).
        np.copyto(block, _HIDDEN, where=np.triu(np.ones((rows, rows), dtype=bool), k=1))
    elif mask.dtype == np.bool_:
        np.copyto(scores, _HIDDEN, where=~mask)
    else:
        np.add(scores, mask.astype(np.float32, copy=False), out=scores)


def route_takes(batch: int, heads: int, rows: int, keys: int) -> bool:
    """Whether a float32 call of these sizes in a routed model takes this route on the
    CPU backend (the memory estimator's question: the route materializes no mask)."""
    scores = batch * heads * rows * keys
    if rows <= 1:
        return False
    if rows <= MAX_VERIFY_ROWS:
        return scores >= MIN_VERIFY_SCORES
    return keys >= MIN_KEYS or scores >= MIN_SCORES


def _supported(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any,
               sinks: Any) -> bool:
    """Whether this call is one the route or the CPU kernels can compute (float32 on the
    CPU backend, grouped heads, a mask of a shape they broadcast), whatever its size."""
    if (sinks is not None
            or hasattr(cache, "bits")  # quantized keys and values: tuples, not arrays
            or mx.default_device().type != mx.cpu
            or not queries.dtype == keys.dtype == values.dtype == mx.float32
            or queries.ndim != 4 or queries.shape[1] % keys.shape[1]):
        return False
    if isinstance(mask, str):
        return mask == "causal"
    return mask is None or (isinstance(mask, mx.array) and (
        mask.ndim == 2 or (mask.ndim == 4 and mask.shape[1] in (1, queries.shape[1]))))


def _quantized_on_cpu(queries: mx.array, keys: Any, cache: Any) -> bool:
    """Whether this is a float32 call over a quantized KV cache on the CPU backend (keys
    and values as ``(data, scales, biases)`` triples)."""
    return (hasattr(cache, "bits") and isinstance(keys, (tuple, list)) and len(keys) == 3
            and mx.default_device().type == mx.cpu and queries.dtype == mx.float32)


def _taken(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any,
           sinks: Any) -> bool:
    """Whether :func:`cpu_attention` computes this call in NumPy (else in the graph)."""
    if not _supported(queries, keys, values, cache, mask, sinks):
        return False
    batch, heads, rows, _ = queries.shape
    return route_takes(batch, heads, rows, keys.shape[-2])


def _row_mask(mask: Any) -> bool:
    """Whether a one-query-row call's mask is one the decode kernel reads: none (or
    "causal", which hides nothing from the last row), or a decode lane's bool
    (batch or 1, 1, 1, keys) left padding."""
    if mask is None or isinstance(mask, str):
        return True
    return (mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[1] == 1
            and mask.shape[2] == 1)


def _graph_mask(mask: Any, heads: int, kv_heads: int, rows: int, keys: int) -> Any:
    """``mask`` as an mlx array broadcasting over the scores' (batch, kv heads, repeats,
    rows, keys) view, as :func:`mask_in_place` reads it (``None``: no mask)."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": the rows end where the keys end
        return mx.arange(keys)[None, :] <= mx.arange(keys - rows, keys)[:, None]
    if mask.ndim <= 2 or mask.shape[1] == 1:
        return mask if mask.ndim <= 2 else mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])


def kernel_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: Any, softmax: Callable[[mx.array], mx.array]) -> mx.array:
    """mlx's fallback attention as graph nodes, its softmax the CPU kernels' ``softmax``:
    the score matmul, the mask (a hidden score becomes the lowest float32) and the value
    matmul of mlx's fallback; nothing is evaluated. Each query head multiplies its own KV
    head's keys (a broadcast, no copy): in a default-model decode step at 16 rows that
    ran 1.1x as fast as stacking a KV head's query heads into one matmul."""
    batch, heads, rows, head_dim = queries.shape
    kv_heads, key_count = keys.shape[1], keys.shape[-2]
    scaled = (queries * scale).reshape(batch, kv_heads, heads // kv_heads, rows, head_dim)
    scores = scaled @ keys[:, :, None].swapaxes(-1, -2)
    hide = _graph_mask(mask, heads, kv_heads, rows, key_count)
    if hide is not None:
        if hide.dtype == mx.bool_:
            scores = mx.where(hide, scores, mx.array(_HIDDEN, dtype=mx.float32))
        else:
            scores = scores + hide.astype(mx.float32)
    output = softmax(scores) @ values[:, :, None]
    return output.reshape(batch, heads, rows, values.shape[-1])


def cpu_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                  scale: float, mask: Any, sinks: mx.array | None = None, *,
                  fallback: Callable[..., mx.array], cores: int | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` contract: the score and value matmuls in
    mlx, the mask and softmax in NumPy in place on the evaluated scores, where that pays
    (:func:`_taken`); every other call it supports in the graph with the CPU kernels'
    softmax (:func:`kernel_attention`) where they are built, and ``fallback`` (mlx-lm's
    function) the rest."""
    expand = getattr(keys, "expand", None)
    if expand is not None:
        # A decode lane's tiled KV (omlx_core/scheduling/kv_tiles.py): the kernel reads
        # the tiles as stored; anything else attends their float expansion.
        kernels = cpu_kernels.kernels()
        if (kernels is not None and queries.shape[2] == 1 and sinks is None
                and queries.dtype == mx.float32 and mx.default_device().type == mx.cpu
                and (mask is None or isinstance(mask, mx.array) and _row_mask(mask))):
            tiles, window_keys, window_values = keys.stored()
            if mask is None:  # a request's own rows: every position is read
                mask = mx.ones((1, 1, 1, tiles[0].shape[2] + window_keys.shape[2]), dtype=mx.bool_)
            return kernels.tiled_decode_attention(queries, tiles, window_keys, window_values, mask,
                                                  scale, keys.group_size, keys.bits)
        keys, values = expand()
    if _quantized_on_cpu(queries, keys, cache):
        # mlx's quantized attention on the CPU backend runs its quantized matmuls one
        # scalar at a time (8 decode streams over 8-bit KV: 0.45x the float32 rate).
        kernels = cpu_kernels.kernels()
        if (kernels is not None and queries.shape[2] == 1 and sinks is None
                and _row_mask(mask) and keys[1].dtype == values[1].dtype == mx.float32
                and cache.bits in (4, 8) and cache.group_size <= 256
                and queries.shape[-1] % cache.group_size == 0):
            # A decode step: the kernel expands 256 key or value rows at a time.
            return kernels.quantized_decode_attention(
                queries, *keys, *values, mask if isinstance(mask, mx.array) else None, scale,
                cache.group_size, cache.bits)
        # Anything else (prefill chunks, verify steps): one layer's keys and values are
        # expanded, used, and let go: a transient of one layer's float32 KV (the
        # estimate counts it: ``dequantized_kv``).
        keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
        values = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
        cache = None
    supported = _supported(queries, keys, values, cache, mask, sinks)
    batch, heads, rows, head_dim = queries.shape
    if not (supported and route_takes(batch, heads, rows, keys.shape[-2])):
        kernels = cpu_kernels.kernels() if supported else None
        if kernels is not None and rows == 1 and _row_mask(mask):
            # A decode step: scores, mask, softmax and values in one pass per head.
            return kernels.decode_attention(queries, keys, values,
                                            mask if isinstance(mask, mx.array) else None, scale)
        if kernels is not None:
            return kernel_attention(queries, keys, values, scale, mask, kernels.softmax)
        return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    kv_heads, key_count = keys.shape[1], keys.shape[-2]
    repeats = heads // kv_heads
    # The grouped heads as mlx's fallback arranges them: head h reads KV head h // repeats.
    scaled = (queries * scale).reshape(batch, kv_heads, repeats * rows, head_dim)
    scores = scaled @ keys.swapaxes(-1, -2)
    if isinstance(mask, mx.array):
        mx.eval(scores, mask)
    else:
        mx.eval(scores)
    # A writable view of the buffer mlx just wrote: nothing else refers to it yet. (A
    # matmul's output is row-contiguous; were it not, the work would go to a copy.)
    raw = np.array(scores, copy=False)
    in_place = raw.flags.c_contiguous
    view = (raw if in_place else np.ascontiguousarray(raw)).reshape(
        batch, kv_heads, repeats, rows, key_count)
    mask_in_place(view, mask if isinstance(mask, str) or mask is None
                     else _mask_view(mask, heads, kv_heads))
    softmax_in_place(view, cores)
    probabilities = scores if in_place else mx.array(view.reshape(raw.shape))
    del raw, view
    output = probabilities @ values
    return output.reshape(batch, heads, rows, values.shape[-1])


def family_modules(model: Any, name: str, original: Any, mark: str) -> list[Any]:
    """The Python modules of ``model``'s layers whose global ``name`` is mlx-lm's
    ``original`` function or a route marked with ``mark``: where a route is installed."""
    # The module that defines ``original`` is never a family: gpt-oss's SwigluOAI layer
    # lives in mlx-lm's activations module, and routing its own ``swiglu`` there would
    # make the route every later install takes for mlx-lm's original.
    found = {}
    for _, layer in model.named_modules():
        module = sys.modules.get(type(layer).__module__)
        if module is None or module.__name__ in found or module.__name__ == original.__module__:
            continue
        current = getattr(module, name, None)
        if current is original or getattr(current, mark, False):
            found[module.__name__] = module
    return list(found.values())


def install_route(model: Any, name: str, original: Any, route: Callable[..., Any],
                  mark: str) -> list[str]:
    """Put ``route`` (marked with ``mark``) in place of mlx-lm's ``original`` under the
    global ``name`` of ``model``'s family modules; the names of the modules now routed
    (installing twice changes nothing; a model with recurrent layers is left to mlx-lm:
    ``[]``)."""
    if not attention_caches_only(model):
        return []
    setattr(route, mark, True)
    installed = []
    for module in family_modules(model, name, original, mark):
        if not getattr(getattr(module, name), mark, False):
            setattr(module, name, route)
        installed.append(module.__name__)
    return installed


def attention_caches_only(model: Any) -> bool:
    """Whether every layer of ``model`` caches keys and values (no recurrent state): the
    models whose prefill peak the route leaves as the memory estimate counts it. (In a
    hybrid model the evaluations mid-forward change which recurrent intermediates are
    alive together.)"""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    try:
        caches = make_prompt_cache(model)
    except Exception:  # a model mlx-lm cannot make a cache for: leave it alone
        return False
    return all(type(cache) in (KVCache, RotatingKVCache) for cache in caches)


def install_cpu_attention(model: Any) -> list[str]:
    """Route ``model``'s attention through :func:`cpu_attention`; the names of the
    model-family modules now doing so (installing twice changes nothing; a model with
    recurrent layers is left to mlx-lm: ``[]``).

    The name is a module global of each mlx-lm model family, so every model of the family
    in this process takes the route; it is the same attention, and off the CPU backend
    (or for a call it does not take) the route is mlx-lm's own function.
    """
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return rotated_attention(partial(cpu_attention, fallback=original), queries, keys, values,
                                 cache, scale, mask, sinks)

    installed = install_route(model, "scaled_dot_product_attention", original,
                              scaled_dot_product_attention, _INSTALLED_MARK)
    if installed and mx.default_device().type == mx.cpu:
        cpu_kernels.kernels()  # built (once) or loaded now, at load: never inside a forward
        if available_cores() > 1:
            _workers()
    return installed


def install_kv_rotation(model: Any) -> list[str]:
    """Make mlx-lm's ``scaled_dot_product_attention`` read a quantized KV cache stored
    rotated (:func:`~omlx_core.models.kv_rotation.rotated_attention`) in the family
    modules of ``model`` that :func:`install_cpu_attention` leaves to mlx-lm (models with
    recurrent layers); it is mlx-lm's function otherwise, on every device. The names of
    the modules doing so (installing twice changes nothing; where the CPU route is in
    place, it reads rotated caches itself: ``[]``)."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention

    def expanded(queries, keys, values, cache, scale, mask, sinks=None):
        if hasattr(keys, "expand"):  # a decode lane's tiled KV: its float expansion
            keys, values = keys.expand()
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return rotated_attention(expanded, queries, keys, values, cache, scale, mask, sinks)

    setattr(scaled_dot_product_attention, _ROTATION_MARK, True)
    installed = []
    for module in family_modules(model, "scaled_dot_product_attention", original, _ROTATION_MARK):
        if not getattr(module.scaled_dot_product_attention, _ROTATION_MARK, False):
            module.scaled_dot_product_attention = scaled_dot_product_attention
        installed.append(module.__name__)
    return installed
