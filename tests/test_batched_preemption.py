"""Preemption in the batched engine: a request the memory guard takes out of the decode
batch pauses and resumes with the output it would have had, never an error."""

from __future__ import annotations

import threading

import pytest

from omlx_core.engine import SamplingParams
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.gate import UNLIMITED_TOKENS, DecodePlan, DecodeStep
from omlx_core.memory.types import PeakEstimate
from omlx_core.testing.conformance import ScriptedGate
from omlx_core.testing.host import make_test_host
from tests.test_batched_engine import (
    collect,
    prompt_of,
    run,
    start_engine,
    submit,
    submit_together,
    wait_idle,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


class PreemptingGate(ScriptedGate):
    """Preempts ``victim`` at its ``at``-th decode budget question and lets it resume
    only once ``resume_after`` has finished (or at once without one)."""

    def __init__(self, victim: str, *, at: int = 1, resume_after: threading.Event | None = None,
                 refuse_resumed_prefill: int = 0):
        super().__init__(refuse=self._refuse_step)
        self.victim, self.at, self.resume_after = victim, at, resume_after
        self.asked = 0
        self.preempted = 0
        self.suspended: list[str] = []
        self.resume_questions = 0
        self._refusals_left = refuse_resumed_prefill

    def check_decode(self, step: DecodeStep) -> DecodePlan:
        ids = {row.request_id for row in step.rows}
        allowed = {rid: UNLIMITED_TOKENS for rid in ids}
        if self.victim in ids:
            self.asked += 1
            row = next(r for r in step.rows if r.request_id == self.victim)
            if self.asked == self.at and not self.preempted:
                self.preempted += 1
                return DecodePlan(allowed, (self.victim,))
            # ask again at every step, so that the victim's KV count is seen growing
            allowed[self.victim] = row.kv_tokens
        return DecodePlan(allowed)

    def may_resume(self, request_id: str) -> bool:
        self.resume_questions += 1
        return self.resume_after is None or self.resume_after.is_set()

    def suspend(self, request_id: str) -> None:
        self.suspended.append(request_id)

    def _refuse_step(self, step):
        if self.preempted and self._refusals_left and any(
                c.request_id == self.victim for c in step.chunks):
            self._refusals_left -= 1
            return {self.victim: "memory ran short while resuming"}
        return {}


def preempted_pair(engine, older, younger, *, older_sampling=GREEDY, younger_sampling=GREEDY,
                   **gate_options):
    """Run ``older`` and ``younger`` together under a :class:`PreemptingGate` aimed at the
    younger; their completions and the gate."""
    handles = submit_together(engine, [(older, older_sampling), (younger, younger_sampling)])
    gate = PreemptingGate(handles[1].request_id, **gate_options)
    engine.scheduler.set_forward_gate(gate)
    try:
        return collect(handles[0]), collect(handles[1]), gate
    finally:
        engine.scheduler.set_forward_gate(None)


@pytest.fixture(scope="module")
def llama(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("at", [1, 5])
def test_a_preempted_request_resumes_with_the_same_greedy_output(llama, at):
    older, younger = prompt_of(llama, 20, 1), prompt_of(llama, 14, 2)
    solo_older, solo_younger = run(llama, older, GREEDY), run(llama, younger, GREEDY)
    before = llama.stats()["preempted"]

    first, second, gate = preempted_pair(llama, older, younger, at=at)
    assert gate.preempted == 1
    assert llama.stats()["preempted"] == before + 1
    assert first.token_ids == solo_older.token_ids
    # No token lost, none repeated; the usage still counts the original prompt.
    assert second.token_ids == solo_younger.token_ids
    assert (second.finish_reason, second.usage.prompt_tokens, second.usage.completion_tokens) == (
        solo_younger.finish_reason, len(younger), solo_younger.usage.completion_tokens)
    assert second.error is None
    wait_idle(llama)


def test_a_preempted_request_waits_until_the_gate_lets_it_resume(llama):
    older, younger = prompt_of(llama, 20, 3), prompt_of(llama, 14, 4)
    solo_younger = run(llama, younger, GREEDY)
    done = threading.Event()
    handles = submit_together(llama, [(older, GREEDY), (younger, GREEDY)])
    gate = PreemptingGate(handles[1].request_id, at=2, resume_after=done)
    llama.scheduler.set_forward_gate(gate)
    try:
        first = collect(handles[0])
        tokens_while_older_ran = []
        while (output := handles[1].next_output(timeout=0)) is not None:
            tokens_while_older_ran += output.token_ids
        done.set()
        second = collect(handles[1])
    finally:
        llama.scheduler.set_forward_gate(None)
    assert first.finish_reason in ("stop", "length") and first.error is None
    assert gate.resume_questions >= 1
    assert tokens_while_older_ran + second.token_ids == solo_younger.token_ids
    wait_idle(llama)


def test_a_resumed_request_refused_by_the_prefill_gate_is_preempted_again_not_failed(
        tiny_model_path):
    # No prefix cache: the resumed request recomputes its KV in gated chunks.
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefix_cache_budget": 0})
    try:
        older, younger = prompt_of(engine, 20, 5), prompt_of(engine, 14, 6)
        solo_younger = run(engine, younger, GREEDY)
        # The older request runs long enough to still hold its memory when the younger
        # one's resumed prefill is refused: so the younger waits again.
        longer = SamplingParams(temperature=0.0, max_tokens=120)
        _, second, gate = preempted_pair(engine, older, younger, older_sampling=longer, at=3,
                                         refuse_resumed_prefill=2)
        assert gate.suspended == [gate.victim] * 2
        assert second.error is None and second.token_ids == solo_younger.token_ids
        assert engine.stats()["preempted"] == 3
    finally:
        engine.shutdown()


def test_seeded_sampling_goes_on_after_a_preemption(llama):
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=30)
    older, younger = prompt_of(llama, 20, 7), prompt_of(llama, 14, 8)

    _, first, gate = preempted_pair(llama, older, younger, younger_sampling=sampled, at=4)
    _, again, _ = preempted_pair(llama, older, younger, younger_sampling=sampled, at=4)
    assert gate.preempted == 1 and first.error is None and first.finish_reason in ("stop", "length")
    assert first.usage.completion_tokens == len(first.token_ids) + (first.finish_reason == "stop")
    # The same seed preempted at the same step samples the same completion.
    assert again.token_ids == first.token_ids
    wait_idle(llama)


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3", "gpt_oss"])
def test_preemption_recomputes_models_whose_layers_cannot_be_cut(tiny_model_path, family):
    engine = start_engine(tiny_model_path(family))
    try:
        older, younger = prompt_of(engine, 20, 9), prompt_of(engine, 14, 10)
        solo_younger = run(engine, younger, GREEDY)
        _, second, gate = preempted_pair(engine, older, younger, at=3)
        assert gate.preempted == 1
        assert second.error is None and second.token_ids == solo_younger.token_ids
    finally:
        engine.shutdown()


def test_a_prefill_refused_while_others_run_waits_for_them_instead_of_failing(llama):
    older, younger = prompt_of(llama, 20, 11), prompt_of(llama, 30, 12)
    solo_younger = run(llama, younger, GREEDY)
    refusals = []

    def refuse_once(step):
        if not refusals and any(c.request_id == "late" for c in step.chunks):
            refusals.append(step)
            return {"late": "memory is held by the running request"}
        return {}

    llama.prefix_cache.clear()
    gate = ScriptedGate(refuse=refuse_once)
    llama.scheduler.set_forward_gate(gate)
    try:
        first = submit_together(llama, [(older, SamplingParams(temperature=0.0, max_tokens=60))])[0]
        late = collect(submit(llama, younger, GREEDY, request_id="late"))
        collect(first)
    finally:
        llama.scheduler.set_forward_gate(None)
    assert refusals and late.error is None
    assert late.token_ids == solo_younger.token_ids
    wait_idle(llama)



def test_the_prefix_cache_gives_back_what_would_take_the_process_over_its_limit(tiny_model_path):
    import mlx.core as mx

    from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot
    from omlx_core.mlx_thread import mlx_thread

    engine = start_engine(tiny_model_path("llama"))
    try:
        run(engine, prompt_of(engine, 60, 13), GREEDY)
        cached = engine.prefix_cache.nbytes
        assert cached > 0

        def limit_to_half_the_cache():
            held = int(mx.get_active_memory() + mx.get_cache_memory())
            hard = held - cached // 2  # mlx's held memory less half the cache fits
            engine.scheduler.apply_memory_limits(LimitSnapshot(
                hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard, tier="custom")))

        mlx_thread().run(limit_to_half_the_cache)
        run(engine, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))
        assert 0 < engine.prefix_cache.nbytes <= cached - cached // 2 + cached // 4
    finally:
        engine.shutdown()


