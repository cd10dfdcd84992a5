"""The model pool: which models are resident, loading them on demand inside the memory
budget, and unloading the idle ones.

A request takes a :class:`Lease` on its model (:meth:`ModelPool.acquire`) for as long
as it runs. A model that is not resident is loaded first, on a loader thread (one load
per model: concurrent first requests wait for the same one). The load is planned
before a byte of the model is read: its weights' bytes from the safetensors headers
plus the engine's working set (the ``estimate_peak`` answer for one prefill chunk),
against the memory guard's latest snapshot (hard limit, memory in use less what the
server gives back on demand, the transient margin), less what other loads in progress
have claimed. When it does not fit, idle models are unloaded, least recently used
first: never a pinned one, never one with a request running or waiting for it. When
busy or pinned models hold the room, the load waits (``server.model_load_wait_s``) and
then refuses with stage ``"load"`` (HTTP 503 with ``Retry-After``); when it could never
fit, even with every unpinned model gone, it refuses at once (HTTP 413, with advice).

An unload drains the model (no new lease; the running ones end), closes its engine
through the same closer that start-up uses, collects, returns mlx's buffers and the
heap's free pages to the OS, and counts the room free only once the enforcer has
read memory again (the settle barrier). A load that fails is remembered for
``server.model_load_retry_s``: requests in that window get the same error at once.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from omlx_core.config.keep_alive import parse_keep_alive
from omlx_core.memory.types import Rejection, RequestRejected
from omlx_core.settings import format_size
from omlx_core.pool.records import (
    AVAILABLE,
    FAILED,
    LOADING,
    RESIDENT,
    UNLOAD_REASONS,
    UNLOADING,
    ModelLoadFailed,
    ModelRecord,
    PoolCounters,
    PoolError,
    describe_record,
    keep_alive_expired,
    load_failure,
)
from omlx_core.pool.room import (
    bare_bytes,
    context_length,
    floor_bytes,
    never_fits,
    no_room,
    plan_load,
    return_memory,
    unload_candidate,
    wait_timeout,
)

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.engine import Engine
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.models.registry import ModelSpec

log = logging.getLogger(__name__)

#: how often the keep-alive reaper looks at idle models, at most
REAP_INTERVAL_S = 0.5
#: loads of different models that may run at once (one model loads once at a time)
LOADER_THREADS = 2


class Lease:
    """A running request's hold on a resident model; :meth:`release` once it ends."""

    def __init__(self, pool: ModelPool, record: ModelRecord, engine: Engine):
        self.engine = engine
        self.model_id = record.id
        self._pool = pool
        self._record = record
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._record)


