"""The engine host: core builds it in one place for every engine, at start-up as while
serving (a model pool), and it is an engine's whole view of the server: cache tiers from
``register_caches``, sinks that reach ``on_boundary_snapshot`` and ``on_request_finished``
with the model's id, the enforcer's limits and gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.hookspecs import hookimpl
from omlx_core.kvblocks import BlockStore, StoredBlock
from omlx_core.memory.gate import ForwardGate
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.serving import Job, ServingPipeline
from omlx_core.testing import SPECIAL_TOKENS, cached_model, engine_io, special_token_id

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


class DictTier(BlockStore):
    """A lower cache tier that keeps blocks in a dict."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.blocks: dict[bytes, object] = {}

    def get(self, block_hash):
        return self.blocks.get(block_hash)

    def describe(self, block_hash):
        block = self.blocks.get(block_hash)
        return None if block is None else StoredBlock(block.nbytes, block.boundary is not None)

    def put(self, block):
        self.blocks[block.block_hash] = block


class Listener:
    """A third-party plugin: a lower tier per model, and what finished where."""

    def __init__(self) -> None:
        self.tiers: list[DictTier] = []
        self.finished: list[tuple[str, str, str]] = []

    @hookimpl
    def register_caches(self, register):
        def factory(model, config):
            self.tiers.append(DictTier(model.id))
            return self.tiers[-1]

        register("dict", factory)

    @hookimpl
    def on_request_finished(self, model_id, request_id, finish_reason):
        self.finished.append((model_id, request_id, finish_reason))


@pytest.fixture
def served(tmp_path: Path):
    model_dir = cached_model("llama", 0, cache_dir=tmp_path / "models")
    config = tmp_path / "omlx.toml"
    config.write_text('[server]\nmodels = ["first"]\n\n'
                      f'[models.first]\npath = "{model_dir}"\nengine = "batched"\n\n'
                      f'[models.second]\npath = "{model_dir}"\nengine = "batched"\n')
    setup = load_setup("cpu-small", [config], [("plugin.ssd_cache.dir", "", "test")])
    listener = Listener()
    setup.plugins.register(listener, "listener")
    context = start_engines(setup, progress=False)
    yield context, listener
    stop_engines(context)


def test_an_engine_created_while_serving_gets_what_one_created_at_start_gets(served) -> None:
    context, listener = served
    # Loaded on demand through the model pool, which builds it with create_engine.
    lease = context.pool.acquire("second")
    second = lease.engine
    lease.release()
    assert list(context.engines) == ["first", "second"]
    assert isinstance(second, BatchedEngine) and second.host is not None
    # Its own lower tier, built by core from register_caches, behind its prefix cache.
    assert [tier.model_id for tier in listener.tiers] == ["first", "second"]
    assert second.host.lower_tiers == (listener.tiers[1],)
    assert second.prefix_cache.stats()["lower_tier"] == "DictTier"
    # The enforcer reaches it on its next poll (limits and the forward gate).
    context.memory_guard.enforcer.poll_once()
    assert second.scheduler.limits is not None
    assert isinstance(second.scheduler.forward_gate, ForwardGate)

    pipeline = ServingPipeline(context)
    generation = pipeline.start(Job("second", GREEDY, token_ids=[20, 21, 22, 23]))
    list(generation.deltas())
    generation.close()
    assert generation.finish_reason in ("stop", "length")
    # Its finish sink reached the hook, with its model's id.
    assert ("second", generation.request_id, generation.finish_reason) in listener.finished

    # Unloaded through the pool, which closes it with close_engine.
    assert context.pool.unload("second")
    assert list(context.engines) == ["first"] and second.scheduler is None
    pipeline.close()


def test_the_finish_sink_names_the_model_and_the_reason(served) -> None:
    context, listener = served
    engine = context.engines["first"]
    handle = engine.submit(GenerationRequest("done", [20, 21, 22, 23], GREEDY))
    final = engine_io.collect(handle)[-1]
    # Nothing but the abort ends it: no length within reach, no end-of-sequence token.
    endless = SamplingParams(temperature=0.0, max_tokens=1000,
                             logit_bias={special_token_id(t): -100.0 for t in SPECIAL_TOKENS})
    handle = engine.submit(GenerationRequest("gone", [20, 21, 22, 24], endless))
    engine_io.first_output(handle)
    handle.close()
    last = engine_io.collect(handle)[-1]
    assert last.finish_reason == "abort"
    # The sink runs before the final output goes out.
    assert ("first", "done", final.finish_reason) in listener.finished
    assert ("first", "gone", "abort") in listener.finished
