"""What the in-memory prefix cache holds: blocks and tails in one use order, under a budget.

Eviction is LRU by bytes, over blocks and tails alike (one use counter orders both).
Each lookup and store refreshes a chain from its deepest block up to its root, and a
tail's use refreshes it and then the chain above it, so a parent is always more recent
than its children and tails, and the leaves go first: evicting a parent would strand
everything below it. A block evicted all the same takes the tails under it along.

At most :data:`TAILS_PER_PREFIX` tails are kept per prefix (the least recently used
goes). Blocks whose leading tokens may be reused in part are indexed by parent, so the
best continuation of a prefix is found without scanning every block.

:class:`BlockLRU` is not locked: :class:`~.prefix_cache.PrefixCache` calls it under its own
lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from omlx_core.kvblocks import CachedBlock, CachedTail
from omlx_core.scheduling.block_hashes import common_prefix_length

#: tails kept under one prefix (different answers or follow-ups to the same history)
TAILS_PER_PREFIX = 8

TailKey = tuple[bytes, tuple[int, ...]]


class BlockLRU:
    """Blocks by hash and tails by ``(parent hash, tokens)``, least recently used first,
    holding ``nbytes`` of at most ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self._tails: OrderedDict[TailKey, CachedTail] = OrderedDict()
        self._tails_of: dict[bytes, list[TailKey]] = {}
        #: parent hash -> hashes of its cached child blocks a prefix of which can be reused
        self._children: dict[bytes, set[bytes]] = {}
        #: last use of each block (by hash) and tail (by key), from one counter: both
        #: dicts above are kept in this order, so each one's oldest comes first
        self._used: dict[Any, int] = {}
        self._clock = 0
        self.nbytes = 0
        self.evictions = 0

    @property
    def block_count(self) -> int:
        return len(self._blocks)

    @property
    def tail_count(self) -> int:
        return len(self._tails)

    def block(self, block_hash: bytes) -> CachedBlock | None:
        """The block with this hash, without refreshing it."""
        return self._blocks.get(block_hash)

    def holds_tail(self, key: TailKey) -> bool:
        """Whether the tail under ``key`` is held."""
        return key in self._tails

    # -- keeping -----------------------------------------------------------------------

    def add(self, block: CachedBlock) -> bool:
        """Keep ``block`` as the most recently used; ``False`` if it is too big or adds
        nothing to the copy held (a copy is replaced only to gain a boundary state)."""
        if block.nbytes > self.budget_bytes:
            return False
        existing = self._blocks.get(block.block_hash)
        if existing is not None:
            if existing.reusable_end or not block.reusable_end:
                return False
            self.nbytes -= existing.nbytes
        self._blocks[block.block_hash] = block
        self.nbytes += block.nbytes
        if block.partially_reusable:
            self._children.setdefault(block.parent_hash, set()).add(block.block_hash)
        self._use(self._blocks, block.block_hash)
        return True

    def add_tail(self, tail: CachedTail) -> None:
        """Keep ``tail`` unless a tail already kept under its prefix starts with all of it
        (that one is refreshed instead); tails it extends go, and so does the least
        recently used one when :data:`TAILS_PER_PREFIX` are kept under the prefix."""
        for key in list(self._tails_of.get(tail.parent_hash, ())):
            kept = key[1]
            if tail.boundary is not None or self._tails[key].boundary is not None:
                # Reused only whole: a longer one does not stand in for a shorter one.
                if kept == tail.tokens:
                    self.touch_tail(key)
                    return
                continue
            if kept[:len(tail.tokens)] == tail.tokens:
                self.touch_tail(key)
                return
            if tail.tokens[:len(kept)] == kept:  # the new tail extends this one
                self._drop_tail(key)
        keys = self._tails_of.get(tail.parent_hash, [])
        if len(keys) >= TAILS_PER_PREFIX:
            self._drop_tail(min(keys, key=self._used.__getitem__))
        key = (tail.parent_hash, tail.tokens)
        self._tails_of.setdefault(tail.parent_hash, []).append(key)
        self._tails[key] = tail
        self.nbytes += tail.nbytes
        self.touch_tail(key)

    # -- use order ----------------------------------------------------------------------

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        """Refresh the held blocks of a chain (given root first), deepest first."""
        for block_hash in reversed(hashes):
            if block_hash in self._blocks:
                self._use(self._blocks, block_hash)

    def touch_tail(self, key: TailKey) -> None:
        """Refresh a tail, then the chain above it (deepest first), so the tail stays
        older than its parent and goes before it."""
        self._use(self._tails, key)
        self.touch_above(key[0])

    def touch_block_and_above(self, block: CachedBlock) -> None:
        """Refresh ``block``, then the chain above it: parents stay more recent."""
        self._use(self._blocks, block.block_hash)
        self.touch_above(block.parent_hash)

    def touch_above(self, block_hash: bytes) -> None:
        """Refresh the held chain ending at ``block_hash``, deepest first."""
        block = self._blocks.get(block_hash)
        while block is not None:
            self._use(self._blocks, block.block_hash)
            block = self._blocks.get(block.parent_hash)

    def _use(self, entries: OrderedDict, key: Any) -> None:
        """Mark the block or tail under ``key`` in ``entries`` as the most recently used."""
        self._clock += 1
        self._used[key] = self._clock
        entries.move_to_end(key)

    # -- continuations ------------------------------------------------------------------

    def best_continuation(self, parent_hash: bytes, tokens: Sequence[int]
                          ) -> tuple[CachedTail | CachedBlock | None, int]:
        """Of the tails and partially reusable blocks under ``parent_hash``, the one
        sharing the most leading tokens with ``tokens`` (a tail on a tie), and how many."""
        best: CachedTail | CachedBlock | None = None
        shared = 0
        for key in self._tails_of.get(parent_hash, ()):
            n = self._tails[key].shared_with(tokens)
            if n > shared:
                best, shared = self._tails[key], n
        for block_hash in self._children.get(parent_hash, ()):
            block = self._blocks[block_hash]
            n = common_prefix_length(block.tokens, tokens)
            if n > shared:
                best, shared = block, n
        return best, shared

    # -- eviction -----------------------------------------------------------------------

    def evict(self, limit: int | None = None) -> list[CachedBlock]:
        """Drop the least recently used blocks and tails down to ``limit`` bytes (the
        budget by default); returns the blocks. A block's tails go with it."""
        limit = self.budget_bytes if limit is None else limit
        evicted = []
        while self.nbytes > limit and (self._blocks or self._tails):
            block_hash = next(iter(self._blocks), None)
            tail_key = next(iter(self._tails), None)
            self.evictions += 1
            if tail_key is not None and (block_hash is None
                                         or self._used[tail_key] < self._used[block_hash]):
                self._drop_tail(tail_key)
                continue
            block = self._blocks.pop(block_hash)
            del self._used[block_hash]
            self.nbytes -= block.nbytes
            self._forget_child(block)
            evicted.append(block)
            for key in list(self._tails_of.get(block_hash, ())):
                self._drop_tail(key)
                self.evictions += 1
        return evicted

    def _drop_tail(self, key: TailKey) -> None:
        tail = self._tails.pop(key)
        del self._used[key]
        self.nbytes -= tail.nbytes
        keys = self._tails_of[key[0]]
        keys.remove(key)
        if not keys:
            del self._tails_of[key[0]]

    def _forget_child(self, block: CachedBlock) -> None:
        children = self._children.get(block.parent_hash)
        if children is not None:
            children.discard(block.block_hash)
            if not children:
                del self._children[block.parent_hash]

    def clear(self) -> None:
        self._children.clear()
        self._blocks.clear()
        self._tails.clear()
        self._tails_of.clear()
        self._used.clear()
        self.nbytes = 0


__all__ = ["TAILS_PER_PREFIX", "BlockLRU", "TailKey"]