# -- with the real memory guard ------------------------------------------------------------


KIB, MIB, GIB = 1024, 1024**2, 1024**3


class KvPerTokenEstimate:
    """An estimate of 64 KiB per token: prefill peaks and decode growth in one unit."""

    @hookimpl
    def estimate_peak(self, query):
        return PeakEstimate(transient_bytes=0, kv_bytes_per_token=64 * KIB,
                            kv_bytes=query.new_tokens * 64 * KIB)


@pytest.fixture
def guarded(tiny_model_path):
    """A batched engine under the real memory guard, its use read as a fixed 100 MiB and a
    170 MiB ceiling: two requests' first 256 completion tokens fit together, not more."""
    from pathlib import Path

    from omlx_core.config import load_config
    from omlx_core.memory.ceilings import ProbeReadings
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.memory.probes import CgroupMemory, LinuxMeminfo, ProcessFootprint
    from omlx_core.memory.usage import MemoryUsage
    from omlx_core.models.registry import spec_for_path
    from omlx_core.pluginmanager import PluginManager
    from omlx_core.plugins import advice, memory_guard
    from omlx_core.plugins.batched import BatchedEngine
    import omlx_core.plugins.batched as batched_plugin

    plugins = PluginManager()
    for name, plugin in (("memory_guard", memory_guard), ("advice", advice),
                         ("estimator", KvPerTokenEstimate()), ("batched", batched_plugin)):
        plugins.register(plugin, name)
    config = load_config(tier="cpu-small", env={}, overrides=[
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", str(170 * MIB), "test"),
        ("memory.transient_margin", str(16 * MIB), "test"),
        ("plugin.batched.prefill_step_size", "16", "test"),
        ("plugin.batched.block_size", "8", "test")])
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host(config))
    engine.start()
    usage = MemoryUsage(read_active=lambda: 100 * MIB, read_footprint=lambda: 0)
    guard = MemoryGuard(plugins, config, usage=usage, mlx_cache=lambda: 0)
    readings = ProbeReadings(
        system="Linux", meminfo=LinuxMeminfo(32 * GIB, 20 * GIB, 20 * GIB, 20 * GIB, 0, 0),
        cgroup=CgroupMemory(2, Path("/x"), None, None, None),
        footprint=ProcessFootprint(GIB, GIB, "test"))
    guard.start(lambda: [engine], read=lambda: readings)
    from omlx_core.testing.waiting import wait_for

    assert wait_for(lambda: engine.scheduler.limits is not None
                    and engine.scheduler.forward_gate is not None)
    try:
        yield engine, guard
    finally:
        guard.close()
        engine.shutdown()


