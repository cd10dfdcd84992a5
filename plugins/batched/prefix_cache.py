"""The in-memory prefix cache: chain-hashed KV blocks under a byte budget, LRU.

A prompt is cut into blocks of ``plugin.batched.block_size`` tokens, each named by a
chain hash that covers the whole prefix up to it (:mod:`.block_hashes`). A new request
reuses the longest run of cached blocks from the start of its prompt, which is what a
multi-turn chat re-sending its history needs.

A :class:`CachedBlock` carries, per layer, either that block's keys and values (for
layers whose cache can be cut at any token, plain ``KVCache``) or nothing; and, for
models that also have layers that cannot be cut (rotating windows, recurrent
``ArraysCache`` state), optionally a ``boundary``: those layers' whole state at the
block's end. Such a model may only resume at a block that has one (``reusable_end``).
How blocks are cut and put back together is :mod:`.cache_layout`'s business; what is
held and what is evicted first is :mod:`.block_lru`'s; this module finds, stores and
promotes blocks, and keeps the lower tier in step.

Tiers: a slower store (the paged SSD cache of the ``ssd_cache`` plugin) can sit
behind this one through :meth:`PrefixCache.attach_lower`. It implements
:class:`~omlx_core.kvblocks.BlockStore`. Writes go through: every block stored here is
offered to it at once (so a restart finds it), and again when evicted here (the store
keeps the better copy, e.g. one that gained a boundary state). A lookup that misses here
asks it, and a block found there is promoted back. The store is told of every chain
stored or found here (:meth:`~omlx_core.kvblocks.BlockStore.touch`, root to leaf), so
its own LRU follows use. Calls to the store are made outside this cache's lock: a disk
read or a full write queue never stalls a concurrent :meth:`PrefixCache.peek`.

**Tails and partial blocks: reuse to the token.** For models whose every layer can be
cut, the tokens after a prefix's last full block (a finished request's
prompt-and-answer tail) are kept too, as a :class:`CachedTail` under the hash of that
block. After its last matching full block, a request reuses the longest common run of
leading tokens among the tails *and the cached blocks* under that block: a cached block
whose first k tokens match is cut to those k (its keys and values are sliced at
restore). So a repeated prompt, the next turn of a chat, the same system prompt with a
new question, or a prompt edited in the middle recompute only what is new, never up to
a block of shared tokens. Tails share the byte budget and the LRU order with blocks. A
lower tier receives each tail as a *partial block* (fewer tokens than a block, named by
:func:`partial_hash`), and offers it back, like any block it holds, as a continuation of
its parent (:meth:`~omlx_core.kvblocks.BlockStore.continuations`).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from omlx_core.kvblocks import BlockStore, CachedBlock, CachedTail
from omlx_core.plugins.batched.block_hashes import (HASH_BYTES, chain_hashes, common_prefix_length,
                                                     partial_hash, root_hash)
from omlx_core.plugins.batched.block_lru import TAILS_PER_PREFIX, BlockLRU


class PrefixCache:
    """Chain-hashed KV blocks under ``budget_bytes``; ``budget_bytes == 0`` turns it off."""

    def __init__(self, block_size: int, budget_bytes: int, namespace: str = "") -> None:
        if block_size < 1:
            raise ValueError(f"plugin.batched.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.root = root_hash(namespace)
        self._held = BlockLRU(budget_bytes)
        self._lock = threading.Lock()
        self._lower: BlockStore | None = None
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.tail_hits = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks and tails held in memory."""
        return self._held.nbytes

    @property
    def evictions(self) -> int:
        return self._held.evictions

    def attach_lower(self, store: BlockStore | None) -> None:
        """Put ``store`` behind this cache (``None`` detaches)."""
        if store is not None and not isinstance(store, BlockStore):
            raise TypeError(f"a lower cache tier must subclass omlx_core.kvblocks.BlockStore, got "
                            f"{type(store).__name__}: subclass it and write get() and put() (and "
                            "what else the tier keeps)")
        with self._lock:
            self._lower = store

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """Chain hashes of every full block of ``tokens``."""
        return chain_hashes(tokens, self.block_size, self.root)

    def extend_hashes(self, hashes: list[bytes], tokens: Sequence[int]) -> list[bytes]:
        """``hashes`` (the chain of ``tokens``' first blocks) extended to all full blocks."""
        start = len(hashes) * self.block_size
        parent = hashes[-1] if hashes else self.root
        return hashes + chain_hashes(tokens[start:], self.block_size, parent)

    # -- blocks ------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[CachedBlock]:
        """The longest reusable cached prefix of the chain ``hashes``; counts a hit or miss."""
        if not self.enabled:
            return []
        found: list[CachedBlock] = []
        with self._lock:
            lower = self._lower
            for block_hash in hashes:
                block = self._held.block(block_hash)
                if block is None:
                    break
                found.append(block)
        if lower is not None:
            for block_hash in hashes[len(found):]:
                block = self.get(block_hash) or lower.get(block_hash)
                if block is None:
                    break
                found.append(block)
        chain = [b.block_hash for b in found]
        with self._lock:
            for block in found:
                if self._held.block(block.block_hash) is not block:
                    self._held.add(block)
            self._held.touch_chain(chain)
            evicted = self._held.evict()
            while found and not found[-1].reusable_end:
                found.pop()
            if found:
                self.hits += 1
                self.tokens_saved += len(found) * self.block_size
            else:
                self.misses += 1
        self._write_through(lower, evicted, chain)
        return found

    def peek(self, hashes: Sequence[bytes]) -> int:
        """How many blocks :meth:`lookup` would reuse now from memory; changes nothing."""
        if not self.enabled:
            return 0
        with self._lock:
            usable = 0
            for position, block_hash in enumerate(hashes):
                block = self._held.block(block_hash)
                if block is None:
                    # Lower-tier blocks are not counted: callers size memory from this
                    # figure, and a block that fails to load must not be counted as free.
                    break
                if block.reusable_end:
                    usable = position + 1
            return usable

    def get(self, block_hash: bytes) -> CachedBlock | None:
        """The in-memory block with this hash, without refreshing it."""
        with self._lock:
            return self._held.block(block_hash)

    def insert(self, blocks: Sequence[CachedBlock], chain: Sequence[bytes] | None = None) -> None:
        """Store ``blocks`` and refresh ``chain`` (default: the blocks' own hashes), the
        whole prefix they belong to, before anything is evicted. A block already present
        is replaced only to gain a boundary state."""
        if not self.enabled:
            return
        chain = list(chain) if chain is not None else [b.block_hash for b in blocks]
        with self._lock:
            added = [block for block in blocks if self._held.add(block)]
            self._held.touch_chain(chain)
            evicted = self._held.evict()
            lower = self._lower
        self._write_through(lower, added + evicted, chain)

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain as just used (deepest block first, root last)."""
        with self._lock:
            self._held.touch_chain(hashes)

    @staticmethod
    def _write_through(lower: BlockStore | None, blocks: Sequence[CachedBlock],
                       chain: Sequence[bytes] = ()) -> None:
        """Offer ``blocks`` to ``lower``, then tell it ``chain`` was just used."""
        if lower is None:
            return
        for block in blocks:
            lower.put(block)
        if chain:
            lower.touch(list(chain))

    # -- tails -------------------------------------------------------------------------

    def insert_tail(self, tail: CachedTail) -> None:
        """Keep ``tail`` unless a tail already kept under its prefix starts with all of it,
        and offer it to the lower tier as a partial block (so a restarted server reuses a
        repeated prompt to the token)."""
        if not self.enabled or not tail.tokens or tail.nbytes > self.budget_bytes:
            return
        self._offer_tail(tail)
        with self._lock:
            self._held.add_tail(tail)
            evicted = self._held.evict()
            lower = self._lower
        self._write_through(lower, evicted)

    def _offer_tail(self, tail: CachedTail) -> None:
        """Hand ``tail`` to the lower tier as a block of its own, under its parent: the
        lower tier offers it back as a continuation of that parent (:meth:`lookup_prefix`)."""
        with self._lock:
            lower = self._lower
            parent = self._held.block(tail.parent_hash)
        if lower is None or len(tail.tokens) >= self.block_size:
            return
        if parent is None and tail.parent_hash != self.root:
            return  # evicted meanwhile: a tail whose chain the lower tier may lack
        index = parent.index + 1 if parent is not None else 0
        lower.put(CachedBlock(block_hash=partial_hash(tail.parent_hash, tail.tokens),
                              parent_hash=tail.parent_hash, index=index, block_size=self.block_size,
                              kv=tail.kv, boundary=None, reusable_end=False, nbytes=tail.nbytes,
                              tokens=tail.tokens))

    def lookup_tail(self, parent_hash: bytes, tokens: Sequence[int]) -> tuple[CachedTail | None, int]:
        """The kept tail or cached block under ``parent_hash`` sharing the most leading
        tokens with ``tokens``, as a tail, and how many it shares (``(None, 0)`` when
        none does). A block comes back as a tail over its own keys and values."""
        if not self.enabled:
            return None, 0
        with self._lock:
            best, shared = self._held.best_continuation(parent_hash, tokens)
            if best is None:
                return None, 0
            if isinstance(best, CachedBlock):
                self._held.touch_block_and_above(best)
                tail = CachedTail(best.parent_hash, best.tokens, best.kv, 0)
            else:
                self._held.touch_tail((best.parent_hash, best.tokens))
                tail = best
            self.tail_hits += 1
            self.tokens_saved += shared
            return tail, shared

    def lookup_prefix(self, hashes: Sequence[bytes], tokens: Sequence[int]
                      ) -> tuple[list[CachedBlock], CachedTail | None, int]:
        """The longest reusable cached prefix of ``tokens`` (``hashes``: the chain of
        their full blocks): its blocks (:meth:`lookup`), then the tail under the last of
        them sharing the most of the tokens after them, and how many it shares. A block
        of the lower tier that shares more of them than anything in memory is read back
        and promoted first (after a restart, only the lower tier has them)."""
        blocks = self.lookup(hashes)
        start = len(blocks) * self.block_size
        parent = blocks[-1].block_hash if blocks else self.root
        self._promote_lower_continuation(parent, tokens[start:])
        tail, shared = self.lookup_tail(parent, tokens[start:])
        return blocks, tail, shared

    def _promote_lower_continuation(self, parent_hash: bytes, tokens: Sequence[int]) -> None:
        """Read back the lower tier's block under ``parent_hash`` that shares the most
        leading ``tokens``, if it shares more than the memory's best continuation."""
        if not self.enabled or not tokens:
            return
        with self._lock:
            lower = self._lower
        if lower is None:
            return
        offered = lower.continuations(parent_hash)
        if not offered:
            return
        with self._lock:
            best = self._held.best_continuation(parent_hash, tokens)[1]
        best_hash = None
        for block_hash, block_tokens in offered:
            n = common_prefix_length(block_tokens, tokens)
            if n > best:
                best_hash, best = block_hash, n
        if best_hash is None or self.get(best_hash) is not None:
            return
        block = lower.get(best_hash)
        if block is None or not block.partially_reusable:
            return
        with self._lock:
            if self._held.block(block.block_hash) is None:
                self._held.add(block)
            self._held.touch_above(block.block_hash)
            evicted = self._held.evict()
        self._write_through(lower, evicted)

    def peek_prefix(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> int:
        """How many of ``tokens`` :meth:`lookup_prefix` would reuse now from memory;
        changes nothing."""
        blocks = self.peek(hashes)
        start = blocks * self.block_size
        return start + self.peek_tail(hashes[blocks - 1] if blocks else self.root, tokens[start:])

    def peek_tail(self, parent_hash: bytes, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` :meth:`lookup_tail` would reuse now; changes nothing."""
        if not self.enabled:
            return 0
        with self._lock:
            return self._held.best_continuation(parent_hash, tokens)[1]

    # -- memory ------------------------------------------------------------------------

    def reclaimable_bytes(self) -> int:
        """Memory :meth:`release` can give back: the blocks and tails held here, and the
        host copies the lower tier still holds for writes not done yet."""
        with self._lock:
            lower = self._lower
            held = self._held.nbytes
        return held + (lower.pending_bytes() if lower is not None else 0)

    def release(self, nbytes: int) -> int:
        """Free ``nbytes`` or everything there is (the memory guard reclaiming room);
        returns the bytes freed. Writes the lower tier has queued go first (their blocks
        stay served from here, and are offered again if evicted by the budget later),
        then the least recently used blocks and tails. Unlike a budget eviction, this one
        offers nothing to the lower tier: a host copy would take the memory being freed."""
        with self._lock:
            lower = self._lower
        freed = lower.drop_pending(nbytes) if lower is not None and nbytes > 0 else 0
        with self._lock:
            before = self._held.nbytes
            self._held.evict(limit=max(0, before - max(0, nbytes - freed)))
            freed += before - self._held.nbytes
        return freed

    def clear(self) -> None:
        with self._lock:
            self._held.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = {
                "enabled": self.enabled,
                "hits": self.hits,
                "misses": self.misses,
                "tokens_saved": self.tokens_saved,
                "blocks": self._held.block_count,
                "tails": self._held.tail_count,
                "tail_hits": self.tail_hits,
                "bytes": self._held.nbytes,
                "budget_bytes": self.budget_bytes,
                "block_size": self.block_size,
                "evictions": self._held.evictions,
                "lower_tier": type(self._lower).__name__ if self._lower is not None else None,
            }
            lower = self._lower
        if lower is not None:
            try:
                counters = dict(lower.stats())
            except Exception:  # a failing tier must not break the engine's stats
                counters = {}
            if counters:
                stats["lower"] = counters
        return stats


__all__ = ["HASH_BYTES", "TAILS_PER_PREFIX", "BlockStore", "CachedBlock", "CachedTail", "PrefixCache",
           "chain_hashes", "common_prefix_length", "partial_hash", "root_hash"]
