"""Bounded grammars: caps on what a client's grammar may be, a bounded compile queue
shared fairly between clients, compiles killed at their deadline or memory limit, and
the compile workers' memory in the server's footprint."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import string
import threading

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                reason="xgrammar is not installed (./setup.sh installs it)")

from omlx_core.grammar import (  # noqa: E402
    GrammarBusy,
    GrammarCompileTimeout,
    GrammarCompilerCache,
    GrammarError,
    GrammarSpec,
    import_xgrammar,
)
from omlx_core.grammar.compile_queue import CompileJob, CompileQueue, CompileSettings  # noqa: E402
from omlx_core.grammar.compile_worker import compile_request  # noqa: E402
from omlx_core.grammar.limits import GrammarLimits, configure_limits, current_limits  # noqa: E402
from omlx_core.memory.usage import footprint_bytes, helper_bytes  # noqa: E402
from omlx_core.testing.waiting import wait_for  # noqa: E402


def words(count: int, length: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters, k=length)) for _ in range(count)]


def enum_schema(values: list[str]) -> dict:
    return {"type": "object", "properties": {"pick": {"enum": values}}, "required": ["pick"]}


# -- the caps ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make, setting", [
    # the flood: an enum of 60,000 random 40-character strings, ~2.7 MB
    (lambda: GrammarSpec.json_schema(enum_schema(words(60_000))), "grammar.max_grammar_bytes"),
    (lambda: GrammarSpec.regex("a" * 600_000), "grammar.max_grammar_bytes"),
    (lambda: GrammarSpec.ebnf('root ::= "' + "x" * 600_000 + '"'), "grammar.max_grammar_bytes"),
    (lambda: GrammarSpec.json_schema(enum_schema(words(501, 8))), "grammar.max_alternatives"),
    (lambda: GrammarSpec.json_schema({"anyOf": [{"const": w} for w in words(501, 8)]}),
     "grammar.max_alternatives"),
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {
        f"p{i}": {"oneOf": [{"const": w} for w in words(300, 8, seed=i)]} for i in range(4)}}),
     "grammar.max_total_alternatives"),
    (lambda: GrammarSpec.json_schema(json.loads('{"type":"array","items":' * 40 + "{}" + "}" * 40)),
     "grammar.max_depth"),
    (lambda: GrammarSpec.structural_tag({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": enum_schema(words(600, 8))}}),
     "grammar.max_alternatives"),
])
def test_a_grammar_over_a_cap_is_refused_naming_the_cap_and_its_setting(make, setting):
    with pytest.raises(GrammarError) as refused:
        make()
    assert setting in refused.value.message, refused.value.message


def test_grammars_within_the_caps_are_made():
    GrammarSpec.json_schema(enum_schema(words(500, 8)))
    GrammarSpec.json_schema(json.loads('{"type":"array","items":' * 30 + "{}" + "}" * 30))


def test_the_caps_come_from_the_configuration():
    from omlx_core.config import load_config

    config = load_config("cpu-small", env={}, overrides=[("grammar.max_alternatives", "600", "t")])
    before = current_limits()
    configure_limits(GrammarLimits.from_config(config))
    try:
        GrammarSpec.json_schema(enum_schema(words(550, 8)))
        assert current_limits().max_grammar_bytes == 512 * 1024
    finally:
        configure_limits(before)


# -- the queue -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from mlx_lm import load

    _, tokenizer = load(str(tiny_model_path("llama")))
    return tokenizer


@pytest.fixture(scope="module")
def jobs(tokenizer):
    """Makes compile jobs for the tiny tokenizer: a regex each, whose build may be held."""
    xgr = import_xgrammar()
    cache = GrammarCompilerCache(tokenizer, vocab_size=512)
    compiler = xgr.GrammarCompiler(cache.tokenizer_info, cache_enabled=False)
    info = cache.tokenizer_info.serialize_json()

    def make(client: str, pattern: str, hold: threading.Event | None = None,
             request: dict | None = None) -> CompileJob:
        request = request or {"kind": "regex", "source": pattern}

        def build():
            if hold is not None:
                assert hold.wait(120), "the test never released the build"
            return compile_request(compiler, request)

        return CompileJob(cache.key, lambda: info, request, "response_format", build=build,
                          client=client)

    return make


def test_clients_take_turns_so_one_clients_flood_does_not_delay_anothers(jobs):
    queue = CompileQueue(CompileSettings(workers=1, queue_size=8, per_client=4, timeout_s=60))
    done: list[str] = []
    try:
        hold = threading.Event()
        first = jobs("flooder", "a+", hold)
        queue.submit(first).add_done_callback(lambda _: done.append("flooder-1"))
        # The flooder's first compile holds the one worker; then it queues more, and
        # another client queues one after them.
        assert wait_for(first.future.running)
        futures = []
        for label, job in (("flooder-2", jobs("flooder", "b+")), ("flooder-3", jobs("flooder", "c+")),
                           ("other-1", jobs("other", "d+"))):
            future = queue.submit(job)
            future.add_done_callback(lambda _, label=label: done.append(label))
            futures.append(future)
        hold.set()
        for future in futures:
            grammar, _ = future.result(timeout=120)
            assert grammar is not None
        # The other client, who had no turn yet, went before the flooder's second.
        assert done == ["flooder-1", "other-1", "flooder-2", "flooder-3"]
    finally:
        queue.close()


def test_a_full_queue_and_a_clients_full_share_are_refused_at_once(jobs):
    queue = CompileQueue(CompileSettings(workers=1, queue_size=2, per_client=2, timeout_s=60))
    try:
        hold = threading.Event()
        running = jobs("a", "a+", hold)
        queue.submit(running)
        assert wait_for(running.future.running)
        queue.submit(jobs("a", "b+"))
        with pytest.raises(GrammarBusy) as share:
            queue.submit(jobs("a", "c+"))
        assert "grammar.compile_queue_per_client = 2" in share.value.message
        assert share.value.retry_after_s >= 1
        queue.submit(jobs("b", "d+"))
        with pytest.raises(GrammarBusy) as full:
            queue.submit(jobs("c", "e+"))
        assert "grammar.compile_queue_size = 2" in full.value.message
        assert queue.refused == 2
        hold.set()
    finally:
        queue.close()


def slow_ebnf(alternatives: int) -> dict:
    return {"kind": "ebnf",
            "source": "root ::= " + " | ".join(f'"word{i}" root?' for i in range(alternatives))}


def test_a_compile_past_its_memory_limit_is_killed_and_named(jobs):
    queue = CompileQueue(CompileSettings(workers=1, timeout_s=120, memory_limit=4 * 1024**2))
    built = threading.Event()
    try:
        job = jobs("a", "", request=slow_ebnf(12_000))
        job.build = built.set  # never reached: the worker's compile is stopped first
        with pytest.raises(GrammarCompileTimeout) as killed:
            queue.submit(job).result(timeout=300)
        assert "grammar.compile_memory_limit" in killed.value.message
        assert "4.00 MiB" in killed.value.message and queue.killed == 1
        assert not built.is_set()
        # The queue goes on with a fresh worker.
        grammar, _ = queue.submit(jobs("a", "ok+")).result(timeout=120)
        assert grammar is not None
    finally:
        queue.close()


def test_the_compile_workers_memory_is_the_servers(jobs):
    queue = CompileQueue(CompileSettings(workers=1, timeout_s=60))
    try:
        queue.submit(jobs("a", "x+")).result(timeout=120)
        (pid,) = queue.worker_pids()
        with open(f"/proc/{pid}/statm") as statm:
            worker = int(statm.read().split()[1]) * 4096
        assert worker > 20 * 1024**2  # an interpreter with xgrammar imported
        assert helper_bytes() >= worker * 0.9
        with open("/proc/self/statm") as statm:
            own = int(statm.read().split()[1]) * 4096
        assert footprint_bytes() >= own * 0.5 + worker * 0.9
    finally:
        queue.close()
    with pytest.raises(ProcessLookupError):  # ended with the queue (and reaped)
        os.kill(pid, 0)


def test_a_compile_worker_starts_without_importing_transformers():
    """The child compiles from serialized tokenizer infos only: with transformers
    imported it idled at 89 MiB and took 1.2 s to start, without it 57 MiB and 0.4 s
    (measured), at every restart after the guard stopped an idle one."""
    from omlx_core.grammar.compile_worker import CompileWorker

    worker = CompileWorker()
    try:
        worker.start()
        assert worker.idle_bytes < 72 * 1024**2, worker.idle_bytes
    finally:
        worker.stop()


def test_idle_compile_workers_are_memory_the_guard_can_take_back(jobs):
    """An idle worker counts as reclaimable (under a small ceiling it made every request
    look too large: the soak's 413s), and the guard's reclaim stops it; the next grammar
    starts it again."""
    from omlx_core.memory.usage import reclaimable_outside_engines, reclaim_outside_engines

    queue = CompileQueue(CompileSettings(workers=1, timeout_s=60))
    try:
        queue.submit(jobs("a", "x+")).result(timeout=120)
        (pid,) = queue.worker_pids()
        assert reclaimable_outside_engines() >= helper_bytes() * 0.9 > 20 * 1024**2
        assert reclaim_outside_engines() > 20 * 1024**2
        assert queue.worker_pids() == [] and reclaimable_outside_engines() == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        queue.submit(jobs("a", "y+")).result(timeout=120)
        assert len(queue.worker_pids()) == 1
    finally:
        queue.close()
    assert reclaimable_outside_engines() == 0


def test_a_prefill_short_only_of_a_compile_in_flight_waits_for_it_and_then_runs(jobs,
                                                                                 tiny_model_path):
    """The soak's 503: a grammar worker starting up (100+ MiB for a second) left a
    lone chat request short, and the gate refused it for good. Now the request waits
    while the compile is in flight, then the idle worker is reclaimed and it runs."""
    from omlx_core.config import load_config
    from omlx_core.engine import GenerationRequest, SamplingParams
    from omlx_core.memory.ceilings import ProbeReadings
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.memory.probes import CgroupMemory, LinuxMeminfo, ProcessFootprint
    from omlx_core.memory.usage import MemoryUsage
    from omlx_core.models.registry import spec_for_path
    from omlx_core.pluginmanager import PluginManager
    from omlx_core.plugins import advice as advice_plugin
    from omlx_core.plugins import batched as batched_plugin
    from omlx_core.plugins import memory_guard as memory_guard_plugin
    from omlx_core.plugins.batched import BatchedEngine
    from omlx_core.testing import engine_io
    from omlx_core.testing.host import make_test_host
    from pathlib import Path
    from tests.test_memory_forward_gate import MIB, PerTokenPlugin

    gib, margin, prompt = 1024**3, 16 * MIB, list(range(7, 17))  # one 9-token chunk: 9 MiB
    queue = CompileQueue(CompileSettings(workers=1, timeout_s=120))
    hold = threading.Event()
    settings = [("memory.tier", "custom", "test"), ("memory.transient_margin", str(margin), "test"),
                ("plugin.batched.prefix_cache_budget", "0", "test")]
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")),
                           make_test_host(load_config(tier="cpu-small", env={}, overrides=settings)))
    guard = None
    try:
        engine.start()
        queue.submit(jobs("a", "x+")).result(timeout=120)  # the worker holds the tokenizer
        busy = jobs("a", "y+", hold)
        queue.submit(busy)
        assert wait_for(busy.future.running) and wait_for(lambda: queue.busy_bytes() > 20 * MIB)
        usage = MemoryUsage()
        # The chunk fits beside what this process holds, but not beside the busy worker.
        ceiling = usage.high_water() + 9 * MIB + margin - queue.busy_bytes() // 2
        plugins = PluginManager()
        for plugin, name in ((memory_guard_plugin, "memory_guard"), (advice_plugin, "advice"),
                             (PerTokenPlugin(), "estimator"), (batched_plugin, "batched")):
            plugins.register(plugin, name)
        guard = MemoryGuard(plugins, load_config(tier="cpu-small", env={}, overrides=[
            *settings, ("memory.custom_ceiling", str(ceiling), "test")]),
            usage=usage, mlx_cache=lambda: 0)
        readings = ProbeReadings(
            system="Linux", meminfo=LinuxMeminfo(32 * gib, 20 * gib, 20 * gib, 20 * gib, 0, 0),
            cgroup=CgroupMemory(2, Path("/x"), None, None, None),
            footprint=ProcessFootprint(gib, gib, "test"))
        guard.start(lambda: [engine], read=lambda: readings)
        assert wait_for(lambda: engine.scheduler.limits is not None)
        handle = engine.submit(GenerationRequest("chat", prompt, SamplingParams(
            temperature=0.0, max_tokens=4)))
        # It waits (preempted, not failed) while the compile is in flight.
        assert wait_for(lambda: engine.scheduler.stats()["preempted"] >= 1)
        assert guard.forward_gate_for(engine).refused_total == 0
        assert queue.busy_bytes() > 20 * MIB  # still held: the wait is for the compile
        hold.set()
        busy.future.result(timeout=120)
        outputs = engine_io.collect(handle)
        assert outputs[-1].finish_reason in ("stop", "length"), outputs[-1].error
        assert sum(len(o.token_ids) for o in outputs) >= 1
        assert guard.forward_gate_for(engine).refused_total == 0
        assert queue.worker_pids() == []  # the idle worker was reclaimed for the room
    finally:
        hold.set()
        if guard is not None:
            guard.close()
        engine.shutdown()
        queue.close()
