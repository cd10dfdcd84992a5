"""Preflight and admission through the guard: a request that can never fit is refused
with its estimate, the limit, the ceilings, the binding one and advice; one that fits
alone is never refused because of the current load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from omlx_core.config import load_config
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.ceilings import ProbeReadings
from omlx_core.engine import EngineLimits, GuardedEngine, MemoryHints
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.probes import CgroupMemory, LinuxMeminfo, ProcessFootprint
from omlx_core.memory.types import PeakEstimate, PeakQuery, Rejection, RequestRejected
from omlx_core.memory.usage import MemoryUsage
from omlx_core.models.registry import ModelSpec
from omlx_core.pluginmanager import PluginManager
from omlx_core.plugins import advice as advice_plugin
from omlx_core.plugins import memory_guard as memory_guard_plugin
from omlx_core.testing.host import make_test_host

GIB = 1024**3
MIB = 1024**2
PER_TOKEN = MIB


class PerTokenEstimate:
    """A stand-in estimator for guard logic: one MiB per token allocated, every query
    recorded. Cached tokens cost nothing only when their KV stays resident."""

    def __init__(self):
        self.queries: list[PeakQuery] = []

    @hookimpl
    def estimate_peak(self, query):
        self.queries.append(query)
        copied = 0 if query.cached_kv_resident else query.cached_tokens
        return PeakEstimate(transient_bytes=0, kv_bytes_per_token=PER_TOKEN,
                            kv_bytes=(query.new_tokens + copied) * PER_TOKEN)


class Engine(GuardedEngine):
    """What the guard reads from an engine: its model, its memory hints, its cache."""

    def __init__(self, **hints):
        self.model = ModelSpec("tiny", Path("/nonexistent"), "batched", "test",
                               {"model_type": "llama", "num_hidden_layers": 2})
        self.cached = 0
        self.hints = MemoryHints(**{"prefill_step_size": 64, **hints})

    def memory_hints(self):
        return self.hints

    def cached_tokens(self, prompt_tokens):
        return self.cached

    def limits(self):
        return EngineLimits(context_length=None, vocab_size=1000)

    start = shutdown = tokenize_chat = tokenize = detokenizer = submit = abort = None  # never called here


def readings(available: int = 20 * GIB) -> ProbeReadings:
    return ProbeReadings(
        system="Linux", meminfo=LinuxMeminfo(32 * GIB, available, available, available, 0, 0),
        cgroup=CgroupMemory(2, Path("/sys/fs/cgroup/x"), None, None, None),
        footprint=ProcessFootprint(GIB, GIB, "test"))


class Setup:
    def __init__(self, ceiling: int = GIB, baseline: int = 200 * MIB, **overrides: str):
        self.plugins = PluginManager()
        self.plugins.register(memory_guard_plugin, "memory_guard")
        self.plugins.register(advice_plugin, "advice")
        self.estimator = PerTokenEstimate()
        self.plugins.register(self.estimator, "estimator")
        self.resident = baseline
        config = load_config(tier="cpu-small", env={}, overrides=[
            ("memory.tier", "custom", "test"), ("memory.custom_ceiling", str(ceiling), "test"),
            # The margin has tests of its own (test_memory_margin): whole MiB here.
            ("memory.transient_margin", "0", "test"),
            *((k, v, "test") for k, v in overrides.items())])
        usage = MemoryUsage(read_active=lambda: self.resident, read_footprint=lambda: 0)
        self.guard = MemoryGuard(self.plugins, config, usage=usage, mlx_cache=lambda: 0)
        self.enforcer = self.guard.start(lambda: [], read=readings)
        self.guard.close()  # polls are driven by hand below


@pytest.fixture
def setup() -> Setup:
    return Setup()


def tokens(n: int) -> list[int]:
    return list(range(n))


def test_a_request_that_fits_passes(setup):
    setup.guard.preflight(Engine(), "ok", tokens(700))  # 200 MiB + 700 MiB <= 1 GiB


def test_a_request_that_can_never_fit_is_refused_with_everything_needed(setup):
    with pytest.raises(RequestRejected) as info:
        setup.guard.preflight(Engine(), "huge", tokens(900))  # 200 + 900 MiB > 1 GiB
    rejection = info.value.rejection
    assert rejection.estimated_bytes == 900 * MIB
    assert rejection.base_bytes == 200 * MIB
    assert rejection.limit_bytes == GIB
    assert rejection.breakdown is setup.guard.snapshot.breakdown
    assert rejection.binding == "custom"
    assert (rejection.request_id, rejection.model_id, rejection.prompt_tokens) == ("huge", "tiny", 900)
    assert rejection.stage == "preflight"
    assert info.value.advice and "memory.custom_ceiling" in info.value.advice[0]
    message = str(info.value)
    assert "900.00 MiB" in message and "1.00 GiB" in message and "custom ceiling binds" in message


def test_the_current_load_does_not_make_a_fitting_request_unfittable(setup):
    # Other requests are running and hold 700 MiB more than at idle.
    ticket = setup.guard.admission.admit("running", 700 * MIB)
    setup.resident = 900 * MIB
    snapshot = setup.enforcer.poll_once()
    assert snapshot.in_use_bytes == 900 * MIB and snapshot.baseline_bytes == 200 * MIB
    # 900 + 700 MiB is over the limit right now, but alone it fits: preflight lets it
    # through and admission makes it wait.
    setup.guard.preflight(Engine(), "fits-alone", tokens(700))
    ticket.release()


def test_no_limits_yet_means_no_refusal():
    plugins = PluginManager()
    plugins.register(memory_guard_plugin, "memory_guard")
    plugins.register(PerTokenEstimate(), "estimator")
    guard = MemoryGuard(plugins, load_config(tier="cpu-small", env={}), mlx_cache=lambda: 0)
    assert guard.snapshot is None
    guard.preflight(Engine(), "early", tokens(10**6))


def test_without_an_estimate_a_request_is_refused_for_good_and_the_gap_is_logged_once(caplog):
    """The forward gate refuses every chunk it cannot estimate: preflight says so at once,
    not retryable (a retry meets the same gap), naming the model and what to fix."""
    plugins = PluginManager()
    plugins.register(memory_guard_plugin, "memory_guard")
    guard = MemoryGuard(plugins, load_config(tier="cpu-small", env={}), mlx_cache=lambda: 0)
    guard.update(Setup().guard.snapshot)
    with caplog.at_level(logging.WARNING, logger="omlx_core.memory.guard"):
        for request_id in ("a", "b"):
            with pytest.raises(RequestRejected) as refused:
                guard.preflight(Engine(), request_id, tokens(10))
            assert refused.value.rejection.cause == "no_estimate"
            assert not refused.value.retryable and refused.value.retry_after_s is None
            assert "'tiny'" in str(refused.value) and "estimator" in str(refused.value)
    assert sum("no estimate_peak plugin" in r.getMessage() for r in caplog.records) == 3
    assert sum("refused request" in r.getMessage() for r in caplog.records) == 2


def test_preflight_and_admission_refusals_are_logged_at_warning(setup, caplog):
    with caplog.at_level(logging.WARNING, logger="omlx_core.memory.guard"):
        with pytest.raises(RequestRejected):
            setup.guard.preflight(Engine(), "too-big", tokens(900))
        setup.guard.admission.timeout_s = 0.05
        first = setup.guard.admit(Engine(), "a", tokens(500), max_tokens=0)
        with pytest.raises(RequestRejected):
            setup.guard.admit(Engine(), "waits", tokens(400), max_tokens=0)
        first.release()
    refusals = [r for r in caplog.records if r.levelno == logging.WARNING
                and r.getMessage().startswith("refused request")]
    assert [r.getMessage().split()[2] for r in refusals] == ["too-big", "waits"]
    assert "at preflight (never_fits)" in refusals[0].getMessage()
    assert "custom ceiling binds" in refusals[0].getMessage()
    assert "at admission (queue_timeout)" in refusals[1].getMessage()


def test_a_third_party_preflight_rejection_gets_the_advice_ladder(setup):
    class Strict:
        @hookimpl
        def preflight(self, request):
            if request.prompt_tokens > 10:
                raise RequestRejected(Rejection(
                    estimated_bytes=request.estimated_bytes, limit_bytes=request.limits.hard_bytes,
                    breakdown=request.limits.breakdown, prompt_tokens=request.prompt_tokens,
                    stage="preflight"))

    setup.plugins.register(Strict(), "strict")
    with pytest.raises(RequestRejected) as info:
        setup.guard.preflight(Engine(), "x", tokens(20))
    assert info.value.advice and "custom" in info.value.advice[0]


def test_the_query_uses_the_engine_chunk_size(setup):
    setup.guard.preflight(Engine(), "a", tokens(10))
    setup.guard.preflight(Engine(prefill_step_size=128), "b", tokens(10))
    assert [q.chunk_size for q in setup.estimator.queries] == [64, 128]
    assert setup.estimator.queries[0].model_config["model_type"] == "llama"


def test_full_logits_unless_the_engine_says_its_prefill_skips_them(setup):
    setup.guard.preflight(Engine(), "a", tokens(10))
    setup.guard.preflight(Engine(prefill_full_logits=False), "b", tokens(10))
    assert [q.full_logits for q in setup.estimator.queries] == [True, False]


def test_cached_kv_counts_as_allocated_unless_the_engine_keeps_it_resident(setup):
    copying = Engine()
    copying.cached = 512
    resident = Engine(cached_kv_resident=True)
    resident.cached = 512
    # 800 tokens, 512 of them cached: fits only if the cached KV is not allocated again.
    with pytest.raises(RequestRejected):
        setup.guard.preflight(copying, "copy", tokens(900))
    setup.guard.preflight(resident, "shared", tokens(900))
    # After the refusal the guard asks whether a quantized KV cache would fit (advice).
    assert [q.kv_bits for q in setup.estimator.queries] == [None, 8, 4, None]
    copy_query, shared_query = [q for q in setup.estimator.queries if q.kv_bits is None]
    assert (copy_query.new_tokens, copy_query.cached_tokens) == (388, 512)
    assert (copy_query.cached_kv_resident, shared_query.cached_kv_resident) == (False, True)


def test_cached_tokens_never_cover_the_whole_prompt(setup):
    engine = Engine()
    engine.cached = 10_000
    setup.guard.preflight(engine, "all-cached", tokens(100))
    query = setup.estimator.queries[0]
    assert (query.new_tokens, query.cached_tokens) == (1, 99)


def test_admission_reserves_the_estimate_and_queues_what_does_not_fit(setup):
    setup.guard.admission.timeout_s = 0.1
    first = setup.guard.admit(Engine(), "a", tokens(500), max_tokens=0)
    assert setup.guard.admission.reserved_bytes == 500 * MIB
    # 200 MiB baseline + 500 + 400 MiB > 1 GiB x 0.95 watermark: waits, then times out.
    with pytest.raises(RequestRejected) as waited:
        setup.guard.admit(Engine(), "b", tokens(400), max_tokens=0)
    assert (waited.value.stage, waited.value.rejection.cause) == ("admission", "queue_timeout")
    with first:
        pass
    with setup.guard.admit(Engine(), "b", tokens(400), max_tokens=100):
        assert setup.guard.admission.reserved_bytes == 500 * MIB  # prompt + completion KV
    assert setup.guard.idle()


def test_preflight_and_admission_each_ask_one_estimate(setup):
    """The structured estimate carries what each decision needs: the peak, and the KV
    per token of the completion; no stage asks twice or reaches into the gate."""
    asked = setup.estimator.queries
    setup.guard.preflight(Engine(), "a", tokens(100), max_tokens=300)
    assert [q.new_tokens for q in asked] == [100]
    setup.guard.admission.timeout_s = 0.1
    with setup.guard.admit(Engine(), "a", tokens(500), max_tokens=0):
        # The prompt and the first 256 completion tokens (memory.decode_reserve_tokens).
        with pytest.raises(RequestRejected) as waited:
            setup.guard.admit(Engine(), "b", tokens(100), max_tokens=300)
    assert [q.new_tokens for q in asked] == [100, 500, 100 + 256]
    # Of the reservation, the completion's KV is the estimate's KV per token.
    rejection = waited.value.rejection
    assert (rejection.decode_bytes, rejection.max_tokens) == (256 * PER_TOKEN, 256)


# -- with the built-in estimator and a real engine --------------------------------------------


@pytest.fixture(scope="module")
def real_guard(tiny_model_path):
    """The built-in plugins (estimator, memory_guard, advice, batched) around a started
    batched engine on a tiny llama; 100 MiB in use, a 110 MiB pinned ceiling, 1 MiB margin."""
    from omlx_core.pluginmanager import build_plugin_manager
    from omlx_core.plugins.batched import BatchedEngine
    from omlx_core.models.registry import spec_for_path

    plugins = build_plugin_manager(["estimator", "memory_guard", "advice", "batched"])
    plugins.require(["estimator", "memory_guard", "advice", "batched"])
    config = load_config(tier="cpu-small", env={}, overrides=[
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", "110MiB", "test"),
        ("memory.transient_margin", "1MiB", "test"),
        ("plugin.batched.prefill_step_size", "64", "test"), ("plugin.batched.prefix_cache_budget", "0", "test")])
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host(config))
    engine.start()
    usage = MemoryUsage(read_active=lambda: 100 * MIB, read_footprint=lambda: 0)
    guard = MemoryGuard(plugins, config, usage=usage, mlx_cache=lambda: 0)
    guard.start(lambda: [engine], read=readings)
    guard.close()
    yield guard, engine
    engine.shutdown()


def test_the_builtin_estimate_refuses_what_cannot_fit_and_passes_what_can(real_guard):
    from omlx_core.plugins.estimator.prefill import estimate_for_config

    guard, engine = real_guard
    guard.preflight(engine, "fits", tokens(300))
    with pytest.raises(RequestRejected) as info:
        guard.preflight(engine, "too-long", tokens(6000))
    rejection = info.value.rejection
    # The batched engine declares it never evaluates prompt logits, and its dtype.
    expected = estimate_for_config(dict(engine.model.config), 6000, 0, 64, full_logits=False,
                                   dtype_bytes=engine.activation_dtype_bytes).total
    # The estimate and the one transient margin every stage charges.
    assert rejection.estimated_bytes == expected + MIB and rejection.margin_bytes == MIB
    assert rejection.base_bytes + rejection.estimated_bytes > rejection.limit_bytes == 110 * MIB
    assert info.value.advice


def test_the_builtin_estimate_covers_a_real_prefill(real_guard):
    import mlx.core as mx

    from omlx_core.engine import GenerationRequest, SamplingParams

    guard, engine = real_guard
    prompt = [5 + (i * 7) % 400 for i in range(1500)]
    estimate = guard.estimate(guard.peak_query(engine, prompt)).total
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    outputs = list(engine.submit(GenerationRequest("measured", prompt, SamplingParams(
        temperature=0.0, max_tokens=1))))
    assert outputs[-1].finish_reason in ("stop", "length")
    measured = mx.get_peak_memory() - before
    assert 0 < measured <= estimate, (measured, estimate)


def test_preflight_counts_the_kv_of_the_whole_completion_and_names_a_max_tokens_that_fits():
    from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, PreflightRequest

    snapshot = LimitSnapshot(hard_bytes=GIB, breakdown=CeilingBreakdown(custom=GIB, tier="custom"),
                             baseline_bytes=0)
    kib = 1024

    def request(max_tokens: int) -> PreflightRequest:
        # A 1,000-token prompt whose prefill peaks at 100 MiB; 256 KiB of KV per token.
        return PreflightRequest("r", "tiny", 1000, 0, 256, 100 * MIB, snapshot,
                                max_tokens=max_tokens, kv_bytes_per_token=256 * kib)

    memory_guard_plugin.preflight(request=request(3000))  # 4,096 tokens of KV: exactly 1 GiB
    with pytest.raises(RequestRejected) as refused:
        memory_guard_plugin.preflight(request=request(3100))
    rejection = refused.value.rejection
    assert rejection.stage == "preflight" and rejection.cause == "never_fits"
    assert "max_tokens=3100" in rejection.detail
    assert rejection.fitting_max_tokens == 3096  # 4,096 tokens of KV less the prompt


# -- preflight reads no memory on the request thread ----------------------------------------

#: every mlx call that reads or changes its memory
MLX_MEMORY_APIS = ("get_active_memory", "get_cache_memory", "get_peak_memory", "reset_peak_memory",
                   "get_memory_limit", "set_memory_limit", "set_cache_limit", "set_wired_limit",
                   "clear_cache", "device_info")


def forbid_on_this_thread(monkeypatch, owner, names) -> None:
    """Make ``owner``'s ``names`` raise when called on the calling thread; other threads
    (the enforcer's, the MLX thread) still get the real call."""
    import threading

    request_thread = threading.current_thread()
    for name in names:
        original = getattr(owner, name)

        def guarded(*args, _original=original, _name=name, **kwargs):
            if threading.current_thread() is request_thread:
                raise AssertionError(f"{_name} was called on the request thread")
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, guarded)


