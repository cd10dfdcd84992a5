"""The in-memory prefix cache: chain-hashed KV blocks under a byte budget, LRU.

A prompt is cut into blocks of ``plugin.batched.block_size`` tokens. Block ``i``'s hash covers
its tokens *and* the hash of block ``i - 1``, so one hash names a whole prefix and
two prompts share blocks exactly as far as they share tokens. A new request reuses
the longest run of cached blocks from the start of its prompt, which is what a
multi-turn chat re-sending its history needs.

A :class:`CachedBlock` carries, per layer, either that block's keys and values (for
layers whose cache can be cut at any token, plain ``KVCache``) or nothing; and, for
models that also have layers that cannot be cut (rotating windows, recurrent
``ArraysCache`` state), optionally a ``boundary``: those layers' whole state at the
block's end. Such a model may only resume at a block that has one (``reusable_end``).
How blocks are cut and put back together is :mod:`.cache_layout`'s business; this
module only stores, finds and evicts them.

Tiers: a slower store (the paged SSD cache of the ``ssd_cache`` plugin) can sit
behind this one through :meth:`PrefixCache.attach_lower`. It implements
:class:`BlockStore`. Writes go through: every block stored here is offered to it at
once (so a restart finds it), and again when evicted here (the store keeps the better
copy, e.g. one that gained a boundary state). A lookup that misses here asks it, and a
block found there is promoted back. A store with the optional ``touch(hashes)`` is told
of every chain stored or found here (root to leaf), so its own LRU follows use. Calls to
the store are made outside this cache's lock: a disk read or a full write queue never
stalls a concurrent :meth:`peek`.

**Tails and partial blocks: reuse to the token.** For models whose every layer can be
cut, the tokens after a prefix's last full block (a finished request's
prompt-and-answer tail) are kept too, as a :class:`CachedTail` under the hash of that
block. After its last matching full block, a request reuses the longest common run of
leading tokens among the tails *and the cached blocks* under that block: a cached block
whose first k tokens match is cut to those k (its keys and values are sliced at
restore). So a repeated prompt, the next turn of a chat, the same system prompt with a
new question, or a prompt edited in the middle recompute only what is new, never up to
a block of shared tokens. Tails share the byte
budget and the LRU order with blocks, and at most :data:`TAILS_PER_PREFIX` are kept per
prefix (the least recently used goes). A lower tier receives each tail as a *partial
block* (fewer tokens than a block, named by :func:`partial_hash`), and offers it back,
like any block it holds, as a continuation of its parent.

Eviction is LRU by bytes, over blocks and tails alike (one use counter orders both).
Each lookup and store refreshes a chain from its deepest block up to its root, and a
tail's use refreshes it and then the chain above it, so a parent is always more recent
than its children and tails, and the leaves go first: evicting a parent would strand
everything below it. A block evicted all the same takes the tails under it along.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import Any, Sequence

from omlx_core.kvblocks import BlockStore, CachedBlock, CachedTail

HASH_BYTES = 16
#: tails kept under one prefix (different answers or follow-ups to the same history)
TAILS_PER_PREFIX = 8


def root_hash(namespace: str) -> bytes:
    """The parent of a chain's first block; differs per model so chains never collide."""
    return hashlib.blake2b(namespace.encode(), digest_size=HASH_BYTES).digest()


