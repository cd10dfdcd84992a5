"""The values that cross the memory hooks: ceilings, limit snapshots, estimate queries
and estimates, preflight requests, rejections and boundary snapshots. Plugin authors
read these types; ``omlx_core.memory`` and the plugins compute them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from omlx_core.settings import format_size

CEILING_NAMES = ("static", "dynamic", "device", "custom")


@dataclass(frozen=True)
class CeilingBreakdown:
    """Each memory ceiling in bytes (``None`` where the probe had nothing to say)."""

    static: int | None = None
    dynamic: int | None = None
    device: int | None = None
    custom: int | None = None
    tier: str = "balanced"
    total_ram: int | None = None
    reclaimable: int | None = None
    own_footprint: int | None = None
    device_kind: str | None = None  # "metal", "cuda", "cgroup" or None
    notes: tuple[str, ...] = ()
    #: where the limit that binds is when it is not this process's own ceiling (the
    #: ``adjust_limits`` hook judged against memory elsewhere, e.g. another rank of a
    #: distributed group), in words: refusals say it instead of the ceiling's name
    elsewhere: str = ""
    #: the rank of a distributed group whose ceilings these are, when that is not this
    #: process (``None``: this process's own), and the group's size: a refusal's
    #: binding ceiling and its advice then name that rank's ceiling
    rank: int | None = None
    ranks: int = 1

    def ceilings(self) -> dict[str, int]:
        return {name: value for name in CEILING_NAMES
                if (value := getattr(self, name)) is not None and value > 0}

    @property
    def hard(self) -> int | None:
        """The binding limit: the smallest ceiling that is set."""
        values = self.ceilings()
        return min(values.values()) if values else None

    @property
    def binding(self) -> str | None:
        """Name of the ceiling that is the hard limit (first in CEILING_NAMES on a tie)."""
        values = self.ceilings()
        return min(values, key=lambda name: values[name]) if values else None


@dataclass(frozen=True)
class LimitSnapshot:
    """One immutable reading the enforcer publishes to every engine each poll."""

    hard_bytes: int | None
    breakdown: CeilingBreakdown
    in_use_bytes: int = 0
    taken_at: float = 0.0
    sequence: int = 0
    #: memory held while no request runs (weights, runtime), without what the server
    #: gives back on demand (prefix caches, mlx's buffer cache): what every request
    #: sits on when every cache is emptied
    baseline_bytes: int = 0
    #: of ``in_use_bytes``, what the server can give back on demand right now
    reclaimable_bytes: int = 0
    #: the transient margin every stage charges under ``hard_bytes``
    margin_bytes: int = 0
    #: of ``in_use_bytes``, what mlx does not hold (interpreter, libraries, heap): it
    #: changes slowly, so with mlx's own counters it tells current use between polls
    other_bytes: int = 0
    #: requests finished when ``baseline_bytes`` was read (on an idle server): a baseline
    #: read before the latest one finished may miss what it left behind
    baseline_epoch: int = 0
    #: when ``baseline_bytes`` was read (``time.monotonic``): model loads and unloads that
    #: ended after it are not in it (the admission ledger adds them)
    baseline_read_at: float = 0.0

    #: what binds the forward gate when it is not ``breakdown`` (the ``adjust_limits``
    #: hook judged admission and the forward gate against different places)
    forward_breakdown: CeilingBreakdown | None = None

    def breakdown_at(self, stage: str) -> CeilingBreakdown:
        """The ceilings that bind a decision at ``stage`` (:data:`STAGES`)."""
        if stage == "forward" and self.forward_breakdown is not None:
            return self.forward_breakdown
        return self.breakdown

    def binding_at(self, stage: str) -> str | None:
        """The name of the ceiling that binds at ``stage`` (``None``: none binds)."""
        breakdown = self.breakdown_at(stage)
        return breakdown.binding if breakdown is not None else None

    @property
    def headroom_bytes(self) -> int | None:
        """What a new request could use now with every cache emptied; ``None`` unlimited."""
        if self.hard_bytes is None:
            return None
        return self.hard_bytes - (self.in_use_bytes - self.reclaimable_bytes)

    @property
    def binding_name(self) -> str | None:
        """The ceiling that is the hard limit (``None``: none binds)."""
        return self.breakdown.binding if self.breakdown is not None else None

    def over_by(self, mlx_bytes: int, keep_free: int = 0) -> int:
        """How far memory in use, read now as ``other_bytes`` plus ``mlx_bytes`` (what
        mlx holds: a cheap reading between two polls), leaves less than ``keep_free``
        under the hard limit: what caches should give back (0 when nothing is over, or
        there is no limit)."""
        if self.hard_bytes is None:
            return 0
        return max(0, self.other_bytes + mlx_bytes + keep_free - self.hard_bytes)


@dataclass(frozen=True)
class PeakQuery:
    """What :func:`estimate_peak` is asked: a prefill of ``new_tokens`` over ``cached_tokens``."""

    model_config: Mapping[str, Any]
    new_tokens: int
    cached_tokens: int = 0
    chunk_size: int = 512
    dtype_bytes: int = 4
    kv_bits: int | None = None
    # True when the engine evaluates the logits of every prompt token (not just the last).
    full_logits: bool = False
    model_id: str = ""
    #: group size of a quantized KV cache (``kv_bits``)
    kv_group_size: int = 64
    #: the last of ``new_tokens`` may be fed in a one-token forward, after which the cache
    #: joins mlx-lm's ``BatchGenerator`` (which copies it); the estimate covers that too
    first_token: bool = True
    #: the cached tokens' KV is already in memory inside the cache being extended; False
    #: when a reused prefix is copied into a fresh cache by the forward (counted as new)
    cached_kv_resident: bool = True
    #: "cpu", "cuda" or "metal": whether attention scores materialize (cpu, cuda)
    backend: str = "cpu"
    #: images a vision model encodes before this prefill: their vision-tower activations
    #: are part of its peak, their features (one row per image token) are held while
    #: prefill feeds them
    images: int = 0
    #: an encode forward (embeddings, relevance scores): ``rows`` sequences, each padded
    #: to ``new_tokens``, in one forward that caches nothing; only its transient and the
    #: pooled outputs count, nothing stays held after it
    encode: bool = False
    rows: int = 1


#: Tokens by which mlx-lm's KV caches (``KVCache``, ``QuantizedKVCache``,
#: ``BatchKVCache``) grow: a cache holding ``n`` tokens has room for a whole number of them.
KV_STEP = 256


def kv_capacity(tokens: int) -> int:
    """The KV tokens a cache holding ``tokens`` has allocated (it grows in steps)."""
    return -(-tokens // KV_STEP) * KV_STEP


@dataclass(frozen=True)
class PeakEstimate:
    """What :func:`estimate_peak` answers: the peak bytes a prefill of ``new_tokens`` over
    ``cached_tokens`` (the :class:`PeakQuery`) adds to memory in use, in the parts each
    stage of the guard needs, so none of them asks twice.

    :attr:`total` is that peak. Preflight and admission compare it with the limit;
    admission reserves it and grows the reservation by :attr:`kv_bytes_per_token` per
    completion token; the forward gate counts :attr:`held_bytes` as staying in use after
    a forward, and :attr:`kv_bytes_per_token` for the rows a shared forward copies.
    """

    #: working memory of the prefill's worst step, freed when the prefill ends:
    #: attention scores, activations, logits, copies made while a cache grows
    transient_bytes: int
    #: cache bytes one more token (prompt or completion) holds, over every layer whose
    #: cache grows with the context: what decode grows by
    kv_bytes_per_token: int
    #: what the request holds beside the model's own cache: a vision model's image
    #: encoding and features, a draft model's weights, KV and verify forward
    extra_bytes: int = 0
    #: the cache the prefill adds and leaves held: its tokens' KV in whole cache steps
    #: (after the decode join), and recurrent state
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("transient_bytes", "kv_bytes_per_token", "extra_bytes", "kv_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PeakEstimate.{name} must be a non-negative int, not {value!r}")

    @property
    def total(self) -> int:
        """The peak bytes the prefill of the query adds: transient, KV and extra together."""
        return self.transient_bytes + self.kv_bytes + self.extra_bytes

    @property
    def held_bytes(self) -> int:
        """What stays in use once the prefill's step is over: its KV and extra bytes."""
        return min(self.total, self.kv_bytes + self.extra_bytes)

    def plus_extra(self, extra_bytes: int, kv_bytes_per_token: int = 0) -> "PeakEstimate":
        """This estimate with ``extra_bytes`` more held beside the model's cache, and
        ``kv_bytes_per_token`` more per token (a draft model's own cache)."""
        return replace(self, extra_bytes=self.extra_bytes + extra_bytes,
                       kv_bytes_per_token=self.kv_bytes_per_token + kv_bytes_per_token)


