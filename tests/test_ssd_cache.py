"""The paged SSD cache (built-in plugin ``ssd_cache``): block files, the writer, races, restarts."""

from __future__ import annotations

import inspect
import json
import logging
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from omlx_core.kvblocks import BlockStore, CachedBlock
from omlx_core.scheduling.prefix_cache import PrefixCache
from omlx_core.plugins.ssd_cache import blockfile
from omlx_core.plugins.ssd_cache.store import PagedSSDStore
from omlx_core.mlx_thread import mlx_thread
from omlx_core.testing.waiting import wait_for

IDENTITY = "a" * 32
BLOCK = 4


# -- helpers --------------------------------------------------------------------------------


def make_store(directory: Path, **overrides) -> PagedSSDStore:
    options = {"identity": IDENTITY, "budget": 1 << 30, **overrides}
    return PagedSSDStore(directory, **options)


def hybrid_states(seed: int) -> tuple:
    """Boundary states of a two-layer model: layer 0 is cuttable, 1 recurrent, 2 a window."""
    key = mx.random.key(seed)
    arrays = ArraysCache(2)
    arrays.cache = [mx.random.normal((1, 3, 8), key=key), mx.random.normal((1, 2, 4, 4), key=key + 1)]
    window = RotatingKVCache(max_size=8)
    window.update_and_fetch(mx.random.normal((1, 2, 6, 4), key=key + 2),
                            mx.random.normal((1, 2, 6, 4), key=key + 3))
    return (None, arrays, window)


def make_block(index: int, *, seed: int = 0, boundary: bool = False, layers: int = 3,
               dtype=mx.float32, parent: bytes | None = None) -> CachedBlock:
    key = mx.random.key(1000 * seed + index)
    cut = 1 if boundary else layers
    # Keys are a transposed view, as caches taken out of a decode batch can be: strided.
    kv = tuple((mx.random.normal((1, BLOCK, 2, 4), key=key + i).astype(dtype).transpose(0, 2, 1, 3),
                mx.random.normal((1, 2, BLOCK, 4), key=key + 50 + i).astype(dtype))
               if i < cut else None for i in range(layers))
    states = hybrid_states(1000 * seed + index) if boundary else None
    mx.eval([a for pair in kv if pair for a in pair], [s.state for s in states or () if s])
    nbytes = sum(a.nbytes for pair in kv if pair for a in pair)
    return CachedBlock(block_hash=bytes([seed % 256, index % 256]) * 8,
                       parent_hash=parent or b"\0" * 16, index=index, block_size=BLOCK, kv=kv,
                       boundary=states, reusable_end=states is not None or boundary is False,
                       nbytes=nbytes)


