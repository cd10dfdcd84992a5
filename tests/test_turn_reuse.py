"""An agent conversation re-sending its history every turn reuses, on every tiny model
family, what the server saw on the turn before: the previous prompt and completion
(boundary capture for the families whose layers cannot be cut), with the same greedy
answers as an engine without a prefix cache."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from omlx_core.config import load_config
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.testing.conversation import reuse_table, run_conversation
from omlx_core.testing.host import make_test_host

#: the issue's goal: turn N+1 reuses this much of the prefix it shares with turn N
MIN_REUSE = 0.95


def engine_for(path, **overrides) -> BatchedEngine:
    # The server's own block size and prefill step (the "base" tier), not the tests' small ones.
    config = load_config("base", overrides=[(k, str(v), "test") for k, v in overrides.items()], env={})
    engine = BatchedEngine(spec_for_path(path), make_test_host(config))
    engine.start()
    return engine


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3", "qwen3_next", "gpt_oss"])
def test_each_turn_reuses_what_the_turn_before_left(tiny_model_path, family):
    path = tiny_model_path(family)
    tokenizer = load_tokenizer(path)
    cached = engine_for(path)
    uncached = engine_for(path, **{"plugin.batched.prefix_cache_budget": 0})
    try:
        with_cache = run_conversation(cached, tokenizer, turns=8, max_tokens=16)
        without = run_conversation(uncached, tokenizer, turns=8, max_tokens=16)
    finally:
        cached.shutdown()
        uncached.shutdown()
    assert with_cache.answers == without.answers
    assert all(t.cached_tokens == 0 for t in without.turns)
    # Something is shared every turn (the system prompt at least), so reuse is measured.
    assert all(t.shared_tokens > 64 for t in with_cache.turns)
    assert with_cache.worst_reuse >= MIN_REUSE, reuse_table([(family, with_cache)])