@dataclass(frozen=True)
class PreflightRequest:
    """A tokenized request about to be admitted, before any response byte."""

    request_id: str
    model_id: str
    prompt_tokens: int
    cached_tokens: int
    chunk_size: int
    estimated_bytes: int | None
    limits: LimitSnapshot | None
    model_config: Mapping[str, Any] = field(default_factory=dict)
    #: the transient margin every stage charges on top of the estimate
    #: (``memory.transient_margin``): a request preflight lets through is never refused
    #: by the forward gate on an idle server for want of it
    margin_bytes: int = 0
    #: the completion tokens the request may generate, and the KV bytes each token of
    #: prompt or completion holds (0: unknown): the KV of the whole prompt and
    #: completion must fit too, since decode grows until then
    max_tokens: int = 0
    kv_bytes_per_token: int = 0


#: where a request was refused: before any work (it can never fit), while its model
#: was to be loaded (the model cannot fit, or the room did not come), while waiting for
#: memory next to the running requests, or at a prefill forward (memory ran short)
STAGES = ("preflight", "load", "admission", "forward")

#: why: the request cannot fit even alone on an idle server; the admission queue is
#: full; it waited past ``memory.queue_timeout_s``; memory in use left no room for its
#: next forward; use was over the limit after a forward; no estimator covers the model
CAUSES = ("never_fits", "queue_full", "queue_timeout", "memory_short", "over_limit",
          "no_estimate")