def test_preflight_judges_the_published_snapshot_without_reading_memory(tmp_path, monkeypatch):
    """Preflight runs on the HTTP request thread: it reads no mlx memory counter, no
    process footprint and no engine cache there, only the enforcer's last snapshot; after
    a request finished, that snapshot's idle baseline is one read after it (the
    enforcer's thread reads it)."""
    import mlx.core as mx

    from omlx_core.bootstrap import load_setup, start_engines, stop_engines
    from omlx_core.engine import SamplingParams
    from omlx_core.serving import Job, ServingPipeline
    from omlx_core.testing import cached_model
    from omlx_core.testing.waiting import wait_for

    model_dir = cached_model("llama", 0, cache_dir=tmp_path / "models")
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n')
    # No timed poll between the steps below: what is fresh came from a poll asked for.
    context = start_engines(load_setup("cpu-small", [config], [
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", "64GiB", "test"),
        ("memory.poll_interval_s", "60", "test")]), progress=False)
    try:
        guard, engine = context.memory_guard, context.engines["tiny"]
        generation = ServingPipeline(context).start(Job(
            "tiny", SamplingParams(temperature=0, max_tokens=2), token_ids=tokens(40),
            prompt_param="prompt"))
        list(generation.deltas())
        generation.close()
        assert wait_for(lambda: guard.admission.idle())
        finished = guard.admission.finished_total
        assert finished == 1

        forbid_on_this_thread(monkeypatch, mx, [n for n in MLX_MEMORY_APIS if hasattr(mx, n)])
        forbid_on_this_thread(monkeypatch, guard.usage, ("resident", "high_water", "recent_peak"))
        forbid_on_this_thread(monkeypatch, engine, ("reclaimable_bytes",))
        with pytest.raises(AssertionError, match="get_active_memory"):
            mx.get_active_memory()  # the trap is set: reading memory here fails the test

        guard.preflight(engine, "fits", tokens(300), max_tokens=16)
        assert guard.snapshot.baseline_epoch == finished
        with pytest.raises(RequestRejected) as info:
            # 512 bytes of KV a token: 2e8 completion tokens grow past 64 GiB.
            guard.preflight(engine, "huge", tokens(300), max_tokens=200_000_000)
        assert info.value.stage == "preflight"
        assert info.value.rejection.base_bytes == guard.snapshot.baseline_bytes
    finally:
        stop_engines(context)


