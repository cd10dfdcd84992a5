"""Batched prefill: chunks of requests waiting together share one forward, with the
greedy output each request gets alone."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from omlx_core.memory.gate import ForwardGate
from omlx_core.testing.conformance import refusal
from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, PeakEstimate
from omlx_core.memory.usage import MemoryUsage
from omlx_core.models.registry import spec_for_path
from omlx_core.mlx_thread import mlx_thread
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.scheduling.batch_prefill import PADDING_SLACK, group_spans, padded_slots
from omlx_core.testing.host import make_test_host
from omlx_core.testing.waiting import wait_for
from omlx_core.testing import engine_io

PREFILL_STEP = 256
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
_ids = itertools.count()


class Gate(ForwardGate):
    """A test gate: ``refuse`` and ``after`` name request ids with reasons."""

    def refuse(self, step):
        return {}

    def after(self, step):
        return {}

    def check_prefill(self, step):
        return {rid: refusal(rid, reason) for rid, reason in self.refuse(step).items()}

    def check_after_prefill(self, step):
        return {rid: refusal(rid, reason) for rid, reason in self.after(step).items()}


def start_engine(path, **overrides) -> BatchedEngine:
    values = {"plugin.batched.prefill_step_size": PREFILL_STEP, "plugin.batched.block_size": BLOCK,
              "plugin.batched.max_batch_size": 8, "plugin.batched.prefix_cache_budget": 0, **overrides}
    config = load_config("base", overrides=[(k, str(v), "test") for k, v in values.items()], env={})
    engine = BatchedEngine(spec_for_path(path), make_test_host(config))
    engine.start()
    return engine


def prompt_of(engine, words: int, salt: int = 0) -> list[int]:
    return engine.tokenize(" ".join(f"word{(i * 5 + salt) % 19}" for i in range(words)))


def submit(engine, prompt, request_id=None, sampling=GREEDY):
    return engine.submit(GenerationRequest(request_id or f"bp-{next(_ids)}", list(prompt), sampling))


def collect(handle):
    outputs = engine_io.collect(handle)
    return [t for o in outputs for t in o.token_ids], outputs[-1]


def counters(engine) -> tuple[int, int]:
    c = engine.scheduler.counters
    return c.prefill_forwards, c.prefill_chunks


def run_together(engine, prompts, ids=None):
    """Submit every prompt before the engine's next step; (outputs, forwards, chunks)."""
    ids = ids or [None] * len(prompts)
    before = counters(engine)
    handles = mlx_thread().run(lambda: [submit(engine, p, i) for p, i in zip(prompts, ids)])
    results = [collect(h) for h in handles]
    after = counters(engine)
    return results, after[0] - before[0], after[1] - before[1]


def run_alone(engine, prompts) -> list[list[int]]:
    return [collect(submit(engine, p))[0] for p in prompts]


