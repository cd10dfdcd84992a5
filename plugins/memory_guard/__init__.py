"""The built-in ``memory_guard`` plugin: the generic answers of two memory hooks.

- ``resolve_scheduler`` answers, last, with the engine itself when the engine is its own
  :class:`~omlx_core.memory.gate.MemoryReceiver`, else with its host's
  :class:`~omlx_core.host.HostMemory` (a simple engine that schedules its own prefills,
  like the example ``sequential`` engine, reads the limits and the gate there). An
  engine whose scheduler is a separate object, or a wrapper around another engine, has
  its plugin answer first.
- ``preflight`` refuses a request that can never fit: its estimated peak plus the
  transient margin, on top of the memory the server holds when idle with every cache
  emptied (weights and runtime, not the current load, not the prefix cache), is over the
  hard limit, or the KV its prompt and whole ``max_tokens`` completion grow to is.
  Waiting or evicting would not help such a request; one that fits alone but not next
  to the running ones is admission's business, not preflight's. (Decode reserves its
  KV in blocks as it grows and preempts younger requests for room, which works only
  because the oldest request always fits alone.)
"""

from __future__ import annotations

from omlx_core.engine import Engine
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.gate import MemoryReceiver
from omlx_core.memory.types import (
    KV_STEP,
    PreflightRequest,
    Rejection,
    RequestRejected,
    kv_capacity,
)
from omlx_core.settings import format_size


@hookimpl(trylast=True)
def resolve_scheduler(engine: Engine) -> MemoryReceiver | None:
    if isinstance(engine, MemoryReceiver):
        return engine
    if isinstance(engine, Engine) and engine.host is not None:
        return engine.host.memory
    return None


@hookimpl(trylast=True)
def preflight(request: PreflightRequest) -> None:
    limits = request.limits
    if limits is None or limits.hard_bytes is None:
        return
    if request.estimated_bytes is None:
        # The forward gate would refuse every chunk of it: refuse it now, for good.
        raise RequestRejected(Rejection(
            estimated_bytes=0, limit_bytes=limits.hard_bytes, breakdown=limits.breakdown,
            request_id=request.request_id, model_id=request.model_id,
            prompt_tokens=request.prompt_tokens, stage="preflight", cause="no_estimate",
            detail=f"no estimate_peak plugin can estimate model {request.model_id!r} (model_type "
                   f"{request.model_config.get('model_type')!r}; its config.json may be missing "
                   "the sizes an estimate needs), so the memory guard cannot let any of its "
                   "requests run; retrying will not help: enable the built-in 'estimator' "
                   "plugin, install one for this architecture, or fix the model's config"))
    per_token = request.kv_bytes_per_token
    room = limits.hard_bytes - limits.baseline_bytes - request.margin_bytes
    decode_kv = per_token * kv_capacity(request.prompt_tokens + request.max_tokens)
    if max(request.estimated_bytes, decode_kv) <= room:
        return
    detail, fitting = "", None
    if decode_kv > request.estimated_bytes:
        detail = (f"the KV of the prompt and a max_tokens={request.max_tokens} completion "
                  f"alone grows to {format_size(decode_kv)}")
        if request.estimated_bytes <= room:
            fitting = room // per_token // KV_STEP * KV_STEP - request.prompt_tokens
    raise RequestRejected(Rejection(
        estimated_bytes=max(request.estimated_bytes, decode_kv) + request.margin_bytes,
        limit_bytes=limits.hard_bytes, breakdown=limits.breakdown,
        request_id=request.request_id, model_id=request.model_id,
        prompt_tokens=request.prompt_tokens, stage="preflight",
        base_bytes=limits.baseline_bytes, cause="never_fits", detail=detail,
        margin_bytes=request.margin_bytes,
        decode_bytes=per_token * request.max_tokens if detail else 0,
        max_tokens=request.max_tokens,
        fitting_max_tokens=fitting if fitting is not None and fitting >= 1 else None))

