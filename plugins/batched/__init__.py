"""The built-in ``batched`` engine: continuous batching on mlx-lm's ``BatchGenerator``.

Registered like any third-party plugin (entry point ``batched`` in the ``omlx_core``
group). What it provides through the public hooks:

- ``register_engines``: ``"batched"`` -> :class:`~.engine.BatchedEngine`, built with
  its :class:`~omlx_core.host.EngineHost`: its scheduler reports boundary snapshots and
  finished requests to the host's sinks, and its in-memory
  :class:`~.prefix_cache.PrefixCache` puts the host's first lower cache tier (e.g.
  ``ssd_cache``'s) behind it;
- ``resolve_scheduler``: a batched engine's :class:`~.scheduler.Scheduler`, its
  :class:`~omlx_core.memory.gate.MemoryReceiver`.

Threads: every mlx operation, model loading included, runs on the process's one MLX
thread (:mod:`omlx_core.mlx_thread`). ``submit`` only validates and enqueues; outputs come back
through a queue per request that a :class:`~omlx_core.engine.QueuedRequestHandle` iterates;
closing the handle aborts the request within one scheduler step.

Forward-gate seam (for the memory guard): before each step's prefill forwards, the
scheduler calls ``gate.check_prefill(PrefillStep)`` with the request ids, chunk token
counts and cached-token counts about to run; a refused request ends with
``finish_reason="error"`` and its cache is freed while the rest of the batch goes on.
The contract is in :mod:`omlx_core.memory.gate`; the scheduling around it in
:mod:`.scheduler`.

Throughput against plain ``mlx_lm.stream_generate``:
``python -m benchmarks.batched_engine`` from the repository root.
"""

from __future__ import annotations

from typing import Any, Callable

from omlx_core.hookspecs import hookimpl
from omlx_core.settings import Setting
from omlx_core.scheduling import (
    BatchedEngine,
    BlockStore,
    CachedBlock,
    EngineSettings,
    PrefixCache,
    Scheduler,
    create_prefix_cache,
)

ENGINE_NAME = "batched"

SETTINGS = (
    Setting("max_batch_size", "int", "most sequences decoded together", minimum=1,
            maximum=4096, default=16),
    Setting("prefill_step_size", "int", "most prompt tokens one scheduler step prefills",
            minimum=16, maximum=65536, default=512),
    Setting("batch_window_s", "float", "how long an idle engine waits after a request arrives "
            "for others to prefill together with it", minimum=0.0, maximum=1.0, default=0.01),
    Setting("batch_window_max_s", "float", "how long that window may stay open while more "
            "requests are still being tokenized and checked on their way to the engine",
            minimum=0.0, maximum=2.0, default=0.1),
    Setting("block_size", "int", "tokens per prefix-cache block", minimum=1, maximum=65536,
            default=64),
    Setting("prefix_cache_budget", "size", "bytes the in-memory prefix cache may hold "
            "(0 turns it off)", default=1 << 30),
    Setting("speculation", "bool", "draft tokens for decoding rows by prompt lookup (the "
            "continuation of an earlier occurrence of their last tokens in prompt and "
            "output) and verify every row's drafts in the decode step's one forward; a cost "
            "model drafts only where it pays; false: one token per row and step",
            default=True),
    Setting("max_draft_tokens", "int", "most draft tokens a decoding row carries in one step",
            minimum=1, maximum=64, default=6),
    Setting("max_decode_gap_ms", "float", "while requests decode, prefill chunks are sized so "
            "that a step (chunk and decode) is expected to take at most this long, from "
            "measured step times; 0: chunks of prefill_step_size always", minimum=0.0,
            maximum=600000.0, default=250.0),
)


@hookimpl
def register_settings(register: Callable[[Setting], None]) -> None:
    for setting in SETTINGS:
        register(setting)


@hookimpl
def register_engines(register: Callable[..., None]) -> None:
    # The class itself is the factory, so `omlx-core plugins` can tell it is guarded.
    register(ENGINE_NAME, BatchedEngine)


@hookimpl
def resolve_scheduler(engine: Any) -> Scheduler | None:
    return engine.scheduler if isinstance(engine, BatchedEngine) else None


__all__ = [
    "ENGINE_NAME", "BatchedEngine", "BlockStore", "CachedBlock",
    "EngineSettings", "PrefixCache", "Scheduler",
    "create_prefix_cache",
]
