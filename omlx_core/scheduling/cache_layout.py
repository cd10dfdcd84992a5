"""How one model's per-layer caches become prefix-cache blocks and back.

A plain attention layer (``KVCache``, or in a quantized KV format
``RotatedQuantizedKVCache`` or ``TiledKVCache``) can be cut at any token: a block keeps
just its own tokens' keys and values (a quantized layer: its packed values, scales and
biases, six arrays, stored as they are and restored without quantizing again; keys
quantized per channel are cut on whole tiles, a tail's keys in float:
:meth:`~.kv_tiles.TiledKVCache.cut`), and a prefix is rebuilt by concatenating blocks.
Every other layer type (``RotatingKVCache`` windows, ``ArraysCache`` recurrent state,
``CacheList``...) cannot be cut back to an earlier token count, so it is captured whole
at a block boundary (a *boundary state*) and restored only at exactly that boundary.

Stored arrays are compact copies: a view would pin the whole buffer it was cut from
and make the byte budget a lie. For the same reason a block's or tail's arrays share a
buffer per dtype and shape (:func:`_one_buffer`): mlx's allocator serves a request from
a freed buffer up to twice its size (or two pages larger), so small per-layer arrays,
each in a reused buffer, held up to 28 % more than the bytes the budget counts in the
tiny test models' conversations; one buffer per entry wastes that slack once at most.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_core.kvblocks import CachedBlock, CachedTail
from omlx_core.scheduling.kv_cache import FULL_PRECISION, KVFormat, RotatedQuantizedKVCache, make_request_cache
from omlx_core.scheduling.kv_tiles import TiledKVCache


def _is_cuttable(layer: Any) -> bool:
    # Exactly KVCache (a KV format may make it a RotatedQuantizedKVCache): subclasses (chunked)
    # keep state a slice would corrupt.
    return type(layer) is KVCache


def _layer_arrays(layer: Any) -> tuple[mx.array, ...]:
    """A cuttable layer's buffers: keys and values, or their quantized triples."""
    if type(layer) is RotatedQuantizedKVCache:
        return (*layer.keys, *layer.values)
    return layer.keys, layer.values


def _adopt_arrays(layer: Any, arrays: list[mx.array]) -> None:
    if type(layer) is RotatedQuantizedKVCache:
        layer.keys, layer.values = tuple(arrays[:3]), tuple(arrays[3:])
    else:
        layer.keys, layer.values = arrays


def _map_arrays(value: Any, on_array: Any) -> Any:
    """A structural copy of ``value`` (lists, tuples, dicts, cache objects) with every
    array replaced by ``on_array(array)``."""
    if isinstance(value, mx.array):
        return on_array(value)
    if isinstance(value, list):
        return [_map_arrays(v, on_array) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_arrays(v, on_array) for v in value)
    if isinstance(value, dict):
        return {k: _map_arrays(v, on_array) for k, v in value.items()}
    if hasattr(value, "__dict__") and type(value).__module__.startswith("mlx_lm."):
        clone = copy.copy(value)
        for name, item in vars(value).items():
            setattr(clone, name, _map_arrays(item, on_array))
        return clone
    return copy.deepcopy(value)


def _arrays(value: Any) -> list[mx.array]:
    found: list[mx.array] = []
    _map_arrays(value, lambda a: found.append(a) or a)
    return found


def _one_buffer(value: Any) -> Any:
    """A structural copy of ``value`` (evaluated) whose arrays are compact copies, those
    of one dtype and one shape past the first axis sharing one new buffer: an entry then
    holds its bytes, plus the allocator's rounding once per buffer, and pins nothing it
    was cut from. Joined along their first axis (a cache's batch axis), the arrays are
    copied once, straight from the views they are given: no temporary copy first."""
    groups: dict[Any, list[mx.array]] = {}
    for array in _arrays(value):
        key = (array.dtype, tuple(array.shape[1:])) if array.ndim and array.size else id(array)
        members = groups.setdefault(key, [])
        if not any(member is array for member in members):
            members.append(array)
    copies: dict[int, mx.array] = {}
    for members in groups.values():
        if len(members) == 1:
            copies[id(members[0])] = mx.array(members[0])  # a copy, never a view
            continue
        joined = mx.concatenate(members, axis=0)
        offset = 0
        for member in members:
            copies[id(member)] = joined[offset:offset + member.shape[0]]
            offset += member.shape[0]
    packed = _map_arrays(value, lambda array: copies[id(array)])
    mx.eval(_arrays(packed))
    return packed


