"""A loaded model's RMS norms and rotary embeddings on the CPU kernels.

On the CPU backend ``mx.fast.rms_norm`` and ``mx.fast.rope`` are compositions of mlx's
elementwise ops (a norm ~6 of them, a rotation ~20: positions, inverse frequencies,
``exp``, ``cos``, ``sin``, the products, a concatenate), and a decode step of the
default model runs 60 of each: on one row they were 14 ms of a 60 ms step, almost all
of it dispatching tiny ops. :mod:`~omlx_core.models.cpu_kernels` has each as one
primitive computing mlx's arithmetic bit for bit (its ``sin``, ``cos`` and ``rsqrt``,
the same order of operations; ``tests/test_models_cpu_kernels.py`` compares them).

:func:`install_cpu_layer_kernels` swaps every ``nn.RMSNorm`` and ``nn.RoPE`` instance of
a model (exactly those classes: a family's own norm or a scaled rotary embedding is left
alone) for a subclass that calls the kernel for a decode step's float32 arrays (one
position per sequence) on the CPU backend, and mlx's op otherwise: same parameters,
same results. Prefill chunks keep mlx's ops: there the dispatch is spread over many
positions, and the order mlx evaluates a chunk's graph in, which its peak memory depends
on (the estimate is measured against it), stays as it was (with the kernels in a
2,048-token prefill of a tiny llama, another score matrix was alive at the peak).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from omlx_core.models import cpu_kernels

__all__ = ["KernelRMSNorm", "KernelRoPE", "install_cpu_layer_kernels", "layer_places"]


def _decode_step(x: mx.array, positions_axis: int) -> Any:
    """The kernels, when ``x`` is a float32 array of one position per sequence (its
    ``positions_axis`` is 1 long) the CPU backend computes; else ``None``."""
    if (x.dtype != mx.float32 or x.ndim <= positions_axis or x.shape[positions_axis] != 1
            or mx.default_device().type != mx.cpu):
        return None
    return cpu_kernels.kernels()


class KernelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by the CPU kernels where they apply (see the module)."""

    def __call__(self, x: mx.array) -> mx.array:
        # (batch, positions, ...): the hidden states, or a family's per-head q/k norms.
        kernels = _decode_step(x, 1)
        if kernels is None or self.weight.dtype != mx.float32:
            return super().__call__(x)
        return kernels.rms_norm(x, self.weight, self.eps)


class KernelRoPE(nn.RoPE):
    """``nn.RoPE`` computed by the CPU kernels where they apply (see the module); the
    inverse frequencies are mlx's own ops' (``exp`` of the scaled range), made once."""

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000,
                 scale: float = 1.0) -> None:
        super().__init__(dims, traditional=traditional, base=base, scale=scale)
        half = dims // 2
        self._inverse_frequencies = mx.exp(
            mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
        mx.eval(self._inverse_frequencies)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        kernels = _decode_step(x, 2) if x.ndim == 4 else None  # (batch, heads, positions, dim)
        if kernels is None:
            return super().__call__(x, offset)
        offsets = (offset.astype(mx.int32) if isinstance(offset, mx.array)
                   else mx.array(int(offset), dtype=mx.int32))
        return kernels.rope(x, offsets, self._inverse_frequencies, self.dims,
                            self.traditional, self.scale)


def _replacement(module: nn.RMSNorm | nn.RoPE) -> nn.Module:
    if type(module) is nn.RMSNorm:
        norm = KernelRMSNorm(module.weight.shape[0], eps=module.eps)
        norm.weight = module.weight
        return norm
    return KernelRoPE(module.dims, traditional=module.traditional, base=module.base,
                      scale=module.scale)


def layer_places(model: nn.Module, wanted: Callable[[Any], bool]) -> list[tuple[Any, Any]]:
    """``(container, key)`` of every module of ``model`` that ``wanted`` picks: a module's
    child, or an item of a module's list of layers (``container[key] = ...`` swaps it).
    Found before anything is swapped, and the list of every module let go on return."""
    places: list[tuple[Any, Any]] = []
    for _, parent in model.named_modules():
        for name, child in parent.items():
            if isinstance(child, list):
                places += [(child, index) for index, item in enumerate(child) if wanted(item)]
            elif wanted(child):
                places.append((parent, name))
    return places


def install_cpu_layer_kernels(model: nn.Module) -> int:
    """Swap ``model``'s ``nn.RMSNorm`` and ``nn.RoPE`` instances for the kernel-backed
    ones (on the CPU backend only, where the kernels are built); how many were swapped."""
    if mx.default_device().type != mx.cpu or cpu_kernels.kernels() is None:
        return 0
    places = layer_places(model, lambda module: type(module) in (nn.RMSNorm, nn.RoPE))
    for container, key in places:
        container[key] = _replacement(container[key])
    return len(places)
