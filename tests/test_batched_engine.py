"""The batched engine on tiny models: batching, prefill, sampling, stops, cancellation, caching."""

from __future__ import annotations

import gc
import itertools
import threading
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.config import load_config
from omlx_core.engine import GenerationOutput, GenerationRequest, SamplingParams, Usage
from omlx_core.models.registry import spec_for_path
from omlx_core.memory.gate import PrefillStep
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.testing.conformance import ScriptedGate
from omlx_core.mlx_thread import mlx_thread
from omlx_core.testing.host import make_test_host
from omlx_core.testing import engine_io

PREFILL_STEP = 16
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
_ids = itertools.count()


def make_config(**overrides):
    values = {"plugin.batched.prefill_step_size": PREFILL_STEP, "plugin.batched.block_size": BLOCK,
              "plugin.batched.max_batch_size": 8, **overrides}
    return load_config("base", overrides=[(k, str(v), "test") for k, v in values.items()], env={})


def start_engine(path, **overrides) -> BatchedEngine:
    engine = BatchedEngine(spec_for_path(path), make_test_host(make_config(**overrides)))
    engine.start()
    return engine


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    error: str | None
    error_type: str | None
    logprobs: list
    rejected: object = None


def collect(handle) -> Completion:
    tokens, logprobs, last = [], [], None
    for output in engine_io.collect(handle):
        tokens += output.token_ids
        logprobs += output.logprobs or []
        last = output
    return Completion(tokens, last.finish_reason, last.usage, last.error, last.error_type,
                      logprobs, last.rejected)


def submit(engine, prompt, sampling=GREEDY, request_id=None):
    request_id = request_id or f"req-{next(_ids)}"
    return engine.submit(GenerationRequest(request_id, list(prompt), sampling))


def submit_together(engine, jobs):
    """Submit every ``(prompt, sampling)`` before the engine takes its next step."""
    return mlx_thread().run(lambda: [submit(engine, prompt, sampling) for prompt, sampling in jobs])


def abort_between_steps(engine, request_id) -> int:
    """Abort from the MLX thread between two steps; the decode step count at that moment."""
    def abort():
        engine.abort(request_id)
        return engine.stats()["decode_steps"]
    return mlx_thread().run(abort)


def run(engine, prompt, sampling=GREEDY) -> Completion:
    return collect(submit(engine, prompt, sampling))


def prompt_of(engine, words: int, salt: int = 0) -> list[int]:
    text = " ".join(f"word{(i * 7 + salt) % 23}" for i in range(words))
    return engine.tokenize(text)


def wait_idle(engine):
    def idle():
        stats = engine.stats()
        return stats["running"] == 0 and stats["prefilling"] == 0 and stats["queue_depth"] == 0
    for _ in range(2000):
        if mlx_thread().run(idle):
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"engine never went idle: {engine.stats()}")


@pytest.fixture(scope="module")
def llama(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"))
    yield engine
    engine.shutdown()


def reference_greedy(path, prompt, n) -> list[int]:
    """Plain mlx-lm greedy decoding, one prompt, one forward for the whole prompt."""
    from mlx_lm.generate import generate_step

    from omlx_core.models.loader import load_model

    def compute():
        model, _ = load_model(path)
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]

    return mlx_thread().run(compute)


# -- output correctness ---------------------------------------------------------------


def test_a_model_loaded_again_runs_the_warm_up_forwards_once(tmp_path, monkeypatch):
    """What the warm-up pays is paid once per process (routes, kernels, BLAS threads);
    a model the pool loads again skips its forwards and still answers the same."""
    from omlx_core.scheduling import engine as scheduling_engine
    from omlx_core.testing import build_model

    calls = []
    real = scheduling_engine.warm_up
    monkeypatch.setattr(scheduling_engine, "warm_up", lambda *a: (calls.append(a), real(*a)))
    path = tmp_path / "llama"
    build_model("llama", path, seed=3)
    answers = []
    for _ in range(2):
        engine = start_engine(path)
        try:
            answers.append(collect(engine.submit(GenerationRequest(
                f"again-{next(_ids)}", prompt_of(engine, 6), GREEDY))).token_ids)
        finally:
            engine.shutdown()
    assert len(calls) == 1 and answers[0] == answers[1] and len(answers[0]) == 12