class CacheLayout:
    """Which layers of a model can be cut, and the cutting, capturing and rebuilding."""

    def __init__(self, model: Any, kv_format: KVFormat = FULL_PRECISION) -> None:
        self._model = model
        self.kv_format = kv_format
        self._template = template = make_prompt_cache(model)
        self.cuttable = tuple(_is_cuttable(layer) for layer in template)
        self.layer_types = tuple(type(layer).__name__ for layer in template)

    @property
    def needs_boundaries(self) -> bool:
        """Whether some layer can only be resumed at a captured boundary."""
        return not all(self.cuttable)

    def new_cache(self) -> list[Any]:
        return make_request_cache(self._model, self.kv_format)

    def cut(self, cache: Sequence[Any], start: int, end: int) -> tuple[Any, ...]:
        """Tokens ``[start, end)`` of every cuttable layer (``None`` for the others):
        views of ``cache``, which :meth:`make_block` and :meth:`make_tail` copy."""
        kv: list[Any] = []
        for layer, cuttable in zip(cache, self.cuttable):
            if isinstance(layer, TiledKVCache):
                kv.append(layer.cut(start, end))
            elif cuttable:
                kv.append(tuple(a[..., start:end, :] for a in _layer_arrays(layer)))
            else:
                kv.append(None)
        return tuple(kv)

    def capture(self, cache: Sequence[Any]) -> tuple[Any, ...]:
        """The whole state of every non-cuttable layer (``None`` for cuttable ones): the
        layers cloned around ``cache``'s arrays, which :meth:`make_block` and
        :meth:`make_tail` copy."""
        return tuple(None if cuttable else _map_arrays(layer, lambda array: array)
                     for layer, cuttable in zip(cache, self.cuttable))

    def make_block(self, block_hash: bytes, parent_hash: bytes, index: int, block_size: int,
                   kv: tuple[Any, ...], boundary: tuple[Any, ...] | None,
                   tokens: Sequence[int] = ()) -> CachedBlock:
        kv, boundary = _one_buffer((kv, boundary))
        arrays = _arrays(kv) + (_arrays(boundary) if boundary is not None else [])
        return CachedBlock(
            block_hash=block_hash,
            parent_hash=parent_hash,
            index=index,
            block_size=block_size,
            kv=kv,
            boundary=boundary,
            reusable_end=boundary is not None or not self.needs_boundaries,
            nbytes=sum(a.nbytes for a in arrays),
            tokens=tuple(int(t) for t in tokens),
        )

    def make_tail(self, parent_hash: bytes, tokens: Sequence[int], cache: Sequence[Any],
                  start: int) -> CachedTail:
        """The tail ``tokens`` (at cache positions ``start``...; for a model with layers
        that cannot be cut, the last tokens ``cache`` holds, whose state it captures)."""
        kv = self.cut(cache, start, start + len(tokens))
        boundary = self.capture(cache) if self.needs_boundaries else None
        kv, boundary = _one_buffer((kv, boundary))
        arrays = _arrays(kv) + (_arrays(boundary) if boundary is not None else [])
        return CachedTail(parent_hash, tuple(int(t) for t in tokens), kv,
                          sum(a.nbytes for a in arrays), boundary)

    def capacity(self, tokens: int) -> int:
        """Tokens a restored cache holding ``tokens`` has room for: up to its cuttable
        layers' next growth step (:meth:`write`)."""
        step = self._step
        return (tokens // step + 1) * step

    @property
    def _step(self) -> int:
        return next((layer.step for layer, cuttable in zip(self._template, self.cuttable) if cuttable),
                    KVCache.step)

    def write(self, cache: Sequence[Any], kv: tuple[Any, ...], start: int, tokens: int,
              end: int) -> None:
        """Copy the first ``tokens`` tokens of ``kv`` (a block's or a tail's keys and
        values per layer) into the cuttable layers of ``cache`` at token ``start``, and
        evaluate the copy, so that ``kv`` can be dropped before the next one is read: a
        cache restored block by block holds each block's KV once, in its own buffer.
        The first write allocates that buffer for ``end`` tokens, with room up to the
        next growth step (:meth:`capacity`), in the same copy: the next forward writes
        into it instead of copying the whole prefix again to grow (a prefix hit's first
        token took 30 % less time)."""
        written = []
        for layer, cuttable, parts in zip(cache, self.cuttable, kv):
            if not cuttable:
                continue
            if isinstance(layer, TiledKVCache):
                written += layer.write(start, parts, tokens, self.capacity(end))
                continue
            if layer.keys is None:
                _adopt_arrays(layer, [mx.zeros((*a.shape[:2], self.capacity(end), a.shape[3]), a.dtype)
                                      for a in parts])
            buffers = _layer_arrays(layer)
            if len(buffers) != len(parts):
                raise ValueError(f"a cached block holds {len(parts)} arrays per layer and the "
                                 f"cache {len(buffers)}: blocks of another KV format")
            for buffer, part in zip(buffers, parts):
                buffer[..., start:start + tokens, :] = part[..., :tokens, :]
            written += buffers
        mx.eval(written)

    def finish(self, cache: list[Any], end: int, boundary: tuple[Any, ...] | None) -> list[Any]:
        """Close a restore (:meth:`write`) at ``end`` tokens; the non-cuttable layers
        take ``boundary``, the state at that token (``None``: leave them empty)."""
        adopted = []
        for index, cuttable in enumerate(self.cuttable):
            if isinstance(cache[index], TiledKVCache):
                cache[index].offset = end  # checks what the writes left
            elif cuttable:
                if cache[index].keys is not None:
                    cache[index].offset = end
            elif boundary is not None:
                # Arrays are immutable values in mlx, so the stored state can be shared;
                # only the containers the cache mutates in place are copied.
                cache[index] = _map_arrays(boundary[index], lambda a: a)
                adopted += _arrays(cache[index])
        mx.eval(adopted)  # read back from a lower tier, they may not be loaded yet
        return cache

    def restore(self, blocks: Sequence[CachedBlock], tail: CachedTail | None = None,
                tail_tokens: int = 0) -> list[Any]:
        """A fresh cache holding the prefix ``blocks`` cover (the last must be a reusable
        end), then the first ``tail_tokens`` tokens of ``tail``."""
        cache = self.new_cache()
        if tail is None or tail_tokens <= 0:
            tail, tail_tokens = None, 0
        elif self.needs_boundaries and (tail.boundary is None or tail_tokens != len(tail.tokens)):
            raise ValueError("a model with layers that cannot be cut resumes only at the "
                             "whole of a tail that has a boundary state")
        if not blocks and tail is None:
            return cache
        last = blocks[-1] if blocks else None
        if last is not None and not last.reusable_end and (tail is None or tail.boundary is None):
            raise ValueError("cannot resume after a block that has no boundary state")
        start = last.end_token if last is not None else 0
        end = start + tail_tokens
        for block in blocks:
            self.write(cache, block.kv, block.index * block.block_size, block.block_size, end)
        if tail is not None:
            self.write(cache, tail.kv, start, tail_tokens, end)
        boundary = tail.boundary if tail is not None and tail.boundary is not None else (
            last.boundary if last is not None else None)
        return self.finish(cache, end, boundary)
