"""A loaded model's float32 linear layers on the CPU kernels' packed product.

On the CPU backend mlx computes ``x @ w.T`` with the BLAS, which copies the weight into
its own panel layout on every call. For the few rows of a decode step that copy is most
of the product: a 16-row decode step of the default model spent ~60 ms in its linear
layers, half of it in OpenBLAS's packing, on a machine that streams all of the model's
weights in 17 ms. :func:`install_packed_linears` stores each float32 ``nn.Linear``'s
weight packed once, in the kernel's panels (:class:`PackedLinear`), and every product of
the layer (a decode step's, a prefill chunk's, a verify step's) is the kernel's
``packed_matmul``: same bytes held, the weight read once per product, front to back.

Numbers: every output is one chain of fused multiply-adds over the inputs in order, so a
row's result does not depend on the rows it is batched with (which BLAS does not promise)
and differs from BLAS's in rounding only (``tests/test_models_packed_linear.py``).

Which layers: exactly ``nn.Linear`` (a quantized or a family's own projection is left
alone) whose weight is float32 with a multiple of 16 outputs (panels of 48, 32 or 16
outputs, the widest that divides them), and exactly
``nn.Embedding`` likewise (a tied output head is its ``as_linear``: :class:`PackedEmbedding`
reads a token's row out of its panel), on the CPU backend where the kernels are built
and the CPU has AVX2 and FMA or AVX-512. ``OMLX_PACKED_LINEAR=0`` keeps mlx's product
(A/B measurements).

Sibling layers a block calls on one input (:data:`SIBLINGS`: attention's q/k/v, the
MLP's gate/up, as mlx-lm's llama-family blocks name them) are packed as one weight and
multiplied in one call (``packed_matmul_split``), each layer handed its own output: a
decode step of the default model makes 120 products instead of 210, and a product's
fixed cost (its helpers' hand-off, the last chunk's wait) is paid per call. Each
layer's ``packed`` is its own panels, a view of the shared weight (the bytes counted
once). A layer called with an input its siblings were not called with gets its own
product of that input: right, only not shared. ``OMLX_PACKED_SIBLINGS=0`` packs each
layer alone (A/B measurements).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn

from omlx_core.memory.usage import FreedHeap, trim_heap
from omlx_core.models import cpu_kernels
from omlx_core.models.layer_kernels import layer_places

__all__ = ["PackedEmbedding", "PackedLinear", "SIBLINGS", "install_packed_linears", "pack_weight",
           "packed_bits", "packing_bytes", "panel_width"]

#: outputs per panel the kernel takes, widest first (a weight takes the widest that
#: divides its outputs)
PANELS = (48, 32, 16)
OFF_ENV = "OMLX_PACKED_LINEAR"
#: ``OMLX_PACKED_SIBLINGS=0`` packs each sibling layer alone (A/B measurements)
SIBLINGS_ENV = "OMLX_PACKED_SIBLINGS"
#: names of sibling layers a block calls on one input, packed as one weight (see the module)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def packed_bits() -> int:
    """The vector width the packed product runs at here (512 or 256), or 0 where it does
    not run (off the CPU backend, kernels not built, a CPU without AVX2 and FMA, or turned
    off by ``OMLX_PACKED_LINEAR=0``)."""
    if os.environ.get(OFF_ENV, "1") == "0" or mx.default_device().type != mx.cpu:
        return 0
    kernels = cpu_kernels.kernels()
    if kernels is None or not hasattr(kernels, "packed_matmul"):
        return 0
    return int(kernels.packed_matmul_bits())


def panel_width(outputs: int) -> int | None:
    """The panel width for a weight of ``outputs`` rows: the widest of :data:`PANELS` that
    divides it, or ``None``."""
    return next((width for width in PANELS if outputs % width == 0), None)


def pack_weight(weight: mx.array) -> mx.array:
    """``weight`` (N outputs x K inputs; :func:`panel_width` of N is W) as the kernel's
    panels (N / W, K, W): panel ``p``, row ``k`` holds ``weight[W p : W p + W, k]``."""
    outputs, inputs = weight.shape
    width = panel_width(outputs)
    return mx.contiguous(weight.reshape(outputs // width, width, inputs).swapaxes(1, 2))


def _product(x: mx.array, packed: mx.array, bits: int) -> mx.array:
    return cpu_kernels.kernels().packed_matmul(x.astype(mx.float32), packed, bits)


def _rows(packed: mx.array, indices: mx.array) -> mx.array:
    """Rows ``indices`` of the weight ``packed`` holds, read out of their panels."""
    width = packed.shape[2]
    return packed[indices // width, :, indices % width]


class _SharedProduct:
    """Sibling layers' weights packed as one (their panels one after another): the product
    is made once for an input, and each sibling called with that same input (the same
    array object) is handed its own output. Per thread: two forwards at once never see
    each other's outputs."""

    def __init__(self, packed: mx.array, splits: list[int], bits: int) -> None:
        self.packed, self.splits, self.bits = packed, splits, bits
        self._held = threading.local()

    def output(self, index: int, x: mx.array) -> mx.array:
        held = getattr(self._held, "value", None)
        if held is None or held[0] is not x or held[1][index] is None:
            outputs = cpu_kernels.kernels().packed_matmul_split(
                x.astype(mx.float32), self.packed, self.bits, self.splits)
            held = (x, list(outputs))
        output, held[1][index] = held[1][index], None
        # let go of the input and the outputs once every sibling has taken its own
        self._held.value = held if any(out is not None for out in held[1]) else None
        return output


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is held packed (:func:`pack_weight`) and multiplied by
    the kernel's ``packed_matmul``: alone, or as one of siblings (``shared``, its index)
    whose weights are packed as one, ``packed`` its own panels of it."""

    def __init__(self, linear: nn.Linear, bits: int, *, packed: mx.array | None = None,
                 shared: _SharedProduct | None = None, index: int = 0) -> None:
        super().__init__()
        outputs, inputs = linear.weight.shape
        self.packed = pack_weight(linear.weight) if packed is None else packed
        if "bias" in linear:
            self.bias = linear.bias
        self.input_dims, self.output_dims = inputs, outputs
        self._bits = bits
        self._shared, self._index = shared, index

    def _extra_repr(self) -> str:
        return f"input_dims={self.input_dims}, output_dims={self.output_dims}, packed"

    def rows(self, outputs: mx.array) -> mx.array:
        """The weight's rows of ``outputs`` (output indices): ``weight[outputs]`` as the
        unpacked weight would give them (a reranker reads a head's rows of a few tokens)."""
        return _rows(self["packed"], outputs)

    def __call__(self, x: mx.array) -> mx.array:
        if self._shared is not None:
            y = self._shared.output(self._index, x)
        else:
            y = _product(x, self["packed"], self._bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


class PackedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table is held packed (:func:`pack_weight`): a token's row
    is read out of its panel, and ``as_linear`` (a tied output head) is the kernel's
    ``packed_matmul``."""

    def __init__(self, embedding: nn.Embedding, bits: int) -> None:
        super().__init__()
        self.packed = pack_weight(embedding.weight)
        self.num_embeddings, self.dims = embedding.weight.shape
        self._bits = bits

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, packed"

    @property
    def weight(self) -> mx.array:
        """The table unpacked, (num_embeddings, dims): lazy, so reading its shape costs
        nothing; evaluating it makes a copy of the whole table."""
        return self["packed"].swapaxes(1, 2).reshape(self.num_embeddings, self.dims)

    def __call__(self, x: mx.array) -> mx.array:
        return _rows(self["packed"], x)

    def as_linear(self, x: mx.array) -> mx.array:
        return _product(x, self["packed"], self._bits)


def _packed_kind(module: Any) -> type | None:
    """The packed class ``module`` is swapped for, or ``None`` where it stays (see the
    module)."""
    kind = {nn.Linear: PackedLinear, nn.Embedding: PackedEmbedding}.get(type(module))
    if (kind is None or module.weight.dtype != mx.float32
            or panel_width(module.weight.shape[0]) is None):
        return None
    return kind


def _sibling_key(name: str) -> tuple[str, int] | None:
    """``(parent, set)`` for a weight named as a :data:`SIBLINGS` layer's
    (``model.layers.0.self_attn.k_proj.weight``), or ``None``."""
    parent, _, rest = name.rpartition(".")
    parent, _, layer = parent.rpartition(".")
    found = next((i for i, names in enumerate(SIBLINGS) if layer in names), None)
    return None if rest != "weight" or found is None else (parent, found)


def packing_bytes(tensors: Iterable[tuple[str, Sequence[int], str]]) -> int:
    """What packing a model's weights holds beyond them at load, from its tensors' names,
    shapes and safetensors dtypes: the largest float32 matrix whose rows fit a panel
    (packed one at a time, each held twice while it is copied), or twice a set of
    siblings' (:data:`SIBLINGS`, each packed, then the packed ones joined), whichever is
    more; 0 where nothing is packed here."""
    if packed_bits() == 0:
        return 0
    largest, siblings = 0, {}
    for name, shape, dtype in tensors:
        if dtype != "F32" or len(shape) != 2 or panel_width(shape[0]) is None:
            continue
        size = math.prod(shape) * 4
        largest = max(largest, size)
        key = _sibling_key(name)
        if key is not None:
            siblings[key] = siblings.get(key, 0) + size
    return max([largest] + [2 * size for size in siblings.values()])


def _sibling_groups(places: list[tuple[Any, Any]]) -> list[list[tuple[Any, Any]]]:
    """The places that are a whole set of :data:`SIBLINGS` in one module, packable as
    one: all ``nn.Linear`` with the same inputs and panel width (and all with a bias or
    none)."""
    groups = []
    for names in SIBLINGS:
        by_parent: dict[int, list[tuple[Any, Any]]] = {}
        for container, key in places:
            if isinstance(container, nn.Module) and key in names:
                by_parent.setdefault(id(container), []).append((container, key))
        for found in by_parent.values():
            layers = [container[key] for container, key in found]
            if (len(found) == len(names) and all(type(layer) is nn.Linear for layer in layers)
                    and len({(layer.weight.shape[1], panel_width(layer.weight.shape[0]),
                              "bias" in layer) for layer in layers}) == 1):
                groups.append(sorted(found, key=lambda place: names.index(place[1])))
    return groups


def _install_siblings(group: list[tuple[Any, Any]], bits: int) -> int:
    """Swap a set of siblings for packed ones sharing one weight; the bytes let go."""
    layers = [container[key] for container, key in group]
    panels = [pack_weight(layer.weight) for layer in layers]
    splits = [part.shape[0] for part in panels]
    packed = mx.concatenate(panels, axis=0)
    mx.eval(packed)
    del panels
    shared = _SharedProduct(packed, splits, bits)
    start = 0
    for index, ((container, key), layer) in enumerate(zip(group, layers)):
        container[key] = PackedLinear(layer, bits, packed=packed[start:start + splits[index]],
                                      shared=shared, index=index)
        start += splits[index]
        mx.eval(container[key].parameters())
    return sum(layer.weight.nbytes for layer in layers)


def install_packed_linears(model: nn.Module) -> int:
    """Swap ``model``'s packable ``nn.Linear`` and ``nn.Embedding`` layers (see the module)
    for :class:`PackedLinear` and :class:`PackedEmbedding`, sibling layers packed as one;
    how many were swapped. Each weight (a set of siblings: theirs) is packed and
    evaluated, and its old buffer let go, before the next: the load holds one weight
    twice, or a set of siblings' three times, at most (:func:`packing_bytes`). (The places
    are found first, and the list of every module let go
    (:func:`~.layer_kernels.layer_places`): while it lived it held every old weight, and
    the default model's load peaked at twice its weights.)"""
    bits = packed_bits()
    if bits == 0:
        return 0
    places = layer_places(model, lambda module: _packed_kind(module) is not None)
    groups = _sibling_groups(places) if os.environ.get(SIBLINGS_ENV, "1") != "0" else []
    in_groups = {(id(container), key) for group in groups for container, key in group}
    heap = FreedHeap()
    for group in groups:
        freed = _install_siblings(group, bits)
        # A set's packed weight is not the size of any old one, so mlx's buffer cache
        # cannot hand the old ones out again: let them go as they are freed, and trim
        # the heap's pages (buffers under the mmap threshold). Kept to the end, a second
        # load of the default model peaked at 990 MB RSS against 786 MB.
        mx.clear_cache()
        heap.freed([freed])
    for container, key in places:
        if (id(container), key) not in in_groups:
            container[key] = _packed_kind(container[key])(container[key], bits)
            mx.eval(container[key].parameters())
    mx.clear_cache()  # the unpacked weights' buffers, back to the system
    trim_heap()
    return len(places)
