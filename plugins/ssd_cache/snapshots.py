"""Boundary snapshots staged per request, until the block they belong to is saved.

A hybrid model's non-cuttable layers (recurrent state, rotating windows) can only be
resumed from their whole state at a block's end. Those states arrive keyed by request
id while the request prefills (the ``on_boundary_snapshot`` hook), before the prefix
cache stores the block: each is copied to host memory, kept by block hash for the
block's save to claim (:meth:`SnapshotStaging.claim`), and written under
``snapshots/<request id>/`` so the writer can adopt the file by rename. A finished
request's staging is removed in queue order (:meth:`SnapshotStaging.finish`), an aborted
one's at once (:meth:`SnapshotStaging.cleanup`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

from omlx_core.plugins.ssd_cache.blockfile import Payload, payload_of_states, snapshot_dir
from omlx_core.plugins.ssd_cache.index import BlockIndex
from omlx_core.plugins.ssd_cache.writer import BlockWriter, WriteItem


class SnapshotStaging:
    """Host copies of staged boundary states by block hash, and their files."""

    def __init__(self, snapshots_dir: Path, *, identity: str, index: BlockIndex, writer: BlockWriter,
                 cleanup_all_timeout_s: float, cleanup_request_timeout_s: float) -> None:
        self.snapshots_dir = snapshots_dir
        self.identity = identity
        self.cleanup_all_timeout_s = cleanup_all_timeout_s
        self.cleanup_request_timeout_s = cleanup_request_timeout_s
        self._index = index
        self._writer = writer
        self._lock = threading.Lock()
        #: block hash -> (request id, host copy) of a snapshot saved and not yet claimed
        self._copies: dict[bytes, tuple[str, Payload]] = {}

    def request_dir(self, request_id: str) -> Path:
        return snapshot_dir(self.snapshots_dir, request_id)

    def save(self, request_id: str, index: int, block_hash: bytes, token_count: int,
             states: Sequence[Any]) -> None:
        """Stage the non-cuttable layers' state at a block boundary of a prefilling request."""
        if not request_id or not any(s is not None for s in states):
            return
        entry = self._index.entry(block_hash)
        if entry is not None and entry.has_boundary:
            return
        with self._lock:
            if block_hash in self._copies:
                return
        layer_types = ["KVCache" if s is None else type(s).__name__ for s in states]
        payload = payload_of_states(states, block_hash=block_hash, index=index,
                                    token_count=token_count, identity=self.identity,
                                    layer_types=layer_types, request_id=request_id).to_host()
        with self._lock:
            # Claimed by the block's save even when the staged write itself is dropped.
            self._copies[block_hash] = (request_id, payload)
        self._writer.submit(WriteItem("snapshot", request_id=request_id, block_hash=block_hash, index=index,
                                      payload=payload))

    def claim(self, block_hash: bytes) -> Payload | None:
        """The staged state of ``block_hash``, for its block's save (taken, not copied)."""
        with self._lock:
            staged = self._copies.pop(block_hash, None)
        return staged[1] if staged is not None else None

    def forget(self, request_id: str) -> None:
        """Drop the host copies of ``request_id``'s snapshots (their files stay)."""
        with self._lock:
            for block_hash in [h for h, (rid, _) in self._copies.items() if rid == request_id]:
                del self._copies[block_hash]

    def finish(self, request_id: str) -> None:
        """A request completed: remove its staged snapshots once the writer reaches this point."""
        self.forget(request_id)
        if not request_id:
            return
        if self.request_dir(request_id).exists() or self._writer.has_work_of(request_id):
            # A small marker that must not be lost, or the directory stays until restart.
            self._writer.submit_marker(WriteItem("finish", request_id=request_id))

    def cleanup(self, request_id: str, timeout: float | None = None) -> bool:
        """Forget a request's snapshots now: withdraw its queued writes, wait (bounded) for
        the one the writer may hold, remove its directory. ``False`` if the wait timed out
        (the held write is still marked cancelled, so it never appears)."""
        if not request_id:
            return True
        self.forget(request_id)
        directory = self.request_dir(request_id)
        return self._writer.cancel(lambda item: item.request_id == request_id, directory,
                                   self.cleanup_request_timeout_s if timeout is None else timeout,
                                   lambda path: path.parent == directory)

    def cleanup_all(self, timeout: float | None = None) -> bool:
        """Forget every staged snapshot (start-up, reset, shutdown); block files stay."""
        with self._lock:
            self._copies.clear()
        return self._writer.cancel(lambda item: item.kind in ("snapshot", "finish"), self.snapshots_dir,
                                   self.cleanup_all_timeout_s if timeout is None else timeout,
                                   lambda path: True, recreate=True)


__all__ = ["SnapshotStaging"]