def chained_blocks(memory: PrefixCache, tokens: list[int], seed: int = 0) -> list[CachedBlock]:
    """The full blocks of ``tokens`` as ``memory`` hashes them, each with its token ids."""
    hashes = memory.hashes(tokens)
    return [CachedBlock(h, hashes[i - 1] if i else memory.root, i, BLOCK, make_block(i, seed=seed).kv,
                        None, True, make_block(i, seed=seed).nbytes,
                        tokens=tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
            for i, h in enumerate(hashes)]


def assert_same_block(got: CachedBlock, want: CachedBlock) -> None:
    assert (got.block_hash, got.parent_hash, got.index, got.block_size) == \
        (want.block_hash, want.parent_hash, want.index, want.block_size)
    for a, b in zip(got.kv, want.kv):
        assert (a is None) == (b is None)
        if a is not None:
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and np.array_equal(np.array(x.astype(mx.float32)),
                                                             np.array(y.astype(mx.float32)))
    if want.boundary is None:
        return
    assert got.boundary is not None and got.reusable_end
    for a, b in zip(got.boundary, want.boundary):
        assert type(a) is type(b)
        if a is None:
            continue
        for x, y in zip(_flat(a.state), _flat(b.state)):
            if isinstance(y, mx.array):
                assert np.array_equal(np.array(x), np.array(y))
            else:
                assert x == y


def _flat(value):
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


class PinnedWriter:
    """Holds the writer thread inside its next file write until released."""

    def __init__(self, store: PagedSSDStore) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self._real = store._writer._write_payload
        store._writer._write_payload = self._write

    def _write(self, payload, path):
        self.entered.set()
        assert self.release.wait(30), "test never released the writer"
        return self._real(payload, path)


def snapshot_files(store: PagedSSDStore) -> list[Path]:
    return sorted(p for p in store.snapshots_dir.rglob("*") if p.is_file())


def stage(store: PagedSSDStore, request_id: str, index: int, seed: int = 0) -> None:
    block = make_block(index, seed=seed, boundary=True)
    store.save_snapshot(request_id, index, block.block_hash, block.end_token, block.boundary)


# -- block files ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_block_round_trips_through_disk_with_its_boundary_state(tmp_path, dtype):
    store = make_store(tmp_path)
    plain, hybrid = make_block(0, dtype=dtype), make_block(1, seed=1, boundary=True, dtype=dtype)
    store.put(plain)
    store.put(hybrid)
    assert store.flush(10)
    assert_same_block(store.get(plain.block_hash), plain)
    assert_same_block(store.get(hybrid.block_hash), hybrid)
    metadata = blockfile.read_metadata(blockfile.block_path(store.blocks_dir, hybrid.block_hash))
    assert metadata["version"] == blockfile.FORMAT_VERSION
    assert metadata["block_hash"] == hybrid.block_hash.hex()
    assert metadata["model"] == IDENTITY
    assert (metadata["token_count"], metadata["layers"]) == (str(2 * BLOCK), "3")
    assert json.loads(metadata["layer_types"]) == ["KVCache", "ArraysCache", "RotatingKVCache"]
    stats = store.stats()
    assert (stats["saves"], stats["saves_persisted"], stats["loads"], stats["hits"]) == (2, 2, 2, 2)
    assert store.get(b"\x09" * 16) is None and store.stats()["misses"] == 1
    store.close()


def test_size_estimate_covers_the_real_file_including_metadata(tmp_path):
    block = make_block(0, layers=40)
    payload = blockfile.payload_of_kv(block.kv, block_hash=block.block_hash, parent_hash=block.parent_hash,
                                      index=0, block_size=BLOCK, identity=IDENTITY,
                                      layer_types=["KVCache" * 20] * 40)
    estimate = payload.estimated_file_size()  # before the host copy, as the quota gate sees it
    with pytest.raises(ValueError, match="to_host"):
        blockfile.write_payload(payload, tmp_path / "x.safetensors")
    size = blockfile.write_payload(payload.to_host(), tmp_path / "x.safetensors")
    # The metadata here is several KiB: a fixed 1 KiB allowance would undercount.
    assert len(json.dumps(payload.metadata)) > 4096
    assert size <= estimate <= size + 128 * len(payload.tensors) + 1024


def test_restarted_store_rebuilds_its_index_and_serves_old_blocks(tmp_path):
    store = make_store(tmp_path)
    blocks = [make_block(i, seed=2, boundary=(i == 2)) for i in range(3)]
    for block in blocks:
        store.put(block)
    store.close()
    (store.blocks_dir / ".deadbeef.tmp").write_bytes(b"half a write")
    again = make_store(tmp_path)
    assert again.stats()["blocks"] == 3
    assert not (again.blocks_dir / ".deadbeef.tmp").exists()
    for block in blocks:
        assert again.contains(block.block_hash)
        assert_same_block(again.get(block.block_hash), block)
    again.close()


def test_blocks_of_another_model_are_never_served(tmp_path):
    store = make_store(tmp_path)
    block = make_block(0, seed=3)
    store.put(block)
    store.close()
    other = make_store(tmp_path, identity="b" * 32)
    assert not other.contains(block.block_hash)
    assert other.get(block.block_hash) is None
    assert not blockfile.block_path(other.blocks_dir, block.block_hash).exists()
    other.close()


def test_corrupt_and_truncated_files_are_detected_skipped_and_removed(tmp_path):
    store = make_store(tmp_path)
    flipped, cut, good = (make_block(i, seed=4) for i in range(3))
    for block in (flipped, cut, good):
        store.put(block)
    assert store.flush(10)
    path = blockfile.block_path(store.blocks_dir, flipped.block_hash)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte inside the last tensor
    path.write_bytes(bytes(data))
    assert store.get(flipped.block_hash) is None
    assert not path.exists() and not store.contains(flipped.block_hash)
    assert store.stats()["errors"] == 1
    store.close()

    truncated = blockfile.block_path(store.blocks_dir, cut.block_hash)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    again = make_store(tmp_path)
    assert not truncated.exists() and not again.contains(cut.block_hash)
    assert_same_block(again.get(good.block_hash), good)
    again.close()


# -- writer queue, eviction, space ----------------------------------------------------------------


def test_saves_count_at_the_gate_and_saves_persisted_after_the_rename(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    block = make_block(0, seed=5)
    store.put(block)
    assert pin.entered.wait(10)
    stats = store.stats()
    assert (stats["saves"], stats["saves_persisted"]) == (1, 0)
    assert not blockfile.block_path(store.blocks_dir, block.block_hash).exists()
    assert store.get(block.block_hash) is None  # not served before it is complete
    pin.release.set()
    assert store.flush(10)
    assert store.stats()["saves_persisted"] == 1
    assert blockfile.block_path(store.blocks_dir, block.block_hash).exists()
    store.close()


def test_a_brief_backlog_is_ridden_over_and_sustained_saturation_drops(tmp_path):
    store = make_store(tmp_path, queue_size=1, save_timeout_s=60.0)
    pin = PinnedWriter(store)
    store.put(make_block(0, seed=6))  # held by the writer
    assert pin.entered.wait(10)
    store.put(make_block(1, seed=6))  # fills the queue
    saved = threading.Event()
    threading.Thread(target=lambda: (store.put(make_block(2, seed=6)), saved.set()),
                     daemon=True).start()
    assert not saved.wait(0.3), "the save did not wait for room in the full queue"
    pin.release.set()
    assert saved.wait(60)  # it gets in once the writer makes room
    assert store.flush(10)
    assert store.stats()["drops"] == 0 and store.stats()["saves_persisted"] == 3

    pin2 = PinnedWriter(store)
    store.save_timeout_s = 0.05
    store.put(make_block(3, seed=6))
    assert pin2.entered.wait(10)
    store.put(make_block(4, seed=6))
    dropped = make_block(5, seed=6)
    store.put(dropped)
    stats = store.stats()
    assert stats["drops"] == 1 and stats["saves"] == 5
    assert not store.contains(dropped.block_hash)  # its space was given back
    pin2.release.set()
    store.close()


def test_eviction_unlinks_inline_capped_per_save_and_carries_over(tmp_path):
    store = make_store(tmp_path, eviction_burst=3)
    blocks = [make_block(i, seed=7) for i in range(12)]
    for block in blocks:
        store.put(block)
    assert store.flush(10)
    per_block = store.stats()["bytes"] // 12
    store.budget = per_block * 2 + per_block // 2  # room for two blocks now
    pin = PinnedWriter(store)
    store.put(make_block(20, seed=7))
    # No unlink goes through the write queue: the files are gone before the writer runs.
    stats = store.stats()
    assert stats["evictions"] == 3 and stats["queue_depth"] == 0
    assert stats["declined"] == 1  # still over: this save waits for later ones
    assert sum(not blockfile.block_path(store.blocks_dir, b.block_hash).exists() for b in blocks) == 3
    for i in range(21, 25):
        store.put(make_block(i, seed=7))
    # At most 3 unlinks per save: the old blocks go over four saves, each of which is
    # declined until the cache is back under its limit.
    stats = store.stats()
    assert stats["evictions"] == 12 and stats["declined"] >= 3
    assert 1 <= stats["blocks"] <= 2 and stats["bytes"] <= store.limit_bytes()
    assert not any(store.contains(b.block_hash) for b in blocks)
    pin.release.set()
    assert store.flush(10)
    store.close()


def full_disk_at(path: Path) -> None:
    """Make the next write to ``path`` hit a real full disk (``/dev/full``: ENOSPC)."""
    path.symlink_to("/dev/full")


def test_disk_full_invalidates_the_disk_reading_and_logs_an_error(tmp_path, caplog):
    store = make_store(tmp_path, budget=None)
    assert store.limit_bytes() > 0 and store._quota.has_reading
    block = make_block(0, seed=8)
    full_disk_at(store.blocks_dir / f".{block.block_hash.hex()}.tmp")
    with caplog.at_level(logging.ERROR, logger="omlx_core.plugins.ssd_cache.writer"):
        store.put(block)
        assert store.flush(10)
    assert not store._quota.has_reading
    assert any(r.levelno == logging.ERROR and "disk full" in r.getMessage() for r in caplog.records)
    stats = store.stats()
    assert stats["errors"] == 1 and stats["saves_persisted"] == 0
    assert not store.contains(block.block_hash) and stats["bytes"] == 0
    assert list(store.blocks_dir.iterdir()) == []
    # Nothing pins the block: the next save of it goes through.
    store.put(block)
    assert store.flush(10) and store.stats()["saves_persisted"] == 1
    store.close()


def test_a_failed_boundary_upgrade_keeps_the_block_it_was_for(tmp_path):
    store = make_store(tmp_path)
    hybrid = make_block(3, seed=11, boundary=True)
    plain = replace_boundary(hybrid, None)
    store.put(plain)
    assert store.flush(10)
    size = store.stats()["bytes"]
    full_disk_at(store.blocks_dir / f".{hybrid.block_hash.hex()}.boundary.tmp")
    store.put(hybrid)  # gains its boundary state: a boundary-only write, which fails
    assert store.flush(10)
    assert store.stats()["errors"] == 1 and store.stats()["bytes"] == size
    got = store.get(hybrid.block_hash)
    assert got is not None and got.boundary is None and not got.reusable_end
    (store.blocks_dir / f".{hybrid.block_hash.hex()}.boundary.tmp").unlink(missing_ok=True)
    store.put(hybrid)  # and a later save can still add it
    assert store.flush(10)
    assert_same_block(store.get(hybrid.block_hash), hybrid)
    store.close()


def replace_boundary(block: CachedBlock, boundary) -> CachedBlock:
    from dataclasses import replace

    return replace(block, boundary=boundary, reusable_end=boundary is not None)


def test_after_a_drop_saves_do_not_wait_again_until_one_gets_in(tmp_path):
    store = make_store(tmp_path, queue_size=1, save_timeout_s=0.05)
    pin = PinnedWriter(store)
    store.put(make_block(0, seed=12))
    assert pin.entered.wait(10)
    store.put(make_block(1, seed=12))  # fills the queue
    store.put(make_block(2, seed=12))  # waits 50 ms, then is dropped
    store.save_timeout_s = 60.0
    block = make_block(3, seed=12)
    # On the MLX thread, as the engine saves: a plain thread must not run mlx work.
    late = threading.Thread(target=lambda: mlx_thread().run(store.put, block))
    late.start()
    late.join(10)  # would take 60 s if it waited
    assert not late.is_alive() and store.stats()["drops"] == 2
    pin.release.set()
    assert store.flush(10)
    store.save_timeout_s = 0.05
    store.put(make_block(4, seed=12))  # room again: saved, and waiting is back on
    assert store.flush(10) and store.stats()["saves_persisted"] == 3
    store.close()


def test_leaves_are_evicted_before_the_blocks_they_hang_from(tmp_path):
    store = make_store(tmp_path, eviction_burst=1)
    chain = [make_block(i, seed=13) for i in range(3)]
    for block in chain:  # saved root first, as prefill stores them
        store.put(block)
    assert store.flush(10)
    store.touch([b.block_hash for b in chain])
    store.budget = store.stats()["bytes"]  # full: the next save evicts exactly one
    store.put(make_block(0, seed=14))
    assert not store.contains(chain[2].block_hash)
    assert store.contains(chain[0].block_hash) and store.contains(chain[1].block_hash)
    store.close()
    # The order survives a restart (kept in the files' mtimes).
    again = make_store(tmp_path)
    assert list(again._index)[:2] == [chain[1].block_hash, chain[0].block_hash]
    again.close()


def test_one_process_per_directory(tmp_path):
    from omlx_core.plugins.ssd_cache.store import DirectoryInUseError

    store = make_store(tmp_path)
    with pytest.raises(DirectoryInUseError, match="give each server its own plugin.ssd_cache.dir"):
        make_store(tmp_path)
    store.close()
    make_store(tmp_path).close()  # free again once closed


# -- boundary snapshots per request and their cleanup ---------------------------------------------


def test_persisted_block_adopts_its_requests_staged_snapshot(tmp_path):
    store = make_store(tmp_path)
    block = make_block(2, seed=9, boundary=True)
    store.save_snapshot("req-a", 2, block.block_hash, block.end_token, block.boundary)
    assert store.flush(10)
    assert [p.name for p in snapshot_files(store)] == ["2.safetensors"]
    assert snapshot_files(store)[0].parent.name == "req-a"
    store.put(block)
    assert store.flush(10)
    assert snapshot_files(store) == []  # moved, not copied
    assert blockfile.boundary_path(store.blocks_dir, block.block_hash).exists()
    assert_same_block(store.get(block.block_hash), block)
    store.finish_request("req-a")
    assert store.flush(10)
    assert not store.request_dir("req-a").exists()
    store.close()


def test_cleanup_all_waits_for_the_item_the_writer_holds(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    stage(store, "req-1", 0)
    assert pin.entered.wait(10)
    stage(store, "req-2", 1)
    stage(store, "req-3", 2)
    done = threading.Event()
    threading.Thread(target=lambda: (store.cleanup_all(), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # blocked on the writer's item
    assert store.stats()["queue_depth"] == 0  # the queued ones were withdrawn
    pin.release.set()
    assert done.wait(10)
    assert store.flush(10)
    assert snapshot_files(store) == []
    store.close()


def test_cleanup_request_waits_for_the_pinned_item_and_no_file_reappears(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    stage(store, "req-x", 0)
    assert pin.entered.wait(10)
    stage(store, "req-x", 1)
    stage(store, "req-y", 2)
    done = threading.Event()
    threading.Thread(target=lambda: (store.cleanup_request("req-x"), done.set()), daemon=True).start()
    assert not done.wait(0.3)
    pin.release.set()
    assert done.wait(10)
    assert store.flush(10)
    assert not store.request_dir("req-x").exists()
    assert [p.parent.name for p in snapshot_files(store)] == ["req-y"]
    assert store.pending_cancellations() == {}
    store.close()


def test_timed_out_cleanup_keeps_the_counter_so_the_late_write_is_discarded(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    stage(store, "req-late", 0)
    assert pin.entered.wait(10)
    assert store.cleanup_request("req-late", timeout=0.1) is False
    assert store.pending_cancellations() == {"req-late": 1}
    assert store.stats()["errors"] == 0
    # A repeated cleanup adds to the count only for items not already counted.
    assert store.cleanup_request("req-late", timeout=0.1) is False
    assert store.pending_cancellations() == {"req-late": 1}
    pin.release.set()
    assert store.flush(10)
    assert not store.request_dir("req-late").exists()
    assert store.pending_cancellations() == {}
    assert store.stats()["errors"] == 0  # discarded as cancelled, not failed
    # The counter is gone, so a new save under the same id is written, not discarded.
    stage(store, "req-late", 1)
    assert store.flush(10)
    assert [p.parent.name for p in snapshot_files(store)] == ["req-late"]
    store.close()


def test_cleanup_of_a_request_with_nothing_pending_creates_no_counter(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    stage(store, "req-busy", 0)
    assert pin.entered.wait(10)
    # The writer holds another request's item: nothing to wait for, no counter made.
    assert store.cleanup_request("never-saved", timeout=30) is True
    assert not pin.release.is_set() and pin.entered.is_set()
    assert "never-saved" not in store.pending_cancellations()
    pin.release.set()
    stage(store, "never-saved", 1)
    assert store.flush(10)
    assert {p.parent.name for p in snapshot_files(store)} == {"req-busy", "never-saved"}
    store.close()


def test_a_block_keeps_its_boundary_when_its_staged_snapshot_was_cleaned_up(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    store.put(make_block(0, seed=15))
    assert pin.entered.wait(10)
    hybrid = make_block(1, seed=15, boundary=True)
    store.save_snapshot("req-gone", 1, hybrid.block_hash, hybrid.end_token, hybrid.boundary)
    store.put(hybrid)
    store.cleanup_request("req-gone")  # the aborted request's staged write is withdrawn
    pin.release.set()
    assert store.flush(10)
    assert snapshot_files(store) == []
    assert_same_block(store.get(hybrid.block_hash), hybrid)
    store.close()


def test_close_with_cleanup_removes_snapshots_before_stopping_and_flushes_blocks(tmp_path):
    store = make_store(tmp_path)
    pin = PinnedWriter(store)
    block = make_block(0, seed=10)
    store.put(block)
    assert pin.entered.wait(10)
    stage(store, "req-s", 1)
    closed = threading.Event()
    threading.Thread(target=lambda: (store.close(cleanup=True), closed.set()), daemon=True).start()
    assert wait_for(lambda: snapshot_files(store) == [], 60), "close left the snapshots"
    assert not closed.is_set(), "close did not wait for the block the writer holds"
    pin.release.set()
    assert closed.wait(60)
    assert blockfile.block_path(store.blocks_dir, block.block_hash).exists()
    assert not store._writer.thread.is_alive()
    stage(store, "req-after", 2)  # an engine still prefilling after shutdown: ignored
    assert snapshot_files(store) == []


def test_request_ids_that_are_not_file_names_get_a_safe_directory(tmp_path):
    store = make_store(tmp_path)
    for request_id in ("../../etc", "a/b", ".hidden", "x" * 300):
        directory = store.request_dir(request_id)
        assert directory.parent == store.snapshots_dir and directory.name.startswith("h-")
    assert store.request_dir("chatcmpl-12_ab.c").name == "chatcmpl-12_ab.c"
    store.close()


# -- behind the prefix cache ---------------------------------------------------------------------


def test_the_ssd_store_implements_every_block_store_method():
    """Nothing the prefix cache asks of the SSD tier falls back to BlockStore's defaults
    for a tier without such state: the store answers every method itself."""
    declared = {name for name, value in vars(BlockStore).items()
                if inspect.isfunction(value) and not name.startswith("_")}
    assert declared >= {"get", "put", "touch", "continuations", "pending_bytes", "drop_pending", "stats"}
    assert issubclass(PagedSSDStore, BlockStore) and not inspect.isabstract(PagedSSDStore)
    for name in sorted(declared):
        own = inspect.getattr_static(PagedSSDStore, name)
        assert own is not vars(BlockStore)[name], f"PagedSSDStore inherits {name} from BlockStore"
        assert list(inspect.signature(own).parameters) == \
            list(inspect.signature(vars(BlockStore)[name]).parameters), name


def test_prefix_cache_writes_through_and_reads_back_from_disk_without_a_second_copy(tmp_path):
    store = make_store(tmp_path)
    memory = PrefixCache(BLOCK, 1 << 20, "m")
    memory.attach_lower(store)
    tokens = list(range(3 * BLOCK))
    hashes = memory.hashes(tokens)
    blocks = [CachedBlock(h, hashes[i - 1] if i else memory.root, i, BLOCK, make_block(i).kv, None,
                          True, make_block(i).nbytes) for i, h in enumerate(hashes)]
    memory.insert(blocks)
    assert store.flush(10) and store.stats()["saves_persisted"] == 3
    fresh = PrefixCache(BLOCK, 1 << 20, "m")
    fresh.attach_lower(store)
    found = fresh.lookup(hashes)
    assert [b.index for b in found] == [0, 1, 2]
    assert fresh.stats()["lower"]["loads"] == 3
    # The caller holds what was read (it becomes a request's own KV): memory keeps no
    # second copy of it, and the disk keeps serving it.
    assert fresh.peek(hashes) == 0 and fresh.nbytes == 0
    assert [b.index for b in fresh.lookup(hashes)] == [0, 1, 2]
    assert fresh.stats()["lower"]["loads"] == 6
    store.close()


def test_metrics_endpoint_exposes_the_counters(tmp_path):
    from omlx_core.http.metrics import flatten_stats

    store = make_store(tmp_path)
    memory = PrefixCache(BLOCK, 1 << 20, "m")
    memory.attach_lower(store)
    flat = flatten_stats({"prefix_cache": memory.stats()})
    for counter in ("saves", "saves_persisted", "loads", "hits", "misses", "evictions", "drops",
                    "errors"):
        assert f"prefix_cache_lower_{counter}" in flat
    store.close()


def test_write_benchmark_accounts_for_every_block(tiny_model_path):
    from benchmarks.ssd_cache import measure_writes, render

    row = measure_writes(tiny_model_path("llama"), blocks=10, queue_size=2, block_size=8)
    assert row.offered == 10 and row.saves + row.drops + row.declined == 10
    assert row.persisted == row.saves and row.megabytes > 0
    assert "| 2 | 10 |" in render([], [row], [])


def test_a_save_the_writer_has_no_room_for_evicts_nothing(tmp_path):
    store = make_store(tmp_path, queue_size=1, save_timeout_s=0.05)
    blocks = [make_block(i, seed=21) for i in range(4)]
    for block in blocks:  # one at a time: a busy machine may not run the writer in 50 ms
        store.put(block)
        assert store.flush(10)
    assert store.stats()["saves_persisted"] == 4
    store.budget = store.stats()["bytes"]  # full: a new block would evict one
    pin = PinnedWriter(store)
    store.put(make_block(10, seed=21))  # evicts one, then is held by the writer
    assert pin.entered.wait(10)
    store.put(make_block(11, seed=21))  # evicts one, fills the queue
    before = store.stats()
    store.put(make_block(12, seed=21))  # no room in the queue: dropped before evicting
    after = store.stats()
    assert after["drops"] == before["drops"] + 1
    assert after["evictions"] == before["evictions"]
    assert sum(store.contains(b.block_hash) for b in blocks) == 4 - before["evictions"]
    pin.release.set()
    store.close()


# -- host memory of queued writes ------------------------------------------------------------------


def test_queued_writes_stay_within_queue_bytes_and_one_block_always_fits(tmp_path):
    block_bytes = make_block(0, seed=30).nbytes
    store = make_store(tmp_path, queue_size=64, queue_bytes=2 * block_bytes, save_timeout_s=0.05)
    pin = PinnedWriter(store)
    store.put(make_block(0, seed=30))  # held by the writer: it still holds its host copy
    assert pin.entered.wait(10)
    store.put(make_block(1, seed=30))  # queued: two blocks' worth of host memory now
    assert store.pending_bytes() == 2 * block_bytes
    before = store.stats()
    store.put(make_block(2, seed=30))  # over queue_bytes: dropped before any copy
    assert store.stats()["drops"] == before["drops"] + 1
    assert not store.contains(make_block(2, seed=30).block_hash)
    assert store.pending_bytes() == 2 * block_bytes
    pin.release.set()
    assert store.flush(10) and store.pending_bytes() == 0
    store.close()

    # A block larger than queue_bytes is still saved when nothing else is queued.
    large = make_block(5, seed=31)
    small_queue = make_store(tmp_path / "small", queue_bytes=large.nbytes // 3)
    small_queue.put(large)
    assert small_queue.flush(10) and small_queue.stats()["saves_persisted"] == 1
    small_queue.close()


def test_dropping_pending_writes_frees_their_host_copies_newest_first(tmp_path):
    store = make_store(tmp_path, queue_size=64)
    pin = PinnedWriter(store)
    blocks = [make_block(i, seed=32) for i in range(4)]
    store.put(blocks[0])
    assert pin.entered.wait(10)
    for block in blocks[1:]:
        store.put(block)
    one = blocks[0].nbytes
    assert store.pending_bytes() == 4 * one
    assert store.drop_pending(one + 1) == 2 * one  # whole blocks, the newest two
    assert [store.contains(b.block_hash) for b in blocks] == [True, True, False, False]
    assert store.pending_bytes() == 2 * one
    assert store.stats()["drops"] == 2
    assert store.drop_pending(10 * one) == one  # the held write cannot be dropped
    pin.release.set()
    assert store.flush(10)
    assert store.stats()["saves_persisted"] == 1 and store.pending_bytes() == 0
    store.close()


def test_the_prefix_cache_counts_queued_writes_as_memory_it_can_give_back(tmp_path):
    store = make_store(tmp_path, queue_size=64)
    memory = PrefixCache(BLOCK, 1 << 20, "m")
    memory.attach_lower(store)
    pin = PinnedWriter(store)
    tokens = list(range(3 * BLOCK))
    hashes = memory.hashes(tokens)
    blocks = chained_blocks(memory, tokens)
    memory.insert(blocks)
    assert pin.entered.wait(10)
    one = blocks[0].nbytes
    assert memory.reclaimable_bytes() == memory.nbytes + 3 * one == 6 * one
    # Queued writes go first: the blocks in memory keep serving.
    assert memory.release(one) == one
    assert memory.peek(hashes) == 3 and store.pending_bytes() == 2 * one
    # Then blocks, and none is copied for the store: that would take the room back.
    assert memory.release(2 * one) == 2 * one
    assert memory.peek(hashes) == 2 and store.pending_bytes() == one  # the held write only
    pin.release.set()
    assert store.flush(10)
    # Only the write the writer held when the memory was needed reached the disk.
    assert [store.contains(h) for h in hashes] == [True, False, False]
    store.close()


# -- reuse in part after a restart ----------------------------------------------------------------


def test_a_restarted_cache_reuses_part_of_a_block_only_the_disk_holds(tmp_path):
    store = make_store(tmp_path)
    memory = PrefixCache(BLOCK, 1 << 20, "m")
    memory.attach_lower(store)
    tokens = list(range(100, 100 + 3 * BLOCK))
    hashes = memory.hashes(tokens)
    blocks = chained_blocks(memory, tokens, seed=33)
    memory.insert(blocks)
    assert store.flush(10)
    store.close()

    restarted = make_store(tmp_path)  # a new process: the index is rebuilt from the files
    fresh = PrefixCache(BLOCK, 1 << 20, "m")
    fresh.attach_lower(restarted)
    # Same first block, then the second block's first 3 tokens, then something new.
    prompt = tokens[:BLOCK] + tokens[BLOCK:BLOCK + 3] + [7, 7, 7, 7, 7, 7]
    found, tail, shared = fresh.lookup_prefix(fresh.hashes(prompt), prompt)
    assert [b.index for b in found] == [0]
    assert shared == 3 and tail is not None and tail.tokens == tuple(tokens[BLOCK:2 * BLOCK])
    assert tail.parent_hash == hashes[0]
    # The keys and values are the block's own, read back from disk.
    assert np.array_equal(np.array(tail.kv[0][1]), np.array(blocks[1].kv[0][1]))
    assert restarted.stats()["loads"] == 2
    # A prompt sharing no token of a continuation reads its first block only (memory
    # kept no copy of what was read).
    other = tokens[:BLOCK] + [9] * (BLOCK + 1)
    found, tail, shared = fresh.lookup_prefix(fresh.hashes(other), other)
    assert [b.index for b in found] == [0] and shared == 0
    assert restarted.stats()["loads"] == 3
    restarted.close()


def test_blocks_without_their_tokens_are_never_offered_in_part(tmp_path):
    store = make_store(tmp_path)
    parent = b"\1" * 16
    store.put(make_block(0, seed=34, parent=parent))  # no tokens stored with it
    hybrid = make_block(1, seed=34, parent=parent, boundary=True)
    store.put(CachedBlock(hybrid.block_hash, parent, 1, BLOCK, hybrid.kv, hybrid.boundary, True,
                          hybrid.nbytes, tokens=(1, 2, 3, 4)))  # a layer not cut by token
    assert store.flush(10)
    assert store.continuations(parent) == []
    store.close()
    assert make_store(tmp_path).continuations(parent) == []


def test_a_tail_reaches_the_disk_and_is_reused_to_the_token_after_a_restart(tmp_path):
    from omlx_core.kvblocks import CachedTail

    store = make_store(tmp_path)
    memory = PrefixCache(BLOCK, 1 << 20, "m")
    memory.attach_lower(store)
    tokens = list(range(200, 200 + 2 * BLOCK + 3))  # two blocks and a 3-token tail
    hashes = memory.hashes(tokens)
    blocks = chained_blocks(memory, tokens, seed=35)
    memory.insert(blocks)
    tail_kv = tuple((k[..., :3, :], v[..., :3, :]) for k, v in make_block(9, seed=35).kv)
    memory.insert_tail(CachedTail(hashes[1], tuple(tokens[2 * BLOCK:]), tail_kv,
                                  sum(a.nbytes for pair in tail_kv for a in pair)))
    assert store.flush(10) and store.stats()["saves_persisted"] == 3
    store.close()

    restarted = make_store(tmp_path)
    fresh = PrefixCache(BLOCK, 1 << 20, "m")
    fresh.attach_lower(restarted)
    prompt = tokens + [5, 5]  # the whole earlier sequence, then something new
    found, tail, shared = fresh.lookup_prefix(fresh.hashes(prompt), prompt)
    assert [b.index for b in found] == [0, 1] and shared == 3
    assert np.array_equal(np.array(tail.kv[0][0][..., :3, :]), np.array(tail_kv[0][0]))
    restarted.close()


def test_keys_past_the_vocabulary_are_indexed_as_they_are(tmp_path):
    """Engines key image tokens far past any vocabulary (a digest): the index takes them."""
    store = make_store(tmp_path)
    memory = PrefixCache(BLOCK, 1 << 20, "m")
    memory.attach_lower(store)
    tokens = [2 ** 56 + i for i in range(BLOCK)] + [1, 2, 3, 4]
    hashes = memory.hashes(tokens)
    blocks = chained_blocks(memory, tokens, seed=36)
    memory.insert(blocks)
    assert store.flush(10)
    store.close()
    restarted = make_store(tmp_path)
    found = [(h, tuple(t)) for h, t in restarted.continuations(memory.root)]
    assert found == [(hashes[0], tuple(tokens[:BLOCK]))]
    restarted.close()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_only_the_owner_may_read_the_cache(tmp_path):
    """Blocks hold KV and their metadata the token ids of prompts: directories 0700, files
    0600, whatever the umask, and an older cache's looser modes are tightened at start."""
    import os

    root = tmp_path / "ssd" / "model-x"
    old_umask = os.umask(0o022)
    try:
        store = make_store(root)
        block = make_block(0, seed=3, boundary=True)
        store.save_snapshot("req-a", 0, block.block_hash, block.end_token, block.boundary)
        store.put(block)
        store.put(make_block(1, seed=4))
        assert store.flush(10)
        for directory in (root.parent, root, store.blocks_dir, store.snapshots_dir):
            assert _mode(directory) == 0o700, directory
        files = [p for p in root.rglob("*") if p.is_file()]
        assert len(files) >= 3 and all(_mode(p) == 0o600 for p in files), \
            {p.name: oct(_mode(p)) for p in files}
        store.close()
        # A cache an older version wrote: world-readable, tightened by the next start.
        for path in [root, store.blocks_dir, *store.blocks_dir.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        again = make_store(root)
        assert again.stats()["blocks"] == 2
        assert _mode(root) == 0o700 and _mode(again.blocks_dir) == 0o700
        assert all(_mode(p) == 0o600 for p in again.blocks_dir.iterdir())
        again.close()
    finally:
        os.umask(old_umask)


# -- the writer leaves the cores to the forwards ------------------------------------------------


class Forwards:
    """Stands in for the MLX thread's ``wait_quiet``: forwards run until ``quiet`` is set."""

    def __init__(self) -> None:
        self.quiet = threading.Event()
        self.asked = threading.Event()

    def wait_quiet(self, timeout: float) -> bool:
        self.asked.set()
        return self.quiet.wait(timeout)


def test_the_writer_puts_writes_off_while_the_forwards_run(tmp_path):
    forwards = Forwards()
    store = make_store(tmp_path)
    store.yield_to(forwards.wait_quiet)
    block = make_block(0, seed=40)
    store.put(block)
    assert forwards.asked.wait(10)
    # Put off: still queued (the memory guard can still take its host copy back).
    assert store.stats()["saves_persisted"] == 0 and store.pending_bytes() == block.nbytes
    assert store.drop_pending(1) == block.nbytes
    store.put(make_block(1, seed=40))
    forwards.quiet.set()
    assert wait_for(lambda: store.stats()["saves_persisted"] == 1)
    assert not store.contains(block.block_hash) and store.contains(make_block(1, seed=40).block_hash)
    store.close()


def test_a_pressed_queue_and_a_flush_are_written_while_the_forwards_run(tmp_path):
    forwards = Forwards()  # never quiet
    block_bytes = make_block(0, seed=41).nbytes
    store = make_store(tmp_path, queue_bytes=4 * block_bytes)
    store.yield_to(forwards.wait_quiet)
    store.put(make_block(0, seed=41))
    assert forwards.asked.wait(10)
    # Half the queue's bytes queued: the writer writes rather than let saves be dropped,
    # down to under half, then puts the rest off again.
    store.put(make_block(1, seed=41))
    assert wait_for(lambda: store.stats()["saves_persisted"] == 1)
    assert store.pending_bytes() == block_bytes
    # A flush (shutdown, a test, a benchmark) waits for nobody's forwards.
    assert store.flush(10) and store.stats()["saves_persisted"] == 2
    store.close()


def test_the_mlx_thread_says_when_it_is_quiet():
    from omlx_core.mlx_thread import MLXThread

    thread = MLXThread(name="omlx-test-quiet")
    assert thread.wait_quiet(10)

    class Worker:
        def __init__(self) -> None:
            self.work = True
            self.stepping = threading.Event()
            self.go = threading.Event()

        def has_work(self) -> bool:
            return self.work

        def step(self) -> None:
            self.stepping.set()
            assert self.go.wait(10)
            self.work = False

        def fail(self, exc: BaseException) -> None:
            pass

    worker = Worker()
    thread.attach(worker)
    assert worker.stepping.wait(10)
    assert not thread.wait_quiet(0.05)  # mid-step
    worker.go.set()
    assert thread.wait_quiet(10)
    thread.detach(worker)


def test_core_hands_the_tier_the_mlx_threads_wait_quiet(tmp_path, tiny_model_path):
    from omlx_core.testing.served import ServedEngine

    with ServedEngine(tiny_model_path("llama"), tmp_path / "ssd") as served:
        assert served.store._writer._wait_quiet == mlx_thread().wait_quiet
