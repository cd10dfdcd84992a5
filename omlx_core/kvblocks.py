"""The blocks of a prefix cache and the protocol of a tier behind it.

The in-memory prefix cache of the ``batched`` engine and lower tiers such as the paged
SSD store of the ``ssd_cache`` plugin exchange :class:`CachedBlock` values through the
:class:`BlockStore` protocol; neither imports the other. A block is one
``plugin.batched.block_size`` run of a prompt's tokens: per layer its keys and values (for layers
cut by token) and, for models with layers that cannot be cut, the state at the block's
end. Hashes chain: a block's hash covers its tokens and its parent's hash, so one hash
names a whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, eq=False)
class CachedBlock:
    """One block of a prefix: its KV slices and, where needed, a boundary state."""

    block_hash: bytes
    parent_hash: bytes
    #: position of the block in its chain (0 = first ``block_size`` tokens)
    index: int
    block_size: int
    #: per layer: ``(keys, values)`` of this block's tokens, or ``None`` for a layer
    #: that cannot be cut and is carried by ``boundary`` instead
    kv: tuple[Any, ...]
    #: per layer: the whole state of a non-cuttable layer at this block's end (``None``
    #: for cuttable layers); ``None`` altogether when not captured
    boundary: tuple[Any, ...] | None
    #: whether a request may resume right after this block
    reusable_end: bool
    nbytes: int
    #: the block's token ids, when known: a prompt that shares only the first k of them
    #: reuses those k (:meth:`PrefixCache.lookup_tail`); blocks read back from a lower
    #: tier may not carry them
    tokens: tuple[int, ...] = ()

    @property
    def partially_reusable(self) -> bool:
        """Whether a prefix of this block can be reused (its tokens are known and every
        layer is cut by token, with no boundary state to resume from)."""
        return bool(self.tokens) and all(layer is not None for layer in self.kv)

    @property
    def end_token(self) -> int:
        return (self.index + 1) * self.block_size


@dataclass(frozen=True, eq=False)
class CachedTail:
    """Tokens after a prefix's last full block, with their keys and values per layer."""

    #: hash of the full-block prefix this tail continues (the root for a short prompt)
    parent_hash: bytes
    tokens: tuple[int, ...]
    #: per layer ``(keys, values)`` of ``tokens``; every layer of such a model is cuttable
    kv: tuple[Any, ...]
    nbytes: int


class BlockStore(Protocol):
    """A lower cache tier (e.g. a paged SSD store) behind the in-memory prefix cache."""

    def get(self, block_hash: bytes) -> CachedBlock | None:
        """The block with this hash, or ``None``."""

    def put(self, block: CachedBlock) -> None:
        """Keep ``block`` (stored or evicted here); may decline or drop it silently."""

    # Optional: ``touch(hashes)``, a chain (root to leaf) just stored or found in memory.


__all__ = ["BlockStore", "CachedBlock", "CachedTail"]
