"""The BERT forward's exponentials on the CPU's vector units: the exact (erf) GELU in
NumPy, and attention through omlx-core's CPU attention route.

On the CPU backend mlx computes ``erf`` and ``exp`` in scalar loops (its CPU ``simd``
width is 1 off Apple silicon): measured on all-MiniLM-L6-v2, the GELU of a forward of
32 short texts took 34 ms a layer against 6 ms for its matmul, and the attention's
softmax most of a 256-token forward. :func:`cpu_gelu` evaluates the intermediate
projection and computes ``0.5 x (1 + erf(x / sqrt 2))`` in place in its buffer with
NumPy's vectorized ``exp``, ``erf`` by Abramowitz and Stegun's formula 7.1.26 (absolute
error under 1.5e-7: float32's own rounding); :func:`cpu_attention` hands the attention
to :func:`omlx_core.models.attention.cpu_attention`, whose NumPy softmax (large calls)
or C++ kernel softmax (the others) is vectorized, masks and all. Calls under
:data:`MIN_ELEMENTS`, other dtypes and GPU streams keep mlx's own ops.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from omlx_core.models.attention import cpu_attention as omlx_cpu_attention

#: Fewest elements a GELU call must have for the NumPy route (evaluating mid-forward
#: costs a one-text forward a sync a layer, less than mlx's scalar erf from here on)
MIN_ELEMENTS = 1 << 12
#: Most elements of each NumPy temporary (a block of the activation's rows)
BLOCK_ELEMENTS = 1 << 16

# Abramowitz and Stegun 7.1.26
_P = 0.3275911
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def gelu_in_place(values: np.ndarray) -> None:
    """``values = 0.5 values (1 + erf(values / sqrt 2))`` for a C-contiguous float32
    array, in place, a block at a time."""
    flat = values.reshape(-1)
    scratch = np.empty((3, min(BLOCK_ELEMENTS, flat.size)), dtype=np.float32)
    for start in range(0, flat.size, BLOCK_ELEMENTS):
        block = flat[start:start + BLOCK_ELEMENTS]
        z, t, e = (row[:block.size] for row in scratch)
        np.abs(block, out=z)
        z *= 1 / math.sqrt(2)
        np.multiply(z, _P, out=t)
        t += 1
        np.reciprocal(t, out=t)
        np.multiply(z, z, out=e)
        np.negative(e, out=e)
        np.exp(e, out=e)
        np.multiply(t, _A[4], out=z)
        for coefficient in reversed(_A[:4]):
            z += coefficient
            z *= t
        z *= e  # 1 - erf(|x| / sqrt 2)
        np.copysign(z, block, out=z)  # erfc's sign follows x: erf = sign(x) - that
        np.sign(block, out=e)
        e -= z  # erf(x / sqrt 2)
        e += 1
        block *= e
        block *= 0.5


def cpu_gelu(x: mx.array, fallback: Callable[[mx.array], mx.array]) -> mx.array:
    """The exact GELU of ``x``, in NumPy in place where that pays, else ``fallback``."""
    if not (mx.default_device().type == mx.cpu and x.dtype == mx.float32
            and x.size >= MIN_ELEMENTS):
        return fallback(x)
    mx.eval(x)
    raw = np.array(x, copy=False)
    if not (raw.flags.c_contiguous and raw.flags.writeable):
        return fallback(x)
    gelu_in_place(raw)
    del raw
    return x


def _fallback(queries: mx.array, keys: mx.array, values: mx.array, cache: Any = None,
              scale: float = 1.0, mask: Any = None, sinks: Any = None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def cpu_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  mask: mx.array | None) -> mx.array:
    """Attention of ``(batch, heads, length, dim)`` arrays with an additive mask through
    omlx-core's CPU route (mlx's fused kernel or fallback where the route does not go)."""
    return omlx_cpu_attention(queries, keys, values, None, scale, mask, fallback=_fallback)


__all__ = ["BLOCK_ELEMENTS", "MIN_ELEMENTS", "cpu_attention", "cpu_gelu", "gelu_in_place"]