def test_greedy_output_matches_plain_mlx_lm(llama, tiny_model_path):
    prompt = prompt_of(llama, 40)
    assert len(prompt) > 3 * PREFILL_STEP  # several prefill chunks
    done = run(llama, prompt, replace(GREEDY, max_tokens=20))
    assert done.token_ids == reference_greedy(tiny_model_path("llama"), prompt, 20)
    assert done.finish_reason == "length"
    assert done.usage.prompt_tokens == len(prompt)
    assert done.usage.completion_tokens == 20


def test_one_token_prompt(llama):
    done = run(llama, prompt_of(llama, 1)[:1])
    assert done.finish_reason == "length" and len(done.token_ids) == GREEDY.max_tokens


def test_invalid_requests_are_refused_at_submit(llama):
    with pytest.raises(ValueError, match="empty"):
        submit(llama, [])
    with pytest.raises(ValueError, match="top_p"):
        submit(llama, [1, 2], SamplingParams(top_p=1.5))


def test_limits_report_the_models_context_vocabulary_and_batch(llama):
    # The pipeline checks requests against these (tests/test_serving.py); the engine
    # itself no longer clamps or re-checks them.
    limits = llama.limits()
    assert limits.context_length == llama.model.config["max_position_embeddings"]
    assert limits.vocab_size == llama.vocab_size and limits.max_running == 8


# -- batching -------------------------------------------------------------------------


