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
keeps the better copy, e.g. one that gained a boundary state). Finding a prefix
(:meth:`PrefixCache.match_prefix`) reads nothing: past what memory holds, the store
*describes* the blocks it holds (what reading each brings into memory), so the memory
can be asked for before any is read (:mod:`.prefix_restore`). A block read back
(:meth:`PrefixCache.blocks_of`) goes into the request's own cache and is not kept here
as well: its KV is held once, by the request, and the blocks that request computes are
stored here as any request's are. The store is told of every chain stored or reused
(:meth:`~omlx_core.kvblocks.BlockStore.touch`, root to leaf), so its own LRU follows
use. Calls to the store are made outside this cache's lock: a disk read or a full
write queue never stalls a concurrent :meth:`PrefixCache.peek`.

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
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from omlx_core.kvblocks import BlockStore, CachedBlock, CachedTail, StoredBlock
from omlx_core.scheduling.block_hashes import (HASH_BYTES, chain_hashes, common_prefix_length,
                                                     partial_hash, root_hash)
from omlx_core.scheduling.block_lru import TAILS_PER_PREFIX, BlockLRU


@dataclass
class PrefixMatch:
    """The longest cached prefix of a prompt, found without reading a block
    (:meth:`PrefixCache.match_prefix`). Per block of the chain, root first, up to the
    last one a request may resume after: its hash, the block when memory holds it
    (``None``: only the lower tier does), and what reading it from the lower tier brings
    into memory (``None`` for a block in memory)."""

    hashes: list[bytes] = field(default_factory=list)
    held: list[CachedBlock | None] = field(default_factory=list)
    stored: list[StoredBlock | None] = field(default_factory=list)
    #: per block: whether a request may resume right after it
    ends: list[bool] = field(default_factory=list)
    #: leading tokens after the whole chain that a continuation shares with the prompt
    tail_tokens: int = 0
    #: that continuation when memory holds it (a tail, or a block reused in part) ...
    tail: CachedTail | None = None
    #: ... or the lower tier's block it is, and what reading it brings in
    tail_hash: bytes | None = None
    tail_stored: StoredBlock | None = None
    #: what memory holds it as (refreshed when the tail is reused)
    tail_entry: CachedTail | CachedBlock | None = None

    def truncate(self, blocks: int) -> None:
        """Keep the first ``blocks`` blocks and no continuation."""
        for part in (self.hashes, self.held, self.stored, self.ends):
            del part[blocks:]
        self.tail_tokens, self.tail, self.tail_hash, self.tail_stored, self.tail_entry = (
            0, None, None, None, None)


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

    def match_prefix(self, hashes: Sequence[bytes], tokens: Sequence[int] = (), *,
                     needs_boundaries: bool = False) -> PrefixMatch:
        """The longest reusable cached prefix of ``tokens`` (``hashes``: the chain of
        their full blocks), and the continuation after it sharing the most of the tokens
        that follow, found without reading, counting or refreshing anything: blocks in
        memory, then those the lower tier describes. For a model with layers that cannot
        be cut (``needs_boundaries``), a prefix may end at a lower-tier block only if it
        has a boundary state."""
        with self._lock:
            lower = self._lower
        return self._match(hashes, tokens, needs_boundaries, lower)

    def _match(self, hashes: Sequence[bytes], tokens: Sequence[int], needs_boundaries: bool,
               lower: BlockStore | None) -> PrefixMatch:
        """:meth:`match_prefix` over memory and ``lower`` (``None``: memory alone)."""
        match = PrefixMatch()
        if not self.enabled:
            return match
        with self._lock:
            in_memory = [self._held.block(block_hash) for block_hash in hashes]
        for block_hash, block in zip(hashes, in_memory):
            stored = None
            if block is None:
                stored = lower.describe(block_hash) if lower is not None else None
                if stored is None:
                    break
            match.hashes.append(block_hash)
            match.held.append(block)
            match.stored.append(stored)
            match.ends.append(block.reusable_end if block is not None
                              else stored.has_boundary or not needs_boundaries)  # type: ignore[union-attr]
        last_end = max((i + 1 for i, end in enumerate(match.ends) if end), default=0)
        if needs_boundaries:
            # Past the last block a request may resume after, a tail with a boundary
            # state (where an earlier request's prompt or completion ended) may be:
            # the deepest one wholly in the prompt wins.
            for blocks in range(len(match.hashes), last_end, -1):
                rest = tokens[blocks * self.block_size:]
                trial = PrefixMatch(match.hashes[:blocks], match.held[:blocks],
                                    match.stored[:blocks], match.ends[:blocks])
                if rest:
                    self._match_continuation(trial, rest, lower, needs_boundaries)
                if trial.tail_tokens:
                    return trial
        match.truncate(last_end)
        rest = tokens[len(match.hashes) * self.block_size:]
        if rest:
            self._match_continuation(match, rest, lower, needs_boundaries)
        return match

    def _match_continuation(self, match: PrefixMatch, tokens: Sequence[int],
                            lower: BlockStore | None, needs_boundaries: bool = False) -> None:
        """The continuation under ``match``'s last block sharing the most leading
        ``tokens``: memory's best, or the lower tier's block when it shares more (for a
        model with layers that cannot be cut, only a block with a boundary state, all of
        whose tokens the prompt continues with)."""
        parent = match.hashes[-1] if match.hashes else self.root
        with self._lock:
            best, shared = self._held.best_continuation(parent, tokens)
        if best is not None:
            match.tail_entry, match.tail_tokens = best, shared
            match.tail = best if isinstance(best, CachedTail) else CachedTail(
                best.parent_hash, best.tokens, best.kv, 0)
        if lower is None:
            return
        for block_hash, block_tokens in lower.continuations(parent):
            n = common_prefix_length(block_tokens, tokens)
            if needs_boundaries and n < len(block_tokens):
                continue
            if n > match.tail_tokens and self.get(block_hash) is None:
                stored = lower.describe(block_hash)
                if stored is not None and (stored.has_boundary or not needs_boundaries):
                    match.tail, match.tail_entry = None, None
                    match.tail_hash, match.tail_stored, match.tail_tokens = block_hash, stored, n

    def read(self, block_hash: bytes) -> CachedBlock | None:
        """The lower tier's block, read now (``None``: absent or unusable); not kept here.
        Ask for the memory :meth:`match_prefix` says it takes first."""
        with self._lock:
            lower = self._lower
        return lower.get(block_hash) if lower is not None else None

    def blocks_of(self, match: PrefixMatch, count: int) -> Iterator[CachedBlock]:
        """The first ``count`` blocks of ``match``, each of the lower tier read only when
        the iteration reaches it; ends early at one that cannot be read."""
        for block_hash, block in zip(match.hashes[:count], match.held[:count]):
            block = block or self.read(block_hash)
            if block is None:
                return
            yield block

    def tail_of(self, match: PrefixMatch) -> CachedTail | None:
        """``match``'s continuation, read from the lower tier when only it holds it."""
        if match.tail is not None or match.tail_hash is None:
            return match.tail
        block = self.read(match.tail_hash)
        if block is None:
            return None
        if block.boundary is not None and block.tokens and len(block.tokens) == match.tail_tokens:
            return CachedTail(block.parent_hash, block.tokens, block.kv, block.nbytes, block.boundary)
        if not block.partially_reusable:
            return None
        return CachedTail(block.parent_hash, block.tokens, block.kv, block.nbytes)

    def record_reuse(self, match: PrefixMatch, blocks: int, tail_tokens: int = 0) -> None:
        """Count a request's reuse of ``match``'s first ``blocks`` blocks and then
        ``tail_tokens`` of its continuation (a hit, or a miss when no block), and
        refresh them, here and in the lower tier."""
        if not self.enabled:
            return
        chain = match.hashes[:blocks]
        with self._lock:
            lower = self._lower
            self._held.touch_chain(chain)
            if blocks:
                self.hits += 1
                self.tokens_saved += blocks * self.block_size
            else:
                self.misses += 1
            if tail_tokens:
                self.tail_hits += 1
                self.tokens_saved += tail_tokens
                self._touch_continuation(match.tail_entry)
        if lower is not None and chain:
            lower.touch(list(chain))

    def _touch_continuation(self, entry: CachedTail | CachedBlock | None) -> None:
        """Refresh a reused continuation still held here (under the lock)."""
        if isinstance(entry, CachedBlock):
            if self._held.block(entry.block_hash) is entry:
                self._held.touch_block_and_above(entry)
        elif entry is not None and self._held.holds_tail((entry.parent_hash, entry.tokens)):
            self._held.touch_tail((entry.parent_hash, entry.tokens))

    def lookup(self, hashes: Sequence[bytes]) -> list[CachedBlock]:
        """The longest reusable cached prefix of the chain ``hashes``, every block of it
        read (with no memory asked for: :mod:`.prefix_restore` asks); counts a hit or
        miss."""
        return self.lookup_prefix(hashes, ())[0]

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

    def insert_tail(self, tail: CachedTail, index: int | None = None) -> None:
        """Keep ``tail`` unless a tail already kept under its prefix starts with all of it,
        and offer it to the lower tier as a partial block (so a restarted server reuses a
        repeated prompt to the token). ``index``: the full blocks before it, when known."""
        if not self.enabled or not tail.tokens or tail.nbytes > self.budget_bytes:
            return
        self._offer_tail(tail, index)
        with self._lock:
            self._held.add_tail(tail)
            evicted = self._held.evict()
            lower = self._lower
        self._write_through(lower, evicted)

    def refresh_tail(self, parent_hash: bytes, tokens: Sequence[int]) -> bool:
        """Whether a tail of exactly ``tokens`` is kept under ``parent_hash``; if so it
        counts as just used, and a writer need not copy the same state again."""
        key = (parent_hash, tuple(int(t) for t in tokens))
        with self._lock:
            if not self._held.holds_tail(key):
                return False
            self._held.touch_tail(key)
            return True

    def _offer_tail(self, tail: CachedTail, index: int | None) -> None:
        """Hand ``tail`` to the lower tier as a block of its own, under its parent: the
        lower tier offers it back as a continuation of that parent (:meth:`match_prefix`)."""
        with self._lock:
            lower = self._lower
            parent = self._held.block(tail.parent_hash)
        if lower is None or len(tail.tokens) >= self.block_size:
            return
        if parent is not None:
            index = parent.index + 1
        elif tail.parent_hash == self.root:
            index = 0
        elif index is None or lower.describe(tail.parent_hash) is None:
            # Evicted meanwhile (or read back from the lower tier, which then still has
            # it): a tail whose chain the lower tier lacks is not offered.
            return
        lower.put(CachedBlock(block_hash=partial_hash(tail.parent_hash, tail.tokens),
                              parent_hash=tail.parent_hash, index=index, block_size=self.block_size,
                              kv=tail.kv, boundary=tail.boundary, reusable_end=False,
                              nbytes=tail.nbytes, tokens=tail.tokens))

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
        their full blocks): its blocks, then the continuation after them sharing the
        most of the tokens after them, and how many it shares; all of it read (with no
        memory asked for: :mod:`.prefix_restore` asks) and counted."""
        match = self.match_prefix(hashes, tokens)
        blocks = list(self.blocks_of(match, len(match.hashes)))
        reusable = len(blocks)
        while reusable and not blocks[reusable - 1].reusable_end:
            reusable -= 1
        if reusable < len(match.hashes):
            match.truncate(reusable)
        tail = self.tail_of(match)
        shared = match.tail_tokens if tail is not None else 0
        self.record_reuse(match, reusable, shared)
        return blocks[:reusable], tail, shared

    def peek_prefix(self, hashes: Sequence[bytes], tokens: Sequence[int], *,
                    needs_boundaries: bool = False) -> int:
        """How many of ``tokens`` a request would reuse now, from memory or the lower
        tier (read in, not prefilled; its KV still counts as new memory); ``hashes`` and
        ``needs_boundaries`` as for :meth:`match_prefix`. Changes nothing."""
        with self._lock:
            lower = self._lower
        match = self._match(hashes, tokens, needs_boundaries, lower)
        return len(match.hashes) * self.block_size + match.tail_tokens

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
