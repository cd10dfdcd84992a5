"""The KV cache formats a model is served with, and the decode batch's batch caches.

**Formats.** A :class:`KVFormat` is full precision (the model's activation dtype) or
quantized to ``bits`` (8 or 4) per element in groups of ``group_size`` elements, each
group with a scale and a bias in the activation dtype (mlx's affine quantization, as
mlx-lm's ``QuantizedKVCache`` stores it). Only plain attention layers (mlx-lm's
``KVCache``) are quantized; sliding-window (``RotatingKVCache``) and recurrent
(``ArraysCache``) layers keep full precision, since mlx-lm has no quantized form of
them: :func:`quantized_layers` says which are which, for ``/health``.

**Rotation.** Quantized keys and values are stored rotated: each head's key and value
rows are multiplied by an orthonormal Hadamard matrix ``R``
(:func:`~omlx_core.models.kv_rotation.kv_rotation`) before they are quantized. A key
row's few large channels otherwise set its group's scale, and 4 bits then leave the
other channels a handful of levels; rotated, every channel carries a share of them.
Attention is unchanged in exact arithmetic when the queries are rotated the same way and
the output rotated back (``R`` is symmetric and its own inverse: ``(qR)(kR)^T = qk^T``,
``softmax(.)(VR)R = softmax(.)V``), which is what
:func:`~omlx_core.models.kv_rotation.rotated_attention` does around any attention
function. On the default model's perplexity text 4-bit KV costs +16 % unrotated and
+5.6 % rotated, at the same bytes (BENCHMARKS.md). :class:`RotatedQuantizedKVCache` is a
request's cache in this format, :class:`BatchQuantizedKVCache` a decode lane's; the
``rotation`` attribute of both is ``(R for keys, R for values)``. This is the 8-bit
format.

**4 bits: keys per channel.** At 4 bits rotated rows still cost +5 % to +12 % on four
texts; keys quantized per channel over tiles of ``group_size`` tokens, values as above,
cost +0.9 % to +4.1 % served, at the same bytes (:mod:`~omlx_core.scheduling.kv_tiles`,
:class:`~omlx_core.scheduling.kv_tiles.TiledKVCache` and its lane form).

**Batch caches.** A decode lane holds its rows' caches merged, one batch cache per
layer, each row left-padded to the lane's longest (:func:`merge_layers`); mlx-lm's
cache classes merge themselves (``KVCache.merge`` gives a ``BatchKVCache``, and so on),
but mlx-lm has no batch form of ``QuantizedKVCache``: :class:`BatchQuantizedKVCache`
is it, with the same public methods (``update_and_fetch``, ``make_mask``, ``filter``,
``extend``, ``extract``, ``merge``, ``trim``, ``state``) and the ``bits`` and
``group_size`` attributes through which mlx-lm's attention takes its quantized path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from omlx_core.models.kv_rotation import rotate, rotated_calls, stored_rotation
from omlx_core.scheduling.kv_tiles import BatchTiledKVCache, TiledKVCache

#: the KV bits a model may be served with (``None``: full precision)
KV_BITS = (8, 4)
#: the quantization group sizes mlx supports
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVFormat:
    """How a model's attention KV is stored: full precision (``bits=None``) or
    quantized to ``bits`` in groups of ``group_size``."""

    bits: int | None = None
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} "
                             f"(or unset for full precision), got {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of "
                             f"{', '.join(map(str, KV_GROUP_SIZES))}, got {self.group_size}")

    @classmethod
    def from_settings(cls, bits: int, group_size: int) -> "KVFormat":
        """The format ``kv_bits``/``kv_group_size`` settings name (0 bits: unquantized)."""
        return cls(bits=int(bits) or None, group_size=int(group_size))

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def keys_per_channel(self) -> bool:
        """Whether keys are quantized per channel over tiles of ``group_size`` tokens
        (4 bits: :mod:`~omlx_core.scheduling.kv_tiles`) rather than per row."""
        return self.bits == 4

    def describe(self, dtype_name: str = "full precision") -> str:
        """``"8-bit (group 64, rotated)"``, ``"4-bit (keys per channel over 64-token
        tiles, values group 64, rotated)"``, or ``dtype_name`` for full precision."""
        if self.keys_per_channel:
            return (f"{self.bits}-bit (keys per channel over {self.group_size}-token tiles, "
                    f"values group {self.group_size}, rotated)")
        return f"{self.bits}-bit (group {self.group_size}, rotated)" if self.bits else dtype_name

    @property
    def tag(self) -> str:
        """What a stored block's key says of its format (``""``: full precision): blocks
        of another format, or of this one before the rotation or the tiles, never match."""
        if self.keys_per_channel:
            return f"kv{self.bits}g{self.group_size}t"
        return f"kv{self.bits}g{self.group_size}h" if self.bits else ""

    def check_block_size(self, block_size: int) -> None:
        """Raise ``ValueError`` when prefix-cache blocks of ``block_size`` tokens cannot
        hold whole tiles of this format's keys (see :attr:`keys_per_channel`)."""
        if self.keys_per_channel and block_size % self.group_size:
            raise ValueError(
                f"kv_bits={self.bits} stores keys per channel in tiles of kv_group_size="
                f"{self.group_size} tokens, and a prefix-cache block must hold whole tiles: "
                f"plugin.batched.block_size={block_size} is not a multiple of {self.group_size}; "
                f"set it to one (the base tier's 64 is) or use kv_bits=8")

    def element_bytes(self, dtype_bytes: int) -> float:
        """Bytes one K or V element takes, its share of its group's scale and bias
        included."""
        if self.bits is None:
            return float(dtype_bytes)
        return self.bits / 8 + 2 * dtype_bytes / self.group_size


