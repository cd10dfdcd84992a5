"""Chain hashes of prompt blocks: one hash names a whole prefix.

A prompt is cut into blocks of ``plugin.batched.block_size`` tokens. Block ``i``'s hash
covers its tokens *and* the hash of block ``i - 1``, so two prompts share block hashes
exactly as far as they share tokens. The chain starts from a root that differs per model,
so chains of different models never collide.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence

HASH_BYTES = 16


def root_hash(namespace: str) -> bytes:
    """The parent of a chain's first block; differs per model so chains never collide."""
    return hashlib.blake2b(namespace.encode(), digest_size=HASH_BYTES).digest()


# Set in every salted key: a salted key is never a token id or an image key (both < 2^61).
_SALTED = 1 << 61


def salted_keys(keys: Sequence[int], salt: str | None) -> Sequence[int]:
    """``keys`` (token ids, image keys) in ``salt``'s own key space: chains of two
    different salts, or of a salt and none, share no block (``None``: ``keys`` as they
    are). A one-to-one map, so equal keys stay equal within a salt."""
    if not salt:
        return keys
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    offset = int.from_bytes(digest, "little") & (_SALTED - 1) | _SALTED
    return [key ^ offset for key in keys]


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


def common_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading items ``a`` and ``b`` share (tokens, or chained block hashes)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["HASH_BYTES", "chain_hashes", "common_prefix_length", "partial_hash", "root_hash",
           "salted_keys"]
