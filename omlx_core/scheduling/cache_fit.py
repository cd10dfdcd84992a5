"""Giving back cached memory that would take the process over its limit, between steps.

Cached blocks count as available memory: a prefill's forward gate reclaims them before
a chunk that needs the room. Decode steps ask no gate, so while requests decode the
blocks also leave free the margin (the step's transients) and room for one copy of the
decode batch's KV (a cache that grows copies itself). Use is read cheaply between
polls: what mlx holds now, the rest of the process as of the last poll
(:meth:`~omlx_core.memory.types.LimitSnapshot.over_by`). That reading still holds host
copies dropped since the poll, so they are subtracted; it misses host copies made
since, so the resident set read now bounds it below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from omlx_core.memory.usage import resident_now, trim_heap

if TYPE_CHECKING:
    from omlx_core.memory.types import LimitSnapshot
    from omlx_core.scheduling.prefix_cache import PrefixCache


class CacheFitter:
    """Releases prefix-cache memory (the lower tier's queued host copies, then blocks)
    the process is over its limit by."""

    def __init__(self, prefix_cache: PrefixCache) -> None:
        self.prefix_cache = prefix_cache
        #: the snapshot :attr:`_host_freed` counts from
        self._snapshot: LimitSnapshot | None = None
        #: bytes given back since that snapshot beyond what mlx reports (host copies of
        #: queued lower-tier writes): the snapshot's process reading still holds them
        self._host_freed = 0

    def fit(self, limits: LimitSnapshot | None, decoding: bool, decode_kv_bytes: int) -> None:
        if limits is None or not self.prefix_cache.reclaimable_bytes():
            return
        keep_free = limits.margin_bytes + decode_kv_bytes if decoding else 0
        if self._snapshot is not limits:
            self._snapshot, self._host_freed = limits, 0
        over = limits.over_by(int(mx.get_active_memory() + mx.get_cache_memory()), keep_free)
        over -= self._host_freed
        # That reading misses what grew outside mlx since the poll (host copies queued
        # for the SSD tier above all): the resident set now is the truth when higher.
        resident = resident_now()
        if resident is not None and limits.hard_bytes is not None:
            over = max(over, resident + keep_free - limits.hard_bytes)
        if over > 0:
            held = self.prefix_cache.nbytes
            freed = self.prefix_cache.release(over)
            self._host_freed += max(0, freed - (held - self.prefix_cache.nbytes))
            # Buffers freed by mlx can sit in the heap's free pages: hand them back too.
            trim_heap()


__all__ = ["CacheFitter"]