FULL_PRECISION = KVFormat()


def _is_plain(layer: Any) -> bool:
    # Exactly KVCache: its subclasses (rotating, chunked, ...) keep state of their own.
    return type(layer) is KVCache


def quantized_layers(model: Any, kv_format: KVFormat) -> tuple[int, int]:
    """``(quantized, kept)``: how many of ``model``'s cache layers ``kv_format``
    quantizes, and how many keep full precision (sliding-window, recurrent)."""
    template = make_prompt_cache(model)
    plain = sum(1 for layer in template if _is_plain(layer))
    return (plain if kv_format.quantized else 0), len(template) - (plain if kv_format.quantized else 0)


def check_kv_format(model: Any, kv_format: KVFormat, model_id: str) -> None:
    """Raise ``ValueError`` naming the value, what is allowed and the model when
    ``model`` (loaded) cannot be served with ``kv_format``: it has no plain attention
    layer, its attention cannot read quantized KV, or some layer computes attention
    without the rotation the cache is stored under (one token is fed to find out)."""
    if not kv_format.quantized:
        return
    quantized, _ = _no_plain_layers(model, kv_format, model_id)
    before = rotated_calls()
    try:
        mx.eval(model(mx.array([[0]]), cache=make_request_cache(model, kv_format)))
    except Exception as exc:  # mlx's quantize or the model's attention refused it
        raise ValueError(
            f"model {model_id!r} cannot be served with kv_bits={kv_format.bits}, "
            f"kv_group_size={kv_format.group_size}: {exc}; use another kv_group_size "
            f"({', '.join(map(str, KV_GROUP_SIZES))}) or kv_bits=0 for it") from None
    read = rotated_calls() - before
    if read < quantized:
        raise ValueError(
            f"model {model_id!r} cannot be served with kv_bits={kv_format.bits}: {quantized - read} "
            f"of its {quantized} quantized attention layers compute attention without going "
            "through mlx-lm's scaled_dot_product_attention, so they cannot read the rotated "
            "quantized cache; allowed for it: kv_bits=0")


def check_config_kv_format(config: dict[str, Any], kv_format: KVFormat, model_id: str) -> None:
    """:func:`check_kv_format`'s layer check from a model's config alone (no weights
    loaded), for models served on demand: a start-up error rather than a failed load."""
    if not kv_format.quantized:
        return
    from omlx_core.models.loader import model_classes

    model_class, args_class = model_classes(config)
    _no_plain_layers(model_class(args_class.from_dict(config)), kv_format, model_id)


