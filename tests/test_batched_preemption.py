"""Preemption in the batched engine: a request the memory guard takes out of the decode
batch pauses and resumes with the output it would have had, never an error."""

from __future__ import annotations

import threading

import pytest

from omlx_core.engine import SamplingParams
from omlx_core.memory.gate import UNLIMITED_TOKENS, DecodePlan, DecodeStep
from omlx_core.testing.conformance import ScriptedGate
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

    handles = submit_together(llama, [(older, GREEDY), (younger, GREEDY)])
    gate = PreemptingGate(handles[1].request_id, at=at)
    llama.scheduler.set_forward_gate(gate)
    try:
        first, second = collect(handles[0]), collect(handles[1])
    finally:
        llama.scheduler.set_forward_gate(None)
    assert gate.preempted == 1
    assert llama.stats()["preempted"] == before + 1
    assert first.token_ids == solo_older.token_ids
    # No token lost, none repeated; the usage still counts the original prompt.
    assert second.token_ids == solo_younger.token_ids
    assert second.text == solo_younger.text
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
        handles = submit_together(engine, [(older, longer), (younger, GREEDY)])
        gate = PreemptingGate(handles[1].request_id, at=3, refuse_resumed_prefill=2)
        engine.scheduler.set_forward_gate(gate)
        try:
            collect(handles[0])
            second = collect(handles[1])
        finally:
            engine.scheduler.set_forward_gate(None)
        assert gate.suspended == [handles[1].request_id] * 2
        assert second.error is None and second.token_ids == solo_younger.token_ids
        assert engine.stats()["preempted"] == 3
    finally:
        engine.shutdown()


def test_seeded_sampling_goes_on_after_a_preemption(llama):
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=30)
    older, younger = prompt_of(llama, 20, 7), prompt_of(llama, 14, 8)

    def preempted_run():
        handles = submit_together(llama, [(older, GREEDY), (younger, sampled)])
        gate = PreemptingGate(handles[1].request_id, at=4)
        llama.scheduler.set_forward_gate(gate)
        try:
            collect(handles[0])
            return collect(handles[1]), gate.preempted
        finally:
            llama.scheduler.set_forward_gate(None)

    (first, preempted), (again, _) = preempted_run(), preempted_run()
    assert preempted == 1 and first.error is None and first.finish_reason in ("stop", "length")
    assert first.usage.completion_tokens == len(first.token_ids) + (first.finish_reason == "stop")
    # The same seed preempted at the same step samples the same completion.
    assert again.token_ids == first.token_ids
    wait_idle(llama)


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3"])
def test_preemption_recomputes_models_whose_layers_cannot_be_cut(tiny_model_path, family):
    engine = start_engine(tiny_model_path(family))
    try:
        older, younger = prompt_of(engine, 20, 9), prompt_of(engine, 14, 10)
        solo_younger = run(engine, younger, GREEDY)
        handles = submit_together(engine, [(older, GREEDY), (younger, GREEDY)])
        gate = PreemptingGate(handles[1].request_id, at=3)
        engine.scheduler.set_forward_gate(gate)
        try:
            collect(handles[0])
            second = collect(handles[1])
        finally:
            engine.scheduler.set_forward_gate(None)
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
