"""The batched engine on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import gc
import itertools
import threading
from dataclasses import replace

import mlx.core as mx
import pytest

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.mlx_thread import mlx_thread
from omlx_core.serving.output import OutputProcessor
from omlx_core.testing.host import make_test_host
from omlx_core.testing import engine_io

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
_ids = itertools.count()


def start(path, **overrides) -> BatchedEngine:
    values = {"plugin.batched.prefill_step_size": 32, "plugin.batched.block_size": 16, **overrides}
    config = load_config("base", overrides=[(k, str(v), "test") for k, v in values.items()], env={})
    engine = BatchedEngine(spec_for_path(path), make_test_host(config))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(default_model_dir):
    engine = start(default_model_dir)
    yield engine
    engine.shutdown()


def ask(engine, question: str) -> list[int]:
    return engine.tokenize_chat([{"role": "user", "content": question}])


def submit(engine, prompt, sampling=GREEDY):
    return engine.submit(GenerationRequest(f"slow-{next(_ids)}", prompt, sampling))


def collect(engine, handle):
    """The completion's text (as the serving pipeline would detokenize it), token ids and
    final output."""
    outputs = engine_io.collect(handle)
    tokens = [t for o in outputs for t in o.token_ids]
    return engine.tokenizer.decode(tokens), tokens, outputs[-1]


def wait_idle(engine):
    for _ in range(2000):
        stats = engine.stats()
        if stats["running"] == stats["prefilling"] == stats["queue_depth"] == 0:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"engine never went idle: {engine.stats()}")


def test_answers_a_question(engine):
    text, _tokens, last = collect(engine, submit(engine, ask(engine, "What is the capital of France?"),
                                         replace(GREEDY, max_tokens=24)))
    assert "Paris" in text
    assert last.finish_reason in ("stop", "length")


def test_requests_progress_in_the_same_steps(engine):
    questions = ["Name a color.", "Count to five.", "Say hello.", "What is 2+2?"]
    prompts = [ask(engine, q) for q in questions]
    solo = [collect(engine, submit(engine, p))[1] for p in prompts]
    before = engine.stats()
    # Submitted from the MLX thread, all of them arrive before the engine's next step.
    handles = mlx_thread().run(lambda: [submit(engine, p) for p in prompts])
    batched = [collect(engine, h)[1] for h in handles]
    after = engine.stats()
    assert batched == solo
    generated = after["tokens_generated"] - before["tokens_generated"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps < generated / 2, (steps, generated)


def test_seeded_sampling_reproduces_when_batched(engine):
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=16)
    prompt = ask(engine, "Tell me a short story about a cat.")
    solo = collect(engine, submit(engine, prompt, sampled))[1]
    others = [submit(engine, ask(engine, f"Give me fact number {i}."), replace(sampled, seed=i)) for i in range(3)]
    again = submit(engine, prompt, sampled)
    assert collect(engine, again)[1] == solo
    for handle in others:
        collect(engine, handle)


def test_cancellation_frees_the_request(engine):
    wait_idle(engine)
    gc.collect()
    before = mlx_thread().run(mx.get_active_memory)
    cache_before = engine.prefix_cache.nbytes
    handle = submit(engine, ask(engine, "Write a very long essay about the sea."), replace(GREEDY, max_tokens=400))
    engine_io.first_output(handle)
    def close_between_steps():
        handle.close()
        return engine.stats()["decode_steps"]

    steps = mlx_thread().run(close_between_steps)
    wait_idle(engine)
    assert engine.stats()["decode_steps"] - steps <= 1
    gc.collect()
    after = mlx_thread().run(mx.get_active_memory)
    # Whatever the prompt added to the prefix cache is accounted; nothing else remains.
    assert after - before - (engine.prefix_cache.nbytes - cache_before) < 256 * 1024


def test_prefix_hit_gives_the_same_answer(default_model_dir, engine):
    uncached = start(default_model_dir, **{"plugin.batched.prefix_cache_budget": 0})
    try:
        history = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
                   {"role": "user", "content": "What is the capital of France?"}]
        first_prompt = engine.tokenize_chat(history)
        first_text, _, first = collect(engine, submit(engine, first_prompt, replace(GREEDY, max_tokens=24)))
        history += [{"role": "assistant", "content": first_text},
                    {"role": "user", "content": "And of Germany?"}]
        second_prompt = engine.tokenize_chat(history)
        text, tokens, last = collect(engine, submit(engine, second_prompt))
        assert last.usage.cached_tokens >= (len(first_prompt) - 1) // 16 * 16 > 0
        assert tokens == collect(uncached, submit(uncached, second_prompt))[1]
    finally:
        uncached.shutdown()


def test_multibyte_characters_are_never_split(engine):
    prompt = ask(engine, "Repeat exactly: café, naïve, 日本語, 😀 emoji.")
    outputs = list(submit(engine, prompt, replace(GREEDY, max_tokens=30)))
    token_ids = [t for o in outputs for t in o.token_ids]
    # The pipeline's output processor turns each output's tokens into text as they stream.
    processor = OutputProcessor(engine.detokenizer())
    pieces = [processor.add(o.token_ids).text for o in outputs] + [processor.finish().text]
    text = "".join(pieces)
    assert any(ord(ch) > 0x7FF for ch in text), text  # a character of three or more bytes came out
    assert all("\ufffd" not in piece for piece in pieces)
    assert text == engine.tokenizer.decode(token_ids)