class ModelPool:
    """Resident and available models under one memory budget (see the module docstring).

    :param config: the effective configuration (``server.*`` pool keys, ``[models.*]``).
    :param create: builds and starts the engine of a model id (``bootstrap.create_engine``
        bound to the server context); it resolves the model (a GGUF is converted then).
    :param close: stops and forgets the engine of a model id (``bootstrap.close_engine``).
    :param resolve: the model's :class:`ModelSpec` without loading it (its directory and
        config), for the plan.
    :param guard: the memory guard whose snapshot the plan reads (``None``: no limit).
    :param estimate_peak: the ``estimate_peak`` hook, for the working set.
    """

    def __init__(self, config: Config, *, create: Callable[[str], Engine],
                 close: Callable[[str], None], resolve: Callable[[str], ModelSpec],
                 guard: Callable[[], MemoryGuard | None] = lambda: None,
                 estimate_peak: Callable[..., Any] | None = None,
                 advice: Callable[[Rejection], list[str]] | None = None):
        self.config = config
        self._create = create
        self._close = close
        self._resolve = resolve
        self._guard = guard
        self._estimate_peak = estimate_peak
        self._advice = advice or (lambda rejection: [])
        self.wait_s = float(config["server.model_load_wait_s"])
        self.retry_s = float(config["server.model_load_retry_s"])
        self.default_keep_alive_s = parse_keep_alive(config["server.keep_alive"])
        self.counters = PoolCounters()
        # Re-entrant: describing a refusal under it reads the guard, whose readings may
        # ask the pool again.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._records: dict[str, ModelRecord] = {}
        self._closed = False
        # Long-lived loader threads: a fresh thread per load gets a fresh malloc arena,
        # and what a load leaves in each stays resident (it showed as growth per cycle).
        self._loaders = ThreadPoolExecutor(max_workers=LOADER_THREADS,
                                           thread_name_prefix="omlx-load")
        #: the least the process was seen to hold without any model (learned at settles)
        self._bare_bytes: int | None = None
        self._reaper: threading.Thread | None = None
        for model_id in config.models:
            self.add(model_id)

    def plan_local(self) -> None:
        """Plan every model whose directory is already local (headers only: cheap), so
        that the listing shows planned bytes before a first load."""
        for record in self.records():
            entry = self.config.models[record.id]
            if record.planned_bytes is not None or not entry.get("path"):
                continue
            try:
                self._plan(record, self._resolve(record.id))
            except Exception as exc:  # the load reports it, with the model's name
                log.debug("model %r cannot be planned yet: %s", record.id, exc)

    # -- the catalog ----------------------------------------------------------------------

    def add(self, model_id: str, *, pinned: bool | None = None) -> ModelRecord:
        """Make a configured model available (idempotent)."""
        with self._lock:
            record = self._records.get(model_id)
            if record is None:
                entry = self.config.models[model_id]
                own = entry.get("keep_alive")
                keep_alive = (parse_keep_alive(own) if own not in (None, "")
                              else self.default_keep_alive_s)
                record = self._records[model_id] = ModelRecord(
                    model_id, entry.engine, bool(entry.get("pinned", False)), keep_alive,
                    task=entry.task)
            if pinned is not None:
                record.pinned = pinned
            return record

    def records(self) -> list[ModelRecord]:
        with self._lock:
            return list(self._records.values())

    def record(self, model_id: str) -> ModelRecord | None:
        return self._records.get(model_id)

    def resident(self) -> list[str]:
        with self._lock:
            return [r.id for r in self._records.values() if r.state == RESIDENT]

    def _known(self, model_id: str) -> ModelRecord:
        record = self._records.get(model_id)
        if record is None:
            raise KeyError(model_id)
        return record

    # -- start-up -------------------------------------------------------------------------

    def adopt(self, model_id: str, engine: Engine, *, pinned: bool, seconds: float,
              footprint_growth: int | None) -> None:
        """Record an engine loaded at start-up (``server.models``) as resident."""
        record = self.add(model_id)
        with self._lock:
            record.pinned = pinned
            record.state, record.engine = RESIDENT, engine
            record.last_used = record.loaded_at = time.monotonic()
            record.load_seconds = seconds
            record.measured_bytes = footprint_growth
            record.context_length = context_length(engine.model.config)
            self.counters.loads += 1
            self.counters.load_seconds_total += seconds

    def start(self) -> None:
        """Start the keep-alive reaper."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="omlx-pool-reaper",
                                            daemon=True)
            self._reaper.start()

    def close(self) -> None:
        """Stop the reaper; the engines themselves are stopped by ``stop_engines``."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        self._loaders.shutdown(wait=False, cancel_futures=True)

    # -- leases ---------------------------------------------------------------------------

    def acquire(self, model_id: str, *, keep_alive: object = None,
                wait_s: float | None = None) -> Lease:
        """A lease on ``model_id``'s engine, loading the model first when it is not resident.

        :param keep_alive: the request's ``keep_alive`` (Ollama's convention): how long
            the model stays resident once idle, from now on.
        :raises KeyError: no such model is available.
        :raises RequestRejected: stage ``"load"``: it can never fit (not retryable), or
            the room did not come within the wait (retryable).
        :raises ModelLoadFailed: its load failed (now, or within the retry back-off).
        """
        keep_alive_s = parse_keep_alive(keep_alive) if keep_alive is not None else ...
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        with self._changed:
            record = self._known(model_id)
            if keep_alive_s is not ...:
                record.keep_alive_s = keep_alive_s
            record.waiters += 1
            try:
                while True:
                    if self._closed:
                        raise ModelLoadFailed(model_id, "the server is shutting down")
                    if record.state == RESIDENT and not record.draining:
                        record.users += 1
                        record.last_used = time.monotonic()
                        return Lease(self, record, record.engine)
                    if record.state in (AVAILABLE, FAILED):
                        if record.state == FAILED and time.monotonic() < record.failed_until:
                            raise record.error
                        self._begin_load(record)
                    attempt = record.attempt
                    # A load in progress ends on its own (its wait for room is bounded),
                    # with the one answer every waiter gets; an unload or a drain is waited
                    # for up to the deadline.
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 and record.state != LOADING:
                        guard = self._guard()
                        raise wait_timeout(record, guard.snapshot if guard is not None else None,
                                           self.wait_s, self.retry_s)
                    self._changed.wait(min(max(remaining, 0.05), 1.0))
                    if record.attempt != attempt and record.state != RESIDENT \
                            and record.error is not None:
                        raise record.error
            finally:
                record.waiters -= 1
                self._changed.notify_all()

    def _release(self, record: ModelRecord) -> None:
        with self._changed:
            record.users -= 1
            record.last_used = time.monotonic()
            self._changed.notify_all()

    # -- loading --------------------------------------------------------------------------

    def _begin_load(self, record: ModelRecord) -> None:
        """Start ``record``'s one load (under the lock)."""
        record.state, record.error = LOADING, None
        self._loaders.submit(self._load, record)

    def _load(self, record: ModelRecord) -> None:
        started = time.monotonic()
        try:
            spec = self._resolve(record.id)
            self._plan(record, spec)
            self._make_room(record)
            before = self._footprint()
            engine = self._create(record.id)
            growth = max(0, self._footprint() - before) if before is not None else None
        except RequestRejected as refusal:
            self._end_claim(record)
            self._end_load(record, AVAILABLE, error=refusal)
            self.counters.refusals[refusal.rejection.cause] = (
                self.counters.refusals.get(refusal.rejection.cause, 0) + 1)
            return
        except Exception as exc:
            self.counters.load_failures += 1
            self._end_claim(record)
            self._end_load(record, FAILED, error=load_failure(record.id, exc),
                           failed_until=time.monotonic() + self.retry_s)
            return_memory()
            return
        seconds = time.monotonic() - started
        # The weights are in memory now: the claim becomes a change of the baseline, the
        # growth measured (other threads' allocations can blur it: at least the weights,
        # at most the claim).
        self._end_claim(record, max(record.weights_bytes or 0,
                                    min(growth or 0, record.planned_bytes or 0)))
        with self._changed:
            record.engine = engine
            record.measured_bytes = growth or None
            record.load_seconds = seconds
            record.loaded_at = record.last_used = time.monotonic()
            record.context_length = context_length(engine.model.config)
            self.counters.loads += 1
            self.counters.load_seconds_total += seconds
        log.info("model %r loaded in %.1f s (planned %s, measured %s)", record.id, seconds,
                 format_size(record.planned_bytes or 0),
                 format_size(growth) if growth else "unknown")
        self._settle()
        self._end_load(record, RESIDENT)

    def _end_claim(self, record: ModelRecord, baseline_change: int = 0) -> None:
        """Give ``record``'s load claim back to the ledger; ``baseline_change``: the bytes
        the loaded model holds."""
        guard = self._guard()
        if guard is not None:
            guard.admission.end_claim(_load_key(record), baseline_change)

    def _end_load(self, record: ModelRecord, state: str, *, error: Exception | None = None,
                  failed_until: float = 0.0) -> None:
        with self._changed:
            record.state, record.error, record.failed_until = state, error, failed_until
            record.attempt += 1
            self._changed.notify_all()

    def _plan(self, record: ModelRecord, spec: ModelSpec) -> None:
        """The bytes loading ``record`` takes: weights from the headers, plus the working
        set of one prefill chunk."""
        guard = self._guard()
        plan = plan_load(spec, self._estimate_peak, guard.backend if guard is not None else "cpu")
        with self._lock:
            record.weights_bytes, record.planned_bytes = plan.weights_bytes, plan.planned_bytes
            record.context_length = plan.context_length

    def _make_room(self, record: ModelRecord) -> None:
        """Return once ``record``'s planned bytes fit and are claimed for it in the memory
        guard's ledger (next to the running requests' reservations and the other loads'
        claims: :meth:`~omlx_core.memory.admission.AdmissionQueue.try_claim`), unloading
        idle models least recently used first; raise :class:`RequestRejected` otherwise."""
        need = record.planned_bytes or 0
        deadline = time.monotonic() + self.wait_s
        while True:
            guard = self._guard()
            snapshot = guard.snapshot if guard is not None else None
            if snapshot is None or snapshot.hard_bytes is None:
                return
            with self._changed:
                measured = snapshot.in_use_bytes - snapshot.reclaimable_bytes
                if guard.admission.try_claim(_load_key(record), need, measured_bytes=measured):
                    return
                room = guard.admission.claim_room(_load_key(record), measured_bytes=measured)
                floor = floor_bytes(self._records.values(), snapshot, self._bare_bytes)
                if floor + need + snapshot.margin_bytes > snapshot.hard_bytes:
                    raise never_fits(record, snapshot, floor, self._records.values(), self._advice)
                victim = unload_candidate(self._records.values())
                if victim is not None:
                    victim.state = UNLOADING
                elif time.monotonic() >= deadline:
                    raise no_room(record, snapshot, room or 0, self._records.values(), self._advice,
                                  self.wait_s, self.retry_s)
                else:
                    self._changed.wait(min(1.0, deadline - time.monotonic()))
                    continue
            log.info("unloading idle model %r (last used %.0f s ago) to make room for %r",
                     victim.id, time.monotonic() - victim.last_used, record.id)
            self._unload(victim, "evicted")

    # -- unloading ------------------------------------------------------------------------

    def _unload(self, record: ModelRecord, reason: str) -> None:
        """Close ``record``'s engine (marked ``UNLOADING``, idle), free its memory and
        wait until a memory reading shows it."""
        guard = self._guard()
        if guard is not None:
            guard.admission.claim(_unload_key(record))
        before = self._footprint()
        try:
            self._close(record.id)
        except Exception:
            log.exception("closing the engine of model %r failed; it is dropped anyway",
                          record.id)
        with self._changed:
            record.engine = None
        return_memory()
        if guard is not None:
            # What the unload gave back leaves the baseline: the footprint's drop (other
            # threads' allocations can blur it), at most what the model held.
            after = self._footprint()
            freed = max(0, before - after) if before is not None and after is not None else 0
            guard.admission.end_claim(_unload_key(record), -min(freed, record.held_bytes()))
        self._settle()
        with self._changed:
            record.state, record.draining = AVAILABLE, False
            self.counters.unloads[reason] = self.counters.unloads.get(reason, 0) + 1
            self._changed.notify_all()
        log.info("model %r unloaded (%s)", record.id, reason)

    def _settle(self) -> None:
        """Wait for a memory reading taken after now (the enforcer's next poll), and
        learn from it what the process holds without any model."""
        guard = self._guard()
        if guard is None:
            return
        snapshot = guard.fresh_snapshot()
        if snapshot is None:
            return
        with self._lock:
            bare = bare_bytes(self._records.values(), snapshot, guard.admission.claimed_bytes)
            if bare > 0 and (self._bare_bytes is None or bare < self._bare_bytes):
                self._bare_bytes = bare

    def _footprint(self) -> int | None:
        guard = self._guard()
        return guard.usage.resident() if guard is not None else None

    def unload(self, model_id: str, reason: str = "admin") -> bool:
        """Drain and unload ``model_id`` (waits for its running requests to end, up to
        ``server.model_load_wait_s``). Returns whether it was resident.

        :raises PoolError: it is loading, or its requests did not end within the wait.
        """
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            record = self._known(model_id)
            if record.state in (AVAILABLE, FAILED):
                return False
            if record.state == LOADING:
                raise PoolError(f"model {model_id!r} is loading; unload it once it is resident")
            record.draining = True
            while record.state == RESIDENT and record.users > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    record.draining = False
                    self._changed.notify_all()
                    raise PoolError(f"model {model_id!r} still runs {record.users} request(s) "
                                    f"after {self.wait_s:g} s; retry when they end")
                self._changed.wait(min(remaining, 1.0))
            if record.state != RESIDENT:
                return False
            record.state = UNLOADING
        self._unload(record, reason)
        return True

    def load(self, model_id: str) -> ModelRecord:
        """Load ``model_id`` now (as a request would) and return its record."""
        self.acquire(model_id).release()
        return self._known(model_id)

    def pin(self, model_id: str, pinned: bool = True) -> ModelRecord:
        with self._changed:
            record = self._known(model_id)
            record.pinned = pinned
            self._changed.notify_all()
            return record

    # -- keep-alive -----------------------------------------------------------------------

    def _reap(self) -> None:
        while True:
            with self._changed:
                if self._closed:
                    return
                now = time.monotonic()
                expired = keep_alive_expired(self._records.values(), now)
                for record in expired:
                    record.state = UNLOADING
                if not expired:
                    self._changed.wait(REAP_INTERVAL_S)
                    continue
            for record in expired:
                self._unload(record, "keep_alive")

    # -- what the surface shows -----------------------------------------------------------

    def describe(self, record: ModelRecord) -> dict[str, Any]:
        """One model as ``GET /v1/models`` and ``omlx-core ps`` show it."""
        with self._lock:
            return describe_record(record)

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(r.bytes() for r in self._records.values() if r.state == RESIDENT)


def _load_key(record: ModelRecord) -> str:
    return f"load:{record.id}"


def _unload_key(record: ModelRecord) -> str:
    return f"unload:{record.id}"


__all__ = ["AVAILABLE", "FAILED", "LOADING", "Lease", "ModelLoadFailed", "ModelPool",
           "ModelRecord", "PoolError", "RESIDENT", "UNLOADING", "UNLOAD_REASONS"]
