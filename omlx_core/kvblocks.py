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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence


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


@dataclass(frozen=True)
class StoredBlock:
    """What a lower tier says of a block it holds, before reading it: what reading it
    would bring into memory, so that the memory can be asked for first."""

    #: bytes a :meth:`BlockStore.get` of the block brings into memory (its keys and
    #: values and its boundary state), or more: never less
    nbytes: int
    #: whether it carries a boundary state (for a model with layers that cannot be cut,
    #: a request may resume only right after such a block)
    has_boundary: bool = False


@dataclass(frozen=True, eq=False)
class CachedTail:
    """Tokens after a prefix's last full block, with their keys and values per layer.

    For a model whose every layer can be cut, a prompt sharing only the first k of its
    tokens reuses those k. For a model with layers that cannot be cut, a tail carries
    their state at its end (``boundary``: where a finished request's prompt or
    completion ended, the places the next chat turn diverges) and is reused only whole.
    """

    #: hash of the full-block prefix this tail continues (the root for a short prompt)
    parent_hash: bytes
    tokens: tuple[int, ...]
    #: per layer ``(keys, values)`` of ``tokens``, or ``None`` for a layer that cannot
    #: be cut (carried by ``boundary``)
    kv: tuple[Any, ...]
    nbytes: int
    #: per layer: the whole state of a non-cuttable layer at the tail's end (``None``
    #: for cuttable layers); ``None`` altogether for a model whose every layer is cut
    boundary: tuple[Any, ...] | None = None

    def shared_with(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` a request continuing this tail reuses: the common
        run, or for a tail with a boundary state all of its tokens or none."""
        n = 0
        for mine, theirs in zip(self.tokens, tokens):
            if mine != theirs:
                break
            n += 1
        if self.boundary is not None and n < len(self.tokens):
            return 0
        return n


class BlockStore(ABC):
    """A lower cache tier (e.g. a paged SSD store) behind the in-memory prefix cache.

    Everything the prefix cache asks of a tier is declared here; a tier subclasses this
    and overrides what it keeps. ``get``, ``describe`` and ``put`` have no neutral answer
    and must be written: a block is read only once the memory it takes, which
    ``describe`` says without reading it, has been asked for. The others default to what
    is true of a tier that keeps no such state: no recency order (:meth:`touch` changes
    nothing), no token ids (:meth:`continuations` offers none), no write queue
    (:meth:`pending_bytes` and :meth:`drop_pending` hold and free nothing), no counters
    (:meth:`stats` is empty).

    The prefix cache calls a tier outside its own lock: reads and writes from the MLX
    thread, :meth:`pending_bytes` and :meth:`stats` from any thread.
    """

    @abstractmethod
    def get(self, block_hash: bytes) -> CachedBlock | None:
        """The block with this hash, or ``None`` when the tier does not hold it (or holds
        it unusable)."""

    @abstractmethod
    def describe(self, block_hash: bytes) -> StoredBlock | None:
        """What a :meth:`get` of this block would bring into memory, without reading it;
        ``None`` when the tier does not hold it. Cheap: asked for every block of a
        prompt's cached chain before any is read."""

    @abstractmethod
    def put(self, block: CachedBlock) -> None:
        """Keep ``block`` (stored by, or evicted from, the prefix cache); may decline or
        drop it silently. A block already held is offered again when it gained a boundary
        state: keep the better copy."""

    def touch(self, hashes: Sequence[bytes]) -> None:
        """A chain (root first, leaf last) was just stored or found in memory: refresh it,
        so the tier evicts leaves before the blocks they hang from."""

    def continuations(self, parent_hash: bytes) -> Sequence[tuple[bytes, Sequence[int]]]:
        """The held blocks after ``parent_hash`` that may be reused in part (their token
        ids known, every layer cut by token), as ``(block hash, token ids)``: the prefix
        cache picks the one sharing most of a prompt and reads only that one back."""
        return ()

    def pending_bytes(self) -> int:
        """Host memory the tier holds for writes not done yet (memory the engine can give
        back, through :meth:`drop_pending`)."""
        return 0

    def drop_pending(self, nbytes: int) -> int:
        """Give up writes not done yet until ``nbytes`` of host memory are freed, or none
        is left (the memory guard needs the room); returns the bytes freed."""
        return 0

    def stats(self) -> Mapping[str, Any]:
        """The tier's counters, shown under the prefix cache's ``lower`` statistics."""
        return {}

    def yield_to(self, wait_quiet: Callable[[float], bool]) -> None:
        """Core hands every tier the MLX thread's ``wait_quiet`` (wait up to its argument's
        seconds for the forwards to stop; whether they have): work of the tier's own that
        can wait (writes) should, rather than take the cores from a forward."""


__all__ = ["BlockStore", "CachedBlock", "CachedTail", "StoredBlock"]