def test_the_guard_preempts_the_younger_of_two_growing_requests_and_both_complete(
        guarded, tiny_model_path):
    """Admission budget 0.95 x 170 - 100 - 16 = 45.5 MiB. Each request reserves its
    prompt and first 256 completion tokens (~266 x 64 KiB = 16.6 MiB; a padded batch of
    two costs 33 MiB): both run. When the older one grows to 512 tokens (32 MiB, 64 MiB
    for the pair) the younger is preempted; it resumes once the older has finished, and
    both answers are the ones each gets alone."""
    engine, guard = guarded
    long_answers = SamplingParams(temperature=0.0, max_tokens=600)
    older, younger = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23]
    reference = start_engine(tiny_model_path("llama"))
    try:
        solo = [run(reference, prompt, long_answers).token_ids for prompt in (older, younger)]
    finally:
        reference.shutdown()

    tickets = []
    for request_id, prompt in (("older", older), ("younger", younger)):
        guard.preflight(engine, request_id, prompt, max_tokens=600)
        tickets.append(guard.admit(engine, request_id, prompt, max_tokens=600))
    handles = [submit(engine, older, long_answers, request_id="older"),
               submit(engine, younger, long_answers, request_id="younger")]
    first = collect(handles[0])
    tickets[0].release()  # as the serving pipeline does when a request ends
    second = collect(handles[1])
    tickets[1].release()

    assert guard.preempted_total() >= 1 and engine.stats()["preempted"] >= 1
    assert guard.preemptions().get(("custom", "decode"), 0) >= 1
    assert first.error is None and second.error is None
    assert [first.token_ids, second.token_ids] == solo
    assert guard.admission.reserved_bytes == 0 and guard.admission.suspended == 0
