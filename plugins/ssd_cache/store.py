"""The paged SSD block store: prefix-cache blocks on disk, surviving restarts.

Layout of one model's directory (``<plugin.ssd_cache.dir>/<model id>-<identity>/``)::

    blocks/<hash>.safetensors            KV of one block (cuttable layers)
    blocks/<hash>.boundary.safetensors   non-cuttable layers' state at the block's end
    snapshots/<request id>/<index>.safetensors   boundary states staged per request

One process owns a model directory at a time (an advisory lock on ``.lock``).

**Saving** (:meth:`PagedSSDStore.put`, on the MLX thread): pass the quota gate
(evicting least-recently-used blocks inline, at most ``eviction_burst`` unlinks per
save, the rest carried over to later saves), copy the block to host memory, then hand
it to the writer thread through a bounded queue with a short timeout: a burst rides
over a brief backlog, only sustained saturation drops a block (counted in ``drops``);
after a drop, saves do not wait again until one gets in, so a saturated writer costs
the MLX thread one timeout, not one per block. The writer writes a temp file and
renames it, so a file under its final name is complete. Recency follows the prefix
cache's :meth:`touch` (deepest block first), so a chain's leaves are evicted before
the blocks they hang from.

**Boundary snapshots** arrive keyed by request id while that request prefills
(:meth:`PagedSSDStore.save_snapshot`) and are staged under ``snapshots/<request id>/``.
The block they belong to, when the writer persists it, adopts its staged state by
rename; if the staged file is gone (its request was cleaned up, or the write was
dropped) the block's item still holds the same host copy and writes it itself. A
block first saved without a boundary gains one later through a boundary-only write; a
failed or dropped upgrade leaves the block as it was. A finished request's staging is
removed in queue order (:meth:`finish_request`); an aborted one's at once
(:meth:`cleanup_request`).

**Cleanup without races.** The writer holds ``_writer_busy`` for each item. A cleanup
withdraws the queued items it covers and marks the item the writer holds, if it covers
it, as cancelled (the writer checks the mark before its rename, and a cancelled write
that fails is discarded quietly), then waits, bounded, for the writer to finish that
item before removing directories; it never waits for an item it does not cover.
``_cancelled`` counts, per request, marked items the writer has not retired yet:
created only when there is one, additive over repeated cleanups, and kept by a cleanup
that timed out.

**Loading** (:meth:`PagedSSDStore.get`): a block file is checked against its header
(format, model identity, block hash) and every tensor's CRC; a truncated, corrupt or
foreign file is removed and counted in ``errors``, never served. A restarted store
rebuilds its index by scanning ``blocks/`` (temp files and invalid files are removed).
"""

from __future__ import annotations

import errno
import json
import fcntl
import hashlib
import logging
import os
import queue
import re
import shutil
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omlx_core.kvblocks import CachedBlock
from omlx_core.plugins.ssd_cache.blockfile import (
    BLOCK_KIND, BLOCK_SUFFIX, BOUNDARY_KIND, BOUNDARY_SUFFIX, TMP_SUFFIX, BlockFileError, Payload,
    block_path, boundary_path, check_metadata, kv_of, payload_of_kv, payload_of_states, read_arrays,
    read_metadata, states_of, write_payload)
from omlx_core.plugins.ssd_cache.workqueue import WorkQueue
from omlx_core.settings import format_size

log = logging.getLogger(__name__)

#: a model directory with more block files than this shows a progress bar while indexing
PROGRESS_FROM_FILES = 512
#: host memory queued block writes may hold (``plugin.ssd_cache.queue_bytes``)
DEFAULT_QUEUE_BYTES = 64 << 20
_HEX_NAME = re.compile(r"^[0-9a-f]{32}$")
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")




@dataclass
class _Entry:
    size: int
    persisted: bool = False
    has_boundary: bool = False
    #: the block's parent in its chain and its token ids, for a block a prompt may reuse
    #: in part (its tokens stored with it, every layer cut by token); empty otherwise
    parent: bytes = b""
    tokens: array = field(default_factory=lambda: array("q"))


