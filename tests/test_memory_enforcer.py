"""The enforcer publishes one immutable snapshot to every engine on every poll: engines
loaded before and after it started, wrappers whose plugin resolves the active path on
every poll, and it says once per type when an engine cannot receive limits."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest

from omlx_core.config import load_config
from omlx_core.memory.ceilings import ProbeReadings
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.gate import MemoryReceiver
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.probes import CgroupMemory, LinuxMeminfo, ProcessFootprint
from omlx_core.memory.types import LimitSnapshot
from omlx_core.memory.usage import MemoryUsage
from omlx_core.pluginmanager import PluginManager
from omlx_core.plugins import memory_guard as memory_guard_plugin

GIB = 1024**3
MIB = 1024**2
POLL_S = 0.05


def readings(available: int = 20 * GIB) -> ProbeReadings:
    return ProbeReadings(
        system="Linux",
        meminfo=LinuxMeminfo(32 * GIB, available, available, available, 0, 0),
        cgroup=CgroupMemory(2, Path("/sys/fs/cgroup/x"), None, None, None),
        footprint=ProcessFootprint(GIB, GIB, "test"))


class Receiver(MemoryReceiver):
    """An object that takes limits and the forward gate, as a scheduler does."""

    def __init__(self):
        self.snapshots: list[LimitSnapshot] = []
        self.forward_gate = None
        self.gates_set = 0

    def apply_memory_limits(self, snapshot: LimitSnapshot) -> None:
        self.snapshots.append(snapshot)

    def set_forward_gate(self, gate) -> None:
        self.forward_gate = gate
        self.gates_set += 1


class SchedulerEngine:
    """An engine that keeps its scheduler at ``.scheduler`` (its plugin resolves it)."""

    def __init__(self):
        self.scheduler = Receiver()


class GuardEngine(Receiver):
    """An engine that bypasses any scheduler and takes limits itself (the built-in
    memory_guard plugin resolves it to itself)."""


class SwitchingEngine:
    """A wrapper with two paths (a speculative one and a fallback): its plugin resolves
    whichever is active, on every poll."""

    def __init__(self):
        self.primary, self.fallback = Receiver(), Receiver()
        self.active = self.primary


class OpaqueEngine:
    """Nothing resolves it."""


class Unknown:
    """Another type nothing resolves."""


class Resolver:
    """The engine plugins' resolve_scheduler for the engine types above."""

    @hookimpl
    def resolve_scheduler(self, engine):
        if isinstance(engine, SchedulerEngine):
            return engine.scheduler
        if isinstance(engine, SwitchingEngine):
            return engine.active
        return None


def make_guard(plugins: PluginManager | None = None, *, resident: int = GIB,
               **overrides: str) -> MemoryGuard:
    if plugins is None:
        plugins = PluginManager()
        plugins.register(memory_guard_plugin, "memory_guard")
        plugins.register(Resolver(), "resolver")
    config = load_config(tier="cpu-small", env={}, overrides=[
        ("memory.poll_interval_s", str(POLL_S), "test"),
        *((key, value, "test") for key, value in overrides.items())])
    usage = MemoryUsage(window_s=1.0, read_active=lambda: resident, read_footprint=lambda: 0)
    return MemoryGuard(plugins, config, usage=usage, mlx_cache=lambda: 0)


def received(engine) -> list[LimitSnapshot]:
    return (engine.scheduler if isinstance(engine, SchedulerEngine) else engine).snapshots


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


# -- propagation ----------------------------------------------------------------------------


def test_engines_loaded_before_and_after_start_get_limits_within_one_poll():
    guard = make_guard()
    engines = {"before": SchedulerEngine()}
    enforcer = guard.start(lambda: engines.values(), read=readings)
    try:
        assert received(engines["before"]), "the first snapshot is published synchronously"
        engines["after"] = SchedulerEngine()  # e.g. a model loaded on first request
        wait_for(lambda: received(engines["after"]))
        latest = guard.snapshot
        assert latest.hard_bytes and latest.hard_bytes == latest.breakdown.hard
        polls = enforcer.polls
        wait_for(lambda: enforcer.polls >= polls + 2)
        # Every poll publishes, not only when something changed.
        assert len(received(engines["before"])) >= 3
    finally:
        guard.close()
    assert not enforcer.running


