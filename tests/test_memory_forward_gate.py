"""The forward gate refuses a prefill chunk before its forward runs, ending only the
request that would overshoot; the others keep going."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.ceilings import ProbeReadings
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.probes import CgroupMemory, LinuxMeminfo, ProcessFootprint
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, PeakEstimate, PeakQuery
from omlx_core.memory.usage import MemoryUsage
from omlx_core.pluginmanager import PluginManager
from omlx_core.plugins import advice as advice_plugin
from omlx_core.plugins import memory_guard as memory_guard_plugin
from omlx_core.memory.gate import CacheRestore, PrefillChunk, PrefillStep
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.plugins.batched import resolve_scheduler as batched_resolve_scheduler
from omlx_core.models.registry import spec_for_path
from omlx_core.testing.host import make_test_host
from omlx_core.testing import engine_io

GIB = 1024**3
MIB = 1024**2
MARGIN = 16 * MIB
RESIDENT = 100 * MIB


def per_token(query: PeakQuery) -> PeakEstimate:
    """A stand-in estimate: 1 MiB of KV per new token."""
    return PeakEstimate(transient_bytes=0, kv_bytes_per_token=MIB, kv_bytes=query.new_tokens * MIB)


def limits(hard: int) -> LimitSnapshot:
    return LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard, tier="custom"),
                         baseline_bytes=RESIDENT)


def fixed_usage(resident: int = RESIDENT) -> MemoryUsage:
    return MemoryUsage(read_active=lambda: resident, read_footprint=lambda: 0)


def step(*chunks: PrefillChunk, hard: int | None) -> PrefillStep:
    return PrefillStep(model_id="tiny", chunks=chunks, decoding=1, chunk_size=64,
                       limits=limits(hard) if hard is not None else None,
                       model_config={"model_type": "llama"})


def chunk(request_id: str, new: int, cached: int = 0) -> PrefillChunk:
    return PrefillChunk(request_id, new, cached, cached + new + 1)


# -- the gate's arithmetic ---------------------------------------------------------------------


def test_only_the_chunk_that_would_overshoot_is_refused():
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    # 100 MiB in use + 16 MiB margin: 50 MiB chunks fit under 170 MiB, 60 MiB do not.
    refused = gate.check_prefill(step(chunk("small", 50), chunk("big", 60), hard=170 * MIB))
    assert set(refused) == {"big"}
    assert "the request was stopped before the forward ran" in str(refused["big"])


def test_the_margin_is_part_of_the_check():
    fits_without_margin = step(chunk("a", 60), hard=170 * MIB)
    assert PrefillForwardGate(per_token, fixed_usage(), 0).check_prefill(fits_without_margin) == {}
    assert set(PrefillForwardGate(per_token, fixed_usage(), MARGIN).check_prefill(
        fits_without_margin)) == {"a"}


def test_each_chunk_is_judged_on_one_estimate():
    """The estimate carries the chunk's peak, the KV it leaves and the KV per token, so
    the gate asks once per chunk: not again for what stays resident, nor for the KV
    bytes of a token."""
    asked: list[PeakQuery] = []

    def counting(query: PeakQuery) -> PeakEstimate:
        asked.append(query)
        return per_token(query)

    gate = PrefillForwardGate(counting, fixed_usage(), MARGIN)
    assert gate.check_prefill(step(chunk("a", 10), chunk("b", 10), hard=400 * MIB)) == {}
    assert [q.new_tokens for q in asked] == [10, 10]
    shared = (replace(chunk("a", 10, cached=40), forward=0), replace(chunk("b", 10), forward=0))
    assert gate.check_prefill(step(*shared, hard=400 * MIB)) == {}
    assert len(asked) == 4


def test_kv_left_by_earlier_chunks_of_the_step_counts():
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    # Each fits alone (100 + 40 + 16 <= 160); the second sits on the first's 40 MiB of KV.
    refused = gate.check_prefill(step(chunk("first", 40), chunk("second", 40), hard=160 * MIB))
    assert set(refused) == {"second"}


def transient_heavy(query: PeakQuery) -> PeakEstimate:
    """A stand-in estimate: 0.1 MiB of KV per new token plus 1 MiB of transient per
    token of the forward (``chunk_size``)."""
    return PeakEstimate(transient_bytes=query.chunk_size * MIB, kv_bytes_per_token=MIB // 10,
                        kv_bytes=query.new_tokens * MIB // 10)


def test_chunks_sharing_a_forward_are_judged_together():
    gate = PrefillForwardGate(transient_heavy, fixed_usage(), MARGIN)
    alone = step(chunk("a", 30), chunk("b", 30), hard=160 * MIB)
    # One after another: 100 + 33 + 16 fits, then 100 + 3 (a's KV) + 33 + 16 fits.
    assert gate.check_prefill(alone) == {}
    # In one forward their transients coexist, and each row is copied into the batch
    # buffer and back (2 x 2 rows x 30 tokens x 0.1 MiB): 100 + 66 + 12 + 16 > 160.
    shared = step(replace(chunk("a", 30), forward=0), replace(chunk("b", 30), forward=0),
                  hard=160 * MIB)
    refused = gate.check_prefill(shared)
    assert set(refused) == {"a", "b"}
    assert "78.00 MiB" in str(refused["a"])


def test_a_shared_forward_counts_the_copy_of_its_rows_cached_prefixes():
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    rows = (replace(chunk("long", 10, cached=40), forward=0), replace(chunk("short", 10), forward=0))
    # Alone each fits: 100 + 10 (+ 10 of the first's KV) + 16 <= 200.
    assert gate.check_prefill(step(*(replace(c, forward=None) for c in rows), hard=200 * MIB)) == {}
    # Together the 20 MiB of chunks fit too, but each row of the batch buffer is as wide
    # as the longest prefix plus the longest chunk, copied in and back out:
    # 2 x 2 rows x (40 + 10) tokens x 1 MiB = 200 MiB more.
    refused = gate.check_prefill(step(*rows, hard=200 * MIB))
    assert set(refused) == {"long", "short"}
    assert "220.00 MiB" in str(refused["short"])
    assert gate.check_prefill(step(*rows, hard=400 * MIB)) == {}


def test_refusals_of_a_shared_forward_are_provisional(caplog):
    """The engine asks again with one chunk per forward: only that answer counts."""
    gate = PrefillForwardGate(transient_heavy, fixed_usage(), MARGIN)
    shared = step(replace(chunk("a", 30), forward=0), replace(chunk("b", 30), forward=0),
                  hard=160 * MIB)
    with caplog.at_level(logging.DEBUG, logger="omlx_core.memory.forward_gate"):
        assert set(gate.check_prefill(shared)) == {"a", "b"}
    refusals = [r for r in caplog.records if "forward gate refuses" in r.getMessage()]
    assert refusals and all(r.levelno == logging.DEBUG for r in refusals)
    assert gate.refused_total == 0
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="omlx_core.memory.forward_gate"):
        assert set(gate.check_prefill(step(chunk("a", 60), hard=160 * MIB))) == {"a"}
    assert [r.levelno for r in caplog.records if "forward gate refuses" in r.getMessage()] == [
        logging.WARNING]
    assert gate.refused_total == 1


def test_a_refused_request_waits_while_a_request_not_refused_runs_on():
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    refused = gate.check_prefill(replace(step(chunk("small", 50), chunk("big", 60),
                                              hard=170 * MIB), running=2))
    assert set(refused) == {"big"} and refused["big"].wait
    assert gate.refused_total == 0


def test_with_nothing_else_running_every_refused_request_but_the_last_waits_for_it():
    """The last one ends and frees its memory; the others are judged again without it.
    (Before, the gate said both wait, and the engine, counting what still ran after
    putting the first back, ended the second: a 503 in the soak.)"""
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    refused = gate.check_prefill(replace(step(chunk("a", 60), chunk("b", 60), hard=170 * MIB),
                                         running=2))
    assert (refused["a"].wait, refused["b"].wait) == (True, False)
    assert gate.refused_total == 1
    alone = gate.check_prefill(step(chunk("a", 60), hard=170 * MIB))
    assert not alone["a"].wait and gate.refused_total == 2


def test_a_refused_chunk_leaves_no_kv_for_the_ones_after_it():
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    refused = gate.check_prefill(step(chunk("big", 100), chunk("next", 40), hard=160 * MIB))
    assert set(refused) == {"big"}


def test_current_use_is_the_high_water_of_recent_readings():
    readings = iter([300 * MIB, RESIDENT])
    usage = MemoryUsage(read_active=lambda: next(readings), read_footprint=lambda: 0)
    gate = PrefillForwardGate(per_token, usage, MARGIN)
    assert gate.check_prefill(step(chunk("a", 10), hard=400 * MIB)) == {}
    # Memory just dropped to 100 MiB, but 300 MiB was read a moment ago.
    assert set(gate.check_prefill(step(chunk("b", 90), hard=400 * MIB))) == {"b"}


def test_footprint_counts_when_it_is_above_active_memory():
    usage = MemoryUsage(read_active=lambda: RESIDENT, read_footprint=lambda: 300 * MIB)
    gate = PrefillForwardGate(per_token, usage, MARGIN)
    assert set(gate.check_prefill(step(chunk("a", 90), hard=400 * MIB))) == {"a"}


def test_no_limits_lets_chunks_run_and_warns_once(caplog):
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    with caplog.at_level(logging.WARNING, logger="omlx_core.memory.forward_gate"):
        assert gate.check_prefill(step(chunk("a", 10**6), hard=None)) == {}
        assert gate.check_prefill(step(chunk("b", 10**6), hard=None)) == {}
    assert sum("no memory limit yet" in r.getMessage() for r in caplog.records) == 1


# -- restoring cached KV -----------------------------------------------------------------------


def restore(nbytes: int, hard: int | None) -> CacheRestore:
    return CacheRestore("tiny", "r", nbytes, limits(hard) if hard is not None else None)


def test_a_restore_gets_the_room_under_the_limit_less_the_margin():
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN)
    # 200 MiB limit - 100 MiB in use - 16 MiB margin: 84 MiB fit, whatever is asked.
    assert gate.room_for_restore(restore(10 * MIB, 200 * MIB)) == 84 * MIB
    assert gate.room_for_restore(restore(90 * MIB, 200 * MIB)) == 84 * MIB
    assert gate.room_for_restore(restore(10 * MIB, 110 * MIB)) == 0  # none, never less
    assert gate.room_for_restore(restore(10**12, None)) == 10**12  # no limit yet: all of it


def test_a_restore_that_does_not_fit_reclaims_caches_first():
    in_use = [RESIDENT + 50 * MIB]  # 50 MiB of it cached blocks
    asked: list[int] = []

    def reclaim(nbytes: int) -> int:
        asked.append(nbytes)
        in_use[0] = RESIDENT
        usage.forget_recent()  # as the guard's reclaim does: the memory is gone
        return 50 * MIB

    usage = MemoryUsage(read_active=lambda: in_use[0], read_footprint=lambda: 0)
    gate = PrefillForwardGate(per_token, usage, MARGIN, reclaim=reclaim)
    assert gate.room_for_restore(restore(30 * MIB, 200 * MIB)) == 34 * MIB
    assert asked == []  # it fits: nothing is given back for it
    assert gate.room_for_restore(restore(60 * MIB, 200 * MIB)) == 84 * MIB
    assert asked == [26 * MIB]


def test_caches_are_reclaimed_again_when_the_reading_falls_less_than_they_freed():
    """What a cache says it freed (a queued host copy the writer still holds, heap pages)
    can exceed what the next reading shows gone: the gate asks again for what is still
    missing, and the chunk runs on the blocks given back, as preflight promised."""
    in_use = [RESIDENT + 40 * MIB]  # 40 MiB of it caches: a host copy, then blocks
    asked: list[int] = []

    def reclaim(nbytes: int) -> int:
        asked.append(nbytes)
        in_use[0] -= 2 * MIB if len(asked) == 1 else min(nbytes, in_use[0] - RESIDENT)
        usage.forget_recent()
        return nbytes

    usage = MemoryUsage(read_active=lambda: in_use[0], read_footprint=lambda: 0)
    gate = PrefillForwardGate(per_token, usage, MARGIN, reclaim=reclaim)
    # 140 MiB in use + 50 MiB chunk + 16 MiB margin = 206 MiB: 6 MiB over a 200 MiB limit.
    assert gate.check_prefill(step(chunk("a", 50), hard=200 * MIB)) == {}
    assert asked == [6 * MIB, 4 * MIB]
    assert in_use[0] == RESIDENT + 34 * MIB


def test_a_reclaim_that_frees_nothing_ends_the_asking():
    asked: list[int] = []

    def reclaim(nbytes: int) -> int:
        asked.append(nbytes)
        return 0

    gate = PrefillForwardGate(per_token, fixed_usage(RESIDENT + 40 * MIB), MARGIN, reclaim=reclaim)
    assert set(gate.check_prefill(step(chunk("a", 50), hard=200 * MIB))) == {"a"}
    assert asked == [6 * MIB]


def test_no_estimate_refuses_rather_than_guessing():
    gate = PrefillForwardGate(lambda query: None, fixed_usage(), MARGIN)
    refused = gate.check_prefill(step(chunk("a", 1), hard=GIB))
    assert "cannot let it run" in str(refused["a"])


def test_refusal_reason_carries_figures_and_advice():
    plugins = PluginManager()
    plugins.register(advice_plugin, "advice")
    advise = lambda r: plugins.hook.on_rejection(rejection=r)  # noqa: E731
    gate = PrefillForwardGate(per_token, fixed_usage(), MARGIN, advise)
    reason = str(gate.check_prefill(step(chunk("a", 64, cached=128), hard=170 * MIB))["a"])
    assert "tokens 128-192 of 193" in reason
    assert "64.00 MiB" in reason and "100.00 MiB in use" in reason and "170.00 MiB limit" in reason
    assert "custom ceiling binds" in reason and "memory.custom_ceiling" in reason


# -- wired into the batched engine ---------------------------------------------------------------


class PerTokenPlugin:
    @hookimpl
    def estimate_peak(self, query):
        return per_token(query)


@pytest.fixture
def served(tiny_model_path):
    """A started batched engine on a tiny model with the guard's gate installed."""
    plugins = PluginManager()
    plugins.register(memory_guard_plugin, "memory_guard")
    plugins.register(advice_plugin, "advice")
    plugins.register(PerTokenPlugin(), "estimator")
    import omlx_core.plugins.batched as batched_plugin

    plugins.register(batched_plugin, "batched")
    # Ceiling 100 MiB resident + 16 MiB margin + 24 MiB: a 20-token chunk fits, 32 do not.
    config = load_config(tier="cpu-small", env={}, overrides=[
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", str(140 * MIB), "test"),
        ("memory.transient_margin", str(MARGIN), "test"),
        ("plugin.batched.prefill_step_size", "32", "test"), ("plugin.batched.prefix_cache_budget", "0", "test")])
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host(config))
    engine.start()
    guard = MemoryGuard(plugins, config, usage=fixed_usage(), mlx_cache=lambda: 0)
    readings = ProbeReadings(
        system="Linux", meminfo=LinuxMeminfo(32 * GIB, 20 * GIB, 20 * GIB, 20 * GIB, 0, 0),
        cgroup=CgroupMemory(2, Path("/x"), None, None, None),
        footprint=ProcessFootprint(GIB, GIB, "test"))
    guard.start(lambda: [engine], read=lambda: readings)
    try:
        yield engine, guard
    finally:
        guard.close()
        engine.shutdown()


