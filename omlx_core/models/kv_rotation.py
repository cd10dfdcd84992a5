"""The rotation a quantized KV cache stores its keys and values under, and attention
over such a cache (:mod:`omlx_core.scheduling.kv_cache` says why).

A cache stored rotated has a ``rotation`` attribute: ``(R for its key head size, R for
its value head size)`` (``None`` for keys stored unrotated, per channel:
:mod:`~omlx_core.scheduling.kv_tiles`), each an orthonormal, symmetric Hadamard matrix
(:func:`kv_rotation`). :func:`rotated_attention` wraps any function with mlx-lm's
``scaled_dot_product_attention`` contract: queries rotated in, the output rotated back.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import mlx.core as mx

#: the widest Hadamard block a rotation uses (a head of 256 dims is two blocks of 128)
MAX_ROTATION_BLOCK = 128


def rotation_block(head_dim: int) -> int:
    """The Hadamard block size of a ``head_dim`` rotation: the largest power of two
    dividing it, at most :data:`MAX_ROTATION_BLOCK` (:func:`kv_rotation` and
    :func:`rotate` share it, so they are one rotation)."""
    return min(head_dim & -head_dim, MAX_ROTATION_BLOCK)


def kv_rotation(head_dim: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The orthonormal, symmetric ``head_dim x head_dim`` matrix quantized KV rows are
    rotated by: Sylvester Hadamard blocks of the largest power of two dividing
    ``head_dim`` (at most :data:`MAX_ROTATION_BLOCK`) on the diagonal, each scaled by
    ``1/sqrt(block)`` (a head of 96 dims: three blocks of 32)."""
    key = (head_dim, dtype)
    rotation = _ROTATIONS.get(key)
    if rotation is None:
        block = rotation_block(head_dim)
        hadamard = mx.array([[1.0]])
        while hadamard.shape[0] < block:
            hadamard = mx.concatenate([mx.concatenate([hadamard, hadamard], axis=1),
                                       mx.concatenate([hadamard, -hadamard], axis=1)], axis=0)
        hadamard = hadamard / math.sqrt(block)
        rotation = mx.zeros((head_dim, head_dim))
        for start in range(0, head_dim, block):
            rotation[start:start + block, start:start + block] = hadamard
        rotation = rotation.astype(dtype)
        mx.eval(rotation)
        _ROTATIONS[key] = rotation
    return rotation


_ROTATIONS: dict[tuple[int, mx.Dtype], mx.array] = {}


def rotate(x: mx.array) -> mx.array:
    """``x @ kv_rotation(d)`` (``d`` its last axis) as a Walsh-Hadamard butterfly per
    block, in float32, rounded once to ``x``'s dtype: each row's result depends on that
    row alone. A matmul's may not: OpenBLAS's Zen kernels round a row differently by how
    many rows are multiplied together (3 rows against each alone: up to 7e-7 apart), so a
    row fed in one chunk, token by token or in a lane would store other quantized codes.
    The rotation is symmetric and orthonormal: ``rotate(rotate(x))`` is ``x``."""
    dim = x.shape[-1]
    block = rotation_block(dim)
    blocks = x.astype(mx.float32).reshape(*x.shape[:-1], dim // block, block)
    return mx.hadamard_transform(blocks, scale=1.0 / math.sqrt(block)).reshape(x.shape).astype(x.dtype)


def rotated_attention(attend: Any, queries: mx.array, keys: Any, values: Any, cache: Any,
                      *args: Any, **kwargs: Any) -> mx.array:
    """``attend(queries, keys, values, cache, ...)`` (mlx-lm's attention contract) over a
    cache whose KV is stored rotated (its ``rotation`` attribute, see the module): the
    queries rotated in, the output rotated back. Any other cache: ``attend`` as is."""
    rotation = getattr(cache, "rotation", None)
    if rotation is None:
        return attend(queries, keys, values, cache, *args, **kwargs)
    _calls.count = rotated_calls() + 1
    key_rotation, value_rotation = rotation
    if key_rotation is not None:  # keys stored per channel are not rotated
        queries = queries @ key_rotation.astype(queries.dtype)
    output = attend(queries, keys, values, cache, *args, **kwargs)
    return output @ value_rotation.astype(output.dtype)


_calls = threading.local()


def rotated_calls() -> int:
    """How many attention calls over a rotated cache this thread has made: a forward over
    a model's quantized caches makes one per quantized layer, unless a layer computes its
    attention some other way (which would read rotated keys with unrotated queries)."""
    return getattr(_calls, "count", 0)


def stored_rotation(keys: Sequence[mx.array] | None, values: Sequence[mx.array] | None,
                    bits: int) -> tuple[mx.array, mx.array] | None:
    """The rotations of quantized ``keys`` and ``values`` triples (``(packed, scales,
    biases)``, stored rotated): ``(R for the key head size, R for the value head size)``,
    ``None`` while there are none."""
    if keys is None or values is None:
        return None
    return (kv_rotation(keys[0].shape[-1] * 32 // bits, keys[1].dtype),
            kv_rotation(values[0].shape[-1] * 32 // bits, values[1].dtype))


__all__ = ["MAX_ROTATION_BLOCK", "kv_rotation", "rotate", "rotated_attention", "rotated_calls", "rotation_block",
           "stored_rotation"]
