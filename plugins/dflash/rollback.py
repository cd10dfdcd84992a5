"""Rolling the target's cache back past the drafted tokens a verify forward rejected.

A verify forward appends ``[anchor, d_1 .. d_k]`` to every layer's cache; only the
anchor and the accepted drafts may stay. Attention layers keep a KV cache that can be
cut back (mlx-lm's ``trim``). Recurrent layers (GatedDeltaNet, Mamba: an
``ArraysCache`` holding a convolution window and a recurrent state) fold every token
into their state and cannot be cut back; their state before the forward is kept
(the forward replaces the arrays, never writes into them, so keeping references is a
snapshot), and after a partial acceptance every layer goes back to before the forward
and the accepted tokens are run again, which leaves each layer exactly as if only they
had been fed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, make_prompt_cache


def _layers(cache: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for layer in cache:
        if isinstance(layer, CacheList):
            flat.extend(_layers(layer.caches))
        else:
            flat.append(layer)
    return flat


def unsupported_layers(cache: Sequence[Any]) -> list[str]:
    """Names of cache types that can neither be trimmed nor snapshotted (a rotating
    sliding window that has wrapped), so speculation cannot roll them back."""
    kinds = set()
    for layer in _layers(cache):
        if isinstance(layer, ArraysCache):
            continue
        if type(layer) is KVCache or (layer.is_trimmable() and not hasattr(layer, "max_size")):
            continue
        kinds.add(type(layer).__name__)
    return sorted(kinds)


class TargetCache:
    """The target model's cache for one request, with rollback of rejected drafts.

    :param model: the target (an mlx-lm model: ``model(tokens, cache=...)``).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = make_prompt_cache(model)
        flat = _layers(self.layers)
        self._recurrent = [layer for layer in flat if isinstance(layer, ArraysCache)]
        self._trimmable = [layer for layer in flat if not isinstance(layer, ArraysCache)]
        self._saved: list[list[Any]] | None = None
        #: tokens the cache holds
        self.offset = 0

    @property
    def hybrid(self) -> bool:
        """Whether some layers are recurrent (rollback recomputes the accepted tokens)."""
        return bool(self._recurrent)

    def forward(self, tokens: Sequence[int], *, logits: bool = True,
                hook: Callable[[], Any] | None = None) -> mx.array | None:
        """Feed ``tokens``; the logits of every position (``(len, vocab)``) or, with
        ``logits=False``, only the cache's state is evaluated."""
        out = self.model(mx.array(list(tokens))[None], cache=self.layers)
        self.offset += len(tokens)
        if not logits:
            mx.eval([layer.state for layer in self.layers])
            return None
        return out[0]

    def checkpoint(self) -> None:
        """Remember the recurrent layers' state before a verify forward."""
        self._saved = [list(layer.cache) for layer in self._recurrent] if self._recurrent else None

    def rollback(self, fed: Sequence[int], kept: int) -> None:
        """Keep the first ``kept`` of the ``fed`` tokens of the last verify forward."""
        rejected = len(fed) - kept
        if rejected <= 0:
            self._saved = None
            return
        if not self._recurrent:
            for layer in self._trimmable:
                layer.trim(rejected)
            self.offset -= rejected
            return
        assert self._saved is not None, "rollback of a hybrid cache without a checkpoint"
        for layer, state in zip(self._recurrent, self._saved):
            layer.cache = state
        for layer in self._trimmable:
            layer.trim(len(fed))
        self.offset -= len(fed)
        self._saved = None
        if kept:
            self.forward(fed[:kept], logits=False)


__all__ = ["TargetCache", "unsupported_layers"]