def run(engine: BatchedEngine, request_id: str, prompt: list[int]):
    return engine.submit(GenerationRequest(request_id, prompt, SamplingParams(
        temperature=0.0, max_tokens=4)))


def test_batched_engine_ends_only_the_request_whose_chunk_would_overshoot(served):
    engine, guard = served
    assert engine.scheduler.forward_gate is guard.forward_gate_for(engine)
    assert engine.scheduler.limits is guard.snapshot
    long_handle = run(engine, "long", [5 + i % 50 for i in range(100)])  # 32-token chunks
    short_handle = run(engine, "short", [7, 8, 9, 10, 11, 12, 13, 14, 15, 16])  # one 9-token chunk
    long_outputs = engine_io.collect(long_handle)
    short_outputs = engine_io.collect(short_handle)
    long_last, short_last = long_outputs[-1], short_outputs[-1]
    assert long_last.finish_reason == "error"
    assert "stopped before the forward ran" in (long_last.error or "")
    assert not any(o.token_ids for o in long_outputs), "no token came out of a refused prefill"
    assert short_last.finish_reason in ("stop", "length") and short_last.error is None
    assert sum(len(o.token_ids) for o in short_outputs) >= 1
    stats = engine.scheduler.stats()
    assert (stats["prefilling"], stats["running"], stats["queue_depth"]) == (0, 0, 0)
    # The refused request never ran a forward: only the short prompt's 9 tokens did.
    assert stats["prompt_tokens_prefilled"] == 9
    assert guard.forward_gate_for(engine).refused_total == 1


