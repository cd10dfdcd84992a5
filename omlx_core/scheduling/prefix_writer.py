"""What the scheduler puts into the prefix cache, and when.

Prefill chunk ends fall on ``plugin.batched.block_size`` boundaries where they can
(:mod:`~omlx_core.scheduling.prefill_planner`), so full blocks go into the prefix
cache as prefill crosses them (:meth:`PrefixCacheWriter.store_prefill_blocks`). For a
model with layers that cannot be cut at any token (sliding windows, recurrent
states), the state at a block boundary is captured as prefill passes it and announced
to the ``boundary_listener`` (the ``on_boundary_snapshot`` hook) as a
:class:`~omlx_core.memory.types.BoundarySnapshot`. A request that finishes, is aborted
or is preempted leaves the full blocks its prompt and completion filled, and the tokens
after the last one as a tail (:meth:`PrefixCacheWriter.store_finished_blocks`), so the
next request continuing them (the next chat turn, a resumed request) reuses them all.

**Boundary capture.** For a model with layers that cannot be cut, a tail carries their
state at its end and is reused only whole. Such tails are kept where a next turn
diverges: the end of the prompt less its last token (prefill's end: a repeated prompt),
the end of the whole prompt (:meth:`PrefixCacheWriter.store_prompt_end`: a next turn
whose re-sent answer differs from the tokens generated) and the end of the completion
(a next turn re-sending it as generated); and at the request's cache points (the end of
the system prompt and the start of the last message, where the engine's
``cache_points`` says later requests are likely to part from this one: a new task under
the same system prompt, a history whose last message was edited or cut), where the
planner ends a prefill chunk (:meth:`PrefixCacheWriter.store_prefill_tail`). They are
held, budgeted and evicted like any tail, and offered to the lower tier as partial blocks
with a boundary state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from omlx_core.scheduling.batch_state import SequenceState
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.scheduling.extensions import CacheKey
from omlx_core.scheduling.prefix_cache import CachedBlock, PrefixCache

if TYPE_CHECKING:
    from omlx_core.memory.types import BoundarySnapshot

log = logging.getLogger(__name__)


class PrefixCacheWriter:
    """Stores a request's blocks, boundary states and tails as its KV comes to hold them."""

    def __init__(self, *, prefix_cache: PrefixCache, layout: CacheLayout, cache_key: CacheKey,
                 model_id: str, boundary_listener: Callable[[BoundarySnapshot], None] | None) -> None:
        self.prefix_cache = prefix_cache
        self.layout = layout
        self.cache_key = cache_key
        self.model_id = model_id
        self.boundary_listener = boundary_listener

    def store_prefill_blocks(self, sequence: SequenceState) -> None:
        """Put the blocks prefill just completed into the prefix cache."""
        if not self.prefix_cache.enabled:
            return
        block_size = self.prefix_cache.block_size
        complete = sequence.prefilled // block_size
        at_boundary = sequence.prefilled % block_size == 0
        key = None
        blocks = []
        for index in range(sequence.stored_blocks, complete):
            block_hash = sequence.block_hashes[index]
            captures_here = at_boundary and index == complete - 1 and self.layout.needs_boundaries
            existing = self.prefix_cache.get(block_hash)
            if existing is not None and (existing.reusable_end or not captures_here):
                continue
            if key is None:
                key = self.cache_key(sequence, sequence.context[:complete * block_size])
            boundary = self.layout.capture(sequence.cache) if captures_here else None
            parent = sequence.block_hashes[index - 1] if index else self.prefix_cache.root
            kv = self.layout.cut(sequence.cache, index * block_size, (index + 1) * block_size)
            blocks.append(self.layout.make_block(
                block_hash, parent, index, block_size, kv, boundary,
                list(key[index * block_size:(index + 1) * block_size])))
            if boundary is not None and self.boundary_listener is not None:
                self._announce_boundary(sequence, blocks[-1])
        self.prefix_cache.insert(blocks, chain=sequence.block_hashes[:complete])
        sequence.stored_blocks = complete

    def store_prefill_tail(self, sequence: SequenceState) -> None:
        """Keep the tokens prefill has fed after the last full block as a tail: at the
        prompt's end (all but its last token) or at one of the request's cache points."""
        end = sequence.prefilled
        self._store_tail(sequence.cache, self.cache_key(sequence, sequence.context[:end]),
                         sequence.block_hashes)

    def store_prompt_end(self, sequence: SequenceState) -> None:
        """For a model with layers that cannot be cut, capture the state at the end of
        the whole prompt (its first-token forward has fed the last token): where the
        next chat turn resumes when the answer it re-sends differs from the tokens
        generated (a template that rewrites it, text that tokenizes differently)."""
        if self.layout.needs_boundaries and sequence.cache:
            self.store_finished_blocks(sequence, sequence.cache, sequence.context)

    def _announce_boundary(self, sequence: SequenceState, block: CachedBlock) -> None:
        from omlx_core.memory.types import BoundarySnapshot

        snapshot = BoundarySnapshot(sequence.request_id, block.index, block.end_token,
                                    block.block_hash, block.boundary or (), self.model_id)
        try:
            self.boundary_listener(snapshot)  # type: ignore[misc]
        except Exception:
            log.exception("on_boundary_snapshot listener failed; the snapshot is dropped")

    def store_finished_blocks(self, sequence: SequenceState, cache: list[Any], tokens: Sequence[int]) -> None:
        """Cache the full blocks (and the tail after them) that ``tokens``, a prefix of
        ``sequence``'s prompt and completion, filled in ``cache``.

        For a model with layers that cannot be cut, their state at the end of what
        ``cache`` holds is captured (boundary capture), with the last block when it ends
        there, else with the tail, so the next chat turn resumes right after the
        completion (the stop token included: the decode step fed it).
        """
        if not self.prefix_cache.enabled or not cache:
            return
        held = cache_length(cache, len(tokens))
        if self.layout.needs_boundaries and held > len(tokens):
            return  # its state is past the tokens known: nothing to key it by
        # The cache holds every token of ``tokens`` (its offset equals their count); the
        # clamp only guards against a cache shorter than them, whose KV it cannot cover.
        keys = list(self.cache_key(sequence, list(tokens[:held])))
        block_size = self.prefix_cache.block_size
        hashes = self.prefix_cache.extend_hashes(sequence.block_hashes[:sequence.stored_blocks], keys)
        ends_on_block = len(hashes) * block_size == len(keys)
        blocks = []
        for index in range(sequence.stored_blocks, len(hashes)):
            captures_here = (self.layout.needs_boundaries and ends_on_block
                             and index == len(hashes) - 1)
            existing = self.prefix_cache.get(hashes[index])
            if existing is not None and (existing.reusable_end or not captures_here):
                continue
            parent = hashes[index - 1] if index else self.prefix_cache.root
            kv = self.layout.cut(cache, index * block_size, (index + 1) * block_size)
            boundary = self.layout.capture(cache) if captures_here else None
            blocks.append(self.layout.make_block(hashes[index], parent, index, block_size, kv, boundary,
                                                 keys[index * block_size:(index + 1) * block_size]))
        self.prefix_cache.insert(blocks, chain=hashes)
        self._store_tail(cache, keys, hashes)

    def _store_tail(self, cache: list[Any] | None, tokens: Sequence[int], hashes: list[bytes]) -> None:
        """Keep the tokens after the last full block of ``tokens`` (all in ``cache``;
        ``hashes``: the chain of their full blocks) as a prefix-cache tail, so the next
        request continuing them reuses them all. For a model with layers that cannot be
        cut, the tail carries their state and ``cache`` must end at ``tokens``' end."""
        if not self.prefix_cache.enabled or not cache:
            return
        if self.layout.needs_boundaries and cache_length(cache, len(tokens)) != len(tokens):
            return  # the captured state would not be the state at the tail's end
        full = len(tokens) // self.prefix_cache.block_size
        if full * self.prefix_cache.block_size == len(tokens):
            return
        parent = hashes[full - 1] if full else self.prefix_cache.root
        start = full * self.prefix_cache.block_size
        if self.prefix_cache.refresh_tail(parent, tokens[start:]):
            return  # the same tail (a shared system prompt's, say) is kept already
        self.prefix_cache.insert_tail(self.layout.make_tail(parent, list(tokens[start:]), cache, start),
                                      index=full)


def cache_length(cache: Sequence[Any], default: int) -> int:
    """Tokens ``cache`` holds: its first attention layer's offset (a recurrent layer
    keeps none), or ``default`` when it has no attention layer."""
    return next((layer.offset for layer in cache if hasattr(layer, "offset")), default)


__all__ = ["PrefixCacheWriter", "cache_length"]
