"""The MLP's SwiGLU for prefill chunks and speculative steps on the CPU backend, with the
exponential on vector units.

mlx-lm's ``swiglu(gate, x)`` is ``silu(gate) * x``; on the CPU backend the sigmoid's
``exp`` is a scalar loop (mlx's CPU ``simd`` width is 1 off Apple silicon), so over the
default model's 30 layers a 256-token prefill chunk spends ~200 ms in it.
:func:`cpu_swiglu` evaluates the gate and up projections and computes
``gate * (1 / (1 + exp(-gate))) * x`` with NumPy, whose float32 ``exp`` is vectorized,
**in place** in the gate's buffer (a writable view of what the gate projection just
wrote, as mlx's compiled SwiGLU writes into it too), a block of rows at a time so that
its one temporary stays under :data:`BLOCK_ELEMENTS` floats: 27-41 ms instead of ~200
ms for the chunk, whose whole forward runs 1.22-1.27x as fast.

:func:`install_cpu_swiglu` puts it in place of ``swiglu`` in the modules of a loaded
model's layers (the models :mod:`~omlx_core.models.attention`'s route is installed for:
every layer caches keys and values). It dispatches per call. Calls of one position per
sequence (plain decode steps, which evaluating mid-forward would cost their overlap with
the next step's graph) and calls under :data:`MIN_ELEMENTS` go, in float32 on the CPU
backend, to the SwiGLU primitive of :mod:`~omlx_core.models.cpu_kernels` (vectorized, in
the graph), or to mlx-lm's function where those kernels are not built; non-float32
activations and every GPU stream go to mlx-lm's function unchanged. The exponentials
differ from mlx's in the last bits at most, so greedy outputs are unchanged
(``tests/test_models_mlp_route.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import numpy as np

from omlx_core.models import cpu_kernels

__all__ = ["BLOCK_ELEMENTS", "MIN_ELEMENTS", "cpu_swiglu", "install_cpu_swiglu", "swiglu_in_place"]

#: Fewest gate elements (batch x positions x intermediate) of a call the route takes: a
#: prefill chunk of 86 tokens of the default model. Smaller calls pay too (a verify step
#: of 8 rows x 5 positions: 1.17x; one row x 7: 1.20x), but evaluating mid-forward
#: changes which intermediates are alive together: taken from 2^12 elements, a tiny
#: VLM's prefill estimate came out past its 1.15x bound over the measured peak.
MIN_ELEMENTS = 1 << 17

#: Most elements of the one NumPy temporary (a block of the gate's rows): 256 KiB.
BLOCK_ELEMENTS = 1 << 16

_INSTALLED_MARK = "_omlx_cpu_swiglu"


def swiglu_in_place(gate: np.ndarray, up: np.ndarray) -> None:
    """``gate = silu(gate) * up`` for 2-D C-contiguous float32 arrays, in place, a block of
    rows at a time."""
    rows, width = gate.shape
    step = max(1, BLOCK_ELEMENTS // max(width, 1))
    scratch = np.empty((min(step, rows), width), dtype=np.float32)
    for start in range(0, rows, step):
        block, other = gate[start:start + step], up[start:start + step]
        temp = scratch[:block.shape[0]]
        np.negative(block, out=temp)
        np.exp(temp, out=temp)
        temp += 1.0
        np.reciprocal(temp, out=temp)
        block *= temp
        block *= other


def _supported(gate: mx.array, up: mx.array) -> bool:
    """Whether the route or the CPU kernels can compute this call, whatever its size."""
    return (mx.default_device().type == mx.cpu
            and gate.dtype == up.dtype == mx.float32 and gate.shape == up.shape)


def _large(gate: mx.array) -> bool:
    """Whether a call is one the NumPy route takes (several positions per sequence, at
    least :data:`MIN_ELEMENTS`)."""
    return gate.ndim >= 2 and gate.shape[-2] > 1 and gate.size >= MIN_ELEMENTS


def cpu_swiglu(gate: mx.array, up: mx.array, *, fallback: Callable[..., mx.array]) -> mx.array:
    """mlx-lm's ``swiglu`` contract, computed in NumPy in place in ``gate``'s buffer where
    that pays (:func:`_large`); every other float32 call on the CPU backend goes to the CPU
    kernels' ``swiglu`` in the graph where they are built, and the rest to ``fallback``
    (mlx-lm's function)."""
    supported = _supported(gate, up)
    if not (supported and _large(gate)):
        kernels = cpu_kernels.kernels() if supported else None
        if kernels is not None:
            return kernels.swiglu(gate, up)
        return fallback(gate, up)
    mx.eval(gate, up)
    raw = np.array(gate, copy=False)
    other = np.array(up, copy=False)
    if not (raw.flags.c_contiguous and raw.flags.writeable and other.flags.c_contiguous):
        return fallback(gate, up)
    swiglu_in_place(raw.reshape(-1, raw.shape[-1]), other.reshape(-1, other.shape[-1]))
    del raw, other
    return gate


def install_cpu_swiglu(model: Any) -> list[str]:
    """Route ``model``'s SwiGLU through :func:`cpu_swiglu`; the names of the model-family
    modules now doing so (installing twice changes nothing; a model with recurrent
    layers is left to mlx-lm: ``[]``)."""
    from mlx_lm.models import activations

    from omlx_core.models.attention import install_route

    original = activations.swiglu

    def swiglu(gate, x):
        return cpu_swiglu(gate, x, fallback=original)

    return install_route(model, "swiglu", original, swiglu, _INSTALLED_MARK)