def test_the_batched_plugin_resolves_its_engine_to_its_scheduler(served):
    engine, _guard = served
    assert batched_resolve_scheduler(engine) is engine.scheduler
    # The built-in fallback, asked last, would name the engine's host memory.
    assert memory_guard_plugin.resolve_scheduler(engine) is engine.host.memory


# -- the post-forward backstop -------------------------------------------------------------------


def test_backstop_stops_the_request_when_use_after_the_forward_is_over_the_limit():
    level = {"bytes": RESIDENT}
    usage = MemoryUsage(window_s=0.0, read_active=lambda: level["bytes"], read_footprint=lambda: 0)
    gate = PrefillForwardGate(per_token, usage, MARGIN)
    assert gate.check_after_prefill(step(chunk("a", 10), hard=170 * MIB)) == {}
    level["bytes"] = 171 * MIB  # a fake high reading right after the forward
    reason = str(gate.check_after_prefill(step(chunk("a", 10, cached=20), hard=170 * MIB))["a"])
    assert "tokens 20-30 of 31" in reason and "171.00 MiB was in use" in reason
    assert "170.00 MiB limit" in reason and "its cache freed" in reason
    assert gate.refused_total == 1
    assert gate.check_after_prefill(step(chunk("a", 10), hard=None)) == {}


