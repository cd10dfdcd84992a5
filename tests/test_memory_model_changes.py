"""Model loads and unloads go through the admission ledger: a load claims its bytes next
to the running requests, requests are judged next to the loads in flight, and the
baseline a busy server judges on follows the models that came and went since it was
last read (issue 20: a server kept busy while the pool swapped models judged its
requests against the footprint of its last idle moment, and went over its ceiling)."""

from __future__ import annotations

import threading
from pathlib import Path

from omlx_core.config import load_config
from omlx_core.memory.admission import AdmissionQueue
from omlx_core.memory.ceilings import ProbeReadings
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.gate import PrefillChunk, PrefillStep
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.probes import CgroupMemory, LinuxMeminfo, ProcessFootprint
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, PeakEstimate, PeakQuery
from omlx_core.memory.usage import MemoryUsage
from omlx_core.pluginmanager import PluginManager
from omlx_core.plugins import memory_guard as memory_guard_plugin
from omlx_core.testing.waiting import wait_for

GIB = 1024**3
MIB = 1024**2


def snapshot(hard: int = 1000 * MIB, baseline: int = 200 * MIB, *, in_use: int = 0,
             read_at: float = 0.0) -> LimitSnapshot:
    return LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard, tier="custom"),
                         baseline_bytes=baseline, in_use_bytes=in_use or baseline,
                         baseline_read_at=read_at)


def ledger(**kwargs) -> AdmissionQueue:
    queue = AdmissionQueue(queue_size=8, timeout_s=30.0, admit_watermark=1.0)
    queue.update(snapshot(**kwargs))
    return queue


def admit_on_a_thread(queue: AdmissionQueue, name: str, reserve: int) -> dict:
    result: dict = {}

    def run() -> None:
        result["ticket"] = queue.admit(name, reserve)

    threading.Thread(target=run, daemon=True).start()
    assert wait_for(lambda: "ticket" in result or queue.waiting == 1)
    return result


def test_a_load_claims_only_the_room_the_running_requests_leave():
    queue = ledger()  # 800 MiB over the 200 MiB baseline
    ticket = queue.admit("running", 500 * MIB)
    assert not queue.try_claim("load:b", 400 * MIB)
    assert queue.claim_room("load:b") == 300 * MIB
    assert queue.try_claim("load:b", 300 * MIB) and queue.changing()
    ticket.release()


def test_a_load_is_judged_on_measured_memory_too():
    # The ledger leaves 800 MiB; memory read now (something the ledger does not know of)
    # leaves 500.
    queue = ledger()
    assert not queue.try_claim("load:b", 600 * MIB, measured_bytes=500 * MIB)
    assert queue.try_claim("load:b", 500 * MIB, measured_bytes=500 * MIB)


def test_a_request_waits_behind_a_load_in_flight_and_the_loaded_model_stays_counted():
    queue = ledger()
    running = queue.admit("running", 100 * MIB)
    assert queue.try_claim("load:b", 600 * MIB)
    # 200 + 100 + 600 + 150 > 1000: it waits for the load.
    waiter = admit_on_a_thread(queue, "late", 150 * MIB)
    assert "ticket" not in waiter and queue.waiting == 1
    # The load ends holding 550 MiB: the budget keeps it (200 + 550 + 100 + 150 <= 1000).
    queue.end_claim("load:b", 550 * MIB)
    assert not queue.changing()
    assert queue.budget_bytes(queue._snapshot) == 250 * MIB
    assert wait_for(lambda: "ticket" in waiter)
    # An unload gives 500 MiB back.
    queue.claim("unload:a")
    queue.end_claim("unload:a", -500 * MIB)
    assert queue.budget_bytes(queue._snapshot) == 750 * MIB
    running.release()
    waiter["ticket"].release()


