"""The built-in ``memory_guard`` plugin: the generic answers of two memory hooks.

- ``resolve_scheduler`` answers, last, with the engine itself when the engine is its own
  :class:`~omlx_core.memory.gate.MemoryReceiver` (a simple engine that schedules its own
  prefills, like the example ``sequential`` engine). An engine whose scheduler is a
  separate object, or a wrapper around another engine, has its plugin answer first.
- ``preflight`` refuses a request that can never fit: its estimated peak plus the
  transient margin, on top of the memory the server holds when idle with every cache
  emptied (weights and runtime, not the current load, not the prefix cache), is over the
  hard limit. Waiting or evicting would not help such a request; one that fits alone but
  not next to the running ones is admission's business, not preflight's.
"""

from __future__ import annotations

from omlx_core.engine import Engine
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.gate import MemoryReceiver
from omlx_core.memory.types import PreflightRequest, Rejection, RequestRejected


@hookimpl(trylast=True)
def resolve_scheduler(engine: Engine) -> MemoryReceiver | None:
    return engine if isinstance(engine, MemoryReceiver) else None


@hookimpl(trylast=True)
def preflight(request: PreflightRequest) -> None:
    limits = request.limits
    if request.estimated_bytes is None or limits is None or limits.hard_bytes is None:
        return
    needed = request.estimated_bytes + request.margin_bytes
    if limits.baseline_bytes + needed > limits.hard_bytes:
        raise RequestRejected(Rejection(
            estimated_bytes=needed, limit_bytes=limits.hard_bytes,
            breakdown=limits.breakdown, request_id=request.request_id,
            model_id=request.model_id, prompt_tokens=request.prompt_tokens,
            stage="preflight", base_bytes=limits.baseline_bytes, cause="never_fits",
            margin_bytes=request.margin_bytes))
