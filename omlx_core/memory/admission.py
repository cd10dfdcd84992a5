"""Budget admission: a request that fits alone but not next to the running ones waits.

Each admitted request holds a reservation (its estimated peak) until its ticket is
released. A new request runs at once when nobody is waiting and

    baseline + cost(running requests and itself) + margin <= hard × admit_watermark

where the cost of a set of requests is the sum of their reservations, except that
requests sharing a padded decode batch (``batch`` key, one per engine) each cost as much
as the largest of them: mlx-lm's ``BatchGenerator`` left-pads every sequence's KV cache
to the longest one in the batch, so a short request next to a long one holds as much KV
as the long one. (The batched engine decodes a row that would pad the others by more
than a forward costs in a lane of its own, :mod:`omlx_core.scheduling.decode_batch`:
the padded cost is then an upper bound, charged before the lane is known.)

(the baseline excludes caches the server gives back on demand; the transient margin is
charged once, since one forward's transient exists at a time), otherwise it joins a
bounded queue, served in arrival order with one exception, backfill: while the head of
the queue cannot fit, a request behind it that fits now runs now, so small requests do
not idle behind a large one the budget cannot take yet. Backfill stops once the head
has waited :attr:`AdmissionQueue.backfill_s` (twice the typical hold time), so the
large one is never starved: from then on only it can be admitted, as room frees up. A
request runs alone whenever nothing else is reserved: it passed preflight, so it fits
alone, and waiting could not make room.

A reservation covers the request's prompt and the KV of its first completion tokens
(``memory.decode_reserve_tokens``), not all ``max_tokens`` of them: most requests stop
long before. Decode grows it in blocks (:meth:`AdmissionQueue.resize`, asked by the forward
gate), and when growth does not fit, the youngest running request is **suspended**
(preempted by its engine; it keeps its place, holds no memory, and resumes with
:meth:`AdmissionQueue.resume` when it fits again). While a request is suspended, new
requests wait behind it: its need counts as reserved for them.

Model loads and unloads (the model pool) go through the same ledger. A load **claims**
its planned bytes (:meth:`AdmissionQueue.try_claim`) only when they fit next to the
running requests and the other claims, and requests are judged next to the claims of
loads in flight. When a load ends, its claim becomes a **baseline change** (the
model's bytes; an unload's change is the bytes it freed): the idle baseline is read only
while no request runs and no model is loading or unloading, so until it is read again
the ledger adds the changes since the last reading to it (:meth:`AdmissionQueue.baseline`).
Without that, a server kept busy while models come and go would judge requests against
the footprint of whatever was resident at its last idle moment.

A full queue raises :class:`~omlx_core.memory.types.RequestRejected` with stage
``"admission"`` (HTTP 503 with ``Retry-After``), and so does a wait that outlasts
``memory.queue_timeout_s`` *without progress*: the timeout counts from the later of the
request's arrival and the last time a running request finished, so a request queued
behind work that keeps completing is never timed out (that would refuse a request the
server was about to run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping

from dataclasses import replace

from omlx_core.memory.types import LimitSnapshot, Rejection, RequestRejected
from omlx_core.settings import format_size

log = logging.getLogger(__name__)

# Retry-After when no request has finished yet to learn typical hold times from.
DEFAULT_RETRY_AFTER_S = 1.0
# How long the head of the queue tolerates being overtaken before any request has
# finished to learn typical hold times from.
DEFAULT_BACKFILL_S = 10.0


@dataclass
class _Waiter:
    request_id: str
    reserve_bytes: int
    batch: Hashable | None
    since: float = 0.0
    model_id: str = ""
    prompt_tokens: int = 0


@dataclass(frozen=True)
class WaitingRequest:
    """A request waiting for memory (:meth:`AdmissionQueue.waiting_requests`)."""

    request_id: str
    model_id: str
    prompt_tokens: int
    reserve_bytes: int
    waited_s: float


def reservation_cost(reservations: Iterable[tuple[int, Hashable | None]]) -> int:
    """Bytes a set of ``(reserve_bytes, batch)`` reservations holds together: each padded
    batch costs its size times its largest member; unbatched ones add up."""
    total = 0
    batches: dict[Hashable, list[int]] = {}
    for reserve, batch in reservations:
        if batch is None:
            total += reserve
        else:
            batches.setdefault(batch, []).append(reserve)
    return total + sum(len(members) * max(members) for members in batches.values())


class AdmissionTicket:
    """A granted reservation. Releasing it (``with`` exit or :meth:`release`) frees the
    budget for the next request; releasing twice is harmless."""

    def __init__(self, queue: "AdmissionQueue", request_id: str, reserve_bytes: int,
                 waited_s: float, batch: Hashable | None = None, *, kv_tokens: int = 0,
                 kv_tokens_cap: int = 0):
        self.request_id = request_id
        self.reserve_bytes = reserve_bytes
        self.batch = batch
        self.waited_s = waited_s
        #: KV tokens the reservation covers (prompt and completion so far)
        self.kv_tokens = kv_tokens
        #: the most KV tokens the request can reach (prompt plus ``max_tokens``)
        self.kv_tokens_cap = max(kv_tokens_cap, kv_tokens)
        #: preempted: holds no memory now, and resumes before any new request is admitted
        self.suspended = False
        self._queue = queue
        self._granted_at = queue.clock()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._queue._release(self, self._queue.clock() - self._granted_at)

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self.release()


class AdmissionQueue:
    """The reservation ledger and the FIFO of requests waiting for room."""

    def __init__(self, queue_size: int, timeout_s: float, admit_watermark: float,
                 clock: Callable[[], float] = time.monotonic, *,
                 margin_bytes: int | Callable[[int], int] = 0,
                 on_idle: Callable[[], None] | None = None):
        #: the transient margin under a hard limit (a number, or a function of the limit)
        self.margin_bytes = margin_bytes if callable(margin_bytes) else (lambda _hard: margin_bytes)
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.admit_watermark = admit_watermark
        self.clock = clock
        self._cond = threading.Condition()
        self._waiting: deque[_Waiter] = deque()
        self._running: dict[int, AdmissionTicket] = {}
        self._snapshot: LimitSnapshot | None = None
        self._mean_hold_s: float | None = None
        #: when a running request last finished (progress that may make room)
        self._progress_at = clock()
        self.backfilled = 0
        #: requests suspended so far (preempted to let older ones grow)
        self.preempted = 0
        #: requests that held a reservation and released it, so far
        self.finished_total = 0
        #: called (without the lock held) when a release leaves nothing running or waiting
        self._on_idle = on_idle
        #: model loads (planned bytes) and unloads (0) in flight, by key
        self._claims: dict[str, int] = {}
        #: (when it ended, bytes) of model loads (+) and unloads (-) the baseline of the
        #: latest snapshot was read before
        self._changes: list[tuple[float, int]] = []

    # -- reading ------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """What the running requests hold together (padded batches included)."""
        with self._cond:
            return self._cost()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_requests(self) -> list[WaitingRequest]:
        """The requests waiting for memory, in queue order."""
        now = self.clock()
        with self._cond:
            return [WaitingRequest(w.request_id, w.model_id, w.prompt_tokens, w.reserve_bytes,
                                   now - w.since) for w in self._waiting]

    def idle(self) -> bool:
        """No request holds a reservation or waits for one."""
        with self._cond:
            return not self._running and not self._waiting

    def changing(self) -> bool:
        """A model is loading or unloading (a baseline read now would catch it half-way)."""
        with self._cond:
            return bool(self._claims)

    @property
    def claimed_bytes(self) -> int:
        """What the model loads in flight have claimed (memory not read yet, in part)."""
        with self._cond:
            return sum(self._claims.values())

    def baseline(self, snapshot: LimitSnapshot) -> int:
        """``snapshot``'s idle baseline plus the model loads and unloads that ended after
        it was read."""
        with self._cond:
            return snapshot.baseline_bytes + sum(
                delta for ended_at, delta in self._changes
                if ended_at >= snapshot.baseline_read_at)

    def adjusted(self, snapshot: LimitSnapshot | None) -> LimitSnapshot | None:
        """``snapshot`` with :meth:`baseline` as its baseline."""
        if snapshot is None:
            return None
        baseline = self.baseline(snapshot)
        return snapshot if baseline == snapshot.baseline_bytes else replace(
            snapshot, baseline_bytes=baseline)

    def budget_bytes(self, snapshot: LimitSnapshot | None) -> int | None:
        """What running requests may reserve in all under ``snapshot``; None: unlimited."""
        if snapshot is None or snapshot.hard_bytes is None:
            return None
        return (int(snapshot.hard_bytes * self.admit_watermark) - self.baseline(snapshot)
                - self._margin(snapshot))

    def _margin(self, snapshot: LimitSnapshot) -> int:
        """The margin charged under ``snapshot``: the tier's for its hard limit, at
        least the snapshot's own (an adjusted snapshot keeps the margin measured)."""
        return max(self.margin_bytes(snapshot.hard_bytes), snapshot.margin_bytes)

    @property
    def backfill_s(self) -> float:
        """How long the head of the queue may be overtaken by smaller requests that fit."""
        if self._mean_hold_s is None:
            return DEFAULT_BACKFILL_S
        return max(1.0, 2 * self._mean_hold_s)

    def retry_after_s(self) -> float:
        """A client's best wait before retrying: the typical hold time of a request."""
        hold = self._mean_hold_s if self._mean_hold_s is not None else DEFAULT_RETRY_AFTER_S
        return max(1.0, min(hold, max(self.timeout_s, 1.0)))

    # -- changing ---------------------------------------------------------------------------

    def update(self, snapshot: LimitSnapshot) -> None:
        """A new limit snapshot: waiters re-check whether they fit now."""
        with self._cond:
            self._snapshot = snapshot
            self._changes = [(ended_at, delta) for ended_at, delta in self._changes
                             if ended_at >= snapshot.baseline_read_at]
            self._cond.notify_all()

    # -- model loads and unloads ----------------------------------------------------------

    def try_claim(self, key: str, nbytes: int, *, measured_bytes: int | None = None) -> bool:
        """Claim ``nbytes`` for loading a model if they fit now; whether they did.

        They fit when, with the transient margin, they stay under the hard limit both
        on the ledger's account (baseline, running requests' reservations, other
        claims) and on ``measured_bytes`` (memory in use now, less what the server gives
        back on demand) plus the other claims. A load is not held to
        the admission watermark: its bytes come from the weights' headers, not from an
        estimate. No limit yet: it always fits.
        """
        nbytes = max(0, int(nbytes))
        with self._cond:
            room = self.claim_room(key, measured_bytes=measured_bytes)
            if room is not None and nbytes > room:
                return False
            self._claims[key] = nbytes
            return True

    def claim_room(self, key: str = "", *, measured_bytes: int | None = None) -> int | None:
        """The bytes a load (``key``: not counting its own claim) could claim now
        (:meth:`try_claim`); ``None``: no limit."""
        with self._cond:
            snapshot = self._snapshot
            if snapshot is None or snapshot.hard_bytes is None:
                return None
            claims = sum(v for k, v in self._claims.items() if k != key)
            held = self.baseline(snapshot) + self._cost() - self._claims.get(key, 0)
            if measured_bytes is not None:
                held = max(held, measured_bytes + claims)
            return snapshot.hard_bytes - self._margin(snapshot) - held

    def claim(self, key: str, nbytes: int = 0) -> None:
        """Mark a model change in flight without a fit check (an unload claims nothing)."""
        with self._cond:
            self._claims[key] = max(0, int(nbytes))

    def end_claim(self, key: str, baseline_change: int = 0) -> None:
        """The load or unload of ``key`` ended: its claim goes, and ``baseline_change``
        (the bytes the model now holds; minus those an unload freed) counts on top of
        the baseline until one is read after now."""
        with self._cond:
            if self._claims.pop(key, None) is None:
                return
            if baseline_change:
                self._changes.append((time.monotonic(), int(baseline_change)))
            self._cond.notify_all()
            idle = not self._running and not self._waiting and not self._claims
        if idle and self._on_idle is not None:
            self._on_idle()

    def admit(self, request_id: str, reserve_bytes: int, batch: Hashable | None = None, *,
              model_id: str = "", prompt_tokens: int = 0, decode_bytes: int = 0,
              max_tokens: int = 0, kv_tokens: int = 0, kv_tokens_cap: int = 0
              ) -> AdmissionTicket:
        """Block until ``reserve_bytes`` fits next to the running requests.

        :param batch: requests with the same key share a padded decode batch (one key
            per engine); ``None`` for a request whose memory adds up with the others'.
        :param decode_bytes: of ``reserve_bytes``, the KV of ``max_tokens`` completion
            tokens: a refusal says which smaller ``max_tokens`` would fit now.
        :param kv_tokens: KV tokens ``reserve_bytes`` covers; :param kv_tokens_cap: the
            most the request can grow to (for :meth:`grow`).
        :raises RequestRejected: stage ``"admission"``: the queue is full (cause
            ``"queue_full"``) or the wait timed out (``"queue_timeout"``).
        """
        reserve_bytes = max(0, int(reserve_bytes))
        start = self.clock()
        timeout = self.timeout_s
        with self._cond:
            if self._fits(reserve_bytes, batch) and (not self._waiting or self._may_backfill()):
                if self._waiting:
                    self.backfilled += 1
                return self._grant(request_id, reserve_bytes, 0.0, batch, kv_tokens, kv_tokens_cap)
            if len(self._waiting) >= self.queue_size:
                raise self._rejected(
                    request_id, reserve_bytes, model_id, prompt_tokens, "queue_full",
                    f"{len(self._waiting)} requests are already waiting for memory; retry later "
                    "or raise memory.queue_size", batch, decode_bytes, max_tokens)
            waiter = _Waiter(request_id, reserve_bytes, batch, start, model_id, prompt_tokens)
            self._waiting.append(waiter)
            log.info("request %s waits for memory (%s; %s held by %d running, budget %s, "
                     "%d waiting)", request_id, format_size(reserve_bytes),
                     format_size(self._cost()), len(self._running),
                     _size_or_unlimited(self.budget_bytes(self._snapshot)), len(self._waiting))
            try:
                while True:
                    head = self._waiting[0] is waiter
                    if self._fits(reserve_bytes, batch) and (head or self._may_backfill()):
                        self._waiting.remove(waiter)
                        self.backfilled += 0 if head else 1
                        # The next waiter may fit as well.
                        self._cond.notify_all()
                        return self._grant(request_id, reserve_bytes, self.clock() - start, batch,
                                           kv_tokens, kv_tokens_cap)
                    deadline = max(start, self._progress_at) + timeout
                    remaining = deadline - self.clock()
                    if remaining <= 0:
                        raise self._rejected(
                            request_id, reserve_bytes, model_id, prompt_tokens, "queue_timeout",
                            f"request {request_id} waited {self.clock() - start:.1f} s for memory, "
                            f"the last {timeout:.0f} s without any running request "
                            "finishing; retry later or raise memory.queue_timeout_s",
                            batch, decode_bytes, max_tokens)
                    self._cond.wait(remaining)
            except BaseException:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                    self._cond.notify_all()
                raise

    # -- decode growth and preemption ----------------------------------------------------

    def ticket(self, request_id: str) -> AdmissionTicket | None:
        """The running (or suspended) request's ticket."""
        with self._cond:
            return self._ticket(request_id)

    def resize(self, sizes: Mapping[str, tuple[int, int]], *, force: bool = False) -> bool:
        """Set running requests' reservations to ``sizes`` (request id → (KV tokens,
        bytes)): the forward gate grows them as decode goes on. Growth must fit the budget next to the other running requests (suspended ones do
        not count: growth is what preemption makes room for); all or nothing. A request
        running alone always may grow (preflight admitted its whole ``max_tokens``), so
        may the oldest in a decode batch (``force``: there is no one left to preempt),
        and shrinking always succeeds and lets waiters re-check."""
        with self._cond:
            tickets = {rid: t for rid in sizes
                       if (t := self._ticket(rid)) is not None and not t.suspended}
            new = {rid: (int(tokens), int(nbytes)) for rid, (tokens, nbytes) in sizes.items()
                   if rid in tickets}
            grows = any(nbytes > tickets[rid].reserve_bytes for rid, (_, nbytes) in new.items())
            active = [t for t in self._running.values() if not t.suspended]
            budget = self.budget_bytes(self._snapshot)
            if grows and not force and len(active) > 1 and budget is not None:
                cost = reservation_cost(
                    (new.get(t.request_id, (0, t.reserve_bytes))[1], t.batch) for t in active)
                if cost + sum(self._claims.values()) > budget:
                    return False
            for rid, (tokens, nbytes) in new.items():
                tickets[rid].kv_tokens, tickets[rid].reserve_bytes = tokens, nbytes
            if not grows:
                self._cond.notify_all()
            return True

    def suspend(self, request_id: str) -> None:
        """The request was preempted: it holds no memory until :meth:`resume`."""
        with self._cond:
            ticket = self._ticket(request_id)
            if ticket is not None and not ticket.suspended:
                ticket.suspended = True
                self.preempted += 1
                self._cond.notify_all()

    def resume(self, request_id: str) -> bool:
        """Whether the suspended request fits next to the running ones again (it always
        does alone); if so it holds its reservation again. Oldest suspended first."""
        with self._cond:
            ticket = self._ticket(request_id)
            if ticket is None or not ticket.suspended:
                return True
            active = [(t.reserve_bytes, t.batch) for t in self._running.values() if not t.suspended]
            budget = self.budget_bytes(self._snapshot)
            if active and budget is not None and reservation_cost(
                    active + [(ticket.reserve_bytes, ticket.batch)]) + sum(
                        self._claims.values()) > budget:
                return False
            ticket.suspended = False
            return True

    @property
    def suspended(self) -> int:
        with self._cond:
            return sum(1 for t in self._running.values() if t.suspended)

    def _ticket(self, request_id: str) -> AdmissionTicket | None:
        for ticket in self._running.values():
            if ticket.request_id == request_id:
                return ticket
        return None

    def _rejected(self, request_id: str, reserve_bytes: int, model_id: str, prompt_tokens: int,
                  cause: str, detail: str, batch: Hashable | None, decode_bytes: int,
                  max_tokens: int) -> RequestRejected:
        snapshot = self._snapshot
        # What admission compared: the running reservations, the load claims, the idle
        # baseline and the margin, plus this request, against the admitting share of the
        # hard limit; so the advice's ceiling is one under which this request is admitted.
        limit, base = None, self._cost()
        if snapshot is not None and snapshot.hard_bytes is not None:
            limit = int(snapshot.hard_bytes * self.admit_watermark)
            base += self.baseline(snapshot) + self._margin(snapshot)
        return RequestRejected(Rejection(
            estimated_bytes=reserve_bytes, limit_bytes=limit,
            breakdown=snapshot.breakdown if snapshot else None, request_id=request_id,
            model_id=model_id, prompt_tokens=prompt_tokens, stage="admission", cause=cause,
            detail=detail, base_bytes=base, decode_bytes=decode_bytes,
            max_tokens=max_tokens,
            fitting_max_tokens=self._fitting_max_tokens(reserve_bytes, batch, decode_bytes,
                                                        max_tokens)),
            retry_after_s=self.retry_after_s())

    def _fitting_max_tokens(self, reserve_bytes: int, batch: Hashable | None,
                            decode_bytes: int, max_tokens: int) -> int | None:
        """The largest ``max_tokens`` whose reservation fits next to the running requests
        now (the completion's KV taken as linear in its length); ``None`` if not even
        the prompt fits, or the request's own already does."""
        if max_tokens < 1 or decode_bytes <= 0 or self._fits(reserve_bytes, batch):
            return None
        prompt_part = reserve_bytes - decode_bytes
        per_token = decode_bytes / max_tokens
        low, high = -1, max_tokens - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self._fits(prompt_part + int(per_token * middle), batch):
                low = middle
            else:
                high = middle - 1
        return low if low >= 1 else None

    def _cost(self, extra: tuple[int, Hashable | None] | None = None) -> int:
        """Running requests' reservations and the claims of model loads in flight."""
        held = [(t.reserve_bytes, t.batch) for t in self._running.values()]
        return (reservation_cost(held + ([extra] if extra is not None else []))
                + sum(self._claims.values()))

    def _may_backfill(self) -> bool:
        """Whether a request behind the head may run now: the head cannot fit yet and
        has not waited long enough to stop being overtaken."""
        head = self._waiting[0]
        if self._fits(head.reserve_bytes, head.batch):
            return False
        return self.clock() - head.since < self.backfill_s

    def _fits(self, reserve_bytes: int, batch: Hashable | None) -> bool:
        """Whether a new request fits next to the running and the suspended ones (the
        latter resume first) and the model loads in flight."""
        if not self._running and not self._claims:
            return True
        budget = self.budget_bytes(self._snapshot)
        return budget is None or self._cost((reserve_bytes, batch)) <= budget

    def _grant(self, request_id: str, reserve_bytes: int, waited_s: float,
               batch: Hashable | None, kv_tokens: int = 0, kv_tokens_cap: int = 0
               ) -> AdmissionTicket:
        ticket = AdmissionTicket(self, request_id, reserve_bytes, waited_s, batch,
                                 kv_tokens=kv_tokens, kv_tokens_cap=kv_tokens_cap)
        self._running[id(ticket)] = ticket
        return ticket

    def _release(self, ticket: AdmissionTicket, held_s: float) -> None:
        with self._cond:
            if self._running.pop(id(ticket), None) is None:
                return
            self.finished_total += 1
            self._mean_hold_s = held_s if self._mean_hold_s is None else (
                0.8 * self._mean_hold_s + 0.2 * held_s)
            self._progress_at = self.clock()
            self._cond.notify_all()
            idle = not self._running and not self._waiting
        if idle and self._on_idle is not None:
            self._on_idle()


def _size_or_unlimited(value: int | None) -> str:
    return "unlimited" if value is None else format_size(value)