def test_backstop_after_a_shared_forward_stops_only_the_request_holding_the_most_kv():
    usage = MemoryUsage(window_s=0.0, read_active=lambda: 171 * MIB, read_footprint=lambda: 0)
    gate = PrefillForwardGate(per_token, usage, MARGIN)
    refused = gate.check_after_prefill(step(
        replace(chunk("a", 10, cached=20), forward=0), replace(chunk("b", 20, cached=16), forward=0),
        replace(chunk("c", 30), forward=0), hard=170 * MIB))
    assert set(refused) == {"b"}  # 36 tokens of KV, against 30 each
    assert gate.refused_total == 1


def test_batched_engine_backstop_ends_only_the_request_whose_forward_overshot(served):
    engine, guard = served
    gate = guard.forward_gate_for(engine)
    level = {"bytes": RESIDENT}
    gate._usage = MemoryUsage(window_s=0.0, read_active=lambda: level["bytes"],
                              read_footprint=lambda: 0)
    runner = engine.submit(GenerationRequest("runner", [7, 8, 9, 10], SamplingParams(
        temperature=0.0, max_tokens=300)))
    runner_outputs = iter(runner)
    first = next(runner_outputs)
    assert first.finish_reason is None
    original = gate.check_after_prefill
    decoding_at_spike = []

    def spike_after_victim(step):
        if step.chunks[0].request_id == "victim":
            decoding_at_spike.append(step.decoding)
            level["bytes"] = 200 * MIB  # a fake high reading after the victim's forward
        try:
            return original(step)
        finally:
            level["bytes"] = RESIDENT

    gate.check_after_prefill = spike_after_victim
    before = engine.scheduler.stats()["prompt_tokens_prefilled"]
    victim_outputs = list(run(engine, "victim", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]))
    runner_rest = list(runner_outputs)
    last = victim_outputs[-1]
    assert last.finish_reason == "error" and last.rejected is not None
    assert "was in use after the forward" in (last.error or "")
    assert not any(o.token_ids for o in victim_outputs)
    # Its forward ran (the backstop comes after it) and its cache is gone.
    assert engine.scheduler.stats()["prompt_tokens_prefilled"] - before == 9
    assert decoding_at_spike == [1], "the runner was decoding when the victim was stopped"
    assert runner_rest[-1].finish_reason in ("stop", "length") and runner_rest[-1].error is None
    stats = engine.scheduler.stats()
    assert (stats["prefilling"], stats["running"], stats["queue_depth"]) == (0, 0, 0)