def test_concurrent_requests_decode_in_the_same_steps(llama):
    before = llama.stats()
    handles = submit_together(llama, [(prompt_of(llama, 6, salt), replace(GREEDY, max_tokens=16))
                                      for salt in range(4)])
    results = [collect(h) for h in handles]
    after = llama.stats()
    assert all(r.usage.completion_tokens == 16 for r in results)
    generated = after["tokens_generated"] - before["tokens_generated"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert generated == 64
    # Four streams of 16 tokens one at a time would take 64 steps.
    assert steps < 40, (steps, generated)


def test_a_step_hands_out_every_token_before_it_stores_finished_rows(llama, monkeypatch):
    """Storing a finished row's blocks takes ~20 ms a row on the default model: the
    other rows' tokens of that step (and the finished row's own last one) go out first."""
    from omlx_core.scheduling import output_emitter

    scheduler = llama.scheduler
    events: list[tuple[str, int, str]] = []
    store = scheduler.writer.store_finished_blocks

    def recording_output(request_id, **fields):
        if fields.get("token_ids"):
            events.append(("token", scheduler.counters.decode_steps, request_id))
        return GenerationOutput(request_id, **fields)

    def recording_store(sequence, *args):
        events.append(("store", scheduler.counters.decode_steps, sequence.request_id))
        store(sequence, *args)

    monkeypatch.setattr(output_emitter, "GenerationOutput", recording_output)
    monkeypatch.setattr(scheduler.writer, "store_finished_blocks", recording_store)
    # The first two finish together while the last two decode on.
    handles = submit_together(llama, [(prompt_of(llama, 6, salt), replace(GREEDY, max_tokens=n))
                                      for salt, n in enumerate((6, 6, 12, 12))])
    results = [collect(h) for h in handles]
    assert [r.usage.completion_tokens for r in results] == [6, 6, 12, 12]
    assert [len(r.token_ids) for r in results] == [6, 6, 12, 12]
    stored_steps = {step for kind, step, _ in events if kind == "store"}
    ids = [h.request_id for h in handles]
    assert {rid for kind, _, rid in events if kind == "store"} >= set(ids)
    for step in stored_steps:
        kinds = [(kind, rid) for kind, s, rid in events if s == step]
        first_store = next(i for i, (kind, _) in enumerate(kinds) if kind == "store")
        assert all(kind == "store" for kind, _ in kinds[first_store:]), kinds
    # The step the first request ended in also handed out a token of a row decoding on.
    ended_in = next(s for kind, s, rid in events if kind == "store" and rid == ids[0])
    assert {rid for kind, s, rid in events if kind == "token" and s == ended_in} & set(ids[2:])


def test_batched_outputs_equal_solo_outputs(llama):
    prompts = [prompt_of(llama, 5 + 3 * salt, salt) for salt in range(4)]
    solo = [run(llama, p).token_ids for p in prompts]
    handles = [submit(llama, p) for p in prompts]
    assert [collect(h).token_ids for h in handles] == solo


def test_new_request_joins_without_waiting_for_the_batch_to_drain(llama):
    long_handle = submit(llama, prompt_of(llama, 5), replace(GREEDY, max_tokens=5000))
    engine_io.first_output(long_handle)
    short = run(llama, prompt_of(llama, 5, 3), replace(GREEDY, max_tokens=4))
    assert short.finish_reason == "length"
    still_running = engine_io.first_output(long_handle)
    assert still_running.finish_reason is None, "the long request should still be decoding"
    long_handle.close()
    wait_idle(llama)


class RecordingGate(ScriptedGate):
    def __init__(self, engine, refuse: dict[str, str] | None = None):
        super().__init__(refuse=self._record)
        self.engine = engine
        self.refuse = refuse or {}
        self.steps: list[tuple[PrefillStep, int]] = []

    def _record(self, step: PrefillStep) -> dict[str, str]:
        self.steps.append((step, self.engine.stats()["tokens_generated"]))
        return {c.request_id: self.refuse[c.request_id] for c in step.chunks if c.request_id in self.refuse}


def test_long_prefill_is_chunked_and_interleaved_with_decoding(llama):
    gate = RecordingGate(llama)
    llama.scheduler.set_forward_gate(gate)
    try:
        runner = submit(llama, prompt_of(llama, 4), replace(GREEDY, max_tokens=5000), request_id="runner")
        runner_iter = iter(runner)
        next(runner_iter)
        long_prompt = prompt_of(llama, 80, 5)
        done = run(llama, long_prompt, replace(GREEDY, max_tokens=2))
    finally:
        runner.close()
        llama.scheduler.set_forward_gate(None)
    assert done.finish_reason == "length"
    long_steps = [(s, t) for s, t in gate.steps if any(c.request_id != "runner" for c in s.chunks)]
    assert len(long_steps) >= (len(long_prompt) - 1) // PREFILL_STEP
    for step, _ in long_steps:
        assert sum(c.new_tokens for c in step.chunks) <= PREFILL_STEP
        assert step.decoding >= 1  # the runner kept decoding during the long prefill
    tokens_seen = [t for _, t in long_steps]
    assert all(b > a for a, b in zip(tokens_seen, tokens_seen[1:])), tokens_seen
    chunks = [c for s, _ in long_steps for c in s.chunks if c.request_id != "runner"]
    cached = [c.cached_tokens for c in chunks]
    # In order from the first token not reused from the prefix cache.
    assert cached == sorted(cached) and cached[0] == chunks[0].reused_tokens


def test_gate_refusal_fails_only_that_request(llama):
    llama.prefix_cache.clear()
    gate = RecordingGate(llama, refuse={"victim": "would exceed the memory ceiling"})
    llama.scheduler.set_forward_gate(gate)
    try:
        victim = submit(llama, prompt_of(llama, 40, 2), request_id="victim")
        survivor_prompt = prompt_of(llama, 12, 9)
        survivor = submit(llama, survivor_prompt)
        victim_done, survivor_done = collect(victim), collect(survivor)
    finally:
        llama.scheduler.set_forward_gate(None)
    assert victim_done.finish_reason == "error"
    assert victim_done.error == "would exceed the memory ceiling"
    assert victim_done.rejected is not None and victim_done.rejected.stage == "forward"
    assert victim_done.usage.completion_tokens == 0
    assert survivor_done.finish_reason == "length"
    assert survivor_done.token_ids == run(llama, survivor_prompt).token_ids
    wait_idle(llama)
    assert llama.stats()["prefilling"] == 0


def test_gate_that_raises_refuses_the_step(llama):
    def broken(step):
        raise RuntimeError("probe failed")

    llama.scheduler.set_forward_gate(ScriptedGate(refuse=broken))
    try:
        done = run(llama, prompt_of(llama, 20, 4))
    finally:
        llama.scheduler.set_forward_gate(None)
    assert done.finish_reason == "error" and "probe failed" in done.error
    assert done.error_type == "internal"  # a broken guard is a bug, not a memory shortage


def test_memory_limits_reach_the_gate_and_resolve_scheduler_finds_them(llama):
    from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot
    from omlx_core.pluginmanager import build_plugin_manager

    scheduler = build_plugin_manager().hook.resolve_scheduler(engine=llama)
    assert scheduler is llama.scheduler
    snapshot = LimitSnapshot(hard_bytes=123 << 20, breakdown=CeilingBreakdown(static=123 << 20), sequence=7)
    scheduler.apply_memory_limits(snapshot)
    gate = RecordingGate(llama)
    scheduler.set_forward_gate(gate)
    try:
        run(llama, prompt_of(llama, 20, 6))
    finally:
        scheduler.set_forward_gate(None)
        scheduler.apply_memory_limits(None)
    assert gate.steps and all(step.limits is snapshot for step, _ in gate.steps)
    assert gate.steps[0][0].model_id == llama.model.id


def test_preflight_estimate_leaves_out_prefill_logits(llama):
    """The engine never evaluates prompt logits: the guard's estimate must not count them."""
    from omlx_core.models.loader import activation_dtype_bytes
    from omlx_core.plugins.estimator.dims import ModelDims
    from omlx_core.plugins.estimator.prefill import estimate_prefill_peak
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.pluginmanager import build_plugin_manager

    assert llama.memory_hints().prefill_full_logits is False
    assert llama.activation_dtype_bytes == activation_dtype_bytes(llama._lm)
    guard = MemoryGuard(build_plugin_manager(), llama.config)
    prompt = prompt_of(llama, 60, 3)
    query = guard.peak_query(llama, prompt)
    assert query.full_logits is False and query.dtype_bytes == llama.activation_dtype_bytes
    breakdown = estimate_prefill_peak(
        ModelDims.from_config(query.model_config), query.new_tokens, query.cached_tokens,
        query.chunk_size, dtype_bytes=query.dtype_bytes, full_logits=False,
        cached_kv_resident=query.cached_kv_resident, backend=query.backend)
    assert guard.estimate(query).total == breakdown.total
    # In one prompt-wide chunk, counting every position's logits would overcount.
    whole = replace(query, chunk_size=len(prompt))
    assert guard.estimate(whole).total < guard.estimate(replace(whole, full_logits=True)).total


def test_restored_prefix_is_resident_before_the_first_gated_chunk(llama):
    """The restored prefix copy is evaluated at admission, so the gate's reading of current
    use already holds it rather than the first chunk's forward materializing it."""
    llama.prefix_cache.clear()
    prompt = prompt_of(llama, 40, 13)
    run(llama, prompt)
    wait_idle(llama)
    follow_up = prompt + prompt_of(llama, 12, 17)
    restored_tokens = llama.cached_tokens(follow_up)
    assert restored_tokens >= 2 * BLOCK, "the test needs a restore that concatenates blocks"
    config = llama.model.config
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    restored_bytes = (restored_tokens * config["num_hidden_layers"] * 2
                      * config.get("num_key_value_heads", heads) * head_dim
                      * llama.activation_dtype_bytes)

    class ActiveMemoryGate(ScriptedGate):
        def __init__(self):
            super().__init__(refuse=self._read)
            self.readings: list[int] = []

        def _read(self, step):
            self.readings.append(mx.get_active_memory())
            return {}

    gate = ActiveMemoryGate()
    idle = mlx_thread().run(mx.get_active_memory)
    llama.scheduler.set_forward_gate(gate)
    try:
        done = run(llama, follow_up)
    finally:
        llama.scheduler.set_forward_gate(None)
    assert done.usage.cached_tokens == restored_tokens
    assert gate.readings[0] - idle >= restored_bytes, (gate.readings[0] - idle, restored_bytes)


# -- stops, sampling, logprobs --------------------------------------------------------


def test_stop_token_ids_and_eos(llama):
    prompt = prompt_of(llama, 8, 2)
    reference = run(llama, prompt, replace(GREEDY, max_tokens=20)).token_ids
    position = 4
    stop_token = reference[position]
    first = reference.index(stop_token)
    done = run(llama, prompt, replace(GREEDY, max_tokens=20, stop_token_ids=(stop_token,)))
    assert done.finish_reason == "stop"
    assert done.token_ids == reference[:first]
    assert done.usage.completion_tokens == first + 1

    eos = next(iter(llama.tokenizer.eos_token_ids))
    done = run(llama, prompt, replace(GREEDY, logit_bias={eos: 1e4}))
    assert (done.finish_reason, done.token_ids, done.usage.completion_tokens) == ("stop", [], 1)


def test_first_token_is_sampled_at_the_end_of_prefill(llama):
    """The last prompt token is fed (one forward for requests ready together over short
    cached prefixes) and the first token handed out in the prefill step; the decode batch
    goes on from it."""
    counters = llama.scheduler.counters
    prompts = [prompt_of(llama, 2 + i % 2, 30 + i) for i in range(4)]
    assert all(len(p) - 1 <= PREFILL_STEP for p in prompts)
    solo = [run(llama, p).token_ids for p in prompts]

    before = (counters.first_token_forwards, counters.decode_steps)
    one = run(llama, prompts[0], replace(GREEDY, max_tokens=1))
    assert one.finish_reason == "length" and one.token_ids == solo[0][:1]
    # Done without a single decode step: it never joined the decode batch.
    assert (counters.first_token_forwards, counters.decode_steps) == (before[0] + 1, before[1])

    eos = next(iter(llama.tokenizer.eos_token_ids))
    before = counters.decode_steps
    done = run(llama, prompts[1], replace(GREEDY, logit_bias={eos: 1e4}))
    assert (done.finish_reason, done.token_ids) == ("stop", [])
    assert counters.decode_steps == before

    before = counters.first_token_forwards
    together = [collect(h) for h in submit_together(llama, [(p, GREEDY) for p in prompts])]
    assert [c.token_ids for c in together] == solo
    assert counters.first_token_forwards == before + 1


def test_seeded_sampling_is_reproducible_even_when_batched(llama):
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=24)
    prompt = prompt_of(llama, 10, 3)
    solo = run(llama, prompt, sampled).token_ids
    neighbours = [submit(llama, prompt_of(llama, 6 + i, i), replace(sampled, seed=i)) for i in range(3)]
    neighbours.append(submit(llama, prompt, GREEDY))
    batched = submit(llama, prompt, sampled)
    assert collect(batched).token_ids == solo
    for handle in neighbours:
        collect(handle)
    assert run(llama, prompt, replace(sampled, seed=4321)).token_ids != solo
    unseeded = {tuple(run(llama, prompt, replace(sampled, seed=None)).token_ids) for _ in range(2)}
    assert len(unseeded) == 2


