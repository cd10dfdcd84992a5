"""Budget admission: wait instead of stacking, arrival order with backfill, a bounded
queue, a timeout,
and reservations that come back when a request ends."""

from __future__ import annotations

import threading
import time

import pytest

from omlx_core.memory.admission import AdmissionQueue, reservation_cost
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, RequestRejected


def is_queue_full(error: BaseException | None) -> bool:
    return isinstance(error, RequestRejected) and error.rejection.cause == "queue_full"


def is_timeout(error: BaseException | None) -> bool:
    return isinstance(error, RequestRejected) and error.rejection.cause == "queue_timeout"

MIB = 1024**2


def limits(hard: int, baseline: int = 0) -> LimitSnapshot:
    return LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard, tier="custom"),
                         baseline_bytes=baseline)


def make_queue(hard=1000 * MIB, baseline=200 * MIB, watermark=1.0, size=8, timeout=60.0,
               clock=time.monotonic):
    queue = AdmissionQueue(queue_size=size, timeout_s=timeout, admit_watermark=watermark,
                           clock=clock)
    queue.update(limits(hard, baseline))
    return queue


class Arrivals:
    """Runs admit() calls on threads and records the order in which they are granted."""

    def __init__(self, queue: AdmissionQueue):
        self.queue = queue
        self.order: list[str] = []
        self.tickets: dict[str, object] = {}
        self.errors: dict[str, BaseException] = {}
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def arrive(self, name: str, reserve: int) -> None:
        def run() -> None:
            try:
                ticket = self.queue.admit(name, reserve)
            except BaseException as exc:
                with self._lock:
                    self.errors[name] = exc
                return
            with self._lock:
                self.order.append(name)
                self.tickets[name] = ticket

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()
        # Each arrival is queued before the next one starts.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self._lock:
                if name in self.order or name in self.errors:
                    return
            if any(w.request_id == name for w in list(self.queue._waiting)):
                return
            time.sleep(0.005)
        raise AssertionError(f"{name} neither admitted nor queued")

    def release(self, name: str) -> None:
        self.tickets[name].release()

    def wait_granted(self, *names: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(n in self.order for n in names):
                    return
            time.sleep(0.005)
        raise AssertionError(f"not granted in time: {names}; granted {self.order}")


def test_requests_that_fit_together_run_at_once():
    queue = make_queue()
    first = queue.admit("a", 300 * MIB)
    second = queue.admit("b", 400 * MIB)
    assert queue.running == 2 and queue.reserved_bytes == 700 * MIB
    first.release()
    second.release()
    assert queue.running == 0 and queue.reserved_bytes == 0 and queue.idle()


def test_a_request_that_does_not_fit_next_to_the_running_ones_waits_then_runs():
    queue = make_queue()  # budget: 1000 - 200 = 800 MiB
    arrivals = Arrivals(queue)
    arrivals.arrive("running", 600 * MIB)
    arrivals.arrive("late", 400 * MIB)
    assert arrivals.order == ["running"] and queue.waiting == 1
    arrivals.release("running")
    arrivals.wait_granted("late")
    assert queue.reserved_bytes == 400 * MIB


def test_a_request_runs_alone_when_nothing_else_is_reserved():
    # Preflight already let it through; waiting could not make room for it.
    queue = make_queue(watermark=0.5)
    ticket = queue.admit("big", 900 * MIB)
    assert queue.running == 1
    ticket.release()


def test_watermark_shrinks_the_budget():
    queue = make_queue(hard=1000 * MIB, baseline=0, watermark=0.5, size=0)
    first = queue.admit("a", 300 * MIB)
    second = queue.admit("b", 200 * MIB)  # 500 MiB: exactly the budget
    with pytest.raises(RequestRejected) as full:
        queue.admit("c", 1 * MIB)  # over 50 % of 1000 MiB, and no room to wait
    assert is_queue_full(full.value) and full.value.stage == "admission"
    first.release()
    second.release()


def test_a_big_request_at_the_head_is_admitted_first_once_it_fits():
    queue = make_queue()  # budget 800 MiB
    arrivals = Arrivals(queue)
    arrivals.arrive("running", 500 * MIB)
    arrivals.arrive("big", 700 * MIB)        # does not fit next to "running": waits
    arrivals.arrive("small-1", 200 * MIB)    # fits beside "running": backfilled now
    arrivals.arrive("small-2", 200 * MIB)    # does not fit beside both: waits
    assert arrivals.order == ["running", "small-1"]
    assert [w.request_id for w in queue._waiting] == ["big", "small-2"]
    arrivals.release("running")             # 200 held: big (700) still cannot fit, so
    arrivals.wait_granted("small-2")        # small-2 runs beside small-1 meanwhile
    arrivals.release("small-1")
    arrivals.release("small-2")
    arrivals.wait_granted("big")            # the head, as soon as it fits
    assert arrivals.order == ["running", "small-1", "small-2", "big"]


def test_queue_full_raises_with_retry_after():
    queue = make_queue(size=1)
    arrivals = Arrivals(queue)
    arrivals.arrive("running", 800 * MIB)
    arrivals.arrive("waiting", 100 * MIB)
    with pytest.raises(RequestRejected) as info:
        queue.admit("rejected", 100 * MIB)
    assert is_queue_full(info.value) and info.value.retry_after_s >= 1
    assert "memory.queue_size" in str(info.value)
    arrivals.release("running")
    arrivals.wait_granted("waiting")


def test_waiting_longer_than_the_timeout_raises_and_leaves_the_queue():
    now = [100.0]  # the queue's clock, moved by the test: no test timing on a loaded machine
    queue = AdmissionQueue(queue_size=8, timeout_s=5.0, admit_watermark=1.0, clock=lambda: now[0])
    queue.update(limits(1000 * MIB, 200 * MIB))
    running = queue.admit("running", 800 * MIB)
    arrivals = Arrivals(queue)
    arrivals.arrive("slow", 100 * MIB)  # queued, not refused at once
    now[0] += 4.9
    queue.update(limits(1000 * MIB, 200 * MIB))  # a wake-up before its deadline: it waits on
    now[0] += 0.2
    queue.update(limits(1000 * MIB, 200 * MIB))  # past it
    arrivals.threads[0].join(60)
    error = arrivals.errors.get("slow")
    assert is_timeout(error) and error.stage == "admission"  # the front end's 503
    assert "waited 5.1 s" in str(error) and "memory.queue_timeout_s" in str(error)
    assert queue.waiting == 0
    running.release()
    assert queue.idle()


def test_a_timed_out_head_lets_the_next_waiter_through():
    queue = make_queue(timeout=5.0)
    arrivals = Arrivals(queue)
    arrivals.arrive("running", 500 * MIB)
    queue.timeout_s = 0.2
    arrivals.arrive("big", 700 * MIB)      # will time out
    queue.timeout_s = 60.0
    arrivals.arrive("small", 400 * MIB)    # does not fit beside "running" either: waits
    arrivals.threads[1].join(60)
    assert is_timeout(arrivals.errors.get("big"))
    assert [w.request_id for w in queue._waiting] == ["small"]  # now the head
    arrivals.release("running")
    arrivals.wait_granted("small")
    arrivals.release("small")
    assert queue.idle()


def test_ticket_context_manager_releases_and_double_release_is_harmless():
    queue = make_queue()
    ticket = queue.admit("a", 600 * MIB)
    with ticket:
        assert queue.reserved_bytes == 600 * MIB
    assert queue.reserved_bytes == 0
    ticket.release()
    assert queue.reserved_bytes == 0 and queue.running == 0


def test_release_on_error_still_returns_the_reservation():
    queue = make_queue()
    with pytest.raises(RuntimeError):
        with queue.admit("a", 600 * MIB):
            raise RuntimeError("client went away")
    assert queue.idle()


def test_a_raised_limit_admits_waiters_without_a_release():
    queue = make_queue(hard=1000 * MIB, baseline=200 * MIB)
    arrivals = Arrivals(queue)
    arrivals.arrive("running", 600 * MIB)
    arrivals.arrive("late", 400 * MIB)
    assert queue.waiting == 1
    queue.update(limits(2000 * MIB, 200 * MIB))  # e.g. other programs exited
    arrivals.wait_granted("late")


def test_no_limit_means_no_waiting():
    queue = AdmissionQueue(queue_size=1, timeout_s=1, admit_watermark=0.9)
    queue.update(LimitSnapshot(hard_bytes=None, breakdown=CeilingBreakdown()))
    tickets = [queue.admit(str(i), 10**12) for i in range(5)]
    assert queue.running == 5
    for ticket in tickets:
        ticket.release()


def test_retry_after_learns_from_hold_times():
    now = [0.0]
    queue = make_queue(clock=lambda: now[0])
    for _ in range(3):
        ticket = queue.admit("a", MIB)
        now[0] += 0.05  # held 50 ms
        ticket.release()
    assert queue.retry_after_s() == 1.0  # short holds: the floor
    queue._mean_hold_s = 3.7
    assert queue.retry_after_s() == pytest.approx(3.7)


# -- padded decode batches -------------------------------------------------------------------


def test_reservation_cost_pads_each_batch_to_its_largest_member():
    assert reservation_cost([(100, None), (50, None)]) == 150
    # One engine's batch: three requests, the largest 300 -> each holds 300.
    assert reservation_cost([(300, "e1"), (10, "e1"), (20, "e1")]) == 900
    # Two engines pad separately; unbatched requests add up.
    assert reservation_cost([(300, "e1"), (10, "e1"), (40, "e2"), (5, None)]) == 600 + 40 + 5


def test_a_short_request_waits_behind_a_long_one_in_the_same_padded_batch():
    queue = make_queue(hard=1000 * MIB, baseline=200 * MIB)  # budget 800 MiB
    long_ticket = queue.admit("long", 300 * MIB, batch="engine")
    shorts = [queue.admit(f"short-{i}", 10 * MIB, batch="engine") for i in range(1)]
    assert queue.reserved_bytes == 600 * MIB  # two sequences padded to the long one
    # A third would make 900 MiB of padded KV: over the budget, and nowhere to wait.
    queue.queue_size = 0
    with pytest.raises(RequestRejected):
        queue.admit("short-late", 10 * MIB, batch="engine")
    # Another engine's batch is not padded by this one.
    other = queue.admit("other-engine", 150 * MIB, batch="other")
    long_ticket.release()
    assert queue.reserved_bytes == 10 * MIB + 150 * MIB
    for ticket in (*shorts, other):
        ticket.release()