# -- decode growth and preemption ---------------------------------------------------------


def ledger_with(hard: int, *tickets: tuple[str, int, int, int]):
    """An admission ledger under ``hard`` (100 MiB baseline, no margin) holding
    ``(request id, MiB reserved, KV tokens covered, KV tokens cap)`` tickets."""
    from omlx_core.memory.admission import AdmissionQueue

    ledger = AdmissionQueue(queue_size=8, timeout_s=0.2, admit_watermark=1.0)
    ledger.update(limits(hard))
    granted = {rid: ledger.admit(rid, mib * MIB, kv_tokens=tokens, kv_tokens_cap=cap)
               for rid, mib, tokens, cap in tickets}
    return ledger, granted


def decode_step(*rows: tuple[str, int, float], hard: int):
    from omlx_core.memory.gate import DecodeRow, DecodeStep

    return DecodeStep("tiny", tuple(DecodeRow(*row) for row in rows), limits=limits(hard),
                      model_config={"model_type": "llama"})


def test_decode_growth_that_fits_grows_in_kv_blocks_up_to_max_tokens():
    hard = 100 * MIB + 2 * GIB
    ledger, tickets = ledger_with(hard, ("a", 300, 300, 600), ("b", 300, 300, 2000))
    gate = PrefillForwardGate(per_token, fixed_usage(), 0, ledger=ledger)
    plan = gate.check_decode(decode_step(("a", 301, 1.0), ("b", 257, 2.0), hard=hard))
    assert plan.preempt == ()
    # "a" grows to the next 256-token block but no further than prompt + max_tokens;
    # "b" is still inside what admission reserved.
    assert plan.allowed_tokens == {"a": 512, "b": 300}
    assert (tickets["a"].kv_tokens, tickets["a"].reserve_bytes) == (512, 512 * MIB)
    plan = gate.check_decode(decode_step(("a", 513, 1.0), ("b", 258, 2.0), hard=hard))
    assert plan.allowed_tokens["a"] == 600 and tickets["a"].reserve_bytes == 600 * MIB