def test_presence_and_frequency_penalties_stop_repetition(llama):
    prompt = prompt_of(llama, 8, 4)
    plain = run(llama, prompt, replace(GREEDY, max_tokens=30)).token_ids
    assert len(set(plain)) < len(plain), "the tiny model repeats itself without a penalty"
    for penalty in ({"presence_penalty": 100.0}, {"frequency_penalty": 100.0}):
        tokens = run(llama, prompt, replace(GREEDY, max_tokens=30, **penalty)).token_ids
        assert len(set(tokens)) == len(tokens), penalty


def test_logprobs_match_a_direct_forward(llama, tiny_model_path):
    from omlx_core.models.loader import load_model

    prompt = prompt_of(llama, 12, 5)
    done = run(llama, prompt, replace(GREEDY, max_tokens=3, logprobs=4))
    assert len(done.logprobs) == 3

    def direct():
        model, _ = load_model(tiny_model_path("llama"))
        logits = model(mx.array(prompt)[None])[0, -1]
        return np.array(logits - mx.logsumexp(logits))

    expected = mlx_thread().run(direct)
    first = done.logprobs[0]
    assert first.token_id == done.token_ids[0] == int(np.argmax(expected))
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-4)
    assert [t for t, _ in first.top] == list(np.argsort(-expected)[:4])
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)