@dataclass(frozen=True)
class Rejection:
    """Why a request cannot run: estimate against limit, and which ceiling binds."""

    estimated_bytes: int
    limit_bytes: int | None
    breakdown: CeilingBreakdown | None
    request_id: str = ""
    model_id: str = ""
    prompt_tokens: int = 0
    stage: str = "preflight"
    #: memory the estimate comes on top of (idle baseline for preflight, current use
    #: for the forward gate); the comparison is ``base_bytes + estimated_bytes > limit``
    base_bytes: int = 0
    cause: str = "never_fits"
    #: what happened, in words, when the byte counts alone do not say it (queue full,
    #: the tokens a refused chunk covered)
    detail: str = ""
    #: of ``estimated_bytes``, the KV the completion grows to (``max_tokens``): the part
    #: a smaller ``max_tokens`` shrinks
    decode_bytes: int = 0
    #: the request's ``max_tokens``, and the largest that would have been admitted now
    #: (``None``: none would, or it was not the completion's KV that did not fit)
    max_tokens: int = 0
    fitting_max_tokens: int | None = None
    #: the transient margin included in ``estimated_bytes``
    margin_bytes: int = 0
    #: stage ``"load"``: the resident pinned models (unpinning one may make room)
    pinned_models: tuple[str, ...] = ()
    #: stage ``"preflight"``: the widest quantized KV format (8 or 4 bits) under which
    #: the request would fit (``None``: none would, or the model's KV is that already)
    fitting_kv_bits: int | None = None

    @property
    def binding(self) -> str | None:
        return self.breakdown.binding if self.breakdown else None

    @property
    def binding_rank(self) -> int | None:
        """The rank of a distributed group whose ceiling binds, when not this process's."""
        return self.breakdown.rank if self.breakdown else None

    @property
    def needed_bytes(self) -> int:
        return self.base_bytes + self.estimated_bytes

    @property
    def binds(self) -> str:
        """What binds, in words (``""``: unknown)."""
        if self.breakdown is not None and self.breakdown.elsewhere:
            return self.breakdown.elsewhere
        return f"{self.binding} ceiling binds" if self.binding else ""

    def summary(self) -> str:
        if self.detail and self.stage != "preflight":
            return self.detail + (f" ({self.binds})" if self.binds else "")
        limit = format_size(self.limit_bytes) if self.limit_bytes is not None else "unknown"
        text = (f"prefill of {self.prompt_tokens} tokens needs an estimated "
                f"{format_size(self.estimated_bytes)}")
        if self.base_bytes:
            text += (f" on top of {format_size(self.base_bytes)} already in use "
                     f"({format_size(self.needed_bytes)} in all)")
        text += f", over the {limit} memory limit"
        text += f" ({self.binds})" if self.binds else ""
        return text + (f"; {self.detail}" if self.detail else "")


class RequestRejected(Exception):
    """The one way a memory guard refuses a request, at any stage.

    ``stage`` says where (:data:`STAGES`): ``"preflight"`` means the request can never
    fit here (the front end answers 413 before any byte), and so does ``"load"`` with
    cause ``"never_fits"`` (its model cannot be loaded even with every unpinned model
    unloaded); ``"admission"``, ``"forward"`` and the other ``"load"`` causes mean
    memory is short right now, so the same request can succeed later (503 with
    ``Retry-After`` before the first byte, an in-band error after it).

    :param rejection: the structured reason: estimate, limit, ceilings, cause.
    :param advice: what an operator or client can do, from the ``on_rejection`` hook.
    :param retry_after_s: when a retry may succeed; ``None`` for a preflight refusal.
    :param wait: (a forward gate's refusal) the memory the request needs is held by work
        that gives it back by itself: other requests of its engine, or a helper's work in
        flight. An engine that can keep the request waiting does (it asks again when the
        gate lets it resume); otherwise the refusal is final and the request ends.
    """

    def __init__(self, rejection: Rejection, advice: list[str] | None = None,
                 retry_after_s: float | None = None, *, wait: bool = False):
        self.rejection = rejection
        self.advice = list(advice or [])
        self.retry_after_s = retry_after_s
        self.wait = wait
        super().__init__(rejection.summary() + (". " + " ".join(self.advice) if self.advice else ""))

    @property
    def stage(self) -> str:
        return self.rejection.stage

    @property
    def retryable(self) -> bool:
        """Whether the same request can succeed later: not one that can never fit, nor
        one for a model no plugin estimates (the guard can never let it run)."""
        rejection = self.rejection
        return not (rejection.stage == "preflight" or rejection.cause == "no_estimate"
                    or (rejection.stage == "load" and rejection.cause == "never_fits"))

    def with_advice(self, advice: list[str]) -> "RequestRejected":
        return RequestRejected(self.rejection, advice, self.retry_after_s, wait=self.wait)


@dataclass(frozen=True)
class BoundarySnapshot:
    """Non-sliceable cache state at a block boundary during prefill, keyed by request id."""

    request_id: str
    block_index: int
    token_count: int
    block_hash: bytes
    layer_states: tuple[Any, ...]
    model_id: str = ""
