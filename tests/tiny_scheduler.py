"""The batched engine's scheduler on a tiny model, as its tests build it: no engine
around it, its own prefix cache, nothing to wake."""

from __future__ import annotations

from typing import Any

from omlx_core.scheduling.prefix_cache import PrefixCache
from omlx_core.scheduling.scheduler import Scheduler


def tiny_scheduler(model: Any, tokenizer: Any, *, block_size: int = 8,
                   cache_bytes: int = 1 << 24, **options: Any) -> Scheduler:
    """A :class:`Scheduler` for ``model`` (4 rows, 128-token prefill steps unless
    ``options`` say otherwise; they are the scheduler's keyword arguments)."""
    options = {"max_batch_size": 4, "prefill_step_size": 128, **options}
    return Scheduler(model=model, tokenizer=tokenizer, model_id="tiny", model_config={},
                     vocab_size=model.args.vocab_size,
                     prefix_cache=PrefixCache(block_size=block_size, budget_bytes=cache_bytes),
                     wake=lambda: None, **options)