def test_first_token_processors_see_the_prompt_as_context(llama, tiny_model_path):
    """The first token, sampled after the one-token forward, is penalized for every prompt
    token, as a direct forward plus the same processors over the prompt would be."""
    from omlx_core.models.loader import load_model
    from omlx_core.scheduling.sampling import make_logits_processors

    penalized = replace(GREEDY, max_tokens=1, repetition_penalty=20.0)

    def pick():
        model, _ = load_model(tiny_model_path("llama"))
        for salt in range(20):
            # The tiny model repeats itself: its greedy continuation is in its own prompt.
            prompt = prompt_of(llama, 4, salt)
            prompt += reference_greedy(tiny_model_path("llama"), prompt, 12)
            logits = model(mx.array(prompt)[None])[:, -1, :]
            plain = int(mx.argmax(logits, axis=-1).item())
            for processor in make_logits_processors(penalized, len(prompt)):
                logits = processor(mx.array(prompt), logits)
            expected = int(mx.argmax(logits, axis=-1).item())
            if expected != plain:
                return prompt, expected
        raise AssertionError("no prompt whose first token the penalty changes")

    prompt, expected = mlx_thread().run(pick)
    assert run(llama, prompt, penalized).token_ids == [expected]


def test_a_failed_first_token_forward_says_so(llama, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no forward today")

    # A one-token prompt has nothing to prefill: its only forward is the first-token one.
    monkeypatch.setattr(llama.scheduler.prefill, "model", broken)
    done = run(llama, prompt_of(llama, 3)[:1])
    assert (done.finish_reason, done.error_type) == ("error", "internal")
    assert done.error.startswith("first-token forward failed: RuntimeError: no forward today")
    assert done.token_ids == []


# -- cancellation ---------------------------------------------------------------------


def test_abort_ends_a_running_request_within_one_step(llama):
    handle = submit(llama, prompt_of(llama, 5, 7), replace(GREEDY, max_tokens=500))
    engine_io.first_output(handle)
    steps_at_abort = abort_between_steps(llama, handle.request_id)
    final = engine_io.collect(handle)[-1]
    assert final.finish_reason == "abort"
    assert final.usage.completion_tokens < 500
    # The abort is taken at the start of the next step, before its decode.
    assert llama.stats()["decode_steps"] - steps_at_abort <= 1
    wait_idle(llama)


def test_an_aborted_request_leaves_its_blocks_for_the_next_turn(llama):
    """The pipeline aborts a request whose text reached a stop string: its prompt and
    completion go into the prefix cache as a stopped request's do (the next chat turn,
    which re-sends them, is a prefix hit)."""
    llama.prefix_cache.clear()
    prompt = prompt_of(llama, 12, 5)
    handle = submit(llama, prompt, replace(GREEDY, max_tokens=500))
    tokens: list[int] = []
    while len(tokens) < 2 * BLOCK:
        tokens += engine_io.first_output(handle).token_ids
    abort_between_steps(llama, handle.request_id)
    rest = engine_io.collect(handle)
    tokens += [t for o in rest for t in o.token_ids]
    assert rest[-1].finish_reason == "abort"
    wait_idle(llama)

    follow_up = prompt + tokens + prompt_of(llama, 4, 9)
    # Every token handed out but the newest (sampled, not yet fed) is in the KV it left.
    assert llama.cached_tokens(follow_up) >= len(prompt) + len(tokens) - 1
    reuse = run(llama, follow_up)
    assert reuse.usage.cached_tokens >= len(prompt) + len(tokens) - 1


def test_thousand_aborted_requests_leak_nothing(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefix_cache_budget": 0, "plugin.batched.max_batch_size": 32,
                                                       "plugin.batched.prefill_step_size": 48})
    try:
        short, long = prompt_of(engine, 6), prompt_of(engine, 20, 1)
        for _ in range(3):
            run(engine, short)
            run(engine, long)
        wait_idle(engine)
        gc.collect()
        before = mlx_thread().run(mx.get_active_memory)
        sampling = replace(GREEDY, max_tokens=1000)
        for wave in range(50):
            handles = [submit(engine, long if i % 2 else short, sampling) for i in range(20)]
            for i, handle in enumerate(handles):
                if i % 3 == 0:
                    handle.close()  # waiting or prefilling
                else:
                    engine_io.first_output(handle)  # decoding
                    handle.close()
            wait_idle(engine)
        gc.collect()
        after = mlx_thread().run(mx.get_active_memory)
        assert engine.stats()["finished"]["abort"] == 1000
        assert after - before < 64 * 1024, (before, after)
    finally:
        engine.shutdown()


