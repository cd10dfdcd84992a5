"""Starting a request from cached KV, with the memory it takes asked for before any of
it is read.

A request whose prompt begins with a cached prefix starts from its own KV cache holding
that prefix (:meth:`PrefixRestorer.start`, at admission, before any forward). Blocks the
prefix cache holds in memory are copied into it; blocks only a lower tier holds (the
SSD cache) are read one at a time, each copied into the request's cache and dropped:
a block read from disk becomes the request's KV and is not held a second time (it is
not kept in the memory tier as well).

Before anything is read or copied, the bytes the restore brings into memory (the
request's cache, in whole growth steps, and the largest block read while it is copied,
from what the tier *describes*) are asked of ``room``: the engine's forward gate
(:meth:`~omlx_core.memory.gate.ForwardGate.room_for_restore`), which reclaims caches
when they do not fit. When even then they do not all fit, the longest prefix that does
is reused (the continuation goes first, then blocks from the end), or none: the request
prefills the rest, chunk by chunk, through the forward gate like any other tokens.
Without such a question a request could read its whole cached chain from disk next to
the copy it makes of it, outside every memory check (docs/reliability.md, "Peak RSS
under the ceiling").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from omlx_core.scheduling.batch_state import SequenceState
from omlx_core.scheduling.block_hashes import common_prefix_length
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.scheduling.prefix_cache import PrefixCache, PrefixMatch


@dataclass
class Restored:
    """A request's fresh cache and what of its cached prefix it holds."""

    cache: list[Any]
    #: full blocks of the prefix it holds
    blocks: int = 0
    #: tokens of a continuation after them
    tail_tokens: int = 0


