"""The batched plugin through the public hooks only, as the server and other plugins see it."""

from __future__ import annotations

from omlx_core.bootstrap import build_host
from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.hookspecs import hookimpl
from omlx_core.kvblocks import BlockStore, StoredBlock
from omlx_core.models.registry import spec_for_path
from omlx_core.pluginmanager import build_plugin_manager
from omlx_core.plugins.batched import BatchedEngine, PrefixCache, Scheduler
from omlx_core.server_context import ServerContext
from omlx_core.testing.host import make_test_host
from omlx_core.testing import engine_io


def config():
    overrides = {"plugin.batched.prefill_step_size": "16", "plugin.batched.block_size": "8"}
    return load_config("base", overrides=[(k, v, "test") for k, v in overrides.items()], env={})


class TierAndSnapshotPlugin:
    """A third-party plugin: a lower cache tier and a boundary-snapshot listener."""

    def __init__(self) -> None:
        self.snapshots = []

    @hookimpl
    def register_caches(self, register):
        register("test-tier", lambda model, config: DictTier({}))

    @hookimpl
    def on_boundary_snapshot(self, snapshot):
        self.snapshots.append(snapshot)


class DictTier(BlockStore):
    def __init__(self, blocks):
        self.blocks = blocks

    def get(self, block_hash):
        return self.blocks.get(block_hash)

    def describe(self, block_hash):
        block = self.blocks.get(block_hash)
        return None if block is None else StoredBlock(block.nbytes, block.boundary is not None)

    def put(self, block):
        self.blocks[block.block_hash] = block


def test_entry_point_registers_the_engine_and_no_cache_tier_of_its_own(tiny_model_path):
    plugins = build_plugin_manager()
    assert plugins.infos["batched"].source == "built-in"
    assert "batched" in plugins.engines()
    # Its prefix cache is its own; register_caches is for the tiers behind it.
    assert "memory" not in plugins.caches()
    engine = plugins.engines()["batched"](spec_for_path(tiny_model_path("llama")),
                                          make_test_host(config()))
    assert isinstance(engine, BatchedEngine)
    assert isinstance(engine.prefix_cache, PrefixCache) and engine.prefix_cache.block_size == 8


def test_core_hands_the_engine_lower_tiers_and_boundary_snapshot_sink(tiny_model_path):
    plugins = build_plugin_manager(disabled=["ssd_cache"])
    extra = TierAndSnapshotPlugin()
    plugins.register(extra, "tier-and-snapshots")
    context = ServerContext(config=config(), plugins=plugins)
    spec = spec_for_path(tiny_model_path("gemma3"))
    host = build_host(context, spec)
    assert [type(tier).__name__ for tier in host.lower_tiers] == ["DictTier"]
    engine = plugins.engines()["batched"](spec, host)
    engine.start()
    try:
        scheduler = plugins.hook.resolve_scheduler(engine=engine)
        assert isinstance(scheduler, Scheduler) and scheduler is engine.scheduler
        assert engine.prefix_cache.stats()["lower_tier"] == "DictTier"

        prompt = engine.tokenize(" ".join(f"w{i % 17}" for i in range(30)))
        handle = engine.submit(GenerationRequest("snap-1", prompt, SamplingParams(temperature=0, max_tokens=2)))
        assert engine_io.collect(handle)[-1].finish_reason == "length"
    finally:
        engine.shutdown()
    # gemma3 has rotating-window layers: prefill captured their state at block ends.
    assert extra.snapshots
    assert {s.request_id for s in extra.snapshots} == {"snap-1"}
    for snapshot in extra.snapshots:
        assert snapshot.token_count == (snapshot.block_index + 1) * 8
        assert snapshot.token_count <= len(prompt) - 1
        assert any(state is not None for state in snapshot.layer_states)
        assert snapshot.model_id == engine.model.id

