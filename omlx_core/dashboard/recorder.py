"""The recorder behind the dashboard: told of every admission and refusal by the serving
pipeline, and of every limit snapshot by the memory enforcer, it keeps the history the
plots draw and the last refusals.

Rates come from the engines' own counters (``engine.stats()``: tokens prefilled and
generated, prefix-cache tokens saved, tokens the SSD tier loaded), read at each poll; TTFT
and prompt tokens from the pipeline's ``admitted`` events. Nothing is read from logs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from omlx_core.dashboard.history import (HISTORY_S, ColumnRing, History, Sample, nan_to_none,
                                         none_to_nan)
from omlx_core.serving import ServingEvents

if TYPE_CHECKING:
    from omlx_core.memory.types import LimitSnapshot, RequestRejected
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)

#: refusals kept for the operator to search
REFUSALS_KEPT = 100
#: TTFT percentiles and cache hit rates are over the requests of this trailing window
TRAILING_S = 60.0


@dataclass(frozen=True)
class Refusal:
    """One request a memory guard refused: where, against which ceiling, and what to do."""

    at: float
    request_id: str
    model_id: str
    #: 413 (can never fit here), 503 (memory short now: before the first byte, or an
    #: in-band error after it) or 500 (no plugin estimates the model)
    status: int
    stage: str
    cause: str
    binding_ceiling: str | None
    estimated_bytes: int
    #: what was already in use or reserved, that the estimate came on top of
    base_bytes: int
    limit_bytes: int | None
    prompt_tokens: int
    summary: str
    advice: tuple[str, ...]

    @classmethod
    def of(cls, error: RequestRejected, model_id: str, at: float) -> Refusal:
        rejection = error.rejection
        return cls(at=at, request_id=rejection.request_id, model_id=rejection.model_id or model_id,
                   status=(500 if rejection.cause == "no_estimate" else
                           503 if error.retryable else 413), stage=rejection.stage,
                   cause=rejection.cause, binding_ceiling=rejection.binding,
                   estimated_bytes=rejection.estimated_bytes, base_bytes=rejection.base_bytes,
                   limit_bytes=rejection.limit_bytes, prompt_tokens=rejection.prompt_tokens,
                   summary=rejection.summary(), advice=tuple(error.advice))


@dataclass(frozen=True)
class _Totals:
    """Counters summed over the engines at one poll."""

    prefilled: int = 0
    generated: int = 0
    prefix_tokens: int = 0
    ssd_tokens: int | None = None
    prompt_tokens: int = 0

    def row(self, at: float) -> list[float]:
        return [at, self.prefilled, self.generated, self.prefix_tokens,
                none_to_nan(self.ssd_tokens), self.prompt_tokens]

    @classmethod
    def of(cls, row: list[float]) -> tuple[float, _Totals]:
        """(time, totals) of a :meth:`row`."""
        ssd = nan_to_none(row[4])
        return row[0], cls(int(row[1]), int(row[2]), int(row[3]),
                           int(ssd) if ssd is not None else None, int(row[5]))


class ServingEventsFanOut(ServingEvents):
    """Tells every listener of each serving event, in order."""

    def __init__(self, *listeners: ServingEvents):
        self.listeners = listeners

    def admitted(self, model_id: str, prompt_tokens: int, ttft_s: float) -> None:
        for listener in self.listeners:
            listener.admitted(model_id, prompt_tokens, ttft_s)

    def rejected(self, model_id: str, error: RequestRejected) -> None:
        for listener in self.listeners:
            listener.rejected(model_id, error)

    def encoded(self, model_id: str, inputs: int, tokens: int, seconds: float) -> None:
        for listener in self.listeners:
            listener.encoded(model_id, inputs, tokens, seconds)

    def finished(self, model_id: str, completion_tokens: int, cached_tokens: int) -> None:
        for listener in self.listeners:
            listener.finished(model_id, completion_tokens, cached_tokens)

    def disconnected(self, request_id: str) -> None:
        for listener in self.listeners:
            listener.disconnected(request_id)


class DashboardRecorder(ServingEvents):
    """The history and the refusal log of one server.

    :param context: the running server (engines, memory guard).
    :param window_s: how much history to keep.
    :param clock: wall-clock seconds (the plots' time axis).
    """

    def __init__(self, context: ServerContext, *, window_s: float = HISTORY_S,
                 clock: Callable[[], float] = time.time):
        self.context = context
        self.clock = clock
        guard = context.memory_guard
        self.enforcer = guard.enforcer if guard is not None else None
        self.interval_s = self.enforcer.interval_s if self.enforcer is not None else 1.0
        self.history = History(window_s, self.interval_s)
        self._refusals: deque[Refusal] = deque(maxlen=REFUSALS_KEPT)
        self._ttfts: deque[tuple[float, float]] = deque()
        self._prompt_tokens = 0
        #: (time, totals) rows of the polls in the trailing window, oldest first (rows of
        #: floats written in place, as the history's: see :mod:`.history`); room for four
        #: polls an interval (the pool asks for extra ones), past that the window shortens
        self._totals = ColumnRing(4 * math.ceil(TRAILING_S / self.interval_s) + 8, 6)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Record at every enforcer poll; without a memory guard, on a thread of its own."""
        if self.enforcer is not None:
            if self.record not in self.enforcer.listeners:
                self.enforcer.listeners.append(self.record)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="omlx-dashboard", daemon=True)
            self._thread.start()

    def close(self) -> None:
        if self.enforcer is not None and self.record in self.enforcer.listeners:
            self.enforcer.listeners.remove(self.record)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.record(None)
            except Exception:
                log.exception("recording a dashboard sample failed")

    # -- ServingEvents -----------------------------------------------------------------------

    def admitted(self, model_id: str, prompt_tokens: int, ttft_s: float) -> None:
        with self._lock:
            self._ttfts.append((self.clock(), ttft_s))
            self._prompt_tokens += prompt_tokens

    def rejected(self, model_id: str, error: RequestRejected) -> None:
        with self._lock:
            self._refusals.appendleft(Refusal.of(error, model_id, self.clock()))

    # -- reading -------------------------------------------------------------------------------

    def refusals(self, request_id: str | None = None) -> list[Refusal]:
        """The last refusals, newest first; with ``request_id``, those whose id contains it."""
        with self._lock:
            refusals = list(self._refusals)
        if request_id:
            needle = request_id.strip().lower()
            refusals = [r for r in refusals if needle in r.request_id.lower()]
        return refusals

    # -- one sample ------------------------------------------------------------------------------

    def record(self, snapshot: LimitSnapshot | None) -> Sample:
        """Take one sample (the enforcer calls this with each snapshot it publishes)."""
        now = self.clock()
        guard = self.context.memory_guard
        stats = self._engine_stats()
        with self._lock:
            totals = _sum_totals(stats, self._prompt_tokens)
            previous = _Totals.of(self._totals.row(-1)) if len(self._totals) else None
            self._totals.append(totals.row(now))
            while len(self._totals) > 1 and self._totals.row(0)[0] < now - TRAILING_S:
                self._totals.popleft()
            oldest = _Totals.of(self._totals.row(0))[1]
            while self._ttfts and self._ttfts[0][0] < now - TRAILING_S:
                self._ttfts.popleft()
            ttfts = sorted(t for _, t in self._ttfts)
        prefill_rate = decode_rate = None
        if previous is not None and now > previous[0]:
            elapsed = now - previous[0]
            prefill_rate = max(0, totals.prefilled - previous[1].prefilled) / elapsed
            decode_rate = max(0, totals.generated - previous[1].generated) / elapsed
        prompt = totals.prompt_tokens - oldest.prompt_tokens
        memory: dict[str, Any] = {}
        if snapshot is not None:
            breakdown = snapshot.breakdown
            memory = dict(in_use_bytes=snapshot.in_use_bytes,
                          reclaimable_bytes=snapshot.reclaimable_bytes,
                          hard_limit_bytes=snapshot.hard_bytes,
                          ceilings=breakdown.ceilings() if breakdown is not None else {},
                          binding=snapshot.binding_name)
        admission = guard.admission if guard is not None else None
        sample = Sample(
            t=now, **memory,
            reserved_bytes=admission.reserved_bytes if admission is not None else None,
            prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
            ttft_p50_s=_percentile(ttfts, 0.50), ttft_p95_s=_percentile(ttfts, 0.95),
            queue_depth=sum(_int(s.get("queue_depth")) for s in stats)
            + (admission.waiting if admission is not None else 0),
            running=sum(_int(s.get("running")) + _int(s.get("prefilling")) for s in stats),
            preempted=admission.suspended if admission is not None else 0,
            prefix_hit_rate=_rate(totals.prefix_tokens - oldest.prefix_tokens, prompt),
            ssd_hit_rate=(_rate(totals.ssd_tokens - (oldest.ssd_tokens or 0), prompt)
                          if totals.ssd_tokens is not None else None))
        self.history.append(sample)
        return sample

    def _engine_stats(self) -> list[Mapping[str, Any]]:
        found = []
        for model_id, engine in list(self.context.engines.items()):
            try:
                found.append(engine.stats() or {})
            except Exception:
                log.warning("engine.stats() of %s failed", model_id, exc_info=True)
        return found


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _sum_totals(stats: list[Mapping[str, Any]], prompt_tokens: int) -> _Totals:
    prefilled = generated = prefix = 0
    ssd: int | None = None  # no SSD tier counts its tokens
    for engine in stats:
        prefilled += _int(engine.get("prompt_tokens_prefilled"))
        generated += _int(engine.get("tokens_generated"))
        cache = engine.get("prefix_cache")
        if isinstance(cache, Mapping):
            prefix += _int(cache.get("tokens_saved"))
            lower = cache.get("lower")
            if isinstance(lower, Mapping) and "tokens_loaded" in lower:
                ssd = (ssd or 0) + _int(lower.get("tokens_loaded"))
    return _Totals(prefilled, generated, prefix, ssd, prompt_tokens)


def _rate(part: int, whole: int) -> float | None:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else None


def _percentile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted values; ``None`` for none."""
    if not ordered:
        return None
    rank = min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1
    return ordered[rank]