def test_growth_that_does_not_fit_preempts_the_youngest_which_resumes_when_room_frees():
    hard = 100 * MIB + 700 * MIB
    ledger, tickets = ledger_with(hard, ("old", 300, 300, 2000), ("mid", 100, 100, 2000),
                                  ("young", 200, 200, 2000))
    gate = PrefillForwardGate(per_token, fixed_usage(), 0, ledger=ledger)
    plan = gate.check_decode(decode_step(("old", 301, 1.0), ("young", 150, 3.0),
                                         ("mid", 90, 2.0), hard=hard))
    # 512 + 100 + 200 MiB > 700 MiB: the youngest goes; the oldest grows.
    assert plan.preempt == ("young",)
    assert plan.allowed_tokens["old"] == 512 and tickets["young"].suspended
    assert gate.preempted_total == 1 and ledger.preempted == 1
    assert not gate.may_resume("young")
    # A new request waits behind the suspended one, whose need still counts for it.
    from omlx_core.memory.types import RequestRejected

    with pytest.raises(RequestRejected) as refused:
        ledger.admit("new", 10 * MIB)
    assert refused.value.rejection.cause == "queue_timeout"
    tickets["old"].release()
    assert gate.may_resume("young") and not tickets["young"].suspended


def test_the_oldest_request_is_never_preempted_and_real_memory_counts_too():
    hard = 100 * MIB + 700 * MIB
    ledger, tickets = ledger_with(hard, ("old", 300, 300, 2000), ("young", 100, 100, 2000))
    # The ledger has room, memory in use does not: 700 MiB in use + 212 MiB growth.
    gate = PrefillForwardGate(per_token, fixed_usage(700 * MIB), 0, ledger=ledger)
    plan = gate.check_decode(decode_step(("old", 301, 1.0), ("young", 99, 2.0), hard=hard))
    assert plan.preempt == ("young",) and plan.allowed_tokens["old"] == 512
    plan = gate.check_decode(decode_step(("old", 513, 1.0), hard=hard))
    assert plan.preempt == () and plan.allowed_tokens["old"] == 768


def test_without_a_ledger_or_a_limit_decode_is_not_budgeted():
    from omlx_core.memory.gate import UNLIMITED_TOKENS

    gate = PrefillForwardGate(per_token, fixed_usage(), 0)
    plan = gate.check_decode(decode_step(("a", 10_000, 1.0), hard=200 * MIB))
    assert plan.allowed_tokens == {"a": UNLIMITED_TOKENS} and plan.preempt == ()