class BitsEstimate(PerTokenEstimate):
    """One MiB per token at full precision, a quarter at 8 bits, an eighth at 4."""

    @hookimpl
    def estimate_peak(self, query):
        self.queries.append(query)
        per_token = {None: PER_TOKEN, 8: PER_TOKEN // 4, 4: PER_TOKEN // 8}[query.kv_bits]
        return PeakEstimate(transient_bytes=0, kv_bytes_per_token=per_token,
                            kv_bytes=query.new_tokens * per_token)


@pytest.mark.parametrize("prompt,bits", [(2000, 8), (5000, 4), (9000, None)])
def test_a_refused_request_is_told_the_kv_bits_that_would_fit(prompt, bits):
    setup = Setup()
    setup.plugins.unregister(name="estimator")
    setup.plugins.register(BitsEstimate(), "estimator")
    with pytest.raises(RequestRejected) as info:
        setup.guard.preflight(Engine(), "long", tokens(prompt))
    assert info.value.rejection.fitting_kv_bits == bits
    advice = " ".join(info.value.advice)
    if bits is None:
        assert "--kv-bits" not in advice
    else:
        assert f"serve with --kv-bits {bits} (engine.kv_bits = {bits}" in advice
        assert "[models.tiny]" in advice


def test_a_model_already_at_8_bits_is_told_only_of_4(setup):
    setup.plugins.unregister(name="estimator")
    setup.plugins.register(BitsEstimate(), "estimator")
    with pytest.raises(RequestRejected) as info:
        setup.guard.preflight(Engine(kv_bits=8), "long", tokens(5000))
    assert info.value.rejection.fitting_kv_bits == 4