def test_every_engine_gets_the_same_immutable_snapshot_each_poll():
    guard = make_guard()
    engines = [SchedulerEngine(), GuardEngine()]
    guard.start(lambda: engines, read=readings)
    guard.close()
    firsts = [received(engine)[0] for engine in engines]
    assert all(snapshot is guard.snapshot for snapshot in firsts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        firsts[0].hard_bytes = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        firsts[0].breakdown.dynamic = 1


def test_snapshots_are_numbered_and_carry_breakdown_usage_and_baseline():
    guard = make_guard(resident=3 * GIB)
    enforcer = guard.start(lambda: [], read=readings)
    guard.close()
    second = enforcer.poll_once()
    assert second.sequence == 2
    assert second.in_use_bytes == 3 * GIB and second.baseline_bytes == 3 * GIB
    assert second.breakdown.tier == "safe" and second.hard_bytes == second.breakdown.hard


def test_a_wrapper_is_followed_to_whichever_path_is_active_on_every_poll():
    guard = make_guard()
    engine = SwitchingEngine()
    enforcer = guard.start(lambda: [engine], read=readings)
    guard.close()
    assert engine.primary.snapshots == [guard.snapshot] and not engine.fallback.snapshots
    engine.active = engine.fallback  # e.g. a speculative engine falls back to batching
    enforcer.poll_once()
    assert engine.fallback.snapshots == [guard.snapshot]
    gate = guard.forward_gate_for(engine)
    assert engine.primary.forward_gate is gate and engine.fallback.forward_gate is gate


def test_a_plugin_resolver_answers_before_the_builtin_one():
    plugins = PluginManager()
    plugins.register(memory_guard_plugin, "memory_guard")
    special = Receiver()

    class KnowsItsEngine:
        from omlx_core.hookspecs import hookimpl

        @hookimpl
        def resolve_scheduler(self, engine):
            return special if isinstance(engine, GuardEngine) else None

    plugins.register(KnowsItsEngine(), "knows")
    guard = make_guard(plugins)
    engine = GuardEngine()  # the built-in plugin would resolve it to itself
    guard.start(lambda: [engine], read=readings)
    guard.close()
    assert special.snapshots == [guard.snapshot] and not engine.snapshots


def test_unresolvable_engine_type_warns_once(caplog):
    guard = make_guard()
    engines = [OpaqueEngine(), OpaqueEngine(), Unknown()]
    with caplog.at_level(logging.WARNING, logger="omlx_core.memory.enforcer"):
        enforcer = guard.start(lambda: engines, read=readings)
        for _ in range(3):
            enforcer.poll_once()
        guard.close()
    warnings = [r.getMessage() for r in caplog.records if "MemoryReceiver" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per type: OpaqueEngine, Unknown
    assert any("OpaqueEngine" in w for w in warnings) and any("Unknown" in w for w in warnings)


def test_a_receiver_that_raises_does_not_stop_the_others(caplog):
    class Broken(GuardEngine):
        def apply_memory_limits(self, snapshot):
            raise RuntimeError("boom")

    guard = make_guard()
    healthy = SchedulerEngine()
    with caplog.at_level(logging.WARNING, logger="omlx_core.memory.enforcer"):
        enforcer = guard.start(lambda: [Broken(), healthy], read=readings)
        enforcer.poll_once()
        guard.close()
    assert len(received(healthy)) == 2
    assert sum("publishing memory limits" in r.getMessage() for r in caplog.records) == 1


def test_the_forward_gate_is_installed_once_per_receiver():
    engine = SchedulerEngine()
    guard = make_guard()
    enforcer = guard.start(lambda: [engine], read=readings)
    guard.close()
    enforcer.poll_once()
    assert engine.scheduler.forward_gate is guard.forward_gate_for(engine)
    assert engine.scheduler.gates_set == 1


def test_changing_ceilings_reach_engines_on_the_next_poll():
    guard = make_guard()
    engine = SchedulerEngine()
    current = {"available": 30 * GIB}
    guard.start(lambda: [engine], read=lambda: readings(current["available"]))
    try:
        first = received(engine)[-1]
        current["available"] = 2 * GIB  # other programs took memory
        wait_for(lambda: received(engine)[-1].hard_bytes < first.hard_bytes)
        latest = received(engine)[-1]
        assert latest.breakdown.binding == "dynamic"
        assert first.breakdown.binding == "static"
    finally:
        guard.close()


def test_baseline_is_only_resampled_while_idle():
    resident = {"bytes": GIB}
    plugins = PluginManager()
    plugins.register(memory_guard_plugin, "memory_guard")
    config = load_config(tier="cpu-small", env={})
    usage = MemoryUsage(read_active=lambda: resident["bytes"], read_footprint=lambda: 0)
    guard = MemoryGuard(plugins, config, usage=usage, mlx_cache=lambda: 0)
    enforcer = guard.start(lambda: [], read=readings)
    guard.close()
    ticket = guard.admission.admit("busy", MIB)
    resident["bytes"] = 5 * GIB  # a request's KV and transients
    busy = enforcer.poll_once()
    assert (busy.baseline_bytes, busy.in_use_bytes) == (GIB, 5 * GIB)
    ticket.release()
    resident["bytes"] = int(1.2 * GIB)  # back to idle, a little heap growth
    assert enforcer.poll_once().baseline_bytes == int(1.2 * GIB)


def test_a_failing_poll_keeps_the_thread_and_the_last_limits(caplog):
    guard = make_guard()
    calls = {"n": 0}

    def flaky() -> ProbeReadings:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("probe exploded")
        return readings()

    with caplog.at_level(logging.ERROR, logger="omlx_core.memory.enforcer"):
        enforcer = guard.start(lambda: [], read=flaky)
        try:
            wait_for(lambda: calls["n"] >= 4)
            assert enforcer.running and "probe exploded" in (enforcer.last_error or "")
        finally:
            guard.close()


# -- start-up and shutdown -------------------------------------------------------------------------


def test_start_engines_installs_the_guard_and_stop_engines_stops_its_enforcer(tiny_model_path,
                                                                              tmp_path):
    from omlx_core.bootstrap import load_setup, start_engines, stop_engines

    model_dir = tiny_model_path("llama")
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n'
                      'engine = "batched"\n')
    setup = load_setup("cpu-small", [config], [("memory.poll_interval_s", str(POLL_S), "test")])
    context = start_engines(setup, progress=False)
    try:
        guard = context.memory_guard
        assert isinstance(guard, MemoryGuard) and guard.enforcer.running
        scheduler = context.engines["tiny"].scheduler
        assert scheduler.limits is not None and scheduler.limits.hard_bytes
        assert scheduler.forward_gate is guard.forward_gate_for(context.engines["tiny"])
        first = scheduler.limits.sequence
        wait_for(lambda: scheduler.limits.sequence > first)
        enforcer = guard.enforcer
    finally:
        stop_engines(context)
    assert not enforcer.running and guard.enforcer is None


# -- mlx's buffer cache ----------------------------------------------------------------------


def _mlx_cache_limit() -> int:
    """mlx's buffer-cache cap now, read on the MLX thread (setting it returns the old one)."""
    import mlx.core as mx

    from omlx_core.mlx_thread import mlx_thread

    def read() -> int:
        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        return limit

    return mlx_thread().run(read)


@pytest.mark.parametrize(("overrides", "share"), [
    ({}, 0.0),  # the cpu tier: glibc's heap reuses freed buffers as fast
    ({"memory.buffer_cache_share": "0.5"}, 0.5),
    ({"memory.buffer_cache_share": "1"}, 1.0),
])
def test_mlx_buffer_cache_keeps_its_share_of_the_margin(overrides, share):
    """Buffers mlx keeps for reuse are resident while a forward runs: under a limit they
    may take only their share of the transient margin, so the rest stays for what no
    estimate counts (with all of it, a 4k-token prefill under 1 GiB peaked over it)."""
    import mlx.core as mx

    from omlx_core.mlx_thread import mlx_thread

    before = mlx_thread().run(lambda: mx.set_cache_limit(1 << 40))
    guard = make_guard(**overrides)
    try:
        guard.start(lambda: [], read=readings)
        margin = guard.snapshot.margin_bytes
        assert margin == 64 * MIB
        wait_for(lambda: _mlx_cache_limit() == int(share * margin))
    finally:
        guard.close()
        mlx_thread().run(lambda: mx.set_cache_limit(before))
