"""The enforcer: a background thread that re-reads the ceilings every
``memory.poll_interval_s`` and publishes one immutable limit snapshot to every engine.

Each poll builds a :class:`~omlx_core.memory.types.LimitSnapshot` (ceilings, hard
limit, current use, idle baseline) and hands that same object to the guard and to each
loaded engine's :class:`~omlx_core.memory.gate.MemoryReceiver`, found through the
``resolve_scheduler`` hook. Engines are re-listed on every poll, so an engine loaded
after start-up has limits within one poll; a receiver seen for the first time is also
given its engine's forward gate. An engine the hook cannot resolve is reported once
per engine type, loudly: that is how a guard silently goes dead.

This thread is where memory is read (mlx's counters, the process footprint, the probes);
the request thread judges against the snapshot it published. :meth:`MemoryEnforcer.
poll_soon` asks for a poll ahead of time: the guard asks when the last running request
finishes, so the idle baseline the next request is judged on includes what that one
left behind.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from omlx_core.memory.ceilings import ProbeReadings, TierPolicy, compute_ceilings, read_probes
from omlx_core.memory.gate import ForwardGate, MemoryReceiver
from omlx_core.memory.types import LimitSnapshot
from omlx_core.memory.usage import MemoryUsage
from omlx_core.platform.backend import held_bytes
from omlx_core.settings import format_size

if TYPE_CHECKING:
    from omlx_core.engine import Engine

log = logging.getLogger(__name__)


class MemoryEnforcer:
    """Polls ceilings and usage; publishes limit snapshots to the guard and the engines.

    :param engines: returns the engines loaded right now (called on every poll).
    :param resolve: the ``resolve_scheduler`` hook: engine -> receiver or None.
    :param policy: the active memory tier.
    :param interval_s: seconds between polls.
    :param usage: where current use is read.
    :param idle: whether no request runs or waits and no model is loading or unloading
        (the baseline is read then).
    :param publish: receives every snapshot before the engines do (admission
        re-checks its waiters); what it returns, if a snapshot, is what the engines get
        to judge by (the ``adjust_limits`` hook's answer), while the listeners get the
        measured one.
    :param gate_for: the forward gate of an engine.
    :param reclaimable: what the server could give back on demand now (caches).
    :param read: returns fresh probe readings (tests pass fixed ones).
    :param epoch: how many requests have finished so far (the snapshot's
        ``baseline_epoch`` says which of them an idle baseline was read after).
    """

    def __init__(self, engines: Callable[[], Iterable[Engine]],
                 resolve: Callable[[Engine], Any], policy: TierPolicy, interval_s: float, *,
                 usage: MemoryUsage, idle: Callable[[], bool],
                 publish: Callable[[LimitSnapshot], LimitSnapshot | None],
                 gate_for: Callable[[Engine], ForwardGate],
                 reclaimable: Callable[[], int] = lambda: 0,
                 read: Callable[[], ProbeReadings] = read_probes,
                 epoch: Callable[[], int] = lambda: 0):
        self.usage = usage
        self._epoch = epoch
        self._baseline_epoch = 0
        self._baseline_read_at = 0.0
        self._reclaimable = reclaimable
        self._idle = idle
        self._publish_first = publish
        self._gate_for = gate_for
        self._gated: dict[int, tuple[MemoryReceiver, ForwardGate]] = {}
        self._engines = engines
        self._resolve = resolve
        self.policy = policy
        self.interval_s = interval_s
        self._read = read
        self._sequence = 0
        self._baseline: int | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned_types: set[str] = set()
        self._logged_notes: set[str] = set()
        self.polls = 0
        self.last_error: str | None = None
        #: called with every snapshot after the engines have it (the dashboard's history)
        self.listeners: list[Callable[[LimitSnapshot], None]] = []

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> LimitSnapshot:
        """Publish the first snapshot synchronously, then keep polling on a daemon thread."""
        first = self.poll_once()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="omlx-memory-enforcer",
                                            daemon=True)
            self._thread.start()
        return first

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def forget(self, engine: Engine) -> None:
        """Drop the receiver kept for an unloaded engine."""
        self._gated.pop(id(engine), None)

    def poll_soon(self) -> None:
        """Poll now rather than at the end of the interval (the next poll starts over)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.poll_once()
            except Exception as exc:  # the enforcer must outlive any one bad poll
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("memory enforcer poll failed; the last limits stay in force")

    # -- one poll --------------------------------------------------------------------------

    def poll_once(self) -> LimitSnapshot:
        """Compute and publish one snapshot; returns it."""
        breakdown = compute_ceilings(self._read(), self.policy)
        for note in breakdown.notes:
            if note not in self._logged_notes:
                self._logged_notes.add(note)
                log.warning("memory ceilings: %s", note)
        usage = self.usage
        # Read before the memory: a request finishing after it makes the baseline count
        # as read before that request finished, and another poll is asked for.
        # Whether the server is idle is asked before the read as well: a model load or
        # unload that begins after it ends after the read, so the ledger still adds it.
        epoch = self._epoch()
        idle = self._idle()
        read_at = time.monotonic()
        resident = usage.resident()
        usage.observe(resident)
        reclaimable = min(resident, max(0, int(self._reclaimable())))
        if idle or self._baseline is None:
            # What is held with no request running and no model loading or unloading,
            # less the caches it would give back for one, is what every request sits on.
            self._baseline = resident - reclaimable
            self._baseline_epoch = epoch
            self._baseline_read_at = read_at
        self._sequence += 1
        snapshot = LimitSnapshot(
            hard_bytes=breakdown.hard, breakdown=breakdown,
            in_use_bytes=max(resident, usage.recent_peak()), taken_at=time.time(),
            sequence=self._sequence, baseline_bytes=self._baseline,
            reclaimable_bytes=reclaimable,
            margin_bytes=self.policy.margin(breakdown.hard) if breakdown.hard else 0,
            other_bytes=max(0, resident - held_bytes()), baseline_epoch=self._baseline_epoch,
            baseline_read_at=self._baseline_read_at)
        judged = self._publish_first(snapshot)
        self._publish(judged if isinstance(judged, LimitSnapshot) else snapshot)
        self.polls += 1
        for listener in list(self.listeners):
            try:
                listener(snapshot)
            except Exception:  # an observer must not stop the limits from being published
                log.exception("memory snapshot listener %r failed", listener)
        if self._sequence == 1:
            log.info("memory limit %s (%s ceiling binds, tier %s); baseline in use %s",
                     format_size(snapshot.hard_bytes) if snapshot.hard_bytes else "none",
                     breakdown.binding or "no", breakdown.tier, format_size(self._baseline))
        return snapshot

    def _publish(self, snapshot: LimitSnapshot) -> None:
        for engine in list(self._engines()):
            kind = type(engine).__qualname__
            try:
                receiver = self._resolve(engine)
            except Exception:
                self._warn_once(kind, "resolve_scheduler raised for engine type %s; it gets no "
                                      "memory limits", exc_info=True)
                continue
            if not isinstance(receiver, MemoryReceiver):
                self._warn_once(kind, "no plugin resolves engine type %s to a MemoryReceiver "
                                      "(omlx_core.memory.gate): its prefills run without memory "
                                      "limits (implement resolve_scheduler for it)")
                continue
            try:
                receiver.apply_memory_limits(snapshot)
                gate = self._gate_for(engine)
                if self._gated.get(id(engine)) != (receiver, gate):
                    # A fallback path or a restarted scheduler is a new receiver.
                    receiver.set_forward_gate(gate)
                    self._gated[id(engine)] = (receiver, gate)
            except Exception:
                self._warn_once(kind, "publishing memory limits to engine type %s failed",
                                exc_info=True)

    def _warn_once(self, kind: str, message: str, exc_info: bool = False) -> None:
        if kind not in self._warned_types:
            self._warned_types.add(kind)
            log.warning(message, kind, exc_info=exc_info)
