"""The memory guard on both paths of the speculative engine (seed 002).

The primary (speculative) path schedules its own prefills, outside any batched
scheduler, so it has a receiver of its own, :class:`PrimaryPathGuard`: it keeps the
enforcer's latest limit snapshot and the forward gate, and the primary path asks that
gate before every prefill chunk. The fallback path is a batched engine whose
scheduler already is a receiver. Both paths can run at once (a speculative request and
the batched ones beside it), so the object ``resolve_scheduler`` finds for the engine is
:class:`BothPaths`, which hands every snapshot and the gate to each of them: whichever
path is serving is reached on every poll, and a path that starts later already holds
the latest limits.

What speculation adds to a prefill's peak (:func:`speculative_extra_bytes`) is added to
every estimate of the engine's model by the plugin's ``estimate_peak`` wrapper
(:func:`with_speculation`, as the estimate's extra bytes), so preflight (413),
admission and the forward gate all see it: the draft's weights while they are not
loaded yet, the draft's KV (or the target hidden states a DFlash draft reads) for every
token, and the verify forward's transient, ``block_size`` positions of full logits and
attention scores over the whole context. The draft's KV per token is added to the
estimate's KV per token too, since decode grows both caches.

A prefix-cache hit on the primary path would be copied into the request's own cache
(there is no resident paged cache to extend), so its prefill costs the whole prompt:
the primary path's estimate takes no ``cached_tokens`` at all, and the engine reports
none (:meth:`DFlashEngine.cached_tokens`), so the guard always costs the full prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from omlx_core.scheduling import ForwardGate, MemoryReceiver

if TYPE_CHECKING:
    from omlx_core.scheduling import LimitSnapshot, PeakEstimate
    from omlx_core.scheduling import DraftFootprint


class PrimaryPathGuard(MemoryReceiver):
    """The primary path's receiver: what its prefill reads before every chunk."""

    def __init__(self) -> None:
        self.limits: LimitSnapshot | None = None
        self.gate: ForwardGate | None = None

    def apply_memory_limits(self, snapshot: LimitSnapshot) -> None:
        self.limits = snapshot

    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        self.gate = gate


class BothPaths(MemoryReceiver):
    """Publishes to the primary guard and to the fallback engine's scheduler alike."""

    def __init__(self, primary: PrimaryPathGuard, fallback: MemoryReceiver | None) -> None:
        self.primary = primary
        #: the started fallback engine's scheduler
        self.fallback = fallback

    def receivers(self) -> list[MemoryReceiver]:
        return [self.primary] if self.fallback is None else [self.primary, self.fallback]

    def apply_memory_limits(self, snapshot: LimitSnapshot) -> None:
        for receiver in self.receivers():
            receiver.apply_memory_limits(snapshot)

    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        for receiver in self.receivers():
            receiver.set_forward_gate(gate)


def speculative_extra_bytes(model_config: Mapping[str, Any], footprint: DraftFootprint,
                            block_size: int, total_tokens: int, chunk_size: int) -> int:
    """Bytes speculation adds to a prefill of ``total_tokens`` (prompt, or prompt and
    completion when admission reserves decode) over the target's own estimate.

    There is deliberately no ``cached_tokens`` parameter: on the primary path every
    token's KV is allocated by this request.
    """
    text = model_config.get("text_config") or {}

    def dim(name: str, default: int = 0) -> int:
        value = model_config.get(name, text.get(name, default))
        return int(value) if isinstance(value, (int, float)) and value else default

    vocab = dim("vocab_size")
    heads = dim("num_attention_heads", 1)
    tokens = max(0, int(total_tokens))
    # The verify forward evaluates the logits of every position it feeds (and their
    # log-softmax), and its attention scores span the whole context.
    verify = block_size * vocab * 4 * 2 + heads * block_size * (tokens + block_size) * 4
    draft_kv = footprint.kv_bytes_per_token * (tokens + block_size)
    draft_transient = footprint.transient_bytes_per_token * max(1, min(chunk_size, tokens))
    return footprint.pending_weight_bytes + draft_kv + verify + draft_transient


def with_speculation(estimate: PeakEstimate, footprint: DraftFootprint | None,
                     extra_bytes: int) -> PeakEstimate:
    """The target's ``estimate`` with what speculation adds: ``extra_bytes``
    (:func:`speculative_extra_bytes`) held beside the target's cache, and the draft's KV
    per token (``footprint``; ``None`` while speculation is off) on every token."""
    per_token = footprint.kv_bytes_per_token if footprint is not None else 0
    return estimate.plus_extra(extra_bytes, kv_bytes_per_token=per_token)


__all__ = ["BothPaths", "PrimaryPathGuard", "speculative_extra_bytes", "with_speculation"]
