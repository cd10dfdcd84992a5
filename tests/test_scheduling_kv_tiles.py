"""4-bit KV with keys per channel in tiles (``omlx_core/scheduling/kv_tiles.py``): the
stored format, a request's cache, a decode lane's rows, prefix-cache blocks and tails,
and the start-up refusal of blocks that cannot hold whole tiles (the SSD tier and a
prefix hit's tokens: ``test_scheduling_kv_quantized``).

The reference for what attention reads is the format's definition written out here:
each key channel of each complete tile of ``group_size`` tokens quantized over those
tokens (mlx's affine quantization along the token axis), the tokens after the last tile
in float, and values quantized per row after the Hadamard rotation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.kv_rotation import kv_rotation, rotate, rotated_attention
from omlx_core.models.registry import ModelError
from omlx_core.scheduling.kv_tiles import BatchTiledKVCache, TiledKVCache, dequantize_tiles, quantize_tiles

from tests.test_scheduling_kv_quantized import quantizable, start  # noqa: F401 - fixture

G = 64


def channel_reference(keys: mx.array, group: int = G) -> mx.array:
    """Keys as the format keeps them: complete tiles per channel, the rest in float."""
    full = keys.shape[2] // group * group
    if not full:
        return keys
    rows, heads, _, dim = keys.shape
    channels = keys[:, :, :full].reshape(rows, heads, full // group, group, dim).swapaxes(-1, -2)
    back = mx.dequantize(*mx.quantize(channels, group_size=group, bits=4), group_size=group, bits=4)
    back = back.swapaxes(-1, -2).reshape(rows, heads, full, dim)
    return mx.concatenate([back, keys[:, :, full:]], axis=2)


def value_reference(values: mx.array, group: int = G) -> mx.array:
    """Values as attention reads them: rotated rows, quantized per row, expanded."""
    rotated = rotate(values)
    return mx.dequantize(*mx.quantize(rotated, group_size=group, bits=4), group_size=group, bits=4)


def rows_of(seed: int, length: int, rows: int = 1) -> mx.array:
    keys = mx.random.normal((rows, 2, length, 64), key=mx.random.key(seed))
    # a few large channels, the same at every token, as a model's keys have
    return keys + mx.zeros((64,)).at[mx.array([3, 40])].add(mx.array([12.0, -8.0]))


@pytest.mark.parametrize("group", [32, 64])
def test_a_tile_holds_each_channel_over_its_tokens_in_4_bit_groups_bytes(group):
    """A tile's codes are each channel quantized over the tile's tokens; the arrays have
    the shapes (so the bytes) of per-row groups of the same size."""
    def run() -> tuple[bool, list[tuple[int, ...]], list[tuple[int, ...]]]:
        keys = rows_of(1, 3 * group)
        tiles = quantize_tiles(keys, group, 4)
        back = dequantize_tiles(*tiles, group, 4)
        per_row = mx.quantize(keys, group_size=group, bits=4)
        return (bool(mx.array_equal(back, channel_reference(keys, group)).item()),
                [a.shape for a in tiles], [a.shape for a in per_row])

    same, shapes, row_shapes = mlx_thread().run(run)
    assert same
    assert shapes == row_shapes


def test_per_channel_tiles_keep_keys_closer_than_rotated_rows():
    """What the layout is for: keys with a few large channels come back from 4 bits with
    less error per channel over a tile than per rotated row."""
    def errors() -> tuple[float, float]:
        keys = rows_of(2, 256)
        rotation = kv_rotation(64)
        rows = mx.dequantize(*mx.quantize(keys @ rotation, group_size=G, bits=4), group_size=G, bits=4) @ rotation
        tiles = channel_reference(keys)
        return (mx.sqrt(mx.mean((rows - keys) ** 2)).item(), mx.sqrt(mx.mean((tiles - keys) ** 2)).item())

    rotated_rows, channels = mlx_thread().run(errors)
    assert channels < 0.8 * rotated_rows, (rotated_rows, channels)


def test_a_tokens_bytes_are_4_bit_groups_before_and_after_the_first_tile():
    """What lane placement weighs padding by: the tiles' bytes per token, the same
    before a request has a tile (a short first request) as after."""
    def run() -> tuple[int, int, int]:
        short, long = TiledKVCache(G, 4), TiledKVCache(G, 4)
        short.update_and_fetch(rows_of(1, 10), rows_of(2, 10))
        long.update_and_fetch(rows_of(1, 300), rows_of(2, 300))
        per_row = sum(a.nbytes for a in mx.quantize(rows_of(3, 1), group_size=G, bits=4))
        return short.position_bytes(), long.position_bytes(), 2 * per_row

    assert len(set(mlx_thread().run(run))) == 1


def test_a_requests_cache_reads_what_the_format_keeps():
    """Fed a chunk, then token by token across tile boundaries: attention reads the
    complete tiles per channel, the window in float, the values rotated per row."""
    def run() -> list[bool]:
        keys, values = rows_of(3, 200), mx.random.normal((1, 2, 200, 64), key=mx.random.key(4))
        cache = TiledKVCache(G, 4)
        checks = []
        read = cache.update_and_fetch(keys[:, :, :130], values[:, :, :130])
        checks.append((cache.full, cache.pending) == (2, 2))
        checks.append(bool(mx.array_equal(read[0], channel_reference(keys[:, :, :130])).item()))
        for i in range(130, 200):
            one = cache.update_and_fetch(keys[:, :, i:i + 1], values[:, :, i:i + 1])[0]
        # A one-token forward reads through the decode kernel: the same, expanded.
        read = one.expand()
        checks.append(cache.offset == 200 and (cache.full, cache.pending) == (3, 8))
        checks.append(bool(mx.array_equal(read[0], channel_reference(keys)).item()))
        checks.append(bool(mx.array_equal(read[1], value_reference(values)).item()))
        return checks

    assert all(mlx_thread().run(run))


def test_attention_over_tiles_is_float_attention_over_what_they_keep():
    """Queries go in unrotated (keys are stored unrotated); the output is rotated back
    from the rotated values."""
    def run() -> float:
        cache = TiledKVCache(G, 4)
        keys, values = rows_of(5, 100), mx.random.normal((1, 2, 100, 64), key=mx.random.key(6))
        stored_keys, stored_values = cache.update_and_fetch(keys, values)
        queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(7))

        def attend(q, k, v, c, scale, mask):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        ours = rotated_attention(attend, queries, stored_keys, stored_values, cache, 0.125, None)
        reference = mx.fast.scaled_dot_product_attention(
            queries, channel_reference(keys), value_reference(values) @ kv_rotation(64), scale=0.125, mask=None)
        return mx.max(mx.abs(ours - reference)).item()

    assert mlx_thread().run(run) < 1e-4


def test_a_lanes_rows_each_read_their_own_cache():
    """Rows of different lengths merged, extended, decoding across their own tile
    boundaries, filtered and extracted: each row reads (through the lane's mask) exactly
    what its own cache fed the same tokens reads, and extracts as that cache."""
    def run() -> list[bool]:
        own = []
        for seed, length in ((1, 10), (2, 70), (3, 130)):
            cache = TiledKVCache(G, 4)
            cache.update_and_fetch(rows_of(seed, length), rows_of(seed + 10, length))
            own.append(cache)
        lane = BatchTiledKVCache.merge([own[0], own[1]])
        lane.extend(BatchTiledKVCache.merge([own[2]]))
        checks = []
        for step in range(60):
            mask = lane.make_mask(1)
            lane.reserve(1)
            new = rows_of(100 + step, 1, rows=3)
            keys, values = lane.update_and_fetch(new, -new)[0].expand()
            checks.append(mask.shape[-1] == keys.shape[2])
            for row, cache in enumerate(own):
                cache.update_and_fetch(new[row:row + 1], -new[row:row + 1])
                mine = cache.fetch()
                seen = mx.array(np.nonzero(np.array(mask[row, 0, 0]))[0])
                checks.append(bool(mx.array_equal(keys[row][:, seen], mine[0][0]).item()))
                checks.append(bool(mx.array_equal(values[row][:, seen], mine[1][0]).item()))
        lane.filter([2, 0])
        for row, cache in ((0, own[2]), (1, own[0])):
            extracted = lane.extract(row)
            checks.append(extracted.offset == cache.offset)
            checks.append(all(bool(mx.array_equal(a, b).item()) for a, b in zip(extracted.fetch(), cache.fetch())))
        return checks

    assert all(mlx_thread().run(run))


def test_the_decode_kernel_reads_a_lanes_tiles_as_their_float_expansion():
    """The CPU kernels' tiled decode attention, reading tiles and windows as stored,
    gives the float decode kernel's result over the lane's expansion, masked the same:
    before any row has a tile, across tile boundaries and blocks of 256 keys."""
    from omlx_core.models.cpu_kernels import kernels

    built = kernels()
    if built is None:
        pytest.skip("the CPU kernels are not built here")

    def run() -> list[float]:
        own = []
        for seed, length in ((1, 20), (2, 300), (3, 40)):
            cache = TiledKVCache(G, 4)
            cache.update_and_fetch(rows_of(seed, length), rows_of(seed + 10, length))
            own.append(cache)
        lane = BatchTiledKVCache.merge([own[0]])
        gaps = []
        for step in range(80):
            if step == 30:
                lane.extend(BatchTiledKVCache.merge(own[1:]))
            rows = len(lane.full)
            mask = lane.make_mask(1)
            lane.reserve(1)
            new = rows_of(200 + step, 1, rows=rows)
            read, _ = lane.update_and_fetch(new, new * 0.5)
            queries = mx.random.normal((rows, 4, 1, 64), key=mx.random.key(step))
            tiles, window_keys, window_values = read.stored()
            ours = built.tiled_decode_attention(queries, tiles, window_keys, window_values, mask, 0.125, G, 4)
            keys, values = read.expand()
            reference = built.decode_attention(queries, keys, values, mask, 0.125)
            gaps.append(mx.max(mx.abs(ours - reference)).item())
        return gaps

    gaps = mlx_thread().run(run)
    assert max(gaps) == 0.0, gaps


def test_blocks_are_whole_tiles_and_a_tail_keeps_float_keys():
    """A block cut on tiles is six arrays, restored as stored; a tail is the float keys
    and the values' triple; part of a block restores its tokens as if fed, the part
    tile's keys as they were stored."""
    def run() -> list[bool]:
        cache = TiledKVCache(G, 4)
        cache.update_and_fetch(rows_of(8, 150), rows_of(9, 150))
        block, tail = cache.cut(0, 128), cache.cut(128, 150)
        checks = [len(block) == 6 and block[0].shape[2] == 128, len(tail) == 4 and tail[0].dtype == mx.float32]
        whole = TiledKVCache(G, 4)
        whole.write(0, block, 128)
        whole.write(128, tail, 22)
        checks.append(whole.offset == 150 and (whole.full, whole.pending) == (2, 22))
        checks += [bool(mx.array_equal(a, b).item()) for a, b in zip(whole.fetch(), cache.fetch())]
        part = TiledKVCache(G, 4)
        part.write(0, block, 100)
        checks.append((part.full, part.pending) == (1, 36))
        checks += [bool(mx.array_equal(a, b[:, :, :100]).item()) for a, b in zip(part.fetch(), cache.fetch())]
        return checks

    assert all(mlx_thread().run(run))


def test_blocks_that_cannot_hold_whole_tiles_are_refused_at_start(quantizable):  # noqa: F811 - fixture
    with pytest.raises(ModelError, match=r"kv_bits=4 stores keys per channel in tiles of kv_group_size=64 "
                                         r"tokens.*plugin.batched.block_size=8 is not a multiple of 64"):
        start(quantizable("llama"), **{"engine.kv_bits": 4})