@dataclass(eq=False)
class _Item:
    """One unit of writer work."""

    kind: str  # "block" | "boundary" (upgrade) | "snapshot" | "finish" | "stop"
    request_id: str = ""
    block_hash: bytes = b""
    index: int = 0
    payload: Payload | None = None
    #: block, boundary: the boundary state to persist (shared with a staged snapshot)
    boundary: Payload | None = None
    #: bytes reserved for this item by the quota gate
    reserved: int = 0
    cancelled: bool = False


STOP = _Item("stop")


def host_bytes(item: _Item) -> int:
    """Host memory an item holds until the writer is done with it."""
    return sum(p.tensor_bytes for p in (item.payload, item.boundary) if p is not None)

COUNTERS = ("saves", "saves_persisted", "loads", "hits", "misses", "evictions", "drops",
            "declined", "errors", "snapshots", "snapshots_persisted", "tokens_loaded")


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


class DirectoryInUseError(RuntimeError):
    """Another process serves from this SSD cache directory."""


class PagedSSDStore:
    """Blocks of one model on disk: a :class:`~omlx_core.kvblocks.BlockStore`."""

    def __init__(self, directory: Path, *, identity: str, budget: int | None = None,
                 auto_share: float = 0.5, queue_size: int = 64, queue_bytes: int | None = DEFAULT_QUEUE_BYTES,
                 save_timeout_s: float = 0.25,
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

        self._lock = threading.Lock()  # index, sizes, counters, disk-usage reading, snapshots
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._used = 0
        self._disk_reading: tuple[float, int] | None = None  # (monotonic time, room bytes)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._saturated = False
        #: block hash -> (request id, host copy) of a snapshot saved and not yet claimed
        self._snapshots: dict[bytes, tuple[str, Payload]] = {}
        self._queue: WorkQueue[_Item] = WorkQueue(queue_size, queue_bytes, weight=host_bytes)
        #: parent hash -> hashes of indexed blocks stored with their tokens (see ``continuations``)
        self._children: dict[bytes, set[bytes]] = {}
        self._writer_busy = threading.Lock()
        #: request id -> cancelled items the writer holds and has not retired (queue lock)
        self._cancelled: dict[str, int] = {}
        #: block hash -> staged snapshot file (queue lock)
        self._staged: dict[bytes, Path] = {}
        self._closed = False

        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._take_directory()
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        # Snapshots staged by a previous process belong to requests that no longer exist.
        self.cleanup_all()
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name=f"ssd-writer-{self.directory.name}",
                                        daemon=True)
        self._writer.start()

    def _take_directory(self) -> Any:
        handle = open(self.directory / ".lock", "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            handle.close()
            raise DirectoryInUseError(
                f"SSD cache directory {self.directory} is in use by {owner}; give each "
                "server its own plugin.ssd_cache.dir (two processes would evict and clean up each "
                "other's files)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        return handle

    # -- the BlockStore protocol (MLX thread) -----------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is indexed: on disk, or queued to be written."""
        with self._lock:
            return block_hash in self._index

    def get(self, block_hash: bytes) -> CachedBlock | None:
        """The block, read back from disk and checked; ``None`` when absent or unusable."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or not entry.persisted or self._closed:
                self._counts["misses"] += 1
                return None
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
            tokens = tuple(int(t) for t in json.loads(metadata.get("tokens", "[]")))
        except Exception as exc:  # whatever a damaged file raises, it is not served
            self._discard(block_hash, f"block {block_hash.hex()} is unusable and was removed: {exc}")
            return None
        boundary = self._read_boundary(block_hash) if has_boundary else None
        nbytes = sum(a.nbytes for pair in kv if pair is not None for a in pair)
        if boundary is not None:
            nbytes += sum(a.nbytes for layer in boundary if layer is not None
                          for a in _arrays_of(layer.state))
        needs_boundary = any(pair is None for pair in kv)
        with self._lock:
            self._counts["loads"] += 1
            # A partial block (a prompt's tail) holds fewer tokens than a full one.
            self._counts["tokens_loaded"] += min(block_size, len(tokens) or block_size)
        return CachedBlock(block_hash=block_hash, parent_hash=parent, index=index,
                           block_size=block_size, kv=kv, boundary=boundary,
                           reusable_end=boundary is not None or not needs_boundary, nbytes=nbytes,
                           tokens=tokens)

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
            size = _size_of(path)
            _unlink(path)
            with self._lock:
                self._counts["errors"] += 1
                entry = self._index.get(block_hash)
                if entry is not None and entry.has_boundary:
                    entry.has_boundary = False
                    entry.size -= size
                    self._used -= size
            return None

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain (root first) as just used: its deepest block becomes the least
        recent of them, so eviction takes leaves before the blocks they hang from. The
        order is kept in the files' mtimes for the next process."""
        with self._lock:
            chain = [h for h in hashes if h in self._index]
            for block_hash in reversed(chain):
                self._index.move_to_end(block_hash)
        now = time.time_ns()
        for position, block_hash in enumerate(reversed(chain)):
            try:
                os.utime(block_path(self.blocks_dir, block_hash), ns=(now + position,) * 2)
            except OSError:
                pass  # not written yet, or just evicted

    def continuations(self, parent_hash: bytes) -> list[tuple[bytes, Sequence[int]]]:
        """The persisted blocks that follow ``parent_hash`` and may be reused in part, with
        their token ids (kept in the index: a lookup reads no file until it picks one)."""
        with self._lock:
            return [(h, self._index[h].tokens) for h in self._children.get(parent_hash, ())
                    if self._index[h].persisted]

    def pending_bytes(self) -> int:
        """Host memory held by writes not done yet (the one being written included)."""
        return self._queue.nbytes

    def drop_pending(self, nbytes: int) -> int:
        """Give up queued block writes, newest first, until ``nbytes`` of host memory are
        freed (the memory guard needs the room); returns the bytes freed. Their blocks are
        not persisted (and are offered again if the prefix cache evicts them later)."""
        dropped = self._queue.withdraw_newest(lambda item: item.kind in ("block", "boundary"), nbytes)
        for item in dropped:
            self._release(item)
        if dropped:
            with self._lock:
                self._counts["drops"] += len(dropped)
        return sum(host_bytes(item) for item in dropped)

    def put(self, block: CachedBlock) -> None:
        """Save ``block`` unless it is already on disk as well as it can be; may decline
        (quota) or drop (writer backlog)."""
        block_hash = block.block_hash
        with self._lock:
            if self._closed:
                return
            existing = self._index.get(block_hash)
            if existing is not None and (existing.has_boundary or block.boundary is None):
                return
            kind = "block" if existing is None else "boundary"
        # A save the writer has no room for is dropped now, before it evicts persisted
        # blocks to make room on disk or copies anything to host memory for nothing.
        if not self._room_in_queue(block.nbytes):
            return
        with self._lock:
            staged = self._snapshots.pop(block_hash, None)
        # Built and sized before any copy: a declined block costs no host copy.
        layer_types = layer_types_of(block.kv, block.boundary)
        payload = None
        if kind == "block":
            payload = payload_of_kv(block.kv, block_hash=block_hash, parent_hash=block.parent_hash,
                                    tokens=block.tokens,
                                    index=block.index, block_size=block.block_size,
                                    identity=self.identity, layer_types=layer_types)
        boundary = staged[1] if staged is not None else None
        if boundary is None and block.boundary is not None:
            boundary = payload_of_states(block.boundary, block_hash=block_hash, index=block.index,
                                         token_count=block.end_token, identity=self.identity,
                                         layer_types=layer_types)
        size = sum(p.estimated_file_size() for p in (payload, boundary) if p is not None)
        admitted, victims = self._admit(block_hash, size, new_entry=kind == "block")
        _unlink_blocks(self.blocks_dir, victims)
        if not admitted:
            return
        if kind == "block" and block.partially_reusable:
            with self._lock:
                entry = self._index.get(block_hash)
                if entry is not None:
                    entry.parent, entry.tokens = block.parent_hash, array("q", block.tokens)
                    self._children.setdefault(block.parent_hash, set()).add(block_hash)
        for part in (payload, boundary):
            if part is not None:
                part.to_host()
        item = _Item(kind, block_hash=block_hash, index=block.index, payload=payload,
                     boundary=boundary, reserved=size)
        self._enqueue(item, on_drop=lambda: self._release(item))

    def _admit(self, block_hash: bytes, size: int, *, new_entry: bool) -> tuple[bool, list[bytes]]:
        """The quota gate: evict (bounded) and reserve ``size`` bytes for ``block_hash``
        (a new pending entry, or more bytes of an existing one) if they fit.

        Returns whether they were reserved and the hashes evicted, whose files the caller
        unlinks (inline on the saving thread, never through the write queue).
        """
        with self._lock:
            limit = self._limit_locked()
            victims: list[bytes] = []
            excess = self._used + size - limit
            if excess > 0:
                freed = 0
                for victim_hash, victim in self._index.items():  # least recent first
                    if freed >= excess or len(victims) >= self.eviction_burst:
                        break
                    if victim.persisted and victim_hash != block_hash:
                        victims.append(victim_hash)
                        freed += victim.size
                for victim_hash in victims:
                    self._forget_locked(victim_hash)
                self._counts["evictions"] += len(victims)
            if self._used + size > limit:
                # Over budget still: a block larger than the budget, or an eviction burst
                # that ran out; the next saves carry the eviction on.
                self._counts["declined"] += 1
                return False, victims
            if new_entry:
                self._index[block_hash] = _Entry(size)
            else:
                self._index[block_hash].size += size
            self._used += size
            return True, victims

    def _forget_locked(self, block_hash: bytes) -> None:
        """Drop ``block_hash`` from the index (its files are the caller's business)."""
        entry = self._index.pop(block_hash, None)
        if entry is None:
            return
        self._used -= entry.size
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._children[entry.parent]

    def _release(self, item: _Item) -> None:
        """Give back what a dropped or failed item reserved; a new block is forgotten."""
        with self._lock:
            entry = self._index.get(item.block_hash)
            if entry is None:
                return
            if item.kind == "block" and not entry.persisted:
                self._forget_locked(item.block_hash)
            elif item.kind == "boundary":
                entry.size -= item.reserved
                self._used -= item.reserved

    def _room_in_queue(self, nbytes: int) -> bool:
        """Whether the writer queue has room for a save of ``nbytes``, waiting up to the
        save timeout for it (not at all within a saturation episode); counts a drop if not."""
        if self._queue.wait_for_room(0.0 if self._saturated else self.save_timeout_s, nbytes):
            return True
        self._saturated = True
        with self._lock:
            self._counts["drops"] += 1
        log.debug("SSD cache writer backlog: dropped a save before evicting or copying")
        return False

    def _enqueue(self, item: _Item, on_drop: Any = None) -> bool:
        timeout = 0.0 if self._saturated else self.save_timeout_s
        try:
            self._queue.put(item, timeout=timeout)
        except queue.Full:
            self._saturated = True
            with self._lock:
                self._counts["drops"] += 1
            if on_drop is not None:
                on_drop()
            log.debug("SSD cache writer backlog: dropped a %s write", item.kind)
            return False
        self._saturated = False
        if item.kind != "finish":
            with self._lock:
                self._counts["snapshots" if item.kind == "snapshot" else "saves"] += 1
        return True

    # -- boundary snapshots, per request (MLX thread) ----------------------------------

    def save_snapshot(self, request_id: str, index: int, block_hash: bytes, token_count: int,
                      states: Sequence[Any]) -> None:
        """Stage the non-cuttable layers' state at a block boundary of a prefilling request."""
        if self._closed or not request_id or not any(s is not None for s in states):
            return
        with self._lock:
            entry = self._index.get(block_hash)
            if (entry is not None and entry.has_boundary) or block_hash in self._snapshots:
                return
        layer_types = ["KVCache" if s is None else type(s).__name__ for s in states]
        payload = payload_of_states(states, block_hash=block_hash, index=index,
                                    token_count=token_count, identity=self.identity,
                                    layer_types=layer_types, request_id=request_id).to_host()
        with self._lock:
            # Claimed by the block's save even when the staged write itself is dropped.
            self._snapshots[block_hash] = (request_id, payload)
        self._enqueue(_Item("snapshot", request_id=request_id, block_hash=block_hash, index=index,
                            payload=payload))

    def finish_request(self, request_id: str) -> None:
        """A request completed: remove its staged snapshots once the writer reaches this point."""
        self._forget_snapshots_of(request_id)
        if self._closed or not request_id:
            return
        if self.request_dir(request_id).exists() or self._queue.any(
                lambda item: item.request_id == request_id):
            # A small marker that must not be lost, or the directory stays until restart.
            self._queue.put_unbounded(_Item("finish", request_id=request_id))

    def _forget_snapshots_of(self, request_id: str) -> None:
        with self._lock:
            for block_hash in [h for h, (rid, _) in self._snapshots.items() if rid == request_id]:
                del self._snapshots[block_hash]

    def request_dir(self, request_id: str) -> Path:
        name = request_id if _SAFE_REQUEST_ID.match(request_id) else \
            "h-" + hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
        return self.snapshots_dir / name

    def cleanup_request(self, request_id: str, timeout: float | None = None) -> bool:
        """Forget a request's snapshots now: withdraw its queued writes, wait (bounded) for
        the one the writer may hold, remove its directory. ``False`` if the wait timed out
        (the held write is still marked cancelled, so it never appears)."""
        if not request_id:
            return True
        self._forget_snapshots_of(request_id)
        directory = self.request_dir(request_id)
        return self._cleanup(lambda item: item.request_id == request_id, directory,
                             self.cleanup_request_timeout_s if timeout is None else timeout,
                             lambda path: path.parent == directory)

    def cleanup_all(self, timeout: float | None = None) -> bool:
        """Forget every staged snapshot (start-up, reset, shutdown); block files stay."""
        with self._lock:
            self._snapshots.clear()
        return self._cleanup(lambda item: item.kind in ("snapshot", "finish"), self.snapshots_dir,
                             self.cleanup_all_timeout_s if timeout is None else timeout,
                             lambda path: True, recreate=True)

    def _cleanup(self, covers: Any, directory: Path, timeout: float, staged_covers: Any,
                 recreate: bool = False) -> bool:
        self._queue.withdraw(lambda item: item.kind != "stop" and covers(item))
        with self._queue.lock:
            held = self._queue.held
            ours = held is not None and held.kind in ("snapshot", "finish") and covers(held)
            if ours and not held.cancelled:
                held.cancelled = True
                self._cancelled[held.request_id] = self._cancelled.get(held.request_id, 0) + 1
            for block_hash in [h for h, path in self._staged.items() if staged_covers(path)]:
                del self._staged[block_hash]
        # Only an item of ours can write under ``directory``: wait for nothing else.
        acquired = self._writer_busy.acquire(timeout=timeout) if ours else False
        try:
            if ours and not acquired:
                log.warning("SSD cache: cleanup waited %.1f s for the writer; the write it holds "
                            "is cancelled and will be discarded when it ends", timeout)
            shutil.rmtree(directory, ignore_errors=True)
            if recreate:
                directory.mkdir(parents=True, exist_ok=True)
        finally:
            if acquired:
                self._writer_busy.release()
        return acquired or not ours

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
                except Exception as exc:
                    log.exception("SSD cache writer failed on a %s item", item.kind)
                    if item.kind in ("block", "boundary"):
                        self._release(item)
                    self._write_failed(exc, f"a {item.kind} item")
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
        elif item.kind == "boundary":
            self._write_upgrade(item)
        elif item.kind == "finish":
            directory = self.request_dir(item.request_id)
            with self._queue.lock:
                for block_hash in [h for h, p in self._staged.items() if p.parent == directory]:
                    del self._staged[block_hash]
            shutil.rmtree(directory, ignore_errors=True)

    def _write_snapshot(self, item: _Item) -> None:
        directory = self.request_dir(item.request_id)
        final = directory / f"{item.index}{BLOCK_SUFFIX}"
        temp = directory / f".{item.index}{TMP_SUFFIX}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._write_payload(item.payload, temp)
            if item.cancelled:  # a cleanup ran while we wrote: the file must not appear
                raise _Cancelled
            os.replace(temp, final)
        except (_Cancelled, OSError) as exc:
            _unlink(temp)
            _rmdir_if_empty(directory)
            if not item.cancelled:  # a cancelled write that fails is just discarded
                self._write_failed(exc, f"snapshot {item.index} of request {item.request_id}")
            return
        with self._queue.lock:
            self._staged[item.block_hash] = final
        with self._lock:
            self._counts["snapshots_persisted"] += 1

    def _write_block(self, item: _Item) -> None:
        block_hash = item.block_hash
        temp = self.blocks_dir / f".{block_hash.hex()}{TMP_SUFFIX}"
        try:
            size = self._write_payload(item.payload, temp)
            os.replace(temp, block_path(self.blocks_dir, block_hash))
        except OSError as exc:
            _unlink(temp)
            self._release(item)
            self._write_failed(exc, f"block {block_hash.hex()}")
            return
        boundary_size = self._write_boundary(item)
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is not None:
                total = size + (boundary_size or 0)
                self._used += total - entry.size
                entry.size, entry.persisted = total, True
                entry.has_boundary = boundary_size is not None
                self._counts["saves_persisted"] += 1
        if entry is None:  # forgotten while being written (cleared): take it back
            _unlink_blocks(self.blocks_dir, [block_hash])

    def _write_upgrade(self, item: _Item) -> None:
        """A boundary for a block saved without one; the block file is left as it is."""
        boundary_size = self._write_boundary(item)
        with self._lock:
            entry = self._index.get(item.block_hash)
            if entry is not None:
                self._used += (boundary_size or 0) - item.reserved
                entry.size += (boundary_size or 0) - item.reserved
                entry.has_boundary = entry.has_boundary or boundary_size is not None
                if boundary_size is not None:
                    self._counts["saves_persisted"] += 1
        if entry is None and boundary_size is not None:
            _unlink(boundary_path(self.blocks_dir, item.block_hash))

    def _write_boundary(self, item: _Item) -> int | None:
        """Persist ``item``'s boundary state next to its block: adopt the staged snapshot
        by rename, else write the host copy. Its size, or ``None`` when there is none."""
        if item.boundary is None:
            return None
        target = boundary_path(self.blocks_dir, item.block_hash)
        with self._queue.lock:
            staged = self._staged.pop(item.block_hash, None)
        if staged is not None:
            try:
                size = staged.stat().st_size
                os.replace(staged, target)
                return size
            except OSError:
                pass  # cleaned up meanwhile: write the copy we hold
        temp = self.blocks_dir / f".{item.block_hash.hex()}.boundary{TMP_SUFFIX}"
        try:
            size = self._write_payload(item.boundary, temp)
            os.replace(temp, target)
            return size
        except OSError as exc:
            _unlink(temp)
            self._write_failed(exc, f"the boundary state of block {item.block_hash.hex()}")
            return None

    def _write_payload(self, payload: Payload | None, path: Path) -> int:
        assert payload is not None
        return write_payload(payload, path)

    def _write_failed(self, exc: BaseException, what: str, count: bool = True) -> None:
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        with self._lock:
            if count:
                self._counts["errors"] += 1
            if full:
                # The next save must see the true free space, not a reading up to
                # disk_usage_ttl_s old. Writes already queued may still fail.
                self._disk_reading = None
        if full:
            log.error("SSD cache: disk full while writing %s in %s; it is not cached, and the "
                      "cache shrinks to the free space from the next save on (writes already "
                      "queued may fail too). Free disk space or lower plugin.ssd_cache.budget.",
                      what, self.directory)
        else:
            log.error("SSD cache: writing %s in %s failed: %s; check that the directory is "
                      "writable and on a working disk, or change plugin.ssd_cache.dir",
                      what, self.directory, exc)

    # -- budget ------------------------------------------------------------------------

    def _limit_locked(self) -> int:
        """The byte limit now: the configured budget, or ``auto_share`` of the room
        (free disk plus what the cache holds), never more than that room."""
        now = time.monotonic()
        if self._disk_reading is None or now - self._disk_reading[0] > self.disk_usage_ttl_s:
            try:
                free = shutil.disk_usage(self.blocks_dir).free
            except OSError as exc:
                log.warning("SSD cache: cannot read the free space of %s (%s); saving nothing "
                            "until it can", self.blocks_dir, exc)
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
        """Index the blocks a previous process left, least recent first; remove what is
        unusable."""
        names = sorted(os.listdir(self.blocks_dir))
        name_set = set(names)
        found: list[tuple[int, int, bytes, _Entry]] = []
        removed = 0
        boundaries = {n[:-len(BOUNDARY_SUFFIX)] for n in names if n.endswith(BOUNDARY_SUFFIX)}
        progress = None
        if len(names) > PROGRESS_FROM_FILES:
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
                metadata = read_metadata(path)
                check_metadata(metadata, kind=BLOCK_KIND, block_hash=block_hash,
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
                depth = int(metadata.get("index", 0))
                parent, tokens = b"", array("q", json.loads(metadata.get("tokens", "[]")))
                if tokens and all(t == "KVCache" for t in json.loads(metadata.get("layer_types", "[]"))):
                    parent = bytes.fromhex(metadata.get("parent_hash", ""))
                else:
                    tokens = array("q")
            except (BlockFileError, OSError, ValueError) as exc:
                log.warning("SSD cache: removing %s: %s", name, exc)
                removed += _unlink(path)
                _unlink(boundary_path(self.blocks_dir, block_hash))
                continue
            found.append((stat.st_mtime_ns, -depth, block_hash, _Entry(size, True, has_boundary, parent, tokens)))
        if progress is not None:
            progress.close()
        # Oldest first; among equally old blocks, the deeper ones (leaves) first.
        for _, _, block_hash, entry in sorted(found, key=lambda f: (f[0], f[1])):
            self._index[block_hash] = entry
            self._used += entry.size
            if entry.parent:
                self._children.setdefault(entry.parent, set()).add(block_hash)
        if found or removed:
            log.info("SSD cache %s: %d blocks (%s) from earlier runs, %d unusable files removed",
                     self.directory, len(found), format_size(self._used), removed)

    @property
    def closed(self) -> bool:
        return self._closed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; ``False`` on timeout."""
        return self._queue.wait_idle(self.flush_timeout_s if timeout is None else timeout)

    def close(self, cleanup: bool = True) -> None:
        """Stop taking saves, flush queued writes within ``flush_timeout_s``, remove
        staged snapshots (``cleanup``), then stop the writer and release the directory."""
        if self._closed:
            return
        self._closed = True
        if not self.flush():
            log.warning("SSD cache %s: %d writes still queued at shutdown are dropped",
                        self.directory, len(self._queue))
            self._queue.withdraw(lambda item: True)
        if cleanup:
            self.cleanup_all()
        self._queue.put_unbounded(STOP)
        self._writer.join(timeout=self.flush_timeout_s)
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
        finally:
            self._lock_file.close()

    def _discard(self, block_hash: bytes, message: str) -> None:
        log.warning("SSD cache: %s", message)
        with self._lock:
            self._forget_locked(block_hash)
            self._counts["errors"] += 1
        _unlink_blocks(self.blocks_dir, [block_hash])

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats: dict[str, Any] = dict(self._counts)
            stats.update(blocks=len(self._index), bytes=self._used, limit_bytes=self._limit_locked())
        stats["queue_depth"] = len(self._queue)
        stats["pending_cancellations"] = sum(self.pending_cancellations().values())
        return stats


class _Cancelled(Exception):
    """A snapshot write whose request was cleaned up while it ran."""


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


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


__all__ = ["COUNTERS", "DirectoryInUseError", "PagedSSDStore", "layer_types_of"]