@pytest.fixture(scope="module")
def llama(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"))
    yield engine
    engine.shutdown()


# -- grouping -------------------------------------------------------------------------


def test_grouping_bounds_padding_and_keeps_long_prefixes_alone():
    spans = [(0, 40), (0, 3), (0, 42), (0, 200), (0, 41), (500, 40), (0, 5)]
    groups = group_spans(spans, max_start=256)
    assert sorted(i for g in groups for i in g) == list(range(len(spans)))
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    together = {frozenset(g) for g in groups if len(g) > 1}
    assert frozenset({0, 2, 4}) in together  # similar lengths share a forward
    assert frozenset({1, 6}) in together  # tiny chunks too
    assert [3] in groups and [5] in groups  # far longer; a 500-token prefix to copy
    for group in groups:
        members = [spans[i] for i in group]
        assert padded_slots(members) <= sum(n for _, n in members) // 4 + PADDING_SLACK


def test_rows_over_different_cached_starts_get_their_own_keys_and_values(tiny_model_path):
    """Each row's cache after a shared forward holds what its own forward would put there:
    same length, same positions (RoPE offsets), same values to float rounding."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from omlx_core.models.loader import load_model
    from omlx_core.scheduling.batch_prefill import PrefillRow, prefill_together

    def compute():
        model, _ = load_model(tiny_model_path("llama"))
        rng = np.random.default_rng(0)
        spans = [(0, 9), (8, 5), (16, 12), (3, 1)]
        prompts = [rng.integers(1, model.args.vocab_size, start + length).tolist() for start, length in spans]

        def cache_at(prompt, start):
            cache = make_prompt_cache(model)
            if start:
                model(mx.array(prompt[:start])[None], cache=cache)
                mx.eval([layer.state for layer in cache])
            return cache

        alone, shared = [], []
        for prompt, (start, length) in zip(prompts, spans):
            cache = cache_at(prompt, start)
            model(mx.array(prompt[start:start + length])[None], cache=cache)
            mx.eval([layer.state for layer in cache])
            alone.append(cache)
            shared.append(cache_at(prompt, start))
        prefill_together(model, [PrefillRow(cache, prompt[start:start + length], start)
                                 for cache, prompt, (start, length) in zip(shared, prompts, spans)])
        worst = 0.0
        for mine, theirs, (start, length) in zip(shared, alone, spans):
            for a, b in zip(mine, theirs):
                assert a.offset == b.offset == start + length
                assert a.keys.shape == (1, *b.keys.shape[1:2], start + length, b.keys.shape[3])
                for x, y in ((a.keys, b.keys), (a.values, b.values)):
                    worst = max(worst, float(mx.abs(x - y[..., :start + length, :]).max()))
        return worst

    assert mlx_thread().run(compute) < 1e-5


# -- equivalence and fewer forwards ---------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_requests_waiting_together_share_forwards_and_match_solo_outputs(tiny_model_path, family):
    engine = start_engine(tiny_model_path(family))
    try:
        prompts = [prompt_of(engine, 5 + salt % 3, salt) for salt in range(6)]
        solo = run_alone(engine, prompts)
        results, forwards, chunks = run_together(engine, prompts)
        assert [tokens for tokens, _ in results] == solo
        assert all(last.finish_reason == "length" for _, last in results)
        assert chunks == len(prompts)
        assert forwards == 1, forwards
    finally:
        engine.shutdown()


def test_mixed_lengths_are_grouped_and_match_solo_outputs(llama):
    prompts = [prompt_of(llama, n, salt) for salt, n in enumerate((1, 1, 2, 3, 6, 7, 15))]
    prompts[0] = prompts[0][:1]  # nothing to prefill: straight to decoding
    solo = run_alone(llama, prompts)
    results, forwards, chunks = run_together(llama, prompts)
    assert [tokens for tokens, _ in results] == solo
    assert chunks == len(prompts) - 1
    assert 1 < forwards < chunks


def test_a_chunk_resuming_a_prompt_batches_with_fresh_ones(tiny_model_path):
    """A step budget that cuts a prompt leaves its next chunk over a cached start of its
    own, batched with chunks starting from nothing: rows with different offsets."""
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefill_step_size": 48})
    try:
        prompts = [prompt_of(engine, 5, salt) for salt in range(5)]
        assert sum(len(p) - 1 for p in prompts) > 2 * 48
        solo = run_alone(engine, prompts)
        starts = []
        scheduler = engine.scheduler
        plain = scheduler.planner.forward_groups

        def recording(plan):
            groups = plain(plan)
            starts.extend(tuple(start for _, start, _ in group) for group in groups if len(group) > 1)
            return groups

        scheduler.planner.forward_groups = recording
        try:
            results, forwards, chunks = run_together(engine, prompts)
        finally:
            del scheduler.planner.forward_groups
        assert [tokens for tokens, _ in results] == solo
        assert forwards < chunks
        assert any(len(set(group)) > 1 for group in starts), starts
    finally:
        engine.shutdown()


def test_gate_refusal_in_a_batched_step_fails_only_that_request(llama):
    class RefuseOne(Gate):
        def __init__(self):
            self.steps = []

        def refuse(self, step):
            self.steps.append(step)
            return {"victim": "no room"} if any(c.request_id == "victim" for c in step.chunks) else {}

    prompts = [prompt_of(llama, 6, salt) for salt in range(4)]
    solo = run_alone(llama, prompts)
    gate = RefuseOne()
    llama.scheduler.set_forward_gate(gate)
    try:
        results, forwards, _ = run_together(llama, prompts, ["victim", None, None, None])
    finally:
        llama.scheduler.set_forward_gate(None)
    (_, victim), survivors = results[0], results[1:]
    assert (victim.finish_reason, victim.error) == ("error", "no room")
    assert victim.rejected is not None and victim.rejected.stage == "forward"
    assert [tokens for tokens, _ in survivors] == solo[1:]
    # A gate that refuses work means memory is tight: the rest run one forward each, as
    # the gate projected them.
    assert forwards == len(prompts) - 1
    # The gate saw every planned chunk of the step, the victim's included, before any forward.
    assert {c.request_id for c in gate.steps[0].chunks} >= {"victim"}
    assert len(gate.steps[0].chunks) == len(prompts)


def test_a_shared_forward_the_gate_refuses_is_retried_one_chunk_per_forward(llama):
    class RefuseSharedForwards(Gate):
        """Memory for each chunk alone, not for several at once."""

        def __init__(self):
            self.steps = []

        def refuse(self, step):
            self.steps.append(step)
            return {c.request_id: "not together" for c in step.chunks if c.forward is not None}

    prompts = [prompt_of(llama, 6, salt) for salt in range(3)]
    solo = run_alone(llama, prompts)
    gate = RefuseSharedForwards()
    llama.scheduler.set_forward_gate(gate)
    try:
        results, forwards, chunks = run_together(llama, prompts)
    finally:
        llama.scheduler.set_forward_gate(None)
    assert [tokens for tokens, _ in results] == solo
    assert all(last.finish_reason == "length" for _, last in results)
    assert forwards == chunks == len(prompts)
    first, second = gate.steps[:2]
    assert {c.forward for c in first.chunks} == {0}  # asked about the shared forward first
    assert all(c.forward is None for c in second.chunks)


def test_post_forward_backstop_stops_one_request_of_a_batched_forward(llama):
    class StopAfterForward(Gate):
        def __init__(self):
            self.asked = []

        def after(self, step):
            self.asked.append(sorted(c.request_id for c in step.chunks))
            return {"big": "over the limit"}

    prompts = [prompt_of(llama, 6, salt + 10) for salt in range(3)]
    solo = run_alone(llama, prompts)
    gate = StopAfterForward()
    llama.scheduler.set_forward_gate(gate)
    try:
        results, forwards, _ = run_together(llama, prompts, [None, "big", None])
    finally:
        llama.scheduler.set_forward_gate(None)
    assert forwards == 1
    assert len(gate.asked) == 1 and len(gate.asked[0]) == 3  # once for the shared forward
    assert results[1][1].finish_reason == "error" and results[1][1].rejected is not None
    assert [results[0][0], results[2][0]] == [solo[0], solo[2]]


def test_real_gate_backstop_stops_only_the_largest_request_of_a_shared_forward(llama):
    """Use read over the limit after a shared forward stops one request, the one holding
    the most KV, not every request of the forward; the others finish as they would alone."""
    gate = PrefillForwardGate(lambda query: PeakEstimate(
        transient_bytes=0, kv_bytes_per_token=1024, kv_bytes=query.new_tokens * 1024), MemoryUsage(
        window_s=0.0, read_active=lambda: level["bytes"], read_footprint=lambda: 0), 0)
    level = {"bytes": 100 << 20}
    original = gate.check_after_prefill

    def spike(step):
        level["bytes"] = 2 << 30  # a reading over the limit right after the forward
        return original(step)

    gate.check_after_prefill = spike
    prompts = [prompt_of(llama, words, salt + 30) for salt, words in enumerate((7, 9, 6))]
    solo = run_alone(llama, prompts)
    llama.scheduler.set_forward_gate(gate)
    llama.scheduler.apply_memory_limits(LimitSnapshot(
        hard_bytes=1 << 30, breakdown=CeilingBreakdown(custom=1 << 30, tier="custom")))
    try:
        results, forwards, _ = run_together(llama, prompts, [None, "big", None])
    finally:
        llama.scheduler.set_forward_gate(None)
        llama.scheduler.apply_memory_limits(None)
    assert forwards == 1
    big = results[1][1]
    assert big.finish_reason == "error" and big.rejected is not None
    assert "was in use after the forward" in big.error
    assert [results[0][0], results[2][0]] == [solo[0], solo[2]]
    assert gate.refused_total == 1


def test_a_failing_batched_forward_falls_back_to_one_forward_each(llama, monkeypatch):
    def broken(model, rows):
        raise RuntimeError("no batched forward today")

    monkeypatch.setattr("omlx_core.scheduling.prefill_runner.prefill_together", broken)
    prompts = [prompt_of(llama, 6, salt + 20) for salt in range(3)]
    solo = run_alone(llama, prompts)
    results, forwards, chunks = run_together(llama, prompts)
    assert [tokens for tokens, _ in results] == solo
    assert forwards == chunks == 3


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "gpt_oss"])
def test_models_with_non_cuttable_layers_prefill_one_request_per_forward(tiny_model_path, family):
    engine = start_engine(tiny_model_path(family))
    try:
        prompts = [prompt_of(engine, 6, salt) for salt in range(3)]
        solo = run_alone(engine, prompts)
        results, forwards, chunks = run_together(engine, prompts)
        assert [tokens for tokens, _ in results] == solo
        assert forwards == chunks == 3
    finally:
        engine.shutdown()


# -- prefix cache ---------------------------------------------------------------------


def test_restored_prefixes_batch_and_match_an_uncached_engine(tiny_model_path, llama):
    cached = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefix_cache_budget": 1 << 26})
    try:
        shared = prompt_of(cached, 30, 3)
        collect(submit(cached, shared + prompt_of(cached, 4, 1)))
        prompts = [shared + prompt_of(cached, 4 + i % 2, 5 + i) for i in range(3)]
        prompts.append(prompt_of(cached, 12, 9))  # no cached prefix
        expected = run_alone(llama, prompts)  # the module engine caches nothing
        results, forwards, chunks = run_together(cached, prompts)
        restored = [last.usage.cached_tokens for _, last in results]
        # Every shared token is reused, to the token, not only the whole blocks.
        assert all(len(shared) <= r < len(p) for r, p in zip(restored[:3], prompts))
        assert restored[3] < BLOCK  # at most the few tokens any two prompts start with
        assert [tokens for tokens, _ in results] == expected
        assert forwards < chunks
        # Blocks were cut from each request's own positions: a later hit reproduces them.
        again = [collect(submit(cached, p)) for p in prompts]
        assert [tokens for tokens, _ in again] == expected
        assert all(last.usage.cached_tokens >= (len(p) - 1) // BLOCK * BLOCK
                   for p, (_, last) in zip(prompts, again))
    finally:
        cached.shutdown()


def test_a_request_waits_for_the_same_prompt_being_prefilled_and_restores_its_blocks(
        tiny_model_path, llama):
    """Copies of one prompt sent together are prefilled once: the later copies wait for
    the first one's blocks and restore them; a different prompt queued among them is
    not held back, and every output is what the request gets alone."""
    cached = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefix_cache_budget": 1 << 26})
    try:
        same = prompt_of(cached, 40, 7)
        other = prompt_of(cached, 12, 9)
        prompts = [same, list(same), other, list(same)]
        expected = run_alone(llama, prompts)  # the module engine caches nothing
        results, _forwards, _chunks = run_together(cached, prompts)
        restored = [last.usage.cached_tokens for _, last in results]
        whole_blocks = (len(same) - 1) // BLOCK * BLOCK
        assert restored[0] < BLOCK and restored[2] < BLOCK
        assert restored[1] >= whole_blocks and restored[3] >= whole_blocks, restored
        assert [tokens for tokens, _ in results] == expected
    finally:
        cached.shutdown()


# -- first-token forwards ---------------------------------------------------------------


def test_a_long_cached_prompt_gets_its_first_token_alone(tiny_model_path, monkeypatch):
    """Rows of a shared first-token forward are right-aligned to the longest cached prefix:
    a fully cached long prompt ready with short ones runs alone, not copied once per row."""
    from omlx_core.scheduling.batch_prefill import prefill_together

    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.prefill_step_size": 16,
                                                       "plugin.batched.prefix_cache_budget": 1 << 26})
    try:
        prompts = [prompt_of(engine, 20, 1)] + [prompt_of(engine, 2, salt)[:12] for salt in range(3)]
        assert len(prompts[0]) > 3 * 16
        solo = run_alone(engine, prompts)  # now every prompt is cached to its last token
        starts = []

        def recording(model, rows, **kwargs):
            starts.append([row.start for row in rows])
            return prefill_together(model, rows, **kwargs)

        monkeypatch.setattr("omlx_core.scheduling.prefill_runner.prefill_together", recording)
        before = engine.scheduler.counters.first_token_forwards
        results, forwards, _ = run_together(engine, prompts)
        assert forwards == 0 and all(last.usage.cached_tokens == len(p) - 1
                                     for p, (_, last) in zip(prompts, results))
        assert [tokens for tokens, _ in results] == solo
        assert engine.scheduler.counters.first_token_forwards - before == 2
        assert [len(rows) for rows in starts] == [3] and max(starts[0]) <= 16
    finally:
        engine.shutdown()


# -- the batch window ---------------------------------------------------------------------


@pytest.fixture
def windowed(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.batch_window_s": 1.0})
    yield engine
    engine.shutdown()


def test_an_open_batch_window_leaves_the_mlx_thread_free(windowed):
    scheduler = windowed.scheduler

    def window_open() -> bool:  # a request waits in the window: no work until it closes
        return scheduler.wake_at() is not None and not scheduler.has_work()

    window = scheduler.inbox.batch_window_s
    scheduler.inbox.batch_window_s = 600.0  # open for longer than any stall of a loaded machine
    try:
        handle = submit(windowed, prompt_of(windowed, 5, 1))
        assert mlx_thread().run(window_open), "a task waited for another engine's batch window"
    finally:
        scheduler.inbox.batch_window_s = window
    mlx_thread().run(lambda: None)  # the thread wakes and finds the window closed
    tokens, last = collect(handle)
    assert last.finish_reason == "length" and len(tokens) == GREEDY.max_tokens


def test_a_window_that_closes_between_the_threads_two_questions_still_wakes_it(windowed):
    """The MLX thread asks has_work() and then wake_at() before it sleeps: a window that
    closed in between must still give a wake-up time, or the request waits forever."""
    scheduler = windowed.scheduler
    closed_between = []

    def run_on_mlx_thread():
        handle = submit(windowed, prompt_of(windowed, 5, 3))
        sequence = scheduler.inbox.arrivals[0]
        sequence.arrived = time.monotonic() - 0.5  # the window is still open...
        closed_between.append(not scheduler.has_work())
        sequence.arrived -= 1.0  # ...and closes before the thread asks when to wake
        closed_between.append(scheduler.wake_at() is not None and scheduler.has_work())
        return handle

    handle = mlx_thread().run(run_on_mlx_thread)
    assert closed_between == [True, True]
    tokens, last = collect(handle)
    assert last.finish_reason == "length" and len(tokens) == GREEDY.max_tokens


def test_requests_sent_within_the_window_share_one_forward(windowed):
    prompts = [prompt_of(windowed, 5 + salt % 2, salt) for salt in range(3)]
    solo = run_alone(windowed, prompts)
    before = counters(windowed)
    handles = []
    senders = [threading.Thread(target=lambda p=p: handles.append(submit(windowed, p))) for p in prompts]
    for sender in senders:  # from ordinary threads, not the MLX thread
        sender.start()
        sender.join(60)
    results = [collect(h) for h in handles]
    after = counters(windowed)
    assert [tokens for tokens, _ in results] == solo
    assert (after[0] - before[0], after[1] - before[1]) == (1, 3)


def test_the_window_waits_for_requests_the_pipeline_is_still_preparing(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.batch_window_s": 0.001,
                                                       "plugin.batched.batch_window_max_s": 2.0})
    try:
        prompts = [prompt_of(engine, 5, 1), prompt_of(engine, 6, 2)]
        solo = run_alone(engine, prompts)
        before = counters(engine)
        with engine.expecting():  # the second request, still being tokenized
            with engine.expecting():
                first = submit(engine, prompts[0])
            # Far past batch_window_s, the first still waits for the second.
            assert not wait_for(lambda: counters(engine) != before, 0.3)
            assert engine.stats()["queue_depth"] == 1
            second = submit(engine, prompts[1])
        results = [collect(first), collect(second)]
        after = counters(engine)
        assert [tokens for tokens, _ in results] == solo
        assert (after[0] - before[0], after[1] - before[1]) == (1, 2)
    finally:
        engine.shutdown()


def test_a_request_that_never_comes_holds_the_window_only_up_to_its_maximum(tiny_model_path):
    engine = start_engine(tiny_model_path("llama"), **{"plugin.batched.batch_window_s": 0.001,
                                                       "plugin.batched.batch_window_max_s": 0.2})
    try:
        with engine.expecting():  # refused before submit (a 400, a 413): never arrives
            handle = submit(engine, prompt_of(engine, 5, 1))
            tokens, last = collect(handle)  # within the block: the window closed on its own
        assert last.finish_reason == "length" and len(tokens) == GREEDY.max_tokens
    finally:
        engine.shutdown()


# -- the real default model -----------------------------------------------------------


@pytest.mark.slow
def test_default_model_chat_prompts_prefill_together(default_model_dir):
    engine = start_engine(default_model_dir, **{"plugin.batched.block_size": 16})
    try:
        prompts = [engine.tokenize_chat([{"role": "user", "content": question}])
                   for question in ("What is the capital of France?", "Name a primary colour.",
                                    "What is two plus two?", "Say hello in Spanish.")]
        solo = run_alone(engine, prompts)
        results, forwards, chunks = run_together(engine, prompts)
        assert [tokens for tokens, _ in results] == solo
        assert (forwards, chunks) == (1, 4)
    finally:
        engine.shutdown()


# -- first tokens before more prefill -------------------------------------------------


def test_a_request_whose_prefill_ended_gets_its_first_token_before_more_prefill(llama):
    class TokensAtEachCheck(Gate):
        def __init__(self):
            self.seen: list[tuple[set[str], int]] = []

        def refuse(self, step):
            self.seen.append(({c.request_id for c in step.chunks}, llama.stats()["tokens_generated"]))
            return {}

    short, long = prompt_of(llama, 5, 1), prompt_of(llama, 130, 2)
    assert len(long) > 2 * PREFILL_STEP
    gate = TokensAtEachCheck()
    llama.scheduler.set_forward_gate(gate)
    try:
        before = llama.stats()["tokens_generated"]
        handles = mlx_thread().run(lambda: [submit(llama, short, "short"), submit(llama, long, "long")])
        results = [collect(h) for h in handles]
    finally:
        llama.scheduler.set_forward_gate(None)
    assert all(last.finish_reason == "length" for _, last in results)
    assert gate.seen[0][0] == {"short", "long"}
    # The long prompt's next chunk waits one decode step: the short one's first token
    # is out by then rather than after another chunk budget of prefill.
    assert gate.seen[1][0] == {"long"} and gate.seen[1][1] > before
