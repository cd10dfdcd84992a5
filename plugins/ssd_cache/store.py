"""The paged SSD block store: prefix-cache blocks on disk, surviving restarts.

Layout of one model's directory (``<plugin.ssd_cache.dir>/<model id>-<identity>/``)::

    blocks/<hash>.safetensors            KV of one block (cuttable layers)
    blocks/<hash>.boundary.safetensors   non-cuttable layers' state at the block's end
    snapshots/<request id>/<index>.safetensors   boundary states staged per request

:class:`PagedSSDStore` is the :class:`~omlx_core.kvblocks.BlockStore` the prefix cache
talks to; it composes one part per concern: the directory lock (:mod:`.dirlock`), the
index of blocks in use order with the partial-block index (:mod:`.index`), the byte
quota (:mod:`.quota`), the writer thread and its queue (:mod:`.writer`), the boundary
snapshots staged per request (:mod:`.snapshots`), restart recovery (:mod:`.recovery`)
and the file format (:mod:`.blockfile`).

**Saving** (:meth:`PagedSSDStore.put`, on the MLX thread): a save the writer has no room
for is dropped first; then the quota gate evicts least-recently-used blocks inline (at
most ``eviction_burst`` unlinks per save, the rest carried over to later saves) and
reserves the block's bytes; the block is copied to host memory and queued for the
writer. Recency follows the prefix cache's :meth:`~PagedSSDStore.touch` (deepest block
first), so a chain's leaves are evicted before the blocks they hang from; the order is
kept in the files' mtimes for the next process.

**Loading** (:meth:`PagedSSDStore.get`): :meth:`~PagedSSDStore.describe` says from the
index what a block's read brings into memory (its files' bytes) before anything is
read, so that memory is asked for first. A block file is checked against its header
(format, model identity, block hash) and every tensor's CRC; a truncated, corrupt or
foreign file is removed and counted in ``errors``, never served. A restarted store
rebuilds its index by scanning ``blocks/`` (temp files and invalid files are removed).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from omlx_core.kvblocks import BlockStore, CachedBlock, StoredBlock
from omlx_core.plugins.ssd_cache.blockfile import (
    make_private_dir,
    BLOCK_KIND, BOUNDARY_KIND, block_path, boundary_path, check_metadata, file_size, kv_of, payload_of_kv,
    payload_of_states, read_arrays, remove_block_files, remove_file, states_of)
from omlx_core.plugins.ssd_cache.counters import COUNTERS, Counters
from omlx_core.plugins.ssd_cache.dirlock import DirectoryInUseError, release_directory, take_directory
from omlx_core.plugins.ssd_cache.index import BlockIndex
from omlx_core.plugins.ssd_cache.quota import DiskQuota
from omlx_core.plugins.ssd_cache.recovery import scan_blocks
from omlx_core.plugins.ssd_cache.snapshots import SnapshotStaging
from omlx_core.plugins.ssd_cache.writer import DEFAULT_DEFER_S, BlockWriter, WriteItem, give_back, host_bytes
from omlx_core.settings import format_size

log = logging.getLogger(__name__)

#: host memory queued block writes may hold (``plugin.ssd_cache.queue_bytes``). The writer
#: puts writes off while the forwards run until the queue is half full, so this is also how
#: much of a turn's writes can wait. A sliding-window model's block carries its window's
#: state (20-26 MB on a 576-wide gemma3: ~185 MB a turn of 350 new tokens), and 64 MiB
#: holds two: raise it for such a model where memory allows (256 MiB took the SSD tier's
#: cost off that model's turns). It is not raised by default: the copies are made without
#: asking the memory guard, which drops them only at its next check (docs/reliability.md).
DEFAULT_QUEUE_BYTES = 64 << 20


def layer_types_of(kv: Sequence[Any], boundary: Sequence[Any] | None) -> list[str]:
    types = []
    for layer, pair in enumerate(kv):
        if pair is not None:
            # A quantized layer's block holds six arrays (packed, scales, biases of K and V).
            types.append("KVCache" if len(pair) == 2 else "QuantizedKVCache")
        elif boundary is not None and boundary[layer] is not None:
            types.append(type(boundary[layer]).__name__)
        else:
            types.append("uncut")
    return types


class PagedSSDStore(BlockStore):
    """Blocks of one model on disk: a :class:`~omlx_core.kvblocks.BlockStore`."""

    def __init__(self, directory: Path, *, identity: str, budget: int | None = None,
                 auto_share: float = 0.5, queue_size: int = 64, queue_bytes: int | None = DEFAULT_QUEUE_BYTES,
                 save_timeout_s: float = 0.25,
                 eviction_burst: int = 32, disk_usage_ttl_s: float = 30.0,
                 cleanup_all_timeout_s: float = 5.0, cleanup_request_timeout_s: float = 2.0,
                 flush_timeout_s: float = 10.0,
                 defer_s: float = DEFAULT_DEFER_S) -> None:
        self.directory = Path(directory)
        self.blocks_dir = self.directory / "blocks"
        self.snapshots_dir = self.directory / "snapshots"
        self.identity = identity
        self.eviction_burst = eviction_burst
        self.flush_timeout_s = flush_timeout_s
        self._closed = False

        if not self.directory.parent.exists():
            make_private_dir(self.directory.parent)
        make_private_dir(self.directory)
        self._lock_file = take_directory(self.directory)
        make_private_dir(self.blocks_dir)
        make_private_dir(self.snapshots_dir)
        self._counts = Counters()
        self._index = BlockIndex()
        self._quota = DiskQuota(self.blocks_dir, budget=budget, auto_share=auto_share, ttl_s=disk_usage_ttl_s)
        self._writer = BlockWriter(self.directory, index=self._index, quota=self._quota, counters=self._counts,
                                   queue_size=queue_size, queue_bytes=queue_bytes,
                                   save_timeout_s=save_timeout_s, defer_s=defer_s)
        self._staging = SnapshotStaging(self.snapshots_dir, identity=identity, index=self._index,
                                        writer=self._writer, cleanup_all_timeout_s=cleanup_all_timeout_s,
                                        cleanup_request_timeout_s=cleanup_request_timeout_s)
        # Snapshots staged by a previous process belong to requests that no longer exist.
        self.cleanup_all()
        self._recover()
        self._writer.start()

    def _recover(self) -> None:
        found, removed = scan_blocks(self.blocks_dir, self.identity, self.directory.name)
        self._index.load(found)
        if found or removed:
            log.info("SSD cache %s: %d blocks (%s) from earlier runs, %d unusable files removed",
                     self.directory, len(found), format_size(self._index.used_bytes), removed)

    @property
    def budget(self) -> int | None:
        """The configured byte budget (``None``: a share of the free disk)."""
        return self._quota.budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        self._quota.budget = value

    @property
    def save_timeout_s(self) -> float:
        """How long a save waits for room in a full write queue."""
        return self._writer.save_timeout_s

    @save_timeout_s.setter
    def save_timeout_s(self, value: float) -> None:
        self._writer.save_timeout_s = value

    # -- the BlockStore protocol ---------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is indexed: on disk, or queued to be written."""
        return block_hash in self._index

    def get(self, block_hash: bytes) -> CachedBlock | None:
        """The block, read back from disk and checked; ``None`` when absent or unusable."""
        entry = self._index.entry(block_hash)
        if entry is None or not entry.persisted or self._closed:
            self._counts.add("misses")
            return None
        self._counts.add("hits")
        path = block_path(self.blocks_dir, block_hash)
        try:
            metadata, arrays = read_arrays(path)
            check_metadata(metadata, kind=BLOCK_KIND, block_hash=block_hash,
                           identity=self.identity, name=path.name)
            kv = kv_of(arrays, int(metadata["layers"]))
            index, block_size = int(metadata["index"]), int(metadata["block_size"])
            parent = bytes.fromhex(metadata["parent_hash"])
            tokens = tuple(int(t) for t in json.loads(metadata.get("tokens", "[]")))
        except Exception as exc:  # whatever a damaged file raises, it is not served
            self._discard(block_hash, f"block {block_hash.hex()} is unusable and was removed: {exc}")
            return None
        boundary = self._read_boundary(block_hash) if entry.has_boundary else None
        nbytes = sum(a.nbytes for pair in kv if pair is not None for a in pair)
        if boundary is not None:
            nbytes += sum(a.nbytes for layer in boundary if layer is not None
                          for a in _arrays_of(layer.state))
        needs_boundary = any(pair is None for pair in kv)
        self._counts.add("loads")
        # A partial block (a prompt's tail) holds fewer tokens than a full one.
        self._counts.add("tokens_loaded", min(block_size, len(tokens) or block_size))
        return CachedBlock(block_hash=block_hash, parent_hash=parent, index=index,
                           block_size=block_size, kv=kv, boundary=boundary,
                           reusable_end=boundary is not None or not needs_boundary, nbytes=nbytes,
                           tokens=tokens)

    def describe(self, block_hash: bytes) -> StoredBlock | None:
        """What :meth:`get` would bring into memory, from the index (no file is read):
        the block's file sizes, its tensors and their headers, so never less."""
        entry = self._index.entry(block_hash)
        if entry is None or not entry.persisted or self._closed:
            return None
        return StoredBlock(nbytes=entry.size, has_boundary=entry.has_boundary)

    def _read_boundary(self, block_hash: bytes) -> tuple[Any, ...] | None:
        path = boundary_path(self.blocks_dir, block_hash)
        try:
            metadata, arrays = read_arrays(path)
            check_metadata(metadata, kind=BOUNDARY_KIND, block_hash=block_hash,
                           identity=self.identity, name=path.name)
            return states_of(metadata, arrays)
        except Exception as exc:  # whatever a damaged file raises, it is not served
            log.warning("SSD cache: the boundary state of block %s is unusable and was removed "
                        "(the block stays, without it): %s", block_hash.hex(), exc)
            size = file_size(path)
            remove_file(path)
            self._counts.add("errors")
            self._index.boundary_lost(block_hash, size)
            return None

    def put(self, block: CachedBlock) -> None:
        """Save ``block`` unless it is already on disk as well as it can be; may decline
        (quota) or drop (writer backlog)."""
        block_hash = block.block_hash
        if self._closed:
            return
        existing = self._index.entry(block_hash)
        if existing is not None and (existing.has_boundary or block.boundary is None):
            return
        kind = "block" if existing is None else "boundary"
        # A save the writer has no room for is dropped now, before it evicts persisted
        # blocks to make room on disk or copies anything to host memory for nothing.
        if not self._writer.has_room(block.nbytes):
            return
        staged = self._staging.claim(block_hash)
        # Built and sized before any copy: a declined block costs no host copy.
        layer_types = layer_types_of(block.kv, block.boundary)
        payload = None
        if kind == "block":
            payload = payload_of_kv(block.kv, block_hash=block_hash, parent_hash=block.parent_hash,
                                    tokens=block.tokens,
                                    index=block.index, block_size=block.block_size,
                                    identity=self.identity, layer_types=layer_types)
        boundary = staged
        if boundary is None and block.boundary is not None:
            boundary = payload_of_states(block.boundary, block_hash=block_hash, index=block.index,
                                         token_count=block.index * block.block_size
                                         + (len(block.tokens) if ends_a_turn(block) else block.block_size),
                                         identity=self.identity,
                                         layer_types=layer_types)
        size = sum(p.estimated_file_size() for p in (payload, boundary) if p is not None)
        admitted, victims = self._index.reserve(block_hash, size, limit=self._quota.limit,
                                                new_entry=kind == "block", eviction_burst=self.eviction_burst)
        self._counts.add("evictions", len(victims))
        remove_block_files(self.blocks_dir, victims)
        if not admitted:
            self._counts.add("declined")
            return
        if kind == "block" and (block.partially_reusable or ends_a_turn(block)):
            self._index.set_tokens(block_hash, block.parent_hash, block.tokens)
        for part in (payload, boundary):
            if part is not None:
                part.to_host()
        item = WriteItem(kind, block_hash=block_hash, index=block.index, payload=payload,
                         boundary=boundary, reserved=size)
        self._writer.submit(item, on_drop=lambda: give_back(self._index, item))

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain (root first) as just used: its deepest block becomes the least
        recent of them, so eviction takes leaves before the blocks they hang from. The
        order is kept in the files' mtimes for the next process."""
        chain = self._index.touch(hashes)
        now = time.time_ns()
        for position, block_hash in enumerate(reversed(chain)):
            try:
                os.utime(block_path(self.blocks_dir, block_hash), ns=(now + position,) * 2)
            except OSError:
                pass  # not written yet, or just evicted

    def continuations(self, parent_hash: bytes) -> list[tuple[bytes, Sequence[int]]]:
        """The persisted blocks that follow ``parent_hash`` and may be reused in part, with
        their token ids (kept in the index: a lookup reads no file until it picks one)."""
        return self._index.continuations(parent_hash)

    def pending_bytes(self) -> int:
        """Host memory held by writes not done yet (the one being written included)."""
        return self._writer.pending_bytes

    def drop_pending(self, nbytes: int) -> int:
        """Give up queued block writes, newest first, until ``nbytes`` of host memory are
        freed (the memory guard needs the room); returns the bytes freed. Their blocks are
        not persisted (and are offered again if the prefix cache evicts them later)."""
        dropped = self._writer.withdraw_block_writes(nbytes)
        for item in dropped:
            give_back(self._index, item)
        if dropped:
            self._counts.add("drops", len(dropped))
        return sum(host_bytes(item) for item in dropped)

    def yield_to(self, wait_quiet: Callable[[float], bool]) -> None:
        """The writer puts writes off while ``wait_quiet`` says the forwards run (see
        :meth:`~.writer.BlockWriter.yield_to`)."""
        self._writer.yield_to(wait_quiet)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._counts.snapshot()
        used = self._index.used_bytes
        stats.update(blocks=len(self._index), bytes=used, limit_bytes=self._quota.limit(used))
        stats["queue_depth"] = self._writer.depth
        stats["pending_cancellations"] = sum(self.pending_cancellations().values())
        return stats

    # -- boundary snapshots, per request (MLX thread) ----------------------------------

    def save_snapshot(self, request_id: str, index: int, block_hash: bytes, token_count: int,
                      states: Sequence[Any]) -> None:
        """Stage the non-cuttable layers' state at a block boundary of a prefilling request."""
        if not self._closed:
            self._staging.save(request_id, index, block_hash, token_count, states)

    def finish_request(self, request_id: str) -> None:
        """A request completed: remove its staged snapshots once the writer reaches this point."""
        if self._closed:
            self._staging.forget(request_id)
        else:
            self._staging.finish(request_id)

    def cleanup_request(self, request_id: str, timeout: float | None = None) -> bool:
        """Forget a request's snapshots now (see :meth:`.SnapshotStaging.cleanup`);
        ``False`` if the wait for the writer timed out."""
        return self._staging.cleanup(request_id, timeout)

    def cleanup_all(self, timeout: float | None = None) -> bool:
        """Forget every staged snapshot (start-up, reset, shutdown); block files stay."""
        return self._staging.cleanup_all(timeout)

    def request_dir(self, request_id: str) -> Path:
        return self._staging.request_dir(request_id)

    def pending_cancellations(self) -> dict[str, int]:
        return self._writer.pending_cancellations()

    # -- quota, shutdown -------------------------------------------------------------------

    def limit_bytes(self) -> int:
        return self._quota.limit(self._index.used_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; ``False`` on timeout."""
        return self._writer.flush(self.flush_timeout_s if timeout is None else timeout)

    def close(self, cleanup: bool = True) -> None:
        """Stop taking saves, flush queued writes within ``flush_timeout_s``, remove
        staged snapshots (``cleanup``), then stop the writer and release the directory."""
        if self._closed:
            return
        self._closed = True
        if not self.flush():
            log.warning("SSD cache %s: %d writes still queued at shutdown are dropped",
                        self.directory, self._writer.depth)
            self._writer.discard_queued()
        if cleanup:
            self.cleanup_all()
        self._writer.stop(self.flush_timeout_s)
        release_directory(self._lock_file)

    def _discard(self, block_hash: bytes, message: str) -> None:
        log.warning("SSD cache: %s", message)
        self._index.forget(block_hash)
        self._counts.add("errors")
        remove_block_files(self.blocks_dir, [block_hash])


def _arrays_of(value: Any) -> list[Any]:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays_of(v)]
    return []


__all__ = ["COUNTERS", "DEFAULT_DEFER_S", "DEFAULT_QUEUE_BYTES", "DirectoryInUseError", "PagedSSDStore", "layer_types_of"]


def ends_a_turn(block: CachedBlock) -> bool:
    """Whether ``block`` is a partial block with a boundary state (a model with layers
    that cannot be cut, where a request's prompt or completion ended): offered back
    whole as a continuation of its parent, like a tail."""
    return block.boundary is not None and 0 < len(block.tokens) < block.block_size
