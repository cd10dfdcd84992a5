"""The BERT forward's work outside its matmuls on the CPU's vector units: the exact
(erf) GELU, the layer norms (with the residual add before them) and the attention.

On the CPU backend mlx computes ``erf`` and ``exp`` in scalar loops and composes
``layer_norm`` of several elementwise passes (its CPU ``simd`` width is 1 off Apple
silicon); a BERT layer on short texts is also a dozen small ops a layer (head
transposes, a mask, the scores, softmax and weighted values of tiny per-head
matrices). Where omlx-core's CPU kernels are built (:mod:`omlx_core.models.cpu_kernels`)
each of these is one vectorized primitive, split over the cores, inside the graph
(nothing is evaluated mid-forward):

- :func:`gelu`: ``0.5 x (1 + erf(x / sqrt 2))``, erf by Abramowitz and Stegun's formula
  7.1.26 (absolute error under 1.5e-7: float32's own rounding);
- :func:`layer_norm`: ``LayerNorm(x + residual)`` in one pass over each row;
- packed rows (:class:`PackedRows`): a forward of short rows (up to
  :data:`KERNEL_MAX_WIDTH` tokens) runs with its rows one after another on one token
  axis, no padding (random 6-14-token texts padded to their longest are ~1.45x the
  tokens), and the kernels' packed attention reads queries, keys and values in place
  from the layer's one fused projection, computes each token's scores over its own
  row's keys, the softmax and the weighted values in one pass, and writes the heads
  side by side as the output projection reads them. Longer rows are padded
  (:class:`PaddedRows`): there two BLAS matmuls per (row, head) beat the kernel's dot
  products, through :func:`omlx_core.models.attention.cpu_attention`.

Without the kernels (no C++ compiler) the GELU of a large call runs in NumPy in place
in its buffer (:func:`gelu_in_place`, the same formula, evaluating mid-forward), the
rest as mlx's ops. Other dtypes and GPU streams keep mlx's ops.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx_core.models import cpu_kernels
from omlx_core.models.attention import cpu_attention as omlx_cpu_attention

#: Fewest elements a GELU call must have for the NumPy route (without the kernels:
#: evaluating mid-forward costs a sync a layer, less than mlx's scalar erf from here on)
MIN_ELEMENTS = 1 << 12
#: Most elements of each NumPy temporary (a block of the activation's rows)
BLOCK_ELEMENTS = 1 << 16
#: Longest forward (padded positions) the kernels' attention takes
KERNEL_MAX_WIDTH = 64

# Abramowitz and Stegun 7.1.26
_P = 0.3275911
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def vector_kernels(x: mx.array) -> ModuleType | None:
    """The CPU kernels when ``x`` is float32 on the CPU backend and they are built."""
    if x.dtype != mx.float32 or mx.default_device().type != mx.cpu:
        return None
    return cpu_kernels.kernels()


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


def numpy_gelu(x: mx.array, fallback: Callable[[mx.array], mx.array]) -> mx.array:
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


def gelu(x: mx.array) -> mx.array:
    """The exact GELU of ``x`` (see the module docstring for the route)."""
    kernels = vector_kernels(x)
    if kernels is not None:
        return kernels.gelu(x)
    return numpy_gelu(x, nn.gelu)


def layer_norm(norm: nn.LayerNorm, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """``norm(x + residual)`` (``norm(x)`` without a residual)."""
    kernels = vector_kernels(x)
    if (kernels is None or "weight" not in norm or "bias" not in norm
            or norm.weight.dtype != mx.float32 or norm.bias.dtype != mx.float32):
        return norm(x if residual is None else x + residual)
    return kernels.layer_norm(x, residual, norm.weight, norm.bias, norm.eps)


def _fallback(queries: mx.array, keys: mx.array, values: mx.array, cache: object = None,
              scale: float = 1.0, mask: object = None, sinks: object = None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class PaddedRows:
    """A forward's rows right-padded to one width: row ``i`` holds ``lengths[i]`` real
    tokens, and the attention hides the rest with an additive mask (made once)."""

    def __init__(self, lengths: mx.array, width: int, dtype: mx.Dtype):
        self.lengths, self.width, self.dtype = lengths, width, dtype
        self._mask: mx.array | None = None

    def mask(self) -> mx.array:
        """The additive mask ``(batch, 1, 1, width)`` that hides each row's padding keys."""
        if self._mask is None:
            keep = mx.arange(self.width)[None, :] < self.lengths[:, None]
            hidden = mx.array(-1e9 if self.dtype == mx.float32 else -3e4, dtype=self.dtype)
            self._mask = mx.where(keep, mx.array(0, dtype=self.dtype), hidden)[:, None, None, :]
        return self._mask

    def attend(self, qkv: mx.array, heads: int, scale: float) -> mx.array:
        """Attention from the fused projection ``qkv`` ``(batch, width, 3 x hidden)``:
        ``(batch, width, hidden)``, through omlx-core's CPU attention route."""
        batch, width, triple = qkv.shape
        hidden = triple // 3
        split = qkv.reshape(batch, width, 3, heads, hidden // heads).transpose(2, 0, 3, 1, 4)
        out = omlx_cpu_attention(split[0], split[1], split[2], None, scale, self.mask(),
                                 fallback=_fallback)
        return out.transpose(0, 2, 1, 3).reshape(batch, width, hidden)


class PackedRows:
    """A forward's rows packed one after another along one token axis, no padding: row
    ``i`` at tokens ``offsets[i]:offsets[i + 1]``. Only the kernels' attention reads
    this layout (:func:`packs`)."""

    def __init__(self, offsets: mx.array, kernels: ModuleType):
        self.offsets, self.kernels = offsets, kernels

    def attend(self, qkv: mx.array, heads: int, scale: float) -> mx.array:
        """Attention from the fused projection ``qkv`` ``(1, tokens, 3 x hidden)``, each
        token over its own row's: ``(1, tokens, hidden)``."""
        return self.kernels.packed_attention(qkv, self.offsets, heads, scale)


def packs(longest: int, dtype: mx.Dtype) -> ModuleType | None:
    """The kernels, when a forward whose longest row is ``longest`` tokens runs packed
    (float32 on the CPU backend, the kernels built, rows up to :data:`KERNEL_MAX_WIDTH`)."""
    if longest > KERNEL_MAX_WIDTH or dtype != mx.float32 or mx.default_device().type != mx.cpu:
        return None
    return cpu_kernels.kernels()


__all__ = ["BLOCK_ELEMENTS", "KERNEL_MAX_WIDTH", "MIN_ELEMENTS", "PackedRows", "PaddedRows",
           "gelu", "gelu_in_place", "layer_norm", "numpy_gelu", "packs", "vector_kernels"]
