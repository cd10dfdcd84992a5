"""A request a stop string ended leaves its blocks in the prefix cache: the pipeline
ends it by aborting the engine request (the engine never sees stop strings), and the
next chat turn, which repeats the prompt and the answer, must still be a prefix hit."""

from __future__ import annotations

import pytest

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.pluginmanager import build_plugin_manager
from omlx_core.server_context import ServerContext
from omlx_core.serving import Job, ServingPipeline
from omlx_core.testing import make_test_host
from omlx_core.testing import engine_io

BLOCK = 8
PROMPT = [(7 * i) % 90 + 20 for i in range(21)]


@pytest.fixture(scope="module")
def pipeline(tiny_model_path):
    config = load_config("base", overrides=[("plugin.batched.block_size", str(BLOCK), "test"),
                                            ("plugin.batched.prefill_step_size", "16", "test")],
                         env={})
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host(config))
    engine.start()
    context = ServerContext(config, build_plugin_manager(), engines={"tiny": engine})
    yield ServingPipeline(context)
    engine.shutdown()


def generate(pipeline: ServingPipeline, **sampling: object) -> tuple[str, int, str | None]:
    job = Job("tiny", SamplingParams(temperature=0.0, **sampling), token_ids=list(PROMPT))
    generation = pipeline.start(job)
    try:
        text = "".join(delta.text for delta in generation.deltas())
    finally:
        generation.close()
    return text, generation.completion_tokens, generation.stop_sequence


def test_a_turn_a_stop_string_ended_is_a_prefix_hit_for_the_next(pipeline) -> None:
    engine = pipeline.engine("tiny")
    reference, _, _ = generate(pipeline, max_tokens=40)
    handle = engine.submit(GenerationRequest("answer", PROMPT,
                                             SamplingParams(temperature=0.0, max_tokens=40)))
    answer = [t for output in engine_io.collect(handle) for t in output.token_ids]
    engine.prefix_cache.clear()
    start = 2 * len(reference) // 3
    stop = next(reference[i:i + 3] for i in range(start, len(reference) - 3)
                if reference[i:i + 3].strip() and reference.find(reference[i:i + 3]) == i)
    text, completion, matched = generate(pipeline, max_tokens=2000, stop=(stop,))
    assert matched == stop and text == reference[:reference.index(stop)]
    # The next turn's prompt: this one, the answer up to the stop, then more.
    next_turn = PROMPT + answer[:completion] + [30, 31, 32]
    full_blocks = (len(PROMPT) + completion) // BLOCK * BLOCK
    assert full_blocks > (len(PROMPT) - 1) // BLOCK * BLOCK, "the answer fills no block"
    assert engine.cached_tokens(next_turn) >= full_blocks