# -- prefix cache ---------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next", "gpt_oss"])
def test_prefix_cache_hit_gives_the_same_greedy_output(tiny_model_path, family):
    path = tiny_model_path(family)
    cached = start_engine(path)
    uncached = start_engine(path, **{"plugin.batched.prefix_cache_budget": 0})
    try:
        prompt = prompt_of(cached, 30, 8)
        assert len(prompt) > 3 * BLOCK
        expected = run(uncached, prompt)
        first = run(cached, prompt)
        assert first.usage.cached_tokens == 0
        predicted = cached.cached_tokens(prompt)
        second = run(cached, prompt)
        assert second.usage.cached_tokens == predicted > 0
        assert expected.token_ids == first.token_ids == second.token_ids
        if family == "llama":
            # The partial last block is kept as a tail: a repeated prompt recomputes nothing.
            assert second.usage.cached_tokens == len(prompt) - 1

        # The next turn of a chat re-sends the history: it reuses at least the old prompt's
        # reusable blocks, and for cuttable models the old completion's too.
        follow_up = prompt + first.token_ids + prompt_of(cached, 6, 11)
        reuse = run(cached, follow_up)
        assert reuse.usage.cached_tokens >= predicted
        if family == "llama":
            # Blocks and tail cover the old prompt and answer: only the new turn is computed.
            assert reuse.usage.cached_tokens >= len(prompt) + len(first.token_ids) - 1
        assert reuse.token_ids == run(uncached, follow_up).token_ids
        stats = cached.stats()["prefix_cache"]
        assert stats["hits"] >= 2 and stats["tokens_saved"] > 0 and stats["bytes"] > 0
    finally:
        cached.shutdown()
        uncached.shutdown()


