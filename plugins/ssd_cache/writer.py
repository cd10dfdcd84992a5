"""The SSD store's writer thread and the bounded queue that feeds it.

**Submitting** (the MLX thread): a save waits for room in the queue with a short
timeout, so a burst rides over a brief backlog and only sustained saturation drops a
write (counted in ``drops``); after a drop, saves do not wait again until one gets in,
so a saturated writer costs the MLX thread one timeout, not one per block.

**Writing** (this thread, no mlx): each file is written under a temp name and renamed,
so a file under its final name is complete. A block's boundary state adopts the snapshot
staged for it by rename; if the staged file is gone (its request was cleaned up, or the
write was dropped) the block's item still holds the same host copy and writes it itself.
A block first saved without a boundary gains one later through a boundary-only write; a
failed or dropped upgrade leaves the block as it was.

**Cancelling without races.** The writer holds ``_busy`` for each item. A cancel
withdraws the queued items it covers and marks the item the writer holds, if it covers
it, as cancelled (the writer checks the mark before its rename, and a cancelled write
that fails is discarded quietly), then waits, bounded, for the writer to finish that
item before removing directories; it never waits for an item it does not cover.
``_cancelled`` counts, per request, marked items the writer has not retired yet: created
only when there is one, additive over repeated cancels, and kept by a cancel that timed
out.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omlx_core.plugins.ssd_cache.blockfile import (
    make_private_dir,
    BLOCK_SUFFIX, TMP_SUFFIX, Payload, block_path, boundary_path, remove_block_files, remove_dir_if_empty,
    remove_file, snapshot_dir, write_payload)
from omlx_core.plugins.ssd_cache.counters import Counters
from omlx_core.plugins.ssd_cache.index import BlockIndex
from omlx_core.plugins.ssd_cache.quota import DiskQuota
from omlx_core.plugins.ssd_cache.workqueue import WorkQueue

log = logging.getLogger(__name__)

#: how long the writer puts a write off while the forwards run (see
#: :meth:`BlockWriter._put_off_while_busy`), and how often it looks again
DEFAULT_DEFER_S = 30.0
QUIET_POLL_S = 0.05


@dataclass(eq=False)
class WriteItem:
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

    @property
    def is_block_write(self) -> bool:
        return self.kind in ("block", "boundary")


STOP = WriteItem("stop")


def host_bytes(item: WriteItem) -> int:
    """Host memory an item holds until the writer is done with it."""
    return sum(p.tensor_bytes for p in (item.payload, item.boundary) if p is not None)


def give_back(index: BlockIndex, item: WriteItem) -> None:
    """Return what a dropped or failed block write reserved in ``index``."""
    index.release(item.block_hash, new_block=item.kind == "block", reserved=item.reserved)


class _Cancelled(Exception):
    """A snapshot write whose request was cleaned up while it ran."""


class BlockWriter:
    """Writes the files of queued items on a thread of its own, in queue order."""

    def __init__(self, directory: Path, *, index: BlockIndex, quota: DiskQuota, counters: Counters,
                 queue_size: int, queue_bytes: int | None, save_timeout_s: float,
                 defer_s: float = DEFAULT_DEFER_S) -> None:
        self.directory = directory
        #: waits up to its argument's seconds for the forwards to stop; whether they have
        #: (:meth:`yield_to`; until then nothing is put off)
        self._wait_quiet: Callable[[float], bool] | None = None
        self.defer_s = defer_s
        #: how many wait for the queue to drain (flush, stop): while any do, nothing is put off
        self._draining = 0
        self._draining_lock = threading.Lock()
        self.blocks_dir = directory / "blocks"
        self.snapshots_dir = directory / "snapshots"
        self.save_timeout_s = save_timeout_s
        self._index = index
        self._quota = quota
        self._counts = counters
        self._queue: WorkQueue[WriteItem] = WorkQueue(queue_size, queue_bytes, weight=host_bytes)
        self._saturated = False
        self._busy = threading.Lock()
        #: request id -> cancelled items the writer holds and has not retired (queue lock)
        self._cancelled: dict[str, int] = {}
        #: block hash -> staged snapshot file (queue lock)
        self._staged: dict[bytes, Path] = {}
        self.thread = threading.Thread(target=self._write_loop, name=f"ssd-writer-{directory.name}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def yield_to(self, wait_quiet: Callable[[float], bool]) -> None:
        """Put writes off while ``wait_quiet`` says the forwards run (see
        :meth:`_put_off_while_busy`)."""
        self._wait_quiet = wait_quiet

    # -- submitting (MLX thread) -------------------------------------------------------

    def has_room(self, nbytes: int) -> bool:
        """Whether the queue has room for a save of ``nbytes``, waiting up to the save
        timeout for it (not at all within a saturation episode); counts a drop if not."""
        if self._queue.wait_for_room(0.0 if self._saturated else self.save_timeout_s, nbytes):
            return True
        self._saturated = True
        self._counts.add("drops")
        log.debug("SSD cache writer backlog: dropped a save before evicting or copying")
        return False

    def submit(self, item: WriteItem, on_drop: Callable[[], None] | None = None) -> bool:
        """Queue ``item`` if room comes within the save timeout; else count a drop, call
        ``on_drop`` and return ``False``."""
        try:
            self._queue.put(item, timeout=0.0 if self._saturated else self.save_timeout_s)
        except queue.Full:
            self._saturated = True
            self._counts.add("drops")
            if on_drop is not None:
                on_drop()
            log.debug("SSD cache writer backlog: dropped a %s write", item.kind)
            return False
        self._saturated = False
        if item.kind != "finish":
            self._counts.add("snapshots" if item.kind == "snapshot" else "saves")
        return True

    def submit_marker(self, item: WriteItem) -> None:
        """Queue ``item`` even when the queue is full (a marker that must not be lost)."""
        self._queue.put_unbounded(item)

    def has_work_of(self, request_id: str) -> bool:
        """Whether an item of ``request_id`` is queued or being written."""
        return self._queue.any(lambda item: item.request_id == request_id)

    def withdraw_block_writes(self, nbytes: int) -> list[WriteItem]:
        """Take queued block writes back, newest first, until they hold ``nbytes``."""
        return self._queue.withdraw_newest(lambda item: item.is_block_write, nbytes)

    @property
    def pending_bytes(self) -> int:
        """Host memory held by writes not done yet (the one being written included)."""
        return self._queue.nbytes

    @property
    def depth(self) -> int:
        return len(self._queue)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is on disk; ``False`` on timeout."""
        self._drain(+1)
        try:
            return self._queue.wait_idle(timeout)
        finally:
            self._drain(-1)

    def _drain(self, change: int) -> None:
        with self._draining_lock:
            self._draining += change

    def discard_queued(self) -> int:
        """Drop every queued item; returns how many there were."""
        return len(self._queue.withdraw(lambda item: True))

    def stop(self, timeout: float) -> None:
        """Stop the thread once it has written what is queued (waits up to ``timeout``)."""
        self._drain(+1)  # never undone: the thread ends
        self._queue.put_unbounded(STOP)
        self.thread.join(timeout=timeout)

    # -- cancelling ----------------------------------------------------------------------

    def cancel(self, covers: Callable[[WriteItem], bool], directory: Path, timeout: float,
               staged_covers: Callable[[Path], bool], recreate: bool = False) -> bool:
        """Withdraw the snapshot work ``covers`` selects, forget the staged files
        ``staged_covers`` selects, wait (bounded) for the covered item the writer holds,
        then remove ``directory`` (and ``recreate`` it). ``False`` if the wait timed out
        (the held item stays marked cancelled, so its file never appears)."""
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
        acquired = self._busy.acquire(timeout=timeout) if ours else False
        try:
            if ours and not acquired:
                log.warning("SSD cache: cleanup waited %.1f s for the writer; the write it holds "
                            "is cancelled and will be discarded when it ends", timeout)
            shutil.rmtree(directory, ignore_errors=True)
            if recreate:
                make_private_dir(directory)
        finally:
            if acquired:
                self._busy.release()
        return acquired or not ours

    def pending_cancellations(self) -> dict[str, int]:
        with self._queue.lock:
            return dict(self._cancelled)

    # -- the thread --------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            self._queue.wait_for_item()
            self._put_off_while_busy()
            item = self._queue.take()
            if item is None:
                continue  # withdrawn while put off (the guard took its memory, a cleanup)
            if item is STOP:
                self._queue.release()
                return
            with self._busy:
                try:
                    self._process(item)
                except Exception as exc:
                    log.exception("SSD cache writer failed on a %s item", item.kind)
                    if item.is_block_write:
                        give_back(self._index, item)
                    self._write_failed(exc, f"a {item.kind} item")
                finally:
                    self._retire(item)
            self._queue.release()

    def _put_off_while_busy(self) -> None:
        """Leave the cores to the forwards: while the MLX thread has work, wait (the
        queued items stay withdrawable), up to ``defer_s``, and not at all once the queue
        is pressed (half full, or a save waits for room: writing now keeps saves from
        being dropped) or someone waits for it to drain. An agent's turn then runs
        without its own blocks being written beside it; they are written while the
        agent works between turns."""
        if self._wait_quiet is None or self.defer_s <= 0:
            return
        deadline = time.monotonic() + self.defer_s
        while not self._wait_quiet(QUIET_POLL_S):
            if self._draining or self._queue.pressed or time.monotonic() >= deadline:
                return

    def _retire(self, item: WriteItem) -> None:
        with self._queue.lock:
            if item.cancelled:
                left = self._cancelled.get(item.request_id, 0) - 1
                if left > 0:
                    self._cancelled[item.request_id] = left
                else:
                    self._cancelled.pop(item.request_id, None)

    def _process(self, item: WriteItem) -> None:
        if item.cancelled:
            return
        if item.kind == "snapshot":
            self._write_snapshot(item)
        elif item.kind == "block":
            self._write_block(item)
        elif item.kind == "boundary":
            self._write_upgrade(item)
        elif item.kind == "finish":
            directory = snapshot_dir(self.snapshots_dir, item.request_id)
            with self._queue.lock:
                for block_hash in [h for h, p in self._staged.items() if p.parent == directory]:
                    del self._staged[block_hash]
            shutil.rmtree(directory, ignore_errors=True)

    def _write_snapshot(self, item: WriteItem) -> None:
        directory = snapshot_dir(self.snapshots_dir, item.request_id)
        final = directory / f"{item.index}{BLOCK_SUFFIX}"
        temp = directory / f".{item.index}{TMP_SUFFIX}"
        try:
            make_private_dir(directory)
            self._write_payload(item.payload, temp)
            if item.cancelled:  # a cleanup ran while we wrote: the file must not appear
                raise _Cancelled
            os.replace(temp, final)
        except (_Cancelled, OSError) as exc:
            remove_file(temp)
            remove_dir_if_empty(directory)
            if not item.cancelled:  # a cancelled write that fails is just discarded
                self._write_failed(exc, f"snapshot {item.index} of request {item.request_id}")
            return
        with self._queue.lock:
            self._staged[item.block_hash] = final
        self._counts.add("snapshots_persisted")

    def _write_block(self, item: WriteItem) -> None:
        block_hash = item.block_hash
        temp = self.blocks_dir / f".{block_hash.hex()}{TMP_SUFFIX}"
        try:
            size = self._write_payload(item.payload, temp)
            os.replace(temp, block_path(self.blocks_dir, block_hash))
        except OSError as exc:
            remove_file(temp)
            give_back(self._index, item)
            self._write_failed(exc, f"block {block_hash.hex()}")
            return
        boundary_size = self._write_boundary(item)
        if self._index.block_written(block_hash, size + (boundary_size or 0), boundary_size is not None):
            self._counts.add("saves_persisted")
        else:  # forgotten while being written (cleared): take it back
            remove_block_files(self.blocks_dir, [block_hash])

    def _write_upgrade(self, item: WriteItem) -> None:
        """A boundary for a block saved without one; the block file is left as it is."""
        boundary_size = self._write_boundary(item)
        if self._index.boundary_written(item.block_hash, item.reserved, boundary_size):
            if boundary_size is not None:
                self._counts.add("saves_persisted")
        elif boundary_size is not None:
            remove_file(boundary_path(self.blocks_dir, item.block_hash))

    def _write_boundary(self, item: WriteItem) -> int | None:
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
            remove_file(temp)
            self._write_failed(exc, f"the boundary state of block {item.block_hash.hex()}")
            return None

    def _write_payload(self, payload: Payload | None, path: Path) -> int:
        assert payload is not None
        return write_payload(payload, path)

    def _write_failed(self, exc: BaseException, what: str) -> None:
        self._counts.add("errors")
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            # The next save must see the true free space, not a reading up to the quota's
            # ttl old. Writes already queued may still fail.
            self._quota.invalidate()
            log.error("SSD cache: disk full while writing %s in %s; it is not cached, and the "
                      "cache shrinks to the free space from the next save on (writes already "
                      "queued may fail too). Free disk space or lower plugin.ssd_cache.budget.",
                      what, self.directory)
        else:
            log.error("SSD cache: writing %s in %s failed: %s; check that the directory is "
                      "writable and on a working disk, or change plugin.ssd_cache.dir",
                      what, self.directory, exc)


__all__ = ["STOP", "BlockWriter", "WriteItem", "give_back", "host_bytes"]
