"""Admission that does not waste the machine: small requests run beside a large one the
budget cannot take yet (backfill) without starving it, and a queued request is never
timed out while the work ahead of it keeps finishing."""

from __future__ import annotations

import threading

import pytest

from omlx_core.memory.admission import AdmissionQueue
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, RequestRejected

MIB = 1024**2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_queue(clock: Clock, *, hard=1000 * MIB, baseline=200 * MIB, timeout=30.0,
               margin=0) -> AdmissionQueue:
    queue = AdmissionQueue(queue_size=8, timeout_s=timeout, admit_watermark=1.0, clock=clock,
                           margin_bytes=margin)
    queue.update(LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard),
                               baseline_bytes=baseline))
    return queue


def admit_later(queue: AdmissionQueue, name: str, reserve: int, results: dict) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = queue.admit(name, reserve)
        except RequestRejected as error:
            results[name] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_until(condition, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def test_a_small_request_runs_beside_a_large_one_the_budget_cannot_take_yet() -> None:
    clock = Clock()
    queue = make_queue(clock)  # 800 MiB of budget
    running = queue.admit("running", 500 * MIB)
    results: dict = {}
    admit_later(queue, "large", 600 * MIB, results)
    wait_until(lambda: queue.waiting == 1)
    small = queue.admit("small", 200 * MIB)  # fits beside "running" while "large" cannot
    assert queue.backfilled == 1 and queue.waiting == 1
    small.release()
    running.release()
    wait_until(lambda: "large" in results)
    assert not isinstance(results["large"], RequestRejected)


def test_backfill_never_takes_room_the_head_could_use() -> None:
    clock = Clock()
    queue = make_queue(clock)
    running = queue.admit("running", 500 * MIB)
    results: dict = {}
    admit_later(queue, "head", 600 * MIB, results)
    wait_until(lambda: queue.waiting == 1)
    running.release()  # the head fits now and is granted before anyone else
    wait_until(lambda: "head" in results)
    admit_later(queue, "small", 300 * MIB, results)
    wait_until(lambda: queue.waiting == 1)
    assert "small" not in results


def test_backfill_stops_once_the_head_has_waited_long_enough() -> None:
    clock = Clock()
    queue = make_queue(clock)
    running = queue.admit("running", 500 * MIB)
    results: dict = {}
    admit_later(queue, "large", 600 * MIB, results)
    wait_until(lambda: queue.waiting == 1)
    clock.now += queue.backfill_s + 0.1
    admit_later(queue, "small", 100 * MIB, results)
    wait_until(lambda: queue.waiting == 2)
    assert "small" not in results  # would have fitted, but the head has waited its share
    running.release()
    wait_until(lambda: "large" in results and "small" in results)


def test_a_queued_request_is_not_timed_out_while_work_ahead_keeps_finishing() -> None:
    clock = Clock()
    queue = make_queue(clock, timeout=10.0)
    tickets = [queue.admit(f"r{i}", 200 * MIB) for i in range(4)]  # 800 of 800 MiB
    results: dict = {}
    admit_later(queue, "late", 800 * MIB, results)
    wait_until(lambda: queue.waiting == 1)
    for ticket in tickets[:3]:
        clock.now += 8.0  # each finishes within the timeout of the previous progress
        ticket.release()
        wait_until(lambda: queue.waiting == 1 and "late" not in results)
    assert clock.now > 10.0 and "late" not in results  # waited past the timeout, not refused
    clock.now += 10.5  # now nothing finishes for longer than the timeout
    queue.update(queue._snapshot)  # any wake-up re-checks the deadline
    wait_until(lambda: "late" in results)
    refused = results["late"]
    assert isinstance(refused, RequestRejected) and refused.rejection.cause == "queue_timeout"
    assert "without any running request finishing" in str(refused)


def test_the_transient_margin_is_charged_once_against_the_budget() -> None:
    clock = Clock()
    queue = make_queue(clock, margin=100 * MIB)  # 800 - 100 = 700 MiB for reservations
    assert queue.budget_bytes(queue._snapshot) == 700 * MIB
    first = queue.admit("a", 400 * MIB)
    results: dict = {}
    admit_later(queue, "b", 350 * MIB, results)  # 750 > 700: waits
    wait_until(lambda: queue.waiting == 1)
    first.release()
    wait_until(lambda: "b" in results)


@pytest.mark.parametrize("reserve", [300 * MIB, 0])
def test_a_request_runs_alone_when_nothing_else_is_reserved(reserve: int) -> None:
    queue = make_queue(Clock(), hard=100 * MIB, baseline=90 * MIB)
    queue.admit("alone", reserve + 500 * MIB).release()


def test_a_refusal_at_admission_names_the_max_tokens_that_would_have_fitted() -> None:
    from omlx_core.plugins.advice import on_rejection

    clock = Clock()
    queue = make_queue(clock, timeout=0.0)
    queue.admit("running", 500 * MIB)
    # 300 MiB of room: the prompt's 100 MiB plus 2 MiB per token of its 400-token completion
    with pytest.raises(RequestRejected) as refused:
        queue.admit("greedy", 900 * MIB, decode_bytes=800 * MIB, max_tokens=400)
    rejection = refused.value.rejection
    assert rejection.fitting_max_tokens == 100
    assert "max_tokens=100" in on_rejection(rejection)
