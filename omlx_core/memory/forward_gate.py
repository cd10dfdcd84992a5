"""The forward gate: refuse a prefill chunk before its forward runs, not after.

Before a scheduler step's prefill forwards, the engine asks :meth:`PrefillForwardGate.
check_prefill`. For each planned forward, in the order they will run, the projected peak
is

    high-water current use + resident KV of the step's earlier forwards
    + the estimated peaks of this forward's chunks + memory.transient_margin

(one chunk, or several requests' chunks sharing the forward). A forward whose
projection passes the hard limit first gets the room cached memory can give (prefix
caches evicted least recently used first, mlx's buffer cache emptied); if it still
passes, it is refused, while every other request goes on. A refused request **waits**
(``RequestRejected.wait``: its engine preempts it) when what holds the memory gives it
back by itself: requests of its engine that run on past the step; when none do, the
last request refused in the step (which ends, so the others are judged again without
it); or a helper's work in flight (a grammar compile in its worker process, which ends
by its deadline) if the forward fits without that. It waits for helpers for at most the
ledger's queue timeout in all, and ``may_resume`` holds it while their work is still
in flight. Otherwise it ends with ``finish_reason="error"`` and its memory is freed.
(Before, the engine decided "others run" itself after putting back the refusals ahead
of it, so the last of several refused requests ended although the gate had said it
waits; and a request refused while the grammar worker restarted, 117 MiB for a second,
ended with a 503 that a second's wait would have avoided.)
A shared forward also copies every member's cached prefix into a batch buffer
(right-aligned to the longest, the new tokens after it) and each row back out, so its
projection adds ``2 x rows x (longest cached + longest new) x KV bytes per token``.
(The batched engine then asks again with every chunk alone before refusing anything,
so refusals of a shared forward are logged at DEBUG and not counted in
``refused_total``: only the second answer is final. Nor are refusals that wait, logged
at INFO.)
Model loads in flight are not counted here: a load claims its bytes in the admission
ledger next to the requests' reservations, so what admission let run already has room
beside it (counting a load not yet begun here refused a request running alone before
its first token, with the room there).
Admission keeps running requests inside the budget; the gate catches what drifted past
it (estimates that undercounted, decode growth, memory taken by other processes).

:meth:`PrefillForwardGate.check_after_prefill` is the backstop after a chunk's forward
has run: if the high-water use then passes the hard limit even with the caches
emptied, the request whose chunk just ran (of a shared forward, the one holding the
most KV) is stopped, its cache freed, before it grows any further.

:meth:`PrefillForwardGate.room_for_restore` answers, before a request's cached prefix
is copied into its own cache (blocks of a lower tier read on the way), how many of the
bytes that brings in fit now: memory in use plus them plus the margin under the hard
limit, after reclaiming caches if they do not fit. What does not fit is not read: the
request reuses a shorter prefix and prefills the rest, chunk by chunk, through the
check above.

:meth:`PrefillForwardGate.check_decode` budgets decode growth in blocks of ``KV_STEP``
tokens (mlx's KV caches grow that way). Oldest request first, each request whose KV
is about to pass what its reservation covers grows it to the next block boundary (at
most its prompt plus ``max_tokens``). The growth must fit both the admission ledger's
budget (:meth:`~.admission.AdmissionQueue.resize`) and memory in use now (plus the
margin, after reclaiming caches); when it does not, the youngest request is preempted
(suspended in the ledger, taken out of the batch by its engine) and the rest asked
again. The oldest request is never preempted: it passed preflight with its whole
``max_tokens``, so it fits alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from omlx_core.memory.gate import (
    UNLIMITED_TOKENS,
    CacheRestore,
    DecodePlan,
    DecodeStep,
    ForwardGate,
    PrefillChunk,
    PrefillStep,
    Refusals,
    refusal_waits,
)
from omlx_core.memory.types import (
    KV_STEP,
    LimitSnapshot,
    PeakEstimate,
    PeakQuery,
    Rejection,
    RequestRejected,
)
from omlx_core.memory.usage import MemoryUsage
from omlx_core.settings import format_size

if TYPE_CHECKING:
    from omlx_core.memory.admission import AdmissionQueue

log = logging.getLogger(__name__)

#: reclaims asked for at most before one decision: each frees what its caches count,
#: and the reading may fall by less, so the shortfall is asked for again
_RECLAIM_ROUNDS = 8
#: how long a request waits for helpers' work in flight at most without a ledger (with
#: one, its queue timeout: ``memory.queue_timeout_s``)
_HELPER_WAIT_S = 30.0
#: requests remembered as waiting for helpers before the ones long gone are forgotten
_MAX_HELPER_WAITS = 1024

Estimate = Callable[[PeakQuery], "PeakEstimate | None"]
Advise = Callable[[Rejection], "list[str]"]


def _forwards(chunks: tuple[PrefillChunk, ...]) -> list[list[PrefillChunk]]:
    """``chunks`` cut into the forwards that run them (a shared ``forward`` number groups)."""
    forwards: list[list[PrefillChunk]] = []
    for chunk in chunks:
        shared = chunk.forward
        if shared is not None and forwards and forwards[-1][0].forward == shared:
            forwards[-1].append(chunk)
        else:
            forwards.append([chunk])
    return forwards


def _copy_bytes(forward: list[PrefillChunk], estimates: list[PeakEstimate]) -> int:
    """What a shared forward copies beyond its chunks' own estimates: every row's cached
    prefix into the batch buffer (each row as wide as the longest prefix plus the
    longest chunk) and its tokens back out."""
    per_token = max(estimate.kv_bytes_per_token for estimate in estimates)
    width = max(c.cached_tokens for c in forward) + max(c.new_tokens for c in forward)
    return 2 * len(forward) * width * per_token


class PrefillForwardGate(ForwardGate):
    """The memory guard's :class:`~omlx_core.memory.gate.ForwardGate`, for any engine.

    :param estimate: peak bytes of a prefill (the ``estimate_peak`` hook).
    :param usage: where current use is read; readings here are taken between forwards,
        so they feed its high-water mark.
    :param transient_margin: bytes added to every forward's estimate, or a function of
        the hard limit giving them (the tier's :meth:`~.ceilings.TierPolicy.margin`).
    :param advise: turns a refusal into advice text (the ``on_rejection`` hook).
    :param retry_after_s: when a refused request may be retried.
    :param reclaim: frees at least the given bytes of caches if it can (returns the
        bytes freed); asked before any refusal, since cached memory is available memory.
    """

    def __init__(self, estimate: Estimate, usage: MemoryUsage,
                 transient_margin: int | Callable[[int], int],
                 advise: Advise | None = None, *, dtype_bytes: int = 4,
                 full_logits: bool = False, backend: str = "cpu", retry_after_s: float = 2.0,
                 kv_bits: int | None = None, kv_group_size: int = 64,
                 reclaim: Callable[[int], int] | None = None,
                 ledger: AdmissionQueue | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._reclaim = reclaim
        #: the admission ledger decode growth is reserved in (``None``: decode unbudgeted)
        self._ledger = ledger
        self._clock = clock
        #: when each request refused for helpers' work in flight first waited for it
        self._helper_waits: dict[str, float] = {}
        #: how long a request waits for helpers' work in flight at most, in all
        self._helper_wait_s = ledger.timeout_s if ledger is not None else _HELPER_WAIT_S
        self._per_token: dict[str, int | None] = {}
        #: requests preempted so far, by (binding ceiling, stage): "decode" for growth
        #: that did not fit, "forward" for a prefill refused while others ran
        self.preemptions: dict[tuple[str, str], int] = {}
        self._binding = "unknown"
        self._estimate = estimate
        self._usage = usage
        self._margin = transient_margin if callable(transient_margin) else (
            lambda _hard: transient_margin)
        self.transient_margin = self._margin(0)
        self._advise = advise
        self.dtype_bytes = dtype_bytes
        self.full_logits = full_logits
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.backend = backend
        self.retry_after_s = retry_after_s
        self.refused_total = 0
        self._warned_no_limits: set[str] = set()

    def check_prefill(self, step: PrefillStep) -> Refusals:
        limits: LimitSnapshot | None = step.limits
        if limits is None or limits.hard_bytes is None:
            if step.model_id not in self._warned_no_limits:
                self._warned_no_limits.add(step.model_id)
                log.warning("forward gate for model %r has no memory limit yet; prefill chunks "
                            "run unchecked until the enforcer publishes one", step.model_id)
            return {}
        hard = limits.hard_bytes
        self.transient_margin = self._margin_of(limits)
        self._binding = limits.binding_at("forward") or self._binding
        current = self._usage.high_water(record=True)
        earlier_kv = 0
        refused: dict[str, RequestRejected] = {}
        # (forward, estimated peak, memory in use before it, projected peak) of each
        # forward that does not fit; what becomes of them depends on all of them.
        short: list[tuple[list[PrefillChunk], int, int, int]] = []
        final = 0
        for forward in _forwards(step.chunks):
            estimates = self._chunk_estimates(step, forward)
            if estimates is None:
                for chunk in forward:
                    refused[chunk.request_id] = self._unestimable(step, chunk, limits)
                final += 0 if len(forward) > 1 else len(forward)  # waiting would not help
                continue
            copy = _copy_bytes(forward, estimates) if len(forward) > 1 else 0
            total = sum(estimate.total for estimate in estimates) + copy
            beside = earlier_kv + total + self.transient_margin
            if current + beside > hard:
                current = self._use_after_reclaim(lambda use: use + beside - hard, current)
            projected = current + beside
            if projected > hard:
                short.append((forward, total, current + earlier_kv, projected))
                continue
            for chunk in forward:
                self._helper_waits.pop(chunk.request_id, None)
            # What stays resident after this forward is its KV (and extra bytes), not
            # its transient.
            earlier_kv += sum(estimate.held_bytes for estimate in estimates)
        # Who waits (refusal_waits): while requests the step does not refuse run on,
        # every refused one; else all but the last, which ends (the unestimable ones
        # count first, and are final anyway). The last waits too for a helper's work in
        # flight (a grammar compile) when that is what it is short of.
        count = len({c.request_id for forward, *_ in short for c in forward} | set(refused))
        others = step.running > count
        in_flight = self._usage.in_flight_outside_engines() if short and not others else 0
        for index, (forward, total, base, projected) in enumerate(short):
            shared = len(forward) > 1
            helpers = in_flight if not others and projected - in_flight <= hard and all(
                self._may_wait_for_helpers(chunk.request_id) for chunk in forward) else 0
            wait = helpers > 0 or refusal_waits(step.running, count, index + count - len(short))
            for chunk in forward:
                refused[chunk.request_id] = self._reason(
                    step, chunk, total, base, limits, shared=shared, wait=wait, helpers=helpers)
            final += 0 if shared or wait else len(forward)
        self.refused_total += final
        return refused

    def _may_wait_for_helpers(self, request_id: str) -> bool:
        """Whether ``request_id`` may (still) wait for helpers' work in flight: for at
        most the ledger's queue timeout in all, counted from its first such wait."""
        now = self._clock()
        since = self._helper_waits.setdefault(request_id, now)
        if len(self._helper_waits) > _MAX_HELPER_WAITS:  # requests that ended meanwhile
            self._helper_waits = {rid: t for rid, t in self._helper_waits.items()
                                  if now - t <= 2 * self._helper_wait_s}
        return now - since <= self._helper_wait_s

    def check_decode(self, step: DecodeStep) -> DecodePlan:
        limits: LimitSnapshot | None = step.limits
        ledger = self._ledger
        unlimited = DecodePlan({row.request_id: UNLIMITED_TOKENS for row in step.rows})
        if ledger is None or limits is None or limits.hard_bytes is None:
            return unlimited
        per_token = self._kv_bytes_per_token(step.model_id, step.model_config)
        if per_token is None:
            return unlimited
        hard = limits.hard_bytes
        margin = self._margin_of(limits)
        rows = sorted(step.rows, key=lambda row: row.arrived)
        preempt: list[str] = []
        while True:
            allowed: dict[str, int] = {}
            sizes: dict[str, tuple[int, int]] = {}
            growth = 0
            for row in rows:
                ticket = ledger.ticket(row.request_id)
                if ticket is None:  # admitted by nobody here: nothing to budget
                    allowed[row.request_id] = UNLIMITED_TOKENS
                    continue
                target = ticket.kv_tokens
                if row.kv_tokens > target:
                    target = min(max(ticket.kv_tokens_cap, row.kv_tokens),
                                 -(-row.kv_tokens // KV_STEP) * KV_STEP)
                    more = (target - ticket.kv_tokens) * per_token
                    growth += more
                    sizes[row.request_id] = (target, ticket.reserve_bytes + more)
                allowed[row.request_id] = target
            if len(rows) == 1:
                # The oldest request fits alone (preflight counted its max_tokens).
                ledger.resize(sizes, force=True)
                return DecodePlan(allowed, tuple(preempt))
            if (not growth or self._decode_fits(growth + margin, hard)) and ledger.resize(sizes):
                return DecodePlan(allowed, tuple(preempt))
            youngest = rows.pop()
            ledger.suspend(youngest.request_id)
            preempt.append(youngest.request_id)
            self._count_preemption(limits, "decode")
            log.info("preempting request %s (model %r) so that %d older request(s) can grow "
                     "their KV: it resumes when memory frees up", youngest.request_id,
                     step.model_id, len(rows))

    def _margin_of(self, limits: LimitSnapshot) -> int:
        """The transient margin charged under ``limits``: the tier's for its hard limit,
        at least the snapshot's own (an adjusted snapshot keeps the margin measured)."""
        return max(self._margin(limits.hard_bytes or 0), limits.margin_bytes)

    def room_for_restore(self, restore: CacheRestore) -> int:
        """The bytes that fit now under the hard limit, less the margin, on top of memory
        in use: the caches are reclaimed first when ``restore.nbytes`` do not fit."""
        limits = restore.limits
        if limits is None or limits.hard_bytes is None:
            return restore.nbytes
        room = self._room(limits.hard_bytes - self._margin_of(limits), restore.nbytes)
        if room < restore.nbytes:
            log.debug("room for %s of the %s a cached prefix of request %s (model %r) takes: "
                      "it reuses less of it", format_size(max(0, room)),
                      format_size(restore.nbytes), restore.request_id, restore.model_id)
        return max(0, room)

    def _decode_fits(self, needed: int, hard: int) -> bool:
        """Whether ``needed`` bytes fit on top of memory in use now (after reclaiming
        caches when they do not)."""
        return self._room(hard, needed) >= needed

    def _room(self, limit: int, wanted: int) -> int:
        """What fits under ``limit`` on top of memory in use now (its high-water mark);
        caches are reclaimed first when ``wanted`` bytes do not fit."""
        return limit - self._use_after_reclaim(lambda use: wanted - (limit - use))

    def may_resume(self, request_id: str) -> bool:
        since = self._helper_waits.get(request_id)
        if (since is not None and self._clock() - since <= self._helper_wait_s
                and self._usage.in_flight_outside_engines() > 0):
            return False  # the helpers' work it waits for is still in flight
        return self._ledger is None or self._ledger.resume(request_id)

    def suspend(self, request_id: str) -> None:
        if self._ledger is not None:
            self._ledger.suspend(request_id)
            self._count_preemption(None, "forward")

    @property
    def preempted_total(self) -> int:
        return sum(self.preemptions.values())

    def _count_preemption(self, limits: LimitSnapshot | None, stage: str) -> None:
        # decode growth is judged by the admission ledger's budget
        binding = limits.binding_at("admission" if stage == "decode" else stage) if limits else None
        self._binding = binding or self._binding
        key = (self._binding, stage)
        self.preemptions[key] = self.preemptions.get(key, 0) + 1

    def _kv_bytes_per_token(self, model_id: str, model_config: Mapping[str, Any]) -> int | None:
        """KV bytes one token of ``model_id`` holds in its cache (``None``: no estimate),
        from one estimate per model (it depends on the model, not on the tokens)."""
        if model_id not in self._per_token:
            estimate = self._estimate(PeakQuery(
                model_config=model_config, new_tokens=1, cached_tokens=0, chunk_size=1,
                dtype_bytes=self.dtype_bytes, full_logits=self.full_logits, model_id=model_id,
                kv_bits=self.kv_bits, kv_group_size=self.kv_group_size,
                first_token=False, cached_kv_resident=True, backend=self.backend))
            self._per_token[model_id] = None if estimate is None else estimate.kv_bytes_per_token
        return self._per_token[model_id]

    def _use_after_reclaim(self, short: Callable[[int], int], use: int | None = None) -> int:
        """Memory in use now (its high-water mark; ``use`` when just read), after
        reclaiming caches while ``short(use)`` bytes are still missing and a reclaim
        frees something.

        The caches count what they free (a queued host copy, a block), and the reading
        afterwards can fall by less (a copy the writer holds, heap pages): one round asked
        for the shortfall left a 4k-token prefill 1 MiB short with 124 MiB of blocks still
        cached, and refused it. Reclaiming also drops the recorded readings, so the next
        one is current use alone rather than a high-water mark of earlier forwards'
        transients: even with nothing to free, a request is judged on what is held now,
        as preflight judged it."""
        if use is None:
            use = self._usage.high_water(record=True)
        for _ in range(_RECLAIM_ROUNDS):
            missing = short(use)
            if missing <= 0 or self._reclaim is None:
                break
            try:
                freed = self._reclaim(missing)
            except Exception:
                log.exception("reclaiming cached memory failed; judging the chunk without it")
                break
            use = self._usage.high_water(record=True)
            if freed <= 0:
                break
        return use

    def _unestimable(self, step: PrefillStep, chunk: PrefillChunk,
                     limits: LimitSnapshot) -> RequestRejected:
        return RequestRejected(Rejection(
            estimated_bytes=0, limit_bytes=limits.hard_bytes,
            breakdown=limits.breakdown_at("forward"),
            request_id=chunk.request_id, model_id=step.model_id,
            prompt_tokens=chunk.prompt_tokens, stage="forward", cause="no_estimate",
            detail=f"no estimate_peak plugin could estimate a prefill of model "
                   f"{step.model_id!r}, so the memory guard cannot let it run"))

    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        """Stop the request of ``step``'s chunk (its forward has just run) if high-water
        use is now over the hard limit; of several chunks that shared the forward, only
        the one whose request holds the most KV (cached plus new tokens)."""
        limits: LimitSnapshot | None = step.limits
        if limits is None or limits.hard_bytes is None or not step.chunks:
            return {}
        current = self._use_after_reclaim(lambda use: use - limits.hard_bytes)
        if current <= limits.hard_bytes:
            return {}
        chunk = max(step.chunks, key=lambda c: c.cached_tokens + c.new_tokens)
        self.refused_total += 1
        return {chunk.request_id: self._after_reason(step, chunk, current, limits)}

    def _after_reason(self, step: PrefillStep, chunk: PrefillChunk, current: int,
                      limits: LimitSnapshot) -> RequestRejected:
        log.warning("memory in use (%s) passed the %s limit after a prefill chunk of request "
                    "%s (model %r); stopping it", format_size(current),
                    format_size(limits.hard_bytes), chunk.request_id, step.model_id)
        return self._rejected(chunk, Rejection(
            estimated_bytes=0, limit_bytes=limits.hard_bytes,
            breakdown=limits.breakdown_at("forward"),
            request_id=chunk.request_id, model_id=step.model_id,
            prompt_tokens=chunk.prompt_tokens, stage="forward", base_bytes=current,
            cause="over_limit"),
            f"{format_size(current)} was in use after the forward, over the "
            f"{format_size(limits.hard_bytes)} limit; the request was stopped and its cache freed")

    def _chunk_estimates(self, step: PrefillStep, forward: list[PrefillChunk]
                         ) -> list[PeakEstimate] | None:
        """One estimate per chunk of ``forward`` (``None`` when any has none)."""
        estimates = []
        for chunk in forward:
            # The chunk extends the request's own cache, whose KV is already in current
            # use; after the prompt's last chunk its last token is fed in a one-token
            # forward and the cache joins the decode batch (which copies it): ``first_token``.
            last = chunk.cached_tokens + chunk.new_tokens >= chunk.prompt_tokens - 1
            estimate = self._estimate(PeakQuery(
                model_config=step.model_config, new_tokens=chunk.new_tokens,
                cached_tokens=chunk.cached_tokens, chunk_size=max(1, chunk.new_tokens),
                dtype_bytes=self.dtype_bytes, full_logits=self.full_logits,
                kv_bits=self.kv_bits, kv_group_size=self.kv_group_size,
                model_id=step.model_id, first_token=last and not step.encode,
                cached_kv_resident=True, backend=self.backend, images=chunk.images,
                encode=step.encode))
            if estimate is None:
                return None
            estimates.append(estimate)
        return estimates

    def _reason(self, step: PrefillStep, chunk: PrefillChunk, peak: int, base: int,
                limits: LimitSnapshot, *, shared: bool = False, wait: bool = False,
                helpers: int = 0) -> RequestRejected:
        # A shared forward's refusal is provisional: the engine asks again with one chunk
        # per forward, and only that answer is final. A request that waits (for the
        # engine's other requests, or helpers' work in flight) is preempted by its engine.
        if shared:
            level, why = logging.DEBUG, " in a shared forward"
        elif helpers:
            level, why = logging.INFO, (f"; it waits for helpers' work in flight (a grammar "
                                        f"compile) holding {format_size(helpers)} of it")
        elif wait:
            level, why = logging.INFO, "; it waits for the running requests"
        else:
            level, why = logging.WARNING, ""
        log.log(level, "forward gate refuses a %d-token prefill chunk of request %s (model %r)%s: "
                "%s in use + %s estimated + %s margin > %s limit", chunk.new_tokens,
                chunk.request_id, step.model_id, why,
                format_size(base), format_size(peak),
                format_size(self.transient_margin), format_size(limits.hard_bytes))
        return self._rejected(chunk, Rejection(
            estimated_bytes=peak + self.transient_margin, limit_bytes=limits.hard_bytes,
            breakdown=limits.breakdown_at("forward"), request_id=chunk.request_id,
            model_id=step.model_id,
            prompt_tokens=chunk.prompt_tokens, stage="forward", base_bytes=base,
            cause="memory_short", margin_bytes=self.transient_margin),
            f"the next chunk needs an estimated {format_size(peak)} "
            f"(+{format_size(self.transient_margin)} margin) on top of {format_size(base)} in "
            f"use, over the {format_size(limits.hard_bytes)} limit; the request was stopped "
            "before the forward ran", wait=wait)

    def _rejected(self, chunk: PrefillChunk, rejection: Rejection, what: str, *,
                  wait: bool = False) -> RequestRejected:
        """The refusal a stopped request carries: where, why, outcome, advice."""
        detail = (f"memory ran short during prefill (tokens {chunk.cached_tokens}-"
                  f"{chunk.cached_tokens + chunk.new_tokens} of {chunk.prompt_tokens}): {what}")
        rejection = replace(rejection, detail=detail)
        advice = self._advise(rejection) if self._advise else []
        return RequestRejected(rejection, advice, retry_after_s=self.retry_after_s, wait=wait)