class PrefixRestorer:
    """Finds, sizes and restores a request's cached prefix (on the MLX thread)."""

    def __init__(self, prefix_cache: PrefixCache, layout: CacheLayout) -> None:
        self.prefix_cache = prefix_cache
        self.layout = layout

    def start(self, hashes: Sequence[bytes], tokens: Sequence[int],
              room: Callable[[int], int] | None = None) -> Restored:
        """A cache for a request whose prompt's leading ``tokens`` (``hashes``: the chain
        of their full blocks) may be reused: holding as much of their cached prefix as
        ``room(bytes wanted)`` answers fits (all of it without ``room``)."""
        if not self.prefix_cache.enabled:
            return Restored(self.layout.new_cache())
        match = self.prefix_cache.match_prefix(hashes, tokens,
                                               needs_boundaries=self.layout.needs_boundaries)
        blocks, tail_tokens = len(match.hashes), match.tail_tokens
        if room is not None and (blocks or tail_tokens):
            blocks, tail_tokens = self.fitting(match, room(self.cost(match, blocks, tail_tokens)))
        restored = self._restore(match, blocks, tail_tokens)
        self.prefix_cache.record_reuse(match, restored.blocks, restored.tail_tokens)
        return restored

    # -- sizing ------------------------------------------------------------------------

    def cost(self, match: PrefixMatch, blocks: int, tail_tokens: int = 0) -> int:
        """Bytes restoring ``match``'s first ``blocks`` blocks (and then ``tail_tokens``
        of its continuation) brings into memory at its peak: the request's copy, in whole
        growth steps, and the largest block read from the lower tier while it is copied."""
        tokens = blocks * self.prefix_cache.block_size + tail_tokens
        if tokens == 0:
            return 0
        reads = [stored.nbytes for stored in match.stored[:blocks] if stored is not None]
        if tail_tokens and match.tail_stored is not None:
            reads.append(match.tail_stored.nbytes)
        return self._kv_bytes_per_token(match) * self.layout.capacity(tokens) + max(reads, default=0)

    def fitting(self, match: PrefixMatch, room: int) -> tuple[int, int]:
        """The most of ``match`` whose :meth:`cost` is within ``room``: ``(blocks,
        continuation tokens)``, the continuation only after every block."""
        blocks = len(match.hashes)
        if self.cost(match, blocks, match.tail_tokens) <= room:
            return blocks, match.tail_tokens
        for count in range(blocks, 0, -1):
            if match.ends[count - 1] and self.cost(match, count) <= room:
                return count, 0
        return 0, 0

    def _kv_bytes_per_token(self, match: PrefixMatch) -> int:
        """KV bytes one token takes in the cuttable layers: from a block in memory when
        there is one, else from what the lower tier says a read takes (headers and
        boundary states included: more, never less)."""
        if not any(self.layout.cuttable):
            return 0
        block_size = self.prefix_cache.block_size
        for block in match.held:
            if block is not None:
                kv = sum(a.nbytes for pair in block.kv if pair is not None for a in pair)
                return -(-kv // block_size)
        if match.stored:
            return -(-match.stored[0].nbytes // block_size)  # type: ignore[union-attr]
        if match.tail is not None:
            kv = sum(a.nbytes for pair in match.tail.kv if pair is not None for a in pair)
            return -(-kv // max(1, len(match.tail.tokens)))
        if match.tail_stored is not None:
            return -(-match.tail_stored.nbytes // max(1, match.tail_tokens))
        return 0

    # -- restoring -----------------------------------------------------------------------

    def _restore(self, match: PrefixMatch, blocks: int, tail_tokens: int) -> Restored:
        """``match``'s first ``blocks`` blocks and ``tail_tokens`` of its continuation in
        a fresh cache, block by block; less when a block cannot be read (the prefix then
        ends at the last block a request may resume after before it)."""
        layout = self.layout
        cache = layout.new_cache()
        if not blocks and not tail_tokens:
            return Restored(cache)
        block_size = self.prefix_cache.block_size
        end = blocks * block_size + tail_tokens
        written = usable = 0
        boundary = None
        for block in self.prefix_cache.blocks_of(match, blocks):
            layout.write(cache, block.kv, written * block_size, block_size, end)
            written += 1
            if block.reusable_end:
                usable, boundary = written, block.boundary
        tail = self.prefix_cache.tail_of(match) if tail_tokens and written == blocks else None
        if tail is not None and tail.boundary is not None:
            # A tail with a boundary state is a place to resume at after every block.
            usable, boundary = written, tail.boundary
        if tail is None or usable < blocks:
            tail_tokens = 0
        else:
            layout.write(cache, tail.kv, usable * block_size, tail_tokens, end)
        if not usable and not tail_tokens:
            return Restored(layout.new_cache())
        layout.finish(cache, usable * block_size + tail_tokens, boundary)
        return Restored(cache, usable, tail_tokens)

def follows_a_prefill(sequence: SequenceState, prefilling: Sequence[SequenceState],
                      prefix_cache: PrefixCache) -> bool:
    """Whether ``sequence``, about to be admitted, should wait for a request in
    ``prefilling`` that is computing the same leading blocks of its prompt: that one
    stores them in the prefix cache as it goes, and this one restores them then instead
    of computing them again (agents fanning one context out to several calls, retries,
    several copies of one prompt).

    It waits only when those blocks are most of what it has left to prefill (a shared
    chat-template opening is not worth a step's wait: it shares the forward instead),
    while the leader has not stored them all and they are not cached yet. The leader's
    prefill moves on every step, and a leader that stops prefilling (first token,
    preemption, abort) releases it. The scheduler admits the requests queued behind it
    meanwhile.
    """
    hashes = sequence.block_hashes
    if not hashes:
        return False
    block = prefix_cache.block_size
    cached = None
    for leader in prefilling:
        shared = common_prefix_length(hashes, leader.block_hashes)
        if shared <= leader.stored_blocks:
            continue
        if cached is None:
            cached = prefix_cache.peek(hashes)
        if shared > cached and 2 * (shared - cached) * block >= sequence.prefill_target - cached * block:
            return True
    return False


__all__ = ["PrefixRestorer", "Restored", "follows_a_prefill"]