def test_a_baseline_read_after_the_change_replaces_it():
    queue = ledger()
    assert queue.try_claim("load:b", 100 * MIB)
    queue.end_claim("load:b", 100 * MIB)
    older = snapshot(read_at=0.0)  # read before the load ended
    queue.update(older)
    assert queue.baseline(older) == 300 * MIB  # read before the load ended: added
    newer = snapshot(baseline=310 * MIB, read_at=float("inf"))  # read after it
    queue.update(newer)
    assert queue.baseline(newer) == 310 * MIB  # the reading has the model: not twice
    assert queue.adjusted(newer) is newer


def readings() -> ProbeReadings:
    available = 20 * GIB
    return ProbeReadings(
        system="Linux", meminfo=LinuxMeminfo(32 * GIB, available, available, available, 0, 0),
        cgroup=CgroupMemory(2, Path("/sys/fs/cgroup/x"), None, None, None),
        footprint=ProcessFootprint(GIB, GIB, "test"))


def test_the_enforcer_reads_no_baseline_while_a_model_loads_and_the_guard_adds_it_after():
    plugins = PluginManager()
    plugins.register(memory_guard_plugin, "memory_guard")
    config = load_config(tier="cpu-small", env={}, overrides=[
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", str(GIB), "test"),
        ("memory.transient_margin", "0", "test")])
    resident = {"bytes": 200 * MIB}
    usage = MemoryUsage(read_active=lambda: resident["bytes"], read_footprint=lambda: 0)
    guard = MemoryGuard(plugins, config, usage=usage, mlx_cache=lambda: 0)
    enforcer = guard.start(lambda: [], read=readings)
    guard.close()  # polls are driven by hand below
    assert guard.snapshot.baseline_bytes == 200 * MIB

    assert guard.admission.try_claim("load:b", 400 * MIB)
    resident["bytes"] = 400 * MIB  # half-way through the load
    enforcer.poll_once()
    assert guard.snapshot.baseline_bytes == 200 * MIB  # not read half-way
    resident["bytes"] = 550 * MIB
    guard.admission.end_claim("load:b", 350 * MIB)
    assert guard.snapshot.baseline_bytes == 550 * MIB  # the last reading plus the load

    ticket = guard.admission.admit("busy", 10 * MIB)
    resident["bytes"] = 560 * MIB
    enforcer.poll_once()  # busy: the baseline is not read, the load stays added
    assert guard.snapshot.baseline_bytes == 550 * MIB
    ticket.release()
    enforcer.poll_once()  # idle: read afresh, the change is in it
    assert guard.snapshot.baseline_bytes == 560 * MIB


def per_token(query: PeakQuery) -> PeakEstimate:
    return PeakEstimate(transient_bytes=0, kv_bytes_per_token=MIB, kv_bytes=query.new_tokens * MIB)


def test_a_load_in_flight_is_judged_by_admission_not_again_by_the_forward_gate():
    """A request admitted next to a load's claim has its room: the gate, which measures
    memory now (the load's weights not read yet), does not count the claim again and
    refuse a request running alone before its first token."""
    queue = ledger()
    usage = MemoryUsage(read_active=lambda: 200 * MIB, read_footprint=lambda: 0)
    gate = PrefillForwardGate(per_token, usage, 0, ledger=queue)
    assert queue.try_claim("load:b", 400 * MIB)
    ticket = queue.admit("r", 300 * MIB)  # 200 + 400 + 300 <= 1000: admitted
    step = PrefillStep(model_id="tiny", chunks=(PrefillChunk("r", 300, 0, 301),), decoding=0,
                       chunk_size=512, limits=snapshot(), model_config={"model_type": "llama"},
                       running=1)
    assert gate.check_prefill(step) == {}
    # What does not fit next to the claim waits at admission instead.
    waiter = admit_on_a_thread(queue, "late", 200 * MIB)
    assert "ticket" not in waiter and queue.waiting == 1
    queue.end_claim("load:b", 50 * MIB)
    assert wait_for(lambda: "ticket" in waiter)
    ticket.release()
    waiter["ticket"].release()
