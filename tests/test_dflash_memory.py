"""Seed 002 on the dflash engine: its primary (speculative) path bypasses any batched
scheduler, so it is guarded on its own — estimated with what speculation adds, refused
with 413 before any byte, gated per prefill chunk — through the same core contract as
the batched engine; the enforcer reaches the primary guard and the fallback's scheduler
on every poll; ``cached_tokens`` cannot reach the primary path's estimate."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Iterator

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.http.serve import HTTPServer
from omlx_core.memory.gate import PrefillStep
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins import estimator as estimator_plugin
from omlx_core.plugins.dflash import DFlashEngine
from omlx_core.scheduling.drafters import NgramDrafter
from omlx_core.plugins.dflash.drafters import ModelDrafter
from omlx_core.plugins.dflash.memory import BothPaths, speculative_extra_bytes
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model
from omlx_core.testing.conformance import ScriptedGate
from omlx_core.testing.host import make_test_host
from omlx_core.testing.models import build_model
from omlx_core.testing.waiting import wait_for
from omlx_core.testing import engine_io

from test_http_api import error_of, post, small_ceiling

MODEL = "tiny"
MIB = 1 << 20
PROMPT = [(i * 7) % 50 + 10 for i in range(60)]


def start_context(tmp_path: Path, model_dir: Path, **settings: str) -> ServerContext:
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["{MODEL}"]\n\n[models.{MODEL}]\npath = "{model_dir}"\n'
                      'engine = "dflash"\n')
    overrides = [(key.replace("__", "."), value, "test") for key, value in settings.items()]
    return start_engines(load_setup("cpu-small", [config], overrides), progress=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def guarded(tiny_dir, tmp_path_factory) -> Iterator[ServerContext]:
    context = start_context(tmp_path_factory.mktemp("guarded"), tiny_dir,
                            memory__tier="custom", memory__custom_ceiling=small_ceiling(),
                            engine__max_context="2000000")
    yield context
    stop_engines(context)


def make_engine(path, drafter=None, **overrides) -> DFlashEngine:
    values = {"plugin.batched.prefill_step_size": 16, **overrides}
    config = load_config("base", overrides=[(k, str(v), "test") for k, v in values.items()], env={})
    engine = DFlashEngine(spec_for_path(path), make_test_host(config), drafter=drafter)
    engine.start()
    return engine


# -- the estimate -------------------------------------------------------------------------------


def test_the_primary_estimate_cannot_take_cached_tokens():
    parameters = list(inspect.signature(speculative_extra_bytes).parameters)
    assert parameters == ["model_config", "footprint", "block_size", "total_tokens", "chunk_size"]
    assert not any("cached" in name for name in parameters)


def test_the_engine_reports_no_cached_prefix_even_when_the_fallback_holds_one(tiny_dir):
    engine = make_engine(tiny_dir)
    try:
        holder = engine.submit(GenerationRequest("hold", PROMPT[:8], SamplingParams(
            temperature=0.0, max_tokens=3000)))
        # The primary path is busy, so this runs on the fallback and fills its prefix cache.
        handle = engine.submit(GenerationRequest("warm", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=2)))
        engine_io.collect(handle)
        holder.close()
        assert engine.stats()["speculative"]["fallback_requests"] == 1
        assert engine.fallback.cached_tokens(PROMPT) > 0
        assert engine.cached_tokens(PROMPT) == 0
    finally:
        engine.shutdown()


def test_the_estimate_of_a_dflash_model_adds_draft_kv_and_the_verify_width(guarded):
    guard, engine = guarded.memory_guard, guarded.engines[MODEL]
    query = guard.peak_query(engine, PROMPT)
    assert query.cached_tokens == 0
    target_only = estimator_plugin.estimate_peak(query)
    estimate = guard.estimate(query)
    extra = estimate.total - target_only.total
    assert extra == estimate.extra_bytes == engine.extra_bytes(query) > 0
    # decode grows the draft's cache next to the target's
    draft_per_token = engine.drafter.footprint().kv_bytes_per_token
    assert estimate.kv_bytes_per_token == target_only.kv_bytes_per_token + draft_per_token
    # the verify forward's full logits: block_size rows of the vocabulary
    vocab = engine.model.config["vocab_size"]
    assert extra >= engine.drafter.block_size * vocab * 4


def test_draft_weights_kv_and_width_are_in_the_extra_bytes(tiny_dir, tmp_path):
    draft_dir = build_model("llama", tmp_path / "draft", seed=2, overrides={"num_hidden_layers": 1})
    config = dict(spec_for_path(tiny_dir).config)
    drafter = ModelDrafter(draft_dir, block_size=4)
    weights = sum(f.stat().st_size for f in draft_dir.glob("*.safetensors"))
    before = drafter.footprint()
    assert before.pending_weight_bytes == weights and before.kv_bytes_per_token > 0
    unloaded = speculative_extra_bytes(config, before, 4, 1000, 256)
    ngram = speculative_extra_bytes(config, NgramDrafter().footprint(), 4, 1000, 256)
    assert unloaded - ngram >= weights + 1000 * before.kv_bytes_per_token
    wider = speculative_extra_bytes(config, NgramDrafter().footprint(), 16, 1000, 256)
    assert wider > ngram
    engine = make_engine(tiny_dir, drafter)
    try:
        assert drafter.footprint().pending_weight_bytes == 0  # loaded: in the idle baseline
    finally:
        engine.shutdown()


# -- preflight, the forward gate, the enforcer ---------------------------------------------------


def oversized_prompt(context: ServerContext) -> list[int]:
    guard, engine = context.memory_guard, context.engines[MODEL]
    assert wait_for(lambda: guard.snapshot is not None)
    limit = guard.snapshot.hard_bytes
    tokens = 4096
    while tokens < 2_000_000:
        prompt = [(7 * i) % 200 + 10 for i in range(tokens)]
        if guard.estimate(guard.peak_query(engine, prompt)).total > limit:
            return prompt
        tokens *= 2
    pytest.fail("no prompt within 2M tokens is estimated over the ceiling")


def test_an_oversized_prompt_on_the_idle_primary_path_is_413_before_any_byte(guarded):
    engine = guarded.engines[MODEL]
    prompt = oversized_prompt(guarded)
    assert not engine.primary.busy  # the primary path would take it
    before = engine.stats()
    with HTTPServer(guarded, port=0) as server:
        for stream in (False, True):
            status, headers, body = post(server, "/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream})
            assert status == 413, body
            assert headers["content-type"].startswith("application/json")
            assert error_of(body)["code"] == "prefill_memory_exceeded"
        status, _, body = post(server, "/v1/completions",
                               {"model": MODEL, "prompt": "hello", "max_tokens": 3})
        assert status == 200, body
    after = engine.stats()
    assert after["speculative"]["requests"] == before["speculative"]["requests"] + 1
    assert after["speculative"]["fallback_requests"] == before["speculative"]["fallback_requests"]


def test_the_enforcer_reaches_the_primary_guard_and_the_fallback_scheduler(guarded):
    guard, engine = guarded.memory_guard, guarded.engines[MODEL]
    receiver = guarded.plugins.hook.resolve_scheduler(engine=engine)
    assert isinstance(receiver, BothPaths) and receiver is engine.receiver
    gate = guard.forward_gate_for(engine)
    scheduler = engine.fallback.scheduler
    assert wait_for(lambda: engine.guard.gate is gate and scheduler.forward_gate is gate)
    seen = guard.snapshot.sequence
    assert wait_for(lambda: engine.guard.limits.sequence > seen
                    and scheduler.limits.sequence > seen)


def test_no_could_not_resolve_warning_for_a_dflash_engine(tiny_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        context = start_context(tmp_path, tiny_dir, memory__tier="custom",
                                memory__custom_ceiling=small_ceiling())
        try:
            guard = context.memory_guard
            assert wait_for(lambda: guard.snapshot is not None and guard.enforcer.polls >= 2)
        finally:
            stop_engines(context)
    assert not [r for r in caplog.records if "resolve" in r.getMessage()], caplog.text


def test_the_primary_path_asks_the_gate_before_every_prefill_chunk(tiny_dir):
    engine = make_engine(tiny_dir)
    steps: list[PrefillStep] = []

    def refuse_third(step):
        steps.append(step)
        return {"victim": "test refusal"} if len(steps) == 3 else {}

    try:
        engine.receiver.set_forward_gate(ScriptedGate(refuse_third))
        handle = engine.submit(GenerationRequest("victim", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=8)))
        outputs = engine_io.collect(handle)
        assert outputs[-1].finish_reason == "error" and outputs[-1].rejected is not None
        assert not [t for o in outputs for t in o.token_ids], "tokens came after a refusal"
        chunks = [step.chunks[0] for step in steps]
        assert [(c.cached_tokens, c.new_tokens) for c in chunks] == [(0, 16), (16, 16), (32, 16)]
        assert all(c.reused_tokens == 0 for c in chunks)
        # The path is free again and the next request runs.
        steps.clear()
        handle = engine.submit(GenerationRequest("next", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=4)))
        assert engine_io.collect(handle)[-1].finish_reason == "length"
        assert engine.stats()["speculative"]["requests"] == 2
    finally:
        engine.receiver.set_forward_gate(None)
        engine.shutdown()


def test_in_fallback_mode_the_batched_engines_gate_guards_the_request(tiny_dir):
    engine = make_engine(tiny_dir)
    try:
        gate = ScriptedGate(lambda step: {c.request_id: "test refusal" for c in step.chunks
                                          if c.request_id == "batched"})
        engine.receiver.set_forward_gate(gate)
        speculative = engine.submit(GenerationRequest("speculative", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=30)))
        batched = engine.submit(GenerationRequest("batched", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=30)))
        refused = list(batched)
        assert refused[-1].finish_reason == "error" and refused[-1].rejected is not None
        assert list(speculative)[-1].finish_reason == "length"
        assert engine.stats()["speculative"]["fallback_requests"] == 1
    finally:
        engine.receiver.set_forward_gate(None)
        engine.shutdown()


def test_usage_and_metrics_report_drafted_and_accepted_tokens(guarded):
    from test_http_api import sample, scrape

    engine = guarded.engines[MODEL]
    prompt = [11, 12, 13, 14] * 12
    with HTTPServer(guarded, port=0) as server:
        status, _, body = post(server, "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert status == 200, body
        usage = body["usage"]
        speculative = usage["speculative"]
        assert speculative["drafted_tokens"] > 0
        assert speculative["acceptance_rate"] == round(
            speculative["accepted_tokens"] / speculative["drafted_tokens"], 4)
        assert usage["completion_tokens_details"]["rejected_prediction_tokens"] == \
            speculative["drafted_tokens"] - speculative["accepted_tokens"]
        metrics = scrape(server)
    stats = engine.stats()["speculative"]
    assert sample(metrics, "omlx_engine_speculative_drafted_tokens", model=MODEL) == \
        stats["drafted_tokens"] > 0
    assert sample(metrics, "omlx_engine_speculative_acceptance_rate", model=MODEL) == \
        stats["acceptance_rate"]


def test_the_post_forward_backstop_stops_a_primary_path_request(tiny_dir):
    engine = make_engine(tiny_dir)
    try:
        engine.receiver.set_forward_gate(ScriptedGate(
            after=lambda step: {"victim": "over the limit after the forward"}))
        outputs = list(engine.submit(GenerationRequest("victim", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=8))))
        assert outputs[-1].finish_reason == "error"
        assert "over the limit after the forward" in outputs[-1].error
        assert engine.stats()["speculative"]["running"] == 0
    finally:
        engine.receiver.set_forward_gate(None)
        engine.shutdown()
