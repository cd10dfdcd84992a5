"""The built-in ``memory_guard`` plugin: the generic answers of two memory hooks.

- ``resolve_scheduler`` walks an engine's wrapper chain (``.inner``, ``.engine``,
  ``__wrapped__``) and returns the first object along it, or its ``.scheduler``, that
  takes ``apply_memory_limits``. It runs last: an engine plugin that knows its own
  engine better answers first.
- ``preflight`` refuses a request that can never fit: its estimated peak on top of the
  memory the server holds when idle (weights and runtime, not the current load) is over
  the hard limit. Waiting would not help such a request; one that fits alone but not
  next to the running ones is admission's business, not preflight's.
"""

from __future__ import annotations

from typing import Any, Iterator

from omlx_core.hookspecs import hookimpl
from omlx_core.memory.types import PreflightRequest, PrefillMemoryExceededError, Rejection

#: attributes through which a wrapper engine reaches the engine it wraps
WRAPPER_ATTRIBUTES = ("inner", "engine", "__wrapped__")
MAX_WRAPPER_DEPTH = 16


def _chain(engine: Any) -> Iterator[Any]:
    """``engine`` and every object it wraps, each once, depth first."""
    seen: set[int] = set()
    stack = [(engine, 0)]
    while stack:
        current, depth = stack.pop()
        if current is None or id(current) in seen or depth > MAX_WRAPPER_DEPTH:
            continue
        seen.add(id(current))
        yield current
        for name in reversed(WRAPPER_ATTRIBUTES):
            try:
                inner = getattr(current, name, None)
            except Exception:  # a property of a half-started engine may raise
                continue
            if inner is not None:
                stack.append((inner, depth + 1))


def _receives_limits(candidate: Any) -> bool:
    return callable(getattr(candidate, "apply_memory_limits", None))


@hookimpl(trylast=True)
def resolve_scheduler(engine: Any) -> Any | None:
    for node in _chain(engine):
        if _receives_limits(node):
            return node
        try:
            scheduler = getattr(node, "scheduler", None)
        except Exception:
            continue
        if scheduler is not None and _receives_limits(scheduler):
            return scheduler
    return None


@hookimpl(trylast=True)
def preflight(request: PreflightRequest) -> None:
    limits = request.limits
    if request.estimated_bytes is None or limits is None or limits.hard_bytes is None:
        return
    if limits.baseline_bytes + request.estimated_bytes > limits.hard_bytes:
        raise PrefillMemoryExceededError(Rejection(
            estimated_bytes=request.estimated_bytes, limit_bytes=limits.hard_bytes,
            breakdown=limits.breakdown, request_id=request.request_id,
            model_id=request.model_id, prompt_tokens=request.prompt_tokens,
            stage="preflight", base_bytes=limits.baseline_bytes))
