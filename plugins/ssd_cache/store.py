"""The paged SSD block store: prefix-cache blocks on disk, surviving restarts.

Layout of one model's directory (``<cache.ssd_dir>/<model id>-<identity>/``)::

    blocks/<hash>.safetensors            KV of one block (cuttable layers)
    blocks/<hash>.boundary.safetensors   non-cuttable layers' state at the block's end
    snapshots/<request id>/<index>.safetensors   boundary states staged per request

**Saving** (:meth:`PagedSSDStore.put`, on the MLX thread): copy the block to host memory,
pass the quota gate (evicting least-recently-used blocks inline, at most
``eviction_burst`` unlinks per save, the rest carried over to later saves), then hand it
to the writer thread through a bounded queue with a short timeout: a burst rides over a
brief backlog, only sustained saturation drops a block (counted in ``drops``). The
writer writes a temp file and renames it, so a file under its final name is complete.

**Boundary snapshots** arrive keyed by request id while that request prefills
(:meth:`PagedSSDStore.save_snapshot`) and are staged under ``snapshots/<request id>/``.
The block they belong to, when the writer persists it, adopts its staged state by
rename instead of serializing it a second time. A finished request's leftovers are
removed in queue order (:meth:`finish_request`); an aborted one's at once
(:meth:`cleanup_request`).

**Cleanup without races.** The writer holds ``_writer_busy`` for each item. A cleanup
withdraws the queued items it covers, marks the item the writer holds as cancelled
(the writer checks the mark before its rename, so a cancelled write never appears
under its final name), then waits, bounded, for the writer to finish that item before
removing directories. ``_cancelled`` counts, per request, marked items the writer has
not retired yet: created only when there is one, additive over repeated cleanups, and
kept by a cleanup that timed out.

**Loading** (:meth:`PagedSSDStore.get`): a block file is checked against its header
(format, model identity, block hash) and every tensor's CRC; a truncated, corrupt or
foreign file is removed and counted in ``errors``, never served. A restarted store
rebuilds its index by scanning ``blocks/`` (temp files and invalid files are removed).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omlx_core.plugins.batched.prefix_cache import CachedBlock
from omlx_core.plugins.ssd_cache.blockfile import (
    BLOCK_KIND, BLOCK_SUFFIX, BOUNDARY_KIND, BOUNDARY_SUFFIX, TMP_SUFFIX, BlockFileError, Payload,
    block_path, boundary_path, check_metadata, kv_of, payload_of_kv, payload_of_states, read_arrays,
    read_metadata, states_of, write_payload)
from omlx_core.plugins.ssd_cache.workqueue import WorkQueue
from omlx_core.settings import format_size

log = logging.getLogger(__name__)

#: a model directory with more block files than this shows a progress bar while indexing
PROGRESS_FROM_FILES = 512
_HEX_NAME = re.compile(r"^[0-9a-f]{32}$")
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


@dataclass
class _Entry:
    size: int
    persisted: bool = False
    has_boundary: bool = False


@dataclass(eq=False)
class _Item:
    """One unit of writer work."""

    kind: str  # "block" | "snapshot" | "finish" | "stop"
    request_id: str = ""
    block_hash: bytes = b""
    index: int = 0
    payload: Payload | None = None
    #: block: a boundary state to write itself, when none was staged for it
    boundary: Payload | None = None
    #: block: whether a staged snapshot is expected for it
    adopt: bool = False
    cancelled: bool = False


STOP = _Item("stop")
COUNTERS = ("saves", "saves_persisted", "loads", "hits", "misses", "evictions", "drops",
            "declined", "errors", "snapshots", "snapshots_persisted")


def layer_types_of(kv: Sequence[Any], boundary: Sequence[Any] | None) -> list[str]:
    types = []
    for layer, pair in enumerate(kv):
        if pair is not None:
            types.append("KVCache")
        elif boundary is not None and boundary[layer] is not None:
            types.append(type(boundary[layer]).__name__)
        else:
            types.append("uncut")
    return types


class PagedSSDStore:
    """Blocks of one model on disk: a :class:`~omlx_core.plugins.batched.BlockStore`."""

    def __init__(self, directory: Path, *, identity: str, budget: int | None = None,
                 auto_share: float = 0.5, queue_size: int = 64, save_timeout_s: float = 0.25,
                 eviction_burst: int = 32, disk_usage_ttl_s: float = 30.0,
                 cleanup_all_timeout_s: float = 5.0, cleanup_request_timeout_s: float = 2.0,
                 flush_timeout_s: float = 10.0) -> None:
        self.directory = Path(directory)
        self.blocks_dir = self.directory / "blocks"
        self.snapshots_dir = self.directory / "snapshots"
        self.identity = identity
        self.budget = budget
        self.auto_share = auto_share
        self.save_timeout_s = save_timeout_s
        self.eviction_burst = eviction_burst
        self.disk_usage_ttl_s = disk_usage_ttl_s
        self.cleanup_all_timeout_s = cleanup_all_timeout_s
        self.cleanup_request_timeout_s = cleanup_request_timeout_s
        self.flush_timeout_s = flush_timeout_s

        self._lock = threading.Lock()  # index, sizes, counters, disk-usage reading
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._used = 0
        self._disk_reading: tuple[float, int] | None = None  # (monotonic time, room bytes)
        self._counts = dict.fromkeys(COUNTERS, 0)
        #: block hash -> request id of a snapshot enqueued for it and not yet finished
        self._snapshot_of: dict[bytes, str] = {}
        self._queue: WorkQueue[_Item] = WorkQueue(queue_size)
        self._writer_busy = threading.Lock()
        self._cancelled: dict[str, int] = {}
        #: writer-owned: block hash -> staged snapshot file
        self._staged: dict[bytes, Path] = {}
        self._closed = False

        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        # Snapshots staged by a previous process belong to requests that no longer exist.
        self.cleanup_all()
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name=f"ssd-writer-{self.directory.name}",
                                        daemon=True)
        self._writer.start()

    # -- the BlockStore protocol (MLX thread) -----------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def get(self, block_hash: bytes) -> CachedBlock | None:
        """The block, read back from disk and checked; ``None`` when absent or unusable."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or not entry.persisted or self._closed:
                self._counts["misses"] += 1
                return None
            self._index.move_to_end(block_hash)
            self._counts["hits"] += 1
            has_boundary = entry.has_boundary
        path = block_path(self.blocks_dir, block_hash)
        try:
            metadata, arrays = read_arrays(path)
            check_metadata(metadata, kind=BLOCK_KIND, block_hash=block_hash,
                           identity=self.identity, name=path.name)
            kv = kv_of(arrays, int(metadata["layers"]))
            index, block_size = int(metadata["index"]), int(metadata["block_size"])
            parent = bytes.fromhex(metadata["parent_hash"])
        except (BlockFileError, KeyError, ValueError) as exc:
            self._discard(block_hash, f"block {block_hash.hex()} is unusable and was removed: {exc}")
            return None
        boundary = self._read_boundary(block_hash) if has_boundary else None
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        nbytes = sum(a.nbytes for pair in kv if pair is not None for a in pair)
        if boundary is not None:
            nbytes += sum(a.nbytes for layer in boundary if layer is not None
                          for a in _arrays_of(layer.state))
        needs_boundary = any(pair is None for pair in kv)
        with self._lock:
            self._counts["loads"] += 1
        return CachedBlock(block_hash=block_hash, parent_hash=parent, index=index,
                           block_size=block_size, kv=kv, boundary=boundary,
                           reusable_end=boundary is not None or not needs_boundary, nbytes=nbytes)

    def _read_boundary(self, block_hash: bytes) -> tuple[Any, ...] | None:
        path = boundary_path(self.blocks_dir, block_hash)
        try:
            metadata, arrays = read_arrays(path)
            check_metadata(metadata, kind=BOUNDARY_KIND, block_hash=block_hash,
                           identity=self.identity, name=path.name)
            return states_of(metadata, arrays)
        except BlockFileError as exc:
            log.warning("boundary state of block %s is unusable and was removed: %s",
                        block_hash.hex(), exc)
            _unlink(path)
            with self._lock:
                self._counts["errors"] += 1
                entry = self._index.get(block_hash)
                if entry is not None:
                    entry.has_boundary = False
            return None

    def put(self, block: CachedBlock) -> None:
        """Save ``block`` unless it is already on disk; may decline (quota) or drop (backlog)."""
        with self._lock:
            if self._closed:
                return
            existing = self._index.get(block.block_hash)
            if existing is not None and (existing.has_boundary or block.boundary is None
                                         or not existing.persisted):
                return
            adopt = block.block_hash in self._snapshot_of
        layer_types = layer_types_of(block.kv, block.boundary)
        payload = payload_of_kv(block.kv, block_hash=block.block_hash, parent_hash=block.parent_hash,
                                index=block.index, block_size=block.block_size,
                                identity=self.identity, layer_types=layer_types)
        boundary = None
        if block.boundary is not None and not adopt:
            boundary = payload_of_states(block.boundary, block_hash=block.block_hash,
                                         index=block.index, token_count=block.end_token,
                                         identity=self.identity, layer_types=layer_types)
        size = payload.estimated_file_size() + (boundary.estimated_file_size() if boundary else 0)
        if adopt and block.boundary is not None:
            size += sum(a.nbytes for layer in block.boundary if layer is not None
                        for a in _arrays_of(layer.state))
        item = _Item("block", block_hash=block.block_hash, index=block.index, payload=payload,
                     boundary=boundary, adopt=adopt)
        admitted, victims = self._admit(block.block_hash, size)
        _unlink_blocks(self.blocks_dir, victims)
        if admitted:
            self._enqueue(item, on_drop=lambda: self._forget_pending(block.block_hash))

    def _admit(self, block_hash: bytes, size: int) -> tuple[bool, list[bytes]]:
        """The quota gate: evict (bounded) and index ``block_hash`` as pending if it fits.

        Returns whether it was admitted and the hashes evicted, whose files the caller
        unlinks (inline on the saving thread, never through the write queue).
        """
        with self._lock:
            limit = self._limit_locked()
            victims: list[bytes] = []
            previous = self._index.get(block_hash)
            freed_by_replace = previous.size if previous is not None else 0
            for victim_hash in list(self._index):
                if self._used - freed_by_replace + size <= limit or len(victims) >= self.eviction_burst:
                    break
                victim = self._index[victim_hash]
                if not victim.persisted or victim_hash == block_hash:
                    continue
                del self._index[victim_hash]
                self._used -= victim.size
                victims.append(victim_hash)
            self._counts["evictions"] += len(victims)
            if self._used - freed_by_replace + size > limit:
                # Over budget still: a block larger than the budget, or an eviction burst
                # that ran out; the next saves carry the eviction on.
                self._counts["declined"] += 1
                return False, victims
            if previous is not None:
                self._used -= previous.size
            self._index[block_hash] = _Entry(size, persisted=False)
            self._index.move_to_end(block_hash)
            self._used += size
            return True, victims

    def _forget_pending(self, block_hash: bytes) -> None:
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is not None and not entry.persisted:
                del self._index[block_hash]
                self._used -= entry.size

    def _enqueue(self, item: _Item, on_drop: Any = None) -> bool:
        try:
            self._queue.put(item, timeout=self.save_timeout_s)
        except queue.Full:
            with self._lock:
                self._counts["drops"] += 1
            if on_drop is not None:
                on_drop()
            log.debug("SSD cache writer backlog: dropped a %s write", item.kind)
            return False
        if item.kind in ("block", "snapshot"):
            with self._lock:
                self._counts["saves" if item.kind == "block" else "snapshots"] += 1
        return True

    # -- boundary snapshots, per request (MLX thread) ----------------------------------

    def save_snapshot(self, request_id: str, index: int, block_hash: bytes, token_count: int,
                      states: Sequence[Any]) -> None:
        """Stage the non-cuttable layers' state at a block boundary of a prefilling request."""
        if self._closed or not any(s is not None for s in states):
            return
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is not None and entry.has_boundary:
                return
        layer_types = ["KVCache" if s is None else type(s).__name__ for s in states]
        payload = payload_of_states(states, block_hash=block_hash, index=index,
                                    token_count=token_count, identity=self.identity,
                                    layer_types=layer_types, request_id=request_id)
        item = _Item("snapshot", request_id=request_id, block_hash=block_hash, index=index,
                     payload=payload)
        if self._enqueue(item):
            with self._lock:
                self._snapshot_of[block_hash] = request_id

    def finish_request(self, request_id: str) -> None:
        """A request completed: remove its staged snapshots once the writer reaches this point."""
        self._forget_snapshots_of(request_id)
        if self._closed:
            return
        if self.request_dir(request_id).exists() or self._queue.any(
                lambda item: item.request_id == request_id):
            self._enqueue(_Item("finish", request_id=request_id))

    def _forget_snapshots_of(self, request_id: str) -> None:
        with self._lock:
            for block_hash in [h for h, rid in self._snapshot_of.items() if rid == request_id]:
                del self._snapshot_of[block_hash]

    def request_dir(self, request_id: str) -> Path:
        name = request_id if _SAFE_REQUEST_ID.match(request_id) else \
            "h-" + hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
        return self.snapshots_dir / name

    def cleanup_request(self, request_id: str, timeout: float | None = None) -> bool:
        """Forget a request's snapshots now: withdraw its queued writes, wait (bounded) for
        the one the writer may hold, remove its directory. ``False`` if the wait timed out
        (the held write is still marked cancelled, so it never appears)."""
        self._forget_snapshots_of(request_id)
        return self._cleanup(lambda item: item.request_id == request_id,
                             [self.request_dir(request_id)],
                             self.cleanup_request_timeout_s if timeout is None else timeout,
                             lambda path: path.parent == self.request_dir(request_id))

    def cleanup_all(self, timeout: float | None = None) -> bool:
        """Forget every staged snapshot (start-up, reset, shutdown); block files stay."""
        with self._lock:
            self._snapshot_of.clear()
        if self._closed and not self._writer_alive():
            log.warning("SSD cache cleanup_all() after shutdown: only the staged files are removed")
        return self._cleanup(lambda item: item.kind in ("snapshot", "finish"),
                             [self.snapshots_dir],
                             self.cleanup_all_timeout_s if timeout is None else timeout,
                             lambda path: True, recreate=True)

    def _cleanup(self, covers: Any, directories: list[Path], timeout: float,
                 staged_covers: Any, recreate: bool = False) -> bool:
        self._queue.withdraw(lambda item: item.kind != "stop" and covers(item))
        with self._queue.lock:
            held = self._queue.held
            if held is not None and covers(held) and not held.cancelled:
                held.cancelled = True
                self._cancelled[held.request_id] = self._cancelled.get(held.request_id, 0) + 1
        acquired = self._writer_busy.acquire(timeout=timeout)
        try:
            if acquired:
                for block_hash in [h for h, p in self._staged.items() if staged_covers(p)]:
                    del self._staged[block_hash]
            else:
                log.warning("SSD cache cleanup waited %.1f s for the writer and goes on; the "
                            "write it holds is cancelled and will be discarded", timeout)
            for directory in directories:
                shutil.rmtree(directory, ignore_errors=True)
                if recreate:
                    directory.mkdir(parents=True, exist_ok=True)
        finally:
            if acquired:
                self._writer_busy.release()
        return acquired

    def pending_cancellations(self) -> dict[str, int]:
        with self._queue.lock:
            return dict(self._cancelled)

    # -- the writer thread (no mlx here) -----------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.take()
            if item is STOP:
                self._queue.release()
                return
            with self._writer_busy:
                try:
                    self._process(item)
                except Exception:
                    log.exception("SSD cache writer failed on a %s item", item.kind)
                    with self._lock:
                        self._counts["errors"] += 1
                finally:
                    self._retire(item)
            self._queue.release()

    def _retire(self, item: _Item) -> None:
        with self._queue.lock:
            if item.cancelled:
                left = self._cancelled.get(item.request_id, 0) - 1
                if left > 0:
                    self._cancelled[item.request_id] = left
                else:
                    self._cancelled.pop(item.request_id, None)

    def _process(self, item: _Item) -> None:
        if item.cancelled:
            return
        if item.kind == "snapshot":
            self._write_snapshot(item)
        elif item.kind == "block":
            self._write_block(item)
        elif item.kind == "finish":
            directory = self.request_dir(item.request_id)
            for block_hash in [h for h, p in self._staged.items() if p.parent == directory]:
                del self._staged[block_hash]
            shutil.rmtree(directory, ignore_errors=True)

    def _write_snapshot(self, item: _Item) -> None:
        directory = self.request_dir(item.request_id)
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"{item.index}{BLOCK_SUFFIX}"
        temp = directory / f".{item.index}{TMP_SUFFIX}"
        try:
            self._write_payload(item.payload, temp)
        except OSError as exc:
            _unlink(temp)
            self._write_failed(exc, f"snapshot {item.index} of request {item.request_id}")
            return
        if item.cancelled:  # a cleanup ran while we wrote: the file must not appear
            _unlink(temp)
            _rmdir_if_empty(directory)
            return
        os.replace(temp, final)
        self._staged[item.block_hash] = final
        with self._lock:
            self._counts["snapshots_persisted"] += 1

    def _write_block(self, item: _Item) -> None:
        block_hash = item.block_hash
        final = block_path(self.blocks_dir, block_hash)
        temp = self.blocks_dir / f".{block_hash.hex()}{TMP_SUFFIX}"
        try:
            size = self._write_payload(item.payload, temp)
            os.replace(temp, final)
        except OSError as exc:
            _unlink(temp)
            self._forget_pending(block_hash)
            self._write_failed(exc, f"block {block_hash.hex()}")
            return
        has_boundary = False
        staged = self._staged.pop(block_hash, None)
        target = boundary_path(self.blocks_dir, block_hash)
        if item.adopt and staged is not None:
            try:
                size += staged.stat().st_size
                os.replace(staged, target)
                has_boundary = True
            except OSError:
                pass  # the staged file went with a cleanup: the block is kept without it
        elif item.boundary is not None:
            temp = self.blocks_dir / f".{block_hash.hex()}.boundary{TMP_SUFFIX}"
            try:
                size += self._write_payload(item.boundary, temp)
                os.replace(temp, target)
                has_boundary = True
            except OSError as exc:
                _unlink(temp)
                self._write_failed(exc, f"boundary of block {block_hash.hex()}")
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None:  # forgotten while being written (cleared): take it back
                orphan = True
            else:
                orphan = False
                self._used += size - entry.size
                entry.size, entry.persisted, entry.has_boundary = size, True, has_boundary
                self._counts["saves_persisted"] += 1
        if orphan:
            _unlink_blocks(self.blocks_dir, [block_hash])

    def _write_payload(self, payload: Payload | None, path: Path) -> int:
        assert payload is not None
        return write_payload(payload, path)

    def _write_failed(self, exc: OSError, what: str) -> None:
        with self._lock:
            self._counts["errors"] += 1
            if exc.errno == errno.ENOSPC:
                # The next save must see the true free space, not a reading up to
                # disk_usage_ttl_s old. Writes already queued may still fail.
                self._disk_reading = None
        if exc.errno == errno.ENOSPC:
            log.error("SSD cache: disk full while writing %s in %s; the block is lost and the "
                      "cache shrinks to the free space on the next save (writes already queued "
                      "may fail too). Free disk space or lower cache.ssd_budget.", what, self.directory)
        else:
            log.error("SSD cache: writing %s failed: %s", what, exc)

    # -- budget ------------------------------------------------------------------------

    def _limit_locked(self) -> int:
        """The byte limit now: the configured budget, or ``auto_share`` of the room
        (free disk plus what the cache holds), never more than that room."""
        now = time.monotonic()
        if self._disk_reading is None or now - self._disk_reading[0] > self.disk_usage_ttl_s:
            try:
                free = shutil.disk_usage(self.blocks_dir).free
            except OSError:
                free = 0
            self._disk_reading = (now, free + self._used)
        room = self._disk_reading[1]
        if self.budget is None:
            return int(room * self.auto_share)
        return min(self.budget, room)

    def limit_bytes(self) -> int:
        with self._lock:
            return self._limit_locked()

    # -- start-up, shutdown, stats -------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Index the blocks a previous process left, oldest first; remove what is unusable."""
        names = sorted(os.listdir(self.blocks_dir))
        name_set = set(names)
        show = len(names) > PROGRESS_FROM_FILES
        found: list[tuple[float, bytes, _Entry]] = []
        removed = 0
        boundaries = {n[:-len(BOUNDARY_SUFFIX)] for n in names if n.endswith(BOUNDARY_SUFFIX)}
        progress = None
        if show:
            from tqdm import tqdm

            progress = tqdm(total=len(names), desc=f"indexing SSD cache {self.directory.name}",
                            unit="file", leave=False)
        for name in names:
            if progress is not None:
                progress.update(1)
            path = self.blocks_dir / name
            if name.endswith(BOUNDARY_SUFFIX):
                if name[:-len(BOUNDARY_SUFFIX)] + BLOCK_SUFFIX not in name_set:
                    removed += _unlink(path)
                continue
            stem = name[:-len(BLOCK_SUFFIX)] if name.endswith(BLOCK_SUFFIX) else ""
            if not _HEX_NAME.match(stem):
                removed += _unlink(path)  # temp files of a write that never finished
                continue
            block_hash = bytes.fromhex(stem)
            try:
                check_metadata(read_metadata(path), kind=BLOCK_KIND, block_hash=block_hash,
                               identity=self.identity, name=name)
                stat = path.stat()
                size = stat.st_size
                has_boundary = False
                if stem in boundaries:
                    side = boundary_path(self.blocks_dir, block_hash)
                    try:
                        check_metadata(read_metadata(side), kind=BOUNDARY_KIND, block_hash=block_hash,
                                       identity=self.identity, name=side.name)
                        size += side.stat().st_size
                        has_boundary = True
                    except (BlockFileError, OSError) as exc:
                        log.warning("SSD cache: removing %s: %s", side.name, exc)
                        removed += _unlink(side)
            except (BlockFileError, OSError) as exc:
                log.warning("SSD cache: removing %s: %s", name, exc)
                removed += _unlink(path)
                _unlink(boundary_path(self.blocks_dir, block_hash))
                continue
            found.append((stat.st_mtime, block_hash, _Entry(size, True, has_boundary)))
        if progress is not None:
            progress.close()
        for _, block_hash, entry in sorted(found, key=lambda f: f[0]):
            self._index[block_hash] = entry
            self._used += entry.size
        if found or removed:
            log.info("SSD cache %s: %d blocks (%s) from earlier runs, %d unusable files removed",
                     self.directory, len(found), format_size(self._used), removed)

    @property
    def closed(self) -> bool:
        return self._closed

    def _writer_alive(self) -> bool:
        writer = getattr(self, "_writer", None)
        return writer is not None and writer.is_alive()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; ``False`` on timeout."""
        return self._queue.wait_idle(self.flush_timeout_s if timeout is None else timeout)

    def close(self, cleanup: bool = True) -> None:
        """Stop the writer: staged snapshots removed first (``cleanup``), queued block
        writes flushed within ``flush_timeout_s``."""
        if self._closed:
            return
        if cleanup:
            self.cleanup_all()
        self._closed = True
        if not self.flush():
            log.warning("SSD cache %s: %d writes still queued at shutdown are dropped",
                        self.directory, len(self._queue))
            self._queue.withdraw(lambda item: True)
        self._queue.put_unbounded(STOP)
        self._writer.join(timeout=self.flush_timeout_s)

    def _discard(self, block_hash: bytes, message: str) -> None:
        log.warning("SSD cache: %s", message)
        with self._lock:
            entry = self._index.pop(block_hash, None)
            if entry is not None:
                self._used -= entry.size
            self._counts["errors"] += 1
        _unlink_blocks(self.blocks_dir, [block_hash])

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats: dict[str, Any] = dict(self._counts)
            stats.update(blocks=len(self._index), bytes=self._used, limit_bytes=self._limit_locked())
        stats["queue_depth"] = len(self._queue)
        stats["pending_cancellations"] = sum(self.pending_cancellations().values())
        return stats


def _arrays_of(value: Any) -> list[Any]:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays_of(v)]
    return []


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("SSD cache: cannot remove %s: %s", path, exc)
        return 0


def _unlink_blocks(directory: Path, hashes: Sequence[bytes]) -> None:
    for block_hash in hashes:
        _unlink(block_path(directory, block_hash))
        _unlink(boundary_path(directory, block_hash))


def _rmdir_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


__all__ = ["COUNTERS", "PagedSSDStore", "layer_types_of"]