def test_prefix_cache_respects_its_byte_budget(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefix_cache_budget": 40_000})
    try:
        for salt in range(6):
            run(engine, prompt_of(engine, 30, salt))
        stats = engine.stats()["prefix_cache"]
        assert 0 < stats["bytes"] <= 40_000
        assert stats["evictions"] > 0
    finally:
        engine.shutdown()


def test_stats_report_queue_batch_and_cache(llama):
    stats = llama.stats()
    for key in ("queue_depth", "running", "prefilling", "tokens_generated", "decode_steps", "finished"):
        assert key in stats
    for key in ("hits", "misses", "tokens_saved", "bytes", "blocks"):
        assert key in stats["prefix_cache"]


def test_tokenize_chat_uses_the_chat_template(llama):
    tokens = llama.tokenize_chat([{"role": "user", "content": "hi"}])
    text = llama.tokenizer.decode(tokens)
    assert "hi" in text and text != "hi"


def test_shutdown_releases_the_model(tiny_model_path):
    path = tiny_model_path("qwen3_moe")
    weights = (path / "model.safetensors").stat().st_size
    gc.collect()
    before = mlx_thread().run(mx.get_active_memory)
    engine = start_engine(path)
    run(engine, prompt_of(engine, 10))
    assert mlx_thread().run(mx.get_active_memory) - before > weights / 2
    engine.shutdown()
    with pytest.raises(RuntimeError, match="not started"):
        submit(engine, [1, 2, 3])
    gc.collect()
    assert mlx_thread().run(mx.get_active_memory) - before < weights / 4
