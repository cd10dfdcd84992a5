"""The SSD store's index: which blocks it holds, in use order, with their bytes.

A block is indexed from the moment the quota gate reserves its bytes (``persisted`` once
the writer has renamed its file into place), so the bytes of queued writes count against
the quota. Recency follows the prefix cache's ``touch`` (deepest block first), so a
chain's leaves are evicted before the blocks they hang from. Blocks stored with their
token ids (every layer cut by token) are also indexed by parent: the partial-block index
that :meth:`BlockIndex.continuations` answers from without reading a file.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Sequence


@dataclass
class IndexEntry:
    size: int
    persisted: bool = False
    has_boundary: bool = False
    #: the block's parent in its chain and its token ids, for a block a prompt may reuse
    #: in part (its tokens stored with it, every layer cut by token); empty otherwise
    parent: bytes = b""
    tokens: array = field(default_factory=lambda: array("q"))


class BlockIndex:
    """Entries by block hash, least recently used first, and the bytes they hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()
        #: parent hash -> hashes of indexed blocks stored with their tokens
        self._children: dict[bytes, set[bytes]] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        """The indexed hashes, least recently used first (a copy)."""
        with self._lock:
            return iter(list(self._entries))

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._entries

    def entry(self, block_hash: bytes) -> IndexEntry | None:
        """A copy of the block's entry, or ``None``."""
        with self._lock:
            entry = self._entries.get(block_hash)
            return None if entry is None else replace(entry)

    def load(self, entries: Iterable[tuple[bytes, IndexEntry]]) -> None:
        """Index blocks found on disk, given least recent first."""
        with self._lock:
            for block_hash, entry in entries:
                self._entries[block_hash] = entry
                self._used += entry.size
                if entry.parent:
                    self._children.setdefault(entry.parent, set()).add(block_hash)

    # -- use order and the partial-block index --------------------------------------------

    def touch(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Mark a chain (root first) as just used, its deepest block the least recent of
        them; returns the indexed hashes of the chain, root first."""
        with self._lock:
            chain = [h for h in hashes if h in self._entries]
            for block_hash in reversed(chain):
                self._entries.move_to_end(block_hash)
        return chain

    def set_tokens(self, block_hash: bytes, parent: bytes, tokens: Sequence[int]) -> None:
        """Record a block's parent and token ids: it may be reused in part."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is not None:
                entry.parent, entry.tokens = parent, array("q", tokens)
                self._children.setdefault(parent, set()).add(block_hash)

    def continuations(self, parent_hash: bytes) -> list[tuple[bytes, Sequence[int]]]:
        """The persisted blocks after ``parent_hash`` with their token ids."""
        with self._lock:
            return [(h, self._entries[h].tokens) for h in self._children.get(parent_hash, ())
                    if self._entries[h].persisted]

    # -- the quota gate -------------------------------------------------------------------

    def reserve(self, block_hash: bytes, size: int, *, limit: Callable[[int], int], new_entry: bool,
                eviction_burst: int) -> tuple[bool, list[bytes]]:
        """Evict (least recent persisted blocks first, at most ``eviction_burst``) and
        reserve ``size`` bytes for ``block_hash`` (a new pending entry, or more bytes of
        an existing one) if they fit under ``limit(held bytes)``.

        Returns whether they were reserved and the hashes evicted, whose files the caller
        removes.
        """
        with self._lock:
            cap = limit(self._used)
            victims: list[bytes] = []
            excess = self._used + size - cap
            if excess > 0:
                freed = 0
                for victim_hash, victim in self._entries.items():
                    if freed >= excess or len(victims) >= eviction_burst:
                        break
                    if victim.persisted and victim_hash != block_hash:
                        victims.append(victim_hash)
                        freed += victim.size
                for victim_hash in victims:
                    self._forget_locked(victim_hash)
            if self._used + size > cap:
                # Over the limit still: a block larger than it, or an eviction burst that
                # ran out; the next saves carry the eviction on.
                return False, victims
            if new_entry:
                self._entries[block_hash] = IndexEntry(size)
            else:
                self._entries[block_hash].size += size
            self._used += size
            return True, victims

    def release(self, block_hash: bytes, *, new_block: bool, reserved: int) -> None:
        """Give back what a dropped or failed write reserved: a block never persisted is
        forgotten, a boundary upgrade's bytes are returned."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return
            if new_block:
                if not entry.persisted:
                    self._forget_locked(block_hash)
            else:
                entry.size -= reserved
                self._used -= reserved

    # -- the writer's results -------------------------------------------------------------

    def block_written(self, block_hash: bytes, size: int, has_boundary: bool) -> bool:
        """A block's files are in place, ``size`` bytes in all; ``False`` if it was
        forgotten meanwhile (its files are then the caller's to remove)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return False
            self._used += size - entry.size
            entry.size, entry.persisted, entry.has_boundary = size, True, has_boundary
            return True

    def boundary_written(self, block_hash: bytes, reserved: int, size: int | None) -> bool:
        """A boundary upgrade ended (``size``: its file's bytes, ``None`` if it failed);
        ``False`` if the block was forgotten meanwhile."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return False
            self._used += (size or 0) - reserved
            entry.size += (size or 0) - reserved
            entry.has_boundary = entry.has_boundary or size is not None
            return True

    def boundary_lost(self, block_hash: bytes, size: int) -> None:
        """A block's boundary file of ``size`` bytes turned out unusable and was removed."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is not None and entry.has_boundary:
                entry.has_boundary = False
                entry.size -= size
                self._used -= size

    def forget(self, block_hash: bytes) -> None:
        """Drop ``block_hash`` (its files are the caller's business)."""
        with self._lock:
            self._forget_locked(block_hash)

    def _forget_locked(self, block_hash: bytes) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return
        self._used -= entry.size
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._children[entry.parent]


__all__ = ["BlockIndex", "IndexEntry"]
