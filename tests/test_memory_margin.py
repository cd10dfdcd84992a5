"""One transient margin, charged by every stage: preflight, admission and the forward gate
agree, so a request that passes preflight on an idle server is never refused half-way;
and the margin scales with the machine the tier is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.config import load_config
from omlx_core.engine import SamplingParams
from omlx_core.memory.ceilings import TierPolicy
from omlx_core.memory.types import RequestRejected
from omlx_core.serving import Job, ServingPipeline
from omlx_core.testing import cached_model
from omlx_core.testing.waiting import wait_for

MIB = 1024**2
GIB = 1024**3


@pytest.mark.parametrize("tier, hard, expected", [
    ("cpu-small", 15 * GIB, 64 * MIB),             # the floor: CPU footprint slack
    ("laptop-16gb", 12 * GIB, int(0.05 * 12 * GIB)),
    # The design history's 128 GB Mac: Metal cap 107.5 GB, a 10.6 GB spike, 12 GB settled on.
    ("workstation-128gb", int(107.5e9), 12 * GIB),
    ("workstation-128gb", 160 * GIB, 16 * GIB),  # a larger limit: its 10 %
    ("cuda-80gb", 76 * GIB, int(0.05 * 76 * GIB)),
])
def test_the_margin_scales_with_the_machine_the_tier_is_for(tier, hard, expected) -> None:
    assert TierPolicy.from_config(load_config(tier, env={})).margin(hard) == expected


def settle_process_memory() -> None:
    """Let this test process's earlier servers' memory go (their objects, mlx's buffer
    cache and its process-wide limit, the heap's free pages): each server measures its
    baseline as if it were the only one, as a real one is."""
    import gc

    import mlx.core as mx

    from omlx_core.memory.usage import trim_heap

    gc.collect()
    mx.set_cache_limit(1 << 40)  # unlimited, as in a fresh process
    mx.clear_cache()
    trim_heap()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("margin-models"))


def start(tmp_path: Path, model_dir: Path, ceiling: int, margin: int):
    settle_process_memory()
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n')
    setup = load_setup("cpu-small", [config], [
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", str(ceiling), "test"),
        ("memory.transient_margin", str(margin), "test"), ("plugin.batched.prefix_cache_budget", "0", "test"),
        # No poll refreshes the idle baseline between the requests: preflight must not
        # trust a stale one.
        ("memory.poll_interval_s", "60", "test")])
    return start_engines(setup, progress=False)


def test_a_request_preflight_admits_on_an_idle_server_is_not_refused_half_way(
        tmp_path: Path, model_dir: Path) -> None:
    """Prompts from small to over the limit on an idle server: each either gets 413 from
    preflight, before any work, or completes; never a forward-gate refusal."""
    probe = start(tmp_path / "probe", model_dir, 64 * GIB, 8 * MIB)
    guard = probe.memory_guard
    assert wait_for(lambda: guard.snapshot is not None)
    baseline = guard.snapshot.baseline_bytes
    engine = probe.engines["tiny"]
    # A ceiling between what a 2k and a 4k prompt need, the margin included.
    small, big = (guard.estimate(guard.peak_query(engine, [(11 * i) % 200 + 10 for i in range(n)])).total
                  for n in (2048, 4000))
    stop_engines(probe)
    # The shipped margin floor (memory.transient_margin), which absorbs the process
    # footprint's allocator slack: in a test process that has run server tests before,
    # the footprint drifts by more than a few MiB during one prefill.
    margin = 64 * MIB
    ceiling = baseline + margin + (small + big) // 2
    context = start(tmp_path / "run", model_dir, ceiling, margin)
    try:
        pipeline = ServingPipeline(context)
        outcomes = []
        for tokens in (64, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4000):
            prompt = [(7 * i + tokens) % 200 + 10 for i in range(tokens)]
            try:
                generation = pipeline.start(Job("tiny", SamplingParams(temperature=0, max_tokens=2),
                                                token_ids=prompt, prompt_param="prompt"))
            except RequestRejected as refused:
                assert refused.stage == "preflight", (tokens, refused.stage, str(refused))
                outcomes.append((tokens, "413"))
                continue
            list(generation.deltas())
            generation.close()
            assert generation.finish_reason in ("stop", "length"), (tokens, generation.error)
            outcomes.append((tokens, "done"))
        kinds = [kind for _tokens, kind in outcomes]
        assert "done" in kinds and "413" in kinds, outcomes  # the range straddles the limit
        assert context.memory_guard.refused_total() == 0
    finally:
        stop_engines(context)


def test_cached_blocks_of_a_finished_request_never_turn_a_fitting_one_into_a_413(
        tmp_path: Path, model_dir: Path) -> None:
    """Issue 11's second scenario: a prompt that fits on a fresh server, then the same
    prompt again and a different one of the same size, each with the prefix cache
    holding the previous one's blocks: same verdict as on a fresh server, and no
    refusal half-way (the cached blocks are given back when the room is needed)."""
    probe = start(tmp_path / "probe", model_dir, 64 * GIB, 8 * MIB)
    guard = probe.memory_guard
    assert wait_for(lambda: guard.snapshot is not None)
    baseline, engine = guard.snapshot.baseline_bytes, probe.engines["tiny"]
    need = guard.estimate(guard.peak_query(engine, [(11 * i) % 200 + 10 for i in range(3000)])).total
    stop_engines(probe)
    margin = max(2 * MIB, need // 4)
    # A 3k prompt fits, with room to spare: 16 MiB, more than this test process's
    # footprint drifts between two servers (a few MiB after the tests before it).
    ceiling = baseline + need + margin + 16 * MIB
    tmp = tmp_path / "run"
    tmp.mkdir()
    config = tmp / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n')
    settle_process_memory()
    setup = load_setup("cpu-small", [config], [
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", str(ceiling), "test"),
        ("memory.transient_margin", str(margin), "test"),
        # A prefix cache as large as the whole ceiling: only eviction makes room.
        ("plugin.batched.prefix_cache_budget", str(ceiling), "test")])
    context = start_engines(setup, progress=False)
    try:
        pipeline = ServingPipeline(context)
        first = [(13 * i) % 200 + 10 for i in range(3000)]
        other = [(17 * i + 5) % 200 + 10 for i in range(3000)]
        for prompt in (first, first, other):
            generation = pipeline.start(Job("tiny", SamplingParams(temperature=0, max_tokens=2),
                                            token_ids=prompt, prompt_param="prompt"))
            list(generation.deltas())
            generation.close()
            assert generation.finish_reason in ("stop", "length"), generation.error
        engine = context.engines["tiny"]
        assert engine.reclaimable_bytes() > 0  # the cache kept blocks all along
        assert context.memory_guard.refused_total() == 0
    finally:
        stop_engines(context)
