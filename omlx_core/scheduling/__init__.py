"""Continuous batching for engine plugins: the scheduler, the decode batch and the caches."""

from omlx_core.scheduling.engine import BatchedEngine, EngineSettings, create_prefix_cache
from omlx_core.scheduling.prefix_cache import BlockStore, CachedBlock, PrefixCache
from omlx_core.scheduling.scheduler import Scheduler

__all__ = ["BatchedEngine", "BlockStore", "CachedBlock", "EngineSettings", "PrefixCache",
           "Scheduler", "create_prefix_cache"]