def _no_plain_layers(model: Any, kv_format: KVFormat, model_id: str) -> tuple[int, int]:
    """:func:`quantized_layers`, refused when none would be quantized."""
    quantized, kept = quantized_layers(model, kv_format)
    if not quantized:
        raise ValueError(
            f"model {model_id!r}: kv_bits={kv_format.bits} needs plain attention layers to "
            "quantize, and this model has none (mlx-lm has no quantized form of its "
            "sliding-window or recurrent caches); allowed for it: kv_bits=0")
    return quantized, kept


def make_request_cache(model: Any, kv_format: KVFormat = FULL_PRECISION) -> list[Any]:
    """A fresh cache for one request, its plain attention layers in ``kv_format``."""
    cache = make_prompt_cache(model)
    if kv_format.keys_per_channel:
        cache = [TiledKVCache(kv_format.group_size, kv_format.bits) if _is_plain(layer) else layer
                 for layer in cache]
    elif kv_format.quantized:
        cache = [RotatedQuantizedKVCache(group_size=kv_format.group_size, bits=kv_format.bits)
                 if _is_plain(layer) else layer for layer in cache]
    return cache


class RotatedQuantizedKVCache(QuantizedKVCache):
    """One request's quantized KV, stored rotated (see the module): mlx-lm's
    ``QuantizedKVCache`` fed rotated keys and values. Its ``keys``/``values`` triples,
    ``state`` and methods are mlx-lm's; attention over it goes through
    :func:`~omlx_core.models.kv_rotation.rotated_attention`."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return super().update_and_fetch(rotate(keys), rotate(values))

    @property
    def rotation(self) -> tuple[mx.array, mx.array] | None:
        return stored_rotation(self.keys, self.values, self.bits)


def is_quantized(layer: Any) -> bool:
    return isinstance(layer, (QuantizedKVCache, BatchQuantizedKVCache, TiledKVCache, BatchTiledKVCache))


def position_bytes(cache: Sequence[Any]) -> int:
    """Bytes one KV position takes in ``cache``'s plain attention layers (full
    precision or quantized; other layers do not grow with positions)."""
    total = 0
    for layer in cache:
        if _is_plain(layer) and layer.keys is not None:
            total += layer.keys.nbytes // layer.keys.shape[2] + layer.values.nbytes // layer.values.shape[2]
        elif type(layer) is RotatedQuantizedKVCache and layer.keys is not None:
            length = layer.keys[0].shape[2]
            total += sum(a.nbytes for a in (*layer.keys, *layer.values)) // length
        elif type(layer) is TiledKVCache:
            total += layer.position_bytes()
    return total


def merge_layers(caches: Sequence[Sequence[Any]]) -> list[Any]:
    """One batch cache per layer holding ``caches`` (one per request) as rows."""
    merged = []
    for index, first in enumerate(caches[0]):
        layers = [cache[index] for cache in caches]
        if type(first) is RotatedQuantizedKVCache:
            merged.append(BatchQuantizedKVCache.merge(layers))
        elif type(first) is TiledKVCache:
            merged.append(BatchTiledKVCache.merge(layers))
        else:
            merged.append(first.merge(layers))
    return merged


def reserve_positions(layer: Any, count: int) -> bool:
    """Grow a decode lane's batch cache ``layer`` so that ``count`` more positions per row
    fit in its buffers; ``True`` when it grew (the caller evaluates it).

    A batch cache grows by itself when a forward writes past its buffers (mlx-lm's
    ``BatchKVCache`` and :class:`BatchQuantizedKVCache` alike, by whole steps of 256
    positions), but then every layer grows inside the one lazy forward: all the new
    buffers are allocated while the old ones wait to be freed, and freed buffers below
    glibc's mmap threshold stay resident in the heap until it is trimmed. Growing each
    layer here, before the forward, lets the lane do it one layer at a time
    (:meth:`~.decode_batch.Lane.reserve`). The growth is the one the forward would have
    made (same capacity), so the KV the guard counts does not change. Layers of other
    kinds (sliding-window, recurrent) are left alone."""
    if isinstance(layer, (BatchQuantizedKVCache, BatchTiledKVCache)):
        return layer.reserve(count)
    if type(layer) is not BatchKVCache:
        return False
    keys, values, offset, left_padding, index = layer.state
    if keys is None or index + count <= keys.shape[2]:
        return False
    keys, values = grown((keys, values), index, count, layer.step)
    layer.state = (keys, values, offset, left_padding, index)
    return True


def grown(buffers: tuple[mx.array, ...], index: int, count: int, step: int) -> tuple[mx.array, ...]:
    """``buffers`` (positions on axis 2, ``[0, index)`` in use) with room for ``count``
    more positions, in whole ``step``s: one new buffer each, the used part copied (padding
    allocates no block of zeros to concatenate)."""
    added = (count + step - 1) // step * step
    return tuple(mx.pad(b[..., :index, :], [(0, 0), (0, 0), (0, added), (0, 0)]) for b in buffers)


def _slice_rows(arrays: tuple[mx.array, ...], rows: Any) -> tuple[mx.array, ...]:
    return tuple(a[rows] for a in arrays)


class BatchQuantizedKVCache:
    """Several requests' quantized KV, left-padded to a common length (see the module).

    ``keys`` and ``values`` are mlx's quantized triples ``(packed, scales, biases)``,
    each ``(rows, kv_heads, capacity, ·)``; columns ``[0, index)`` are in use, row ``i``'s
    from ``left_padding[i]`` on; ``offset[i]`` is row ``i``'s own token count (the RoPE
    offset of its next token)."""

    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int, bits: int) -> None:
        self.keys: tuple[mx.array, ...] | None = None
        self.values: tuple[mx.array, ...] | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self.index = 0
        self.group_size = group_size
        self.bits = bits

    # -- what mlx-lm's attention calls ------------------------------------------------

    def reserve(self, count: int) -> bool:
        """Grow the buffers so that ``count`` more positions fit (see
        :func:`reserve_positions`); ``True`` when they grew."""
        if self.keys is None or self.index + count <= self.keys[0].shape[2]:
            return False
        self.keys = grown(self.keys, self.index, count, self.step)
        self.values = grown(self.values, self.index, count, self.step)  # type: ignore[arg-type]
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple[mx.array, ...], ...]:
        start, count = self.index, keys.shape[2]
        if self.keys is None:
            self._allocate(keys, values, count)
        else:
            self.reserve(count)
        keys, values = rotate(keys), rotate(values)
        quantized_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        quantized_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for buffer, part in zip((*self.keys, *self.values), (*quantized_keys, *quantized_values)):  # type: ignore[misc]
            buffer[..., start:start + count, :] = part
        self.index += count
        self.offset = self.offset + count
        return self._used(self.keys), self._used(self.values)  # type: ignore[arg-type]

    def _allocate(self, keys: mx.array, values: mx.array, count: int) -> None:
        """The first buffers, shaped like ``keys`` and ``values``, for ``count``
        positions in whole steps."""
        rows, heads = keys.shape[:2]
        added = (count + self.step - 1) // self.step * self.step
        per_word = 32 // self.bits

        def empty(dim: int) -> tuple[mx.array, ...]:
            shape = (rows, heads, added)
            return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype))

        self.keys, self.values = empty(keys.shape[3]), empty(values.shape[3])

    def _used(self, arrays: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        return tuple(a[..., :self.index, :] for a in arrays)

    @property
    def rotation(self) -> tuple[mx.array, mx.array] | None:
        """The rotations its KV is stored under (see the module)."""
        return stored_rotation(self.keys, self.values, self.bits)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 - mlx-lm's name
        return create_causal_mask(N, offset=self.index, left_padding=self.left_padding, **kwargs)

    # -- rows joining and leaving -------------------------------------------------------

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only ``rows``, in that order; drop the columns no kept row uses."""
        indices = mx.array(list(rows))
        if self.keys is not None:
            self.keys = _slice_rows(self.keys, indices)
            self.values = _slice_rows(self.values, indices)  # type: ignore[arg-type]
        self.offset = self.offset[indices]
        self.left_padding = self.left_padding[indices]
        unused = min(self.left_padding.tolist(), default=0)
        if unused > 0:
            if self.keys is not None:
                self.keys = tuple(a[..., unused:, :] for a in self.keys)
                self.values = tuple(a[..., unused:, :] for a in self.values)  # type: ignore[union-attr]
            self.index -= unused
            self.left_padding = self.left_padding - unused

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append ``other``'s rows, both right-aligned at the longer one's index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        index = max(self.index, other.index)
        capacity = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        template = (self if self.keys is not None else other)

        def aligned(cache: BatchQuantizedKVCache) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...], mx.array]:
            left = index - cache.index
            parts = []
            for arrays, model in ((cache.keys, template.keys), (cache.values, template.values)):
                if arrays is None:
                    rows = cache.offset.shape[0]
                    arrays = tuple(mx.zeros((rows, m.shape[1], 0, m.shape[3]), m.dtype) for m in model)  # type: ignore[union-attr]
                right = capacity - arrays[0].shape[2] - left
                padded = []
                for a in arrays:
                    if right < 0:
                        a = a[..., :right, :]
                    if left or right > 0:
                        a = mx.pad(a, [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)])
                    padded.append(a)
                parts.append(tuple(padded))
            return parts[0], parts[1], cache.left_padding + left

        mine, theirs = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(mine[0], theirs[0]))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(mine[1], theirs[1]))
        self.left_padding = mx.concatenate([mine[2], theirs[2]])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.index = index

    def extract(self, row: int) -> RotatedQuantizedKVCache:
        """Row ``row`` as a request's own quantized cache (a compact copy)."""
        padding = int(self.left_padding[row].item())
        cache = RotatedQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None:
            return cache
        keys = tuple(mx.contiguous(a[row:row + 1, :, padding:self.index]) for a in self.keys)
        values = tuple(mx.contiguous(a[row:row + 1, :, padding:self.index]) for a in self.values)  # type: ignore[union-attr]
        cache.state = (keys, values, self.index - padding, self.group_size, self.bits)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[RotatedQuantizedKVCache]) -> "BatchQuantizedKVCache":
        """Requests' own quantized caches as the rows of one batch cache."""
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first.bits)
        if longest == 0:
            return batch
        model = next(c for c in caches if c.keys is not None)
        rows = len(caches)

        def stacked(pick: Any) -> tuple[mx.array, ...]:
            parts = []
            for position, template in enumerate(pick(model)):
                buffer = mx.zeros((rows, template.shape[1], longest, template.shape[3]), template.dtype)
                for row, (cache, length) in enumerate(zip(caches, lengths)):
                    if length:
                        buffer[row:row + 1, :, longest - length:] = pick(cache)[position][..., :length, :]
                parts.append(buffer)
            return tuple(parts)

        batch.keys = stacked(lambda c: c.keys)
        batch.values = stacked(lambda c: c.values)
        batch.index = longest
        batch.offset = batch.offset + longest
        return batch

    # -- the rest of mlx-lm's cache surface ----------------------------------------------

    def trim(self, n: int) -> int:
        n = min(self.index, n)
        self.index -= n
        self.offset = self.offset - n
        return n

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self.index

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))  # type: ignore[misc]

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self.index

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self.index = value


__all__ = ["FULL_PRECISION", "KV_BITS", "KV_GROUP_SIZES", "BatchQuantizedKVCache", "KVFormat",
           "RotatedQuantizedKVCache", "check_config_kv_format", "check_kv_format", "is_quantized",
           "make_request_cache", "merge_layers", "position_bytes", "quantized_layers", "reserve_positions"]
