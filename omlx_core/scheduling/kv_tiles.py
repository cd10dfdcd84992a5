"""4-bit KV with the keys quantized per channel, in tiles of tokens (KIVI's layout).

**Why.** Keys have a few channels far larger than the rest, the same channels at every
token. Quantized along a token's row (a scale and a bias per group of channels), those
channels set the group's scale and leave the others a handful of the 16 levels; the
Hadamard rotation spreads them but does not remove them. Quantized along the tokens of
one channel instead (each channel over a *tile* of ``group_size`` consecutive tokens,
a scale and a bias each), every channel gets its own range. On four texts the default
model's perplexity with 4-bit KV rose +1.2 % to +4.2 % this way against +5 % to +12 %
rotated per row (BENCHMARKS.md, "4-bit KV perplexity"); values stay per row, rotated
(:mod:`~omlx_core.scheduling.kv_cache`), where 4 bits cost under 1 %. arXiv:2402.02750.

**Layout.** Every row's tokens are left-aligned (row frame: token ``j`` at position
``j``), in two parts:

- *tiles*: the row's complete tiles, positions ``[0, full * group_size)``: six arrays
  shaped ``(rows, kv_heads, capacity, .)`` exactly as per-row groups of ``group_size``
  would be (:func:`quantize_tiles` spreads a tile's ``dim`` scales over its
  ``group_size`` positions), so a tile's bytes are 4-bit groups' bytes, and a prefix
  cache block of whole tiles is six arrays cut by token like any quantized block;
- *window*: the tokens after the last complete tile (fewer than ``group_size``), keys
  in float, values quantized per row; when a token completes a tile the window's keys
  are quantized into the next tile and its values copied there. A tile's codes depend
  only on its own float keys, and a stored tile is restored as it is (only part of a
  block, restored, is fed again: its keys expanded).

A request's cache gives attention float keys (the tiles expanded, then the window's)
and values expanded from their rotated rows, so a prefill chunk takes any attention
function's float path; the output is rotated back (``rotation = (None, R)``, see
:func:`~omlx_core.models.kv_rotation.rotated_attention`). A decode lane gives a
:class:`TiledRead` instead, which the CPU kernels' ``tiled_decode_attention`` reads as
stored (256 keys expanded at a time: 12 rows of 1,500 tokens took 0.22-0.25 s a step,
float32 KV 0.19 s; expanded in the graph, 1.4 s) and any other attention expands. A
lane's rows have different lengths: their tiles and windows are concatenated per row
with a mask that hides the unused positions (:meth:`BatchTiledKVCache.make_mask`), so
no row is padded to another's tile boundary. An expansion in the graph is a transient of
one layer the memory estimate counts (``dequantized_kv``, ``tiled_kv_copies``), and the
window's float keys a per-request constant (``kv_tile_window``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from omlx_core.models.kv_rotation import kv_rotation, rotate

#: tile capacity grows in whole steps of this many positions (as mlx-lm's caches do)
TILE_STEP = 256


def quantize_tiles(keys: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """``keys`` ``(rows, heads, n * group_size, dim)`` (row frame, tile-aligned), each
    channel of each tile quantized over its ``group_size`` tokens: ``(packed, scales,
    biases)`` shaped like mlx's per-row groups of ``group_size`` (``(…, n * group_size,
    dim * bits / 32)`` and ``(…, n * group_size, dim / group_size)``)."""
    rows, heads, tokens, dim = keys.shape
    tiles = tokens // group_size
    channels = keys.reshape(rows, heads, tiles, group_size, dim).swapaxes(-1, -2)
    packed, scales, biases = mx.quantize(channels, group_size=group_size, bits=bits)
    return (packed.reshape(rows, heads, tokens, dim * bits // 32),
            scales.reshape(rows, heads, tokens, dim // group_size),
            biases.reshape(rows, heads, tokens, dim // group_size))


def dequantize_tiles(packed: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                     bits: int) -> mx.array:
    """The float keys :func:`quantize_tiles` stored: ``(rows, heads, tokens, dim)``."""
    rows, heads, tokens, words = packed.shape
    dim, tiles = words * 32 // bits, tokens // group_size
    channels = mx.dequantize(packed.reshape(rows, heads, tiles, dim, group_size * bits // 32),
                             scales.reshape(rows, heads, tiles, dim, 1),
                             biases.reshape(rows, heads, tiles, dim, 1),
                             group_size=group_size, bits=bits)
    return channels.swapaxes(-1, -2).reshape(rows, heads, tokens, dim)


def _grow(arrays: tuple[mx.array, ...], used: int, needed: int) -> tuple[mx.array, ...]:
    """``arrays`` (positions on axis 2, ``[0, used)`` in use) with room for ``needed``
    positions, in whole :data:`TILE_STEP` steps (the used part copied)."""
    capacity = -(-needed // TILE_STEP) * TILE_STEP
    return tuple(mx.pad(a[..., :used, :], [(0, 0), (0, 0), (0, capacity - used), (0, 0)]) for a in arrays)


def _after(arrays: tuple[mx.array, ...], new: mx.array | None) -> tuple[mx.array, ...]:
    """``arrays`` (a layer's stored tiles), computed on only once ``new`` (the layer's
    new keys) is: a forward's graph otherwise lets mlx expand every layer's tiles, which
    depend on nothing the forward computes, before the first layer runs, and hold them
    all at once (12 rows of 1,500 tokens: 306 MiB for one step, 7 layers' worth)."""
    return arrays if new is None else tuple(mx.depends(list(arrays), [new]))


def _zeros_like_rows(arrays: tuple[mx.array, ...], rows: int, positions: int) -> tuple[mx.array, ...]:
    return tuple(mx.zeros((rows, a.shape[1], positions, a.shape[3]), a.dtype) for a in arrays)


class TiledKVCache:
    """One request's KV in the tiled format (see the module): ``tiles`` (keys' packed,
    scales, biases, then values'), ``window_keys`` (float) and ``window_values`` (a
    quantized triple) for the tokens after the last tile. ``offset`` is its token count.
    """

    def __init__(self, group_size: int, bits: int) -> None:
        self.group_size, self.kv_bits = group_size, bits
        self.tiles: tuple[mx.array, ...] | None = None
        self.window_keys: mx.array | None = None
        self.window_values: tuple[mx.array, ...] | None = None
        self.full = 0  # complete tiles
        self.pending = 0  # tokens in the window

    # -- attention --------------------------------------------------------------------

    @property
    def offset(self) -> int:
        return self.full * self.group_size + self.pending

    @offset.setter
    def offset(self, value: int) -> None:
        # A restore (:class:`~.cache_layout.CacheLayout`) sets the token count it wrote.
        if value != self.offset:
            raise ValueError(f"a tiled KV cache holding {self.offset} tokens cannot be set to {value}")

    @property
    def rotation(self) -> tuple[None, mx.array] | None:
        """Keys are stored unrotated, values rotated (see the module)."""
        if self.window_keys is None and self.tiles is None:
            return None
        dim = (self.window_values or self.tiles[3:])[0].shape[-1] * 32 // self.kv_bits  # type: ignore[index]
        dtype = (self.window_keys if self.window_keys is not None else self.tiles[1]).dtype  # type: ignore[index]
        return None, kv_rotation(dim, dtype)

    def quantize_values(self, values: mx.array) -> tuple[mx.array, ...]:
        rotated = rotate(values)
        return tuple(mx.quantize(rotated, group_size=self.group_size, bits=self.kv_bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self._append(keys, self.quantize_values(values))
        used = self.full * self.group_size
        if keys.shape[2] == 1 and used:
            # A one-token forward (a prompt's last token): read as a decode lane's rows are.
            read = _read(self, used, self.window_keys)
            return read, read
        return self.fetch()

    def _append(self, keys: mx.array, values: tuple[mx.array, ...]) -> None:
        """Append float keys and their values, quantized and rotated: the tiles they
        complete are quantized, the rest waits in the window."""
        if self.window_keys is not None:
            keys = mx.concatenate([self.window_keys, keys], axis=2)
            values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.window_values, values))  # type: ignore[arg-type]
        count = keys.shape[2]
        complete = count // self.group_size * self.group_size
        if complete:
            self._store_tiles((*quantize_tiles(keys[..., :complete, :], self.group_size, self.kv_bits),
                               *(a[..., :complete, :] for a in values)), complete)
        if complete:  # copies: a view would pin the chunk's keys until the next update
            keys, values = mx.array(keys[..., complete:, :]), tuple(mx.array(a[..., complete:, :]) for a in values)
        self.window_keys, self.window_values = keys, values
        self.pending = count - complete

    def _store_tiles(self, parts: Sequence[mx.array], tokens: int, capacity: int = 0) -> None:
        """Copy ``tokens`` positions (whole tiles) of the six tile arrays ``parts`` after
        the complete tiles; a first or a growing buffer takes room for ``capacity``
        positions at least (a restore knows where it ends: one buffer, not one per step)."""
        start = self.full * self.group_size
        end = start + tokens
        if self.tiles is None:
            self.tiles = _grow(tuple(mx.zeros_like(p[..., :0, :]) for p in parts), 0, max(end, capacity))
        elif end > self.tiles[0].shape[2]:
            self.tiles = _grow(self.tiles, start, max(end, capacity))
        for buffer, part in zip(self.tiles, parts):
            buffer[..., start:end, :] = part[..., :tokens, :]
        self.full += tokens // self.group_size

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Float keys and rotated float values of every token, in order."""
        return _read(self, self.full * self.group_size, self.window_keys).expand()

    def _float_keys(self, start: int, end: int) -> mx.array:
        """Float keys of tokens ``[start, end)`` (``start`` on a tile boundary): the
        tiles' expanded, then the window's."""
        used = self.full * self.group_size
        parts = []
        if start < used:
            stop = min(end, used)
            last = -(-stop // self.group_size) * self.group_size
            tiles = _after(tuple(a[..., start:last, :] for a in self.tiles[:3]), self.window_keys)  # type: ignore[index]
            parts.append(dequantize_tiles(*tiles, self.group_size, self.kv_bits)[..., :stop - start, :])
        if end > used:
            parts.append(self.window_keys[..., max(start, used) - used:end - used, :])  # type: ignore[index]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _values(self, start: int, end: int) -> tuple[mx.array, ...]:
        """The stored (quantized, rotated) values of tokens ``[start, end)``."""
        used = self.full * self.group_size
        parts = []
        if start < used:
            parts.append(tuple(a[..., start:min(end, used), :] for a in self.tiles[3:]))  # type: ignore[index]
        if end > used:
            lo = max(start, used) - used
            parts.append(tuple(a[..., lo:end - used, :] for a in self.window_values))  # type: ignore[union-attr]
        if len(parts) == 1:
            return parts[0]
        return tuple(mx.concatenate([a, b], axis=2) for a, b in zip(*parts))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,  # noqa: N803 - mlx-lm's name
                  **kwargs: Any) -> Any:
        if window_size is not None or return_array:
            return create_causal_mask(N, self.offset, window_size=window_size)
        return None if N == 1 else "causal"

    # -- prefix cache blocks ----------------------------------------------------------

    def cut(self, start: int, end: int) -> tuple[mx.array, ...]:
        """Tokens ``[start, end)`` (``start`` on a tile boundary): whole tiles as the six
        tile arrays (views), or, for any other span (a tail), the float keys and the
        values' triple (four arrays)."""
        if start % self.group_size:
            raise ValueError(f"a tiled KV cache is cut on tile boundaries ({self.group_size} tokens), not at {start}")
        if end <= self.full * self.group_size and end % self.group_size == 0:
            return tuple(a[..., start:end, :] for a in self.tiles)  # type: ignore[union-attr]
        return (self._float_keys(start, end), *self._values(start, end))

    def write(self, start: int, parts: Sequence[mx.array], tokens: int, end: int = 0) -> list[mx.array]:
        """Restore the first ``tokens`` tokens of a cut (:meth:`cut`) at token ``start``,
        the cache's end (``end``: where the whole restore ends); returns the arrays
        written, to evaluate. Whole tiles are copied
        as stored; part of a tile, or a tail, is appended as if fed (a part tile's keys
        expanded; values are never quantized again)."""
        if start != self.offset:
            raise ValueError(f"a tiled KV cache holding {self.offset} tokens restores at its end, not at {start}")
        if len(parts) not in (4, 6):
            raise ValueError(f"a cached block holds {len(parts)} arrays per layer and a tiled KV "
                             "cache 6 (4 for a tail): blocks of another KV format")
        whole = tokens // self.group_size * self.group_size if len(parts) == 6 and not self.pending else 0
        if whole:
            self._store_tiles(parts, whole, end)
            if self.window_keys is None:
                dim = parts[0].shape[3] * 32 // self.kv_bits
                self.window_keys = mx.zeros((*parts[0].shape[:2], 0, dim), parts[1].dtype)
                self.window_values = tuple(p[..., :0, :] for p in parts[3:])
        if tokens > whole:
            if len(parts) == 6:
                end = -(-tokens // self.group_size) * self.group_size
                keys = dequantize_tiles(*(p[..., whole:end, :] for p in parts[:3]), self.group_size, self.kv_bits)
                keys = keys[..., :tokens - whole, :]
            else:
                keys = parts[0][..., whole:tokens, :]
            self._append(keys, tuple(p[..., whole:tokens, :] for p in parts[-3:]))
        return list(self.state)

    # -- mlx-lm's cache surface -------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(a for a in (*(self.tiles or ()), self.window_keys, *(self.window_values or ()))
                     if a is not None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def position_bytes(self) -> int:
        """Bytes one token takes in the tiles (keys and values), known from the window's
        shapes before the first tile is (a short first request must not read as 0)."""
        if self.window_keys is None:
            return 0
        heads, dim = self.window_keys.shape[1], self.window_keys.shape[3]
        keys = heads * (dim * self.kv_bits // 8 + 2 * (dim // self.group_size) * self.window_keys.itemsize)
        return keys + sum(a.shape[1] * a.shape[3] * a.itemsize for a in self.window_values)  # type: ignore[union-attr]

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.window_keys is None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens, from the window only (a tile is never requantized)."""
        if n > self.pending:
            raise ValueError(f"a tiled KV cache trims its last {self.pending} tokens at most, not {n}")
        self.pending -= n
        self.window_keys = self.window_keys[..., :self.pending, :]  # type: ignore[index]
        self.window_values = tuple(a[..., :self.pending, :] for a in self.window_values)  # type: ignore[union-attr]
        return n


@dataclass(frozen=True)
class TiledRead:
    """What a decode lane's attention reads (:meth:`BatchTiledKVCache.update_and_fetch`
    returns it for keys and for values alike): every row's tiles (``tiles``: the used
    positions of the six tile arrays, ``None`` before any row has a tile), then its
    window. The CPU kernels' ``tiled_decode_attention`` reads it as stored; any other
    attention gets float arrays from :meth:`expand`. The lane's mask says which
    positions each row reads."""

    tiles: tuple[mx.array, ...] | None
    window_keys: mx.array
    window_values: tuple[mx.array, ...]
    group_size: int
    bits: int

    def expand(self) -> tuple[mx.array, mx.array]:
        """Float keys and rotated float values, tiles then window, per row."""
        keys, values = self.window_keys, self.window_values
        if self.tiles is not None:
            tiled = dequantize_tiles(*self.tiles[:3], self.group_size, self.bits)
            if not keys.shape[2]:  # an empty window (a chunk ending on a tile): no copy
                keys, values = tiled, self.tiles[3:]
            else:
                keys = mx.concatenate([tiled, keys], axis=2)
                values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.tiles[3:], values))
        return keys, mx.dequantize(*values, group_size=self.group_size, bits=self.bits)

    def stored(self) -> tuple[list[mx.array], mx.array, list[mx.array]]:
        """``(tiles, window keys, window values)`` as the kernel reads them (tiles of no
        positions before any row has one)."""
        tiles = self.tiles
        if tiles is None:
            rows, heads, _, dim = self.window_keys.shape
            keys = ((dim * self.bits // 32, mx.uint32), (dim // self.group_size, self.window_keys.dtype),
                    (dim // self.group_size, self.window_keys.dtype))
            tiles = (*(mx.zeros((rows, heads, 0, last), dtype) for last, dtype in keys),
                     *(mx.zeros((rows, heads, 0, a.shape[3]), a.dtype) for a in self.window_values))
        return list(tiles), self.window_keys, list(self.window_values)


def _read(cache: Any, used: int, new: mx.array | None) -> TiledRead:
    """What ``cache`` (a request's or a lane's) holds: its first ``used`` tile positions,
    expanded only after ``new`` (:func:`_after`), then its window."""
    tiles = _after(tuple(a[..., :used, :] for a in cache.tiles), new) if used else None
    return TiledRead(tiles, cache.window_keys, cache.window_values, cache.group_size, cache.kv_bits)


class BatchTiledKVCache:
    """A decode lane's rows in the tiled format (see the module): tiles
    ``(rows, kv_heads, capacity, .)`` with row ``i``'s first ``full[i]`` tiles, a window
    of ``group_size`` positions per row with its first ``pending[i]`` in use. Rows feed
    one token per forward (a lane over tiled KV does not speculate)."""

    def __init__(self, group_size: int, bits: int) -> None:
        self.group_size, self.kv_bits = group_size, bits
        self.tiles: tuple[mx.array, ...] | None = None
        self.window_keys: mx.array | None = None
        self.window_values: tuple[mx.array, ...] | None = None
        self.full: list[int] = []
        self.pending: list[int] = []
        self.offset = mx.array([], dtype=mx.int32)

    rotation = TiledKVCache.rotation
    quantize_values = TiledKVCache.quantize_values

    @property
    def lengths(self) -> list[int]:
        return [f * self.group_size + p for f, p in zip(self.full, self.pending)]

    def _after_one(self) -> tuple[list[int], list[int]]:
        """``(full, pending)`` once every row has fed one more token."""
        full = [f + (p + 1 == self.group_size) for f, p in zip(self.full, self.pending)]
        return full, [(p + 1) % self.group_size for p in self.pending]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 - mlx-lm's name
        """Which of :meth:`update_and_fetch`'s positions each row attends to, for the
        coming one-token forward: its tiles and the used part of its window."""
        if N != 1:
            raise ValueError("a decode lane over tiled KV feeds one token per row")
        full, pending = self._after_one()
        tiles = mx.arange(max(full) * self.group_size)[None, :] < (mx.array(full)[:, None] * self.group_size)
        window = mx.arange(self.group_size)[None, :] < mx.array(pending)[:, None]
        return mx.concatenate([tiles, window], axis=1)[:, None, None, :]

    def reserve(self, count: int) -> bool:
        """Grow the tiles so that ``count`` more tokens per row fit; ``True`` when they grew."""
        if self.tiles is None:
            return False
        needed = max(f * self.group_size + p + count for f, p in zip(self.full, self.pending))
        needed = needed // self.group_size * self.group_size
        if needed <= self.tiles[0].shape[2]:
            return False
        self.tiles = _grow(self.tiles, max(self.full) * self.group_size, needed)
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError("a decode lane over tiled KV feeds one token per row")
        slot = mx.arange(self.group_size)[None, None, :, None] == mx.array(self.pending)[:, None, None, None]
        self.window_keys = mx.where(slot, keys, self.window_keys)
        self.window_values = tuple(mx.where(slot, new, old) for new, old in
                                   zip(self.quantize_values(values), self.window_values))  # type: ignore[arg-type]
        full, pending = self._after_one()
        for row, (before, after) in enumerate(zip(self.full, full)):
            if after > before:
                self._flush(row, before)
        self.full, self.pending = full, pending
        self.offset = mx.array(self.lengths, dtype=mx.int32)
        used = max(full) * self.group_size
        read = _read(self, used, keys)
        return read, read

    def _flush(self, row: int, tile: int) -> None:
        """Row ``row``'s full window becomes its tile number ``tile``."""
        start, end = tile * self.group_size, (tile + 1) * self.group_size
        parts = (*quantize_tiles(self.window_keys[row:row + 1], self.group_size, self.kv_bits),  # type: ignore[index]
                 *(a[row:row + 1] for a in self.window_values))  # type: ignore[union-attr]
        if self.tiles is None:
            self.tiles = _grow(_zeros_like_rows(parts, len(self.full), 0), 0, end)
        elif end > self.tiles[0].shape[2]:
            self.tiles = _grow(self.tiles, max(self.full) * self.group_size, end)
        for buffer, part in zip(self.tiles, parts):
            buffer[row:row + 1, :, start:end, :] = part

    # -- rows joining and leaving -------------------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence[TiledKVCache]) -> "BatchTiledKVCache":
        """Requests' own tiled caches as the rows of one batch cache."""
        first = next(c for c in caches if c.window_keys is not None)
        batch = cls(first.group_size, first.kv_bits)
        rows, size = len(caches), first.group_size
        batch.full, batch.pending = [c.full for c in caches], [c.pending for c in caches]
        window = (first.window_keys, *first.window_values)  # type: ignore[misc]
        buffers = _zeros_like_rows(window, rows, size)
        tiled = [c for c in caches if c.tiles is not None]
        tiles = _zeros_like_rows(tiled[0].tiles, rows, max(batch.full) * size) if tiled else None  # type: ignore[arg-type]
        for row, cache in enumerate(caches):
            if cache.pending:
                for buffer, part in zip(buffers, (cache.window_keys, *cache.window_values)):  # type: ignore[misc]
                    buffer[row:row + 1, :, :cache.pending, :] = part
            if cache.full:
                for buffer, part in zip(tiles, cache.tiles):  # type: ignore[arg-type]
                    buffer[row:row + 1, :, :cache.full * size, :] = part[..., :cache.full * size, :]
        batch.window_keys, batch.window_values = buffers[0], tuple(buffers[1:])
        if tiles is not None:
            batch.tiles = _grow(tiles, max(batch.full) * size, max(batch.full) * size + size)
        batch.offset = mx.array(batch.lengths, dtype=mx.int32)
        return batch

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only ``rows``, in that order; drop the tile positions no kept row uses."""
        indices = mx.array(list(rows))
        self.full = [self.full[i] for i in rows]
        self.pending = [self.pending[i] for i in rows]
        self.window_keys = self.window_keys[indices]  # type: ignore[index]
        self.window_values = tuple(a[indices] for a in self.window_values)  # type: ignore[union-attr]
        if self.tiles is not None:
            used = -(-(max(self.full) * self.group_size + 1) // TILE_STEP) * TILE_STEP
            self.tiles = tuple(a[:, :, :used][indices] for a in self.tiles)
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def extend(self, other: "BatchTiledKVCache") -> None:
        """Append ``other``'s rows."""
        mine, theirs = self.tiles, other.tiles
        if mine is not None or theirs is not None:
            capacity = max(t[0].shape[2] for t in (mine, theirs) if t is not None)
            template = mine if mine is not None else theirs
            mine = mine if mine is not None else _zeros_like_rows(template, len(self.full), 0)  # type: ignore[arg-type]
            theirs = theirs if theirs is not None else _zeros_like_rows(template, len(other.full), 0)  # type: ignore[arg-type]
            self.tiles = tuple(mx.concatenate([_grow((a,), a.shape[2], capacity)[0], _grow((b,), b.shape[2], capacity)[0]])
                               for a, b in zip(mine, theirs))
        self.window_keys = mx.concatenate([self.window_keys, other.window_keys])  # type: ignore[list-item]
        self.window_values = tuple(mx.concatenate([a, b]) for a, b in zip(self.window_values, other.window_values))  # type: ignore[arg-type]
        self.full, self.pending = self.full + other.full, self.pending + other.pending
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def extract(self, row: int) -> TiledKVCache:
        """Row ``row`` as a request's own tiled cache (a compact copy)."""
        cache = TiledKVCache(self.group_size, self.kv_bits)
        cache.full, cache.pending = self.full[row], self.pending[row]
        used = cache.full * self.group_size
        if used:
            cache.tiles = _grow(tuple(a[row:row + 1] for a in self.tiles), used, used)  # type: ignore[union-attr]
        cache.window_keys = mx.contiguous(self.window_keys[row:row + 1, :, :cache.pending])  # type: ignore[index]
        cache.window_values = tuple(mx.contiguous(a[row:row + 1, :, :cache.pending]) for a in self.window_values)  # type: ignore[union-attr]
        return cache

    # -- the rest of mlx-lm's cache surface ----------------------------------------------

    state = TiledKVCache.state
    nbytes = TiledKVCache.nbytes

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.window_keys is None

    def is_trimmable(self) -> bool:
        return False


__all__ = ["TILE_STEP", "BatchTiledKVCache", "TiledKVCache", "dequantize_tiles", "quantize_tiles"]