def chain_hashes(tokens: Sequence[int], block_size: int, parent: bytes) -> list[bytes]:
    """Hashes of every full block of ``tokens``, chained from ``parent``."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        digest.update(array("q", tokens[start:start + block_size]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def partial_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of fewer than a block's tokens after ``parent``: it names a tail kept in
    a lower tier, and never equals a full block's hash (its tokens are fewer)."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Chain-hashed KV blocks under ``budget_bytes``; ``budget_bytes == 0`` turns it off."""

    def __init__(self, block_size: int, budget_bytes: int, namespace: str = "") -> None:
        if block_size < 1:
            raise ValueError(f"plugin.batched.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.root = root_hash(namespace)
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self._tails: OrderedDict[tuple[bytes, tuple[int, ...]], CachedTail] = OrderedDict()
        self._tails_of: dict[bytes, list[tuple[bytes, tuple[int, ...]]]] = {}
        #: parent hash -> hashes of its cached child blocks a prefix of which can be reused
        self._children: dict[bytes, set[bytes]] = {}
        #: last use of each block (by hash) and tail (by key), from one counter: both
        #: dicts above are kept in this order, so each one's oldest comes first
        self._used: dict[Any, int] = {}
        self._clock = 0
        self._lock = threading.Lock()
        self._lower: BlockStore | None = None
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.evictions = 0
        self.tail_hits = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def attach_lower(self, store: BlockStore | None) -> None:
        """Put ``store`` behind this cache (``None`` detaches)."""
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

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[CachedBlock]:
        """The longest reusable cached prefix of the chain ``hashes``; counts a hit or miss."""
        if not self.enabled:
            return []
        found: list[CachedBlock] = []
        with self._lock:
            lower = self._lower
            for block_hash in hashes:
                block = self._blocks.get(block_hash)
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
                if self._blocks.get(block.block_hash) is not block:
                    self._add_locked(block)
            self._touch_locked(chain)
            evicted = self._evict_locked()
            while found and not found[-1].reusable_end:
                found.pop()
            if found:
                self.hits += 1
                self.tokens_saved += len(found) * self.block_size
            else:
                self.misses += 1
        self._offer(lower, evicted)
        self._touch_lower(lower, chain)
        return found

    def peek(self, hashes: Sequence[bytes]) -> int:
        """How many blocks :meth:`lookup` would reuse now from memory; changes nothing."""
        if not self.enabled:
            return 0
        with self._lock:
            usable = 0
            for position, block_hash in enumerate(hashes):
                block = self._blocks.get(block_hash)
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
            return self._blocks.get(block_hash)

    # -- stores ----------------------------------------------------------------------

    def insert(self, blocks: Sequence[CachedBlock], chain: Sequence[bytes] | None = None) -> None:
        """Store ``blocks`` and refresh ``chain`` (default: the blocks' own hashes), the
        whole prefix they belong to, before anything is evicted. A block already present
        is replaced only to gain a boundary state."""
        if not self.enabled:
            return
        chain = list(chain) if chain is not None else [b.block_hash for b in blocks]
        with self._lock:
            added = [block for block in blocks if self._add_locked(block)]
            self._touch_locked(chain)
            evicted = self._evict_locked()
            lower = self._lower
        self._offer(lower, added + evicted)
        self._touch_lower(lower, chain)

    @staticmethod
    def _offer(lower: BlockStore | None, blocks: Sequence[CachedBlock]) -> None:
        if lower is None:
            return
        for block in blocks:
            lower.put(block)

    @staticmethod
    def _touch_lower(lower: BlockStore | None, chain: Sequence[bytes]) -> None:
        """Tell ``lower`` (if it has the optional ``touch``) that ``chain`` was just used."""
        touch = getattr(lower, "touch", None)
        if touch is not None and chain:
            touch(list(chain))

    # -- tails -------------------------------------------------------------------------

    def insert_tail(self, tail: CachedTail) -> None:
        """Keep ``tail`` unless a tail already kept under its prefix starts with all of it,
        and offer it to the lower tier as a partial block (so a restarted server reuses a
        repeated prompt to the token)."""
        if not self.enabled or not tail.tokens or tail.nbytes > self.budget_bytes:
            return
        self._offer_tail(tail)
        with self._lock:
            for key in list(self._tails_of.get(tail.parent_hash, ())):
                kept = key[1]
                if kept[:len(tail.tokens)] == tail.tokens:
                    self._touch_tail_locked(key)
                    return
                if tail.tokens[:len(kept)] == kept:  # the new tail extends this one
                    self._drop_tail_locked(key)
            keys = self._tails_of.get(tail.parent_hash, [])
            if len(keys) >= TAILS_PER_PREFIX:
                self._drop_tail_locked(min(keys, key=self._used.__getitem__))
            key = (tail.parent_hash, tail.tokens)
            self._tails_of.setdefault(tail.parent_hash, []).append(key)
            self._tails[key] = tail
            self.nbytes += tail.nbytes
            self._touch_tail_locked(key)
            evicted = self._evict_locked()
            lower = self._lower
        self._offer(lower, evicted)

    def _offer_tail(self, tail: CachedTail) -> None:
        """Hand ``tail`` to the lower tier as a block of its own, under its parent: the
        lower tier offers it back as a continuation of that parent (:meth:`lookup_prefix`)."""
        with self._lock:
            lower = self._lower
            parent = self._blocks.get(tail.parent_hash)
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
            best, shared = self._best_continuation_locked(parent_hash, tokens)
            if best is None:
                return None, 0
            if isinstance(best, CachedBlock):
                # The block, then the chain above it: parents stay more recent.
                self._use_locked(self._blocks, best.block_hash)
                self._touch_above_locked(best.parent_hash)
                tail = CachedTail(best.parent_hash, best.tokens, best.kv, 0)
            else:
                self._touch_tail_locked((best.parent_hash, best.tokens))
                tail = best
            self.tail_hits += 1
            self.tokens_saved += shared
            return tail, shared

    def _best_continuation_locked(self, parent_hash: bytes, tokens: Sequence[int]
                                  ) -> tuple[CachedTail | CachedBlock | None, int]:
        """Of the tails and partially reusable blocks under ``parent_hash``, the one
        sharing the most leading tokens with ``tokens`` (a tail on a tie)."""
        best: CachedTail | CachedBlock | None = None
        shared = 0
        for key in self._tails_of.get(parent_hash, ()):
            n = common_prefix_length(key[1], tokens)
            if n > shared:
                best, shared = self._tails[key], n
        for block_hash in self._children.get(parent_hash, ()):
            block = self._blocks[block_hash]
            n = common_prefix_length(block.tokens, tokens)
            if n > shared:
                best, shared = block, n
        return best, shared

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
        continuations = getattr(lower, "continuations", None)
        if continuations is None:
            return
        with self._lock:
            in_memory = self._best_continuation_locked(parent_hash, tokens)[1]
        best_hash, best = None, in_memory
        for block_hash, block_tokens in continuations(parent_hash):
            n = common_prefix_length(block_tokens, tokens)
            if n > best:
                best_hash, best = block_hash, n
        if best_hash is None or self.get(best_hash) is not None:
            return
        block = lower.get(best_hash)
        if block is None or not block.partially_reusable:
            return
        with self._lock:
            if self._blocks.get(block.block_hash) is None:
                self._add_locked(block)
            self._touch_above_locked(block.block_hash)
            evicted = self._evict_locked()
        self._offer(lower, evicted)

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
            return self._best_continuation_locked(parent_hash, tokens)[1]

    def _drop_tail_locked(self, key: tuple[bytes, tuple[int, ...]]) -> None:
        tail = self._tails.pop(key)
        del self._used[key]
        self.nbytes -= tail.nbytes
        keys = self._tails_of[key[0]]
        keys.remove(key)
        if not keys:
            del self._tails_of[key[0]]

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain as just used (deepest block first, root last)."""
        with self._lock:
            self._touch_locked(hashes)

    def _add_locked(self, block: CachedBlock) -> bool:
        """Keep ``block``; ``False`` if it is too big or adds nothing to the copy held."""
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
        self._use_locked(self._blocks, block.block_hash)
        return True

    def _use_locked(self, entries: OrderedDict, key: Any) -> None:
        """Mark the block or tail under ``key`` in ``entries`` as the most recently used."""
        self._clock += 1
        self._used[key] = self._clock
        entries.move_to_end(key)

    def _touch_locked(self, hashes: Sequence[bytes]) -> None:
        for block_hash in reversed(hashes):
            if block_hash in self._blocks:
                self._use_locked(self._blocks, block_hash)

    def _touch_tail_locked(self, key: tuple[bytes, tuple[int, ...]]) -> None:
        """Refresh a tail, then the in-memory chain above it (deepest first), so the
        tail stays older than its parent and goes before it."""
        self._use_locked(self._tails, key)
        self._touch_above_locked(key[0])

    def _touch_above_locked(self, block_hash: bytes) -> None:
        """Refresh the in-memory chain ending at ``block_hash``, deepest first."""
        block = self._blocks.get(block_hash)
        while block is not None:
            self._use_locked(self._blocks, block.block_hash)
            block = self._blocks.get(block.parent_hash)

    def reclaimable_bytes(self) -> int:
        """Memory :meth:`release` can give back: the blocks and tails held here, and the
        host copies the lower tier still holds for writes not done yet."""
        with self._lock:
            lower = self._lower
            held = self.nbytes
        pending = getattr(lower, "pending_bytes", None)
        return held + (pending() if pending is not None else 0)

    def release(self, nbytes: int) -> int:
        """Free ``nbytes`` or everything there is (the memory guard reclaiming room);
        returns the bytes freed. Writes the lower tier has queued go first (their blocks
        stay served from here, and are offered again if evicted by the budget later),
        then the least recently used blocks and tails. Unlike a budget eviction, this one
        offers nothing to the lower tier: a host copy would take the memory being freed."""
        with self._lock:
            lower = self._lower
        drop_pending = getattr(lower, "drop_pending", None)
        freed = drop_pending(nbytes) if drop_pending is not None and nbytes > 0 else 0
        with self._lock:
            before = self.nbytes
            self._evict_locked(limit=max(0, before - max(0, nbytes - freed)))
            freed += before - self.nbytes
        return freed

    def _evict_locked(self, limit: int | None = None) -> list[CachedBlock]:
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
                self._drop_tail_locked(tail_key)
                continue
            block = self._blocks.pop(block_hash)
            del self._used[block_hash]
            self.nbytes -= block.nbytes
            self._forget_child_locked(block)
            evicted.append(block)
            for key in list(self._tails_of.get(block_hash, ())):
                self._drop_tail_locked(key)
                self.evictions += 1
        return evicted

    def _forget_child_locked(self, block: CachedBlock) -> None:
        children = self._children.get(block.parent_hash)
        if children is not None:
            children.discard(block.block_hash)
            if not children:
                del self._children[block.parent_hash]

    def clear(self) -> None:
        with self._lock:
            self._children.clear()
            self._blocks.clear()
            self._tails.clear()
            self._tails_of.clear()
            self._used.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = {
                "enabled": self.enabled,
                "hits": self.hits,
                "misses": self.misses,
                "tokens_saved": self.tokens_saved,
                "blocks": len(self._blocks),
                "tails": len(self._tails),
                "tail_hits": self.tail_hits,
                "bytes": self.nbytes,
                "budget_bytes": self.budget_bytes,
                "block_size": self.block_size,
                "evictions": self.evictions,
                "lower_tier": type(self._lower).__name__ if self._lower is not None else None,
            }
            lower_stats = getattr(self._lower, "stats", None)
        if callable(lower_stats):
            try:
                stats["lower"] = dict(lower_stats())
            except Exception:  # a failing tier must not break the engine's stats
                pass
        return stats
