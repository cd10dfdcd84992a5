"""The dashboard's tables, read from the running server when asked: the requests in
flight (waiting for memory, queued in an engine, prefilling, decoding, preempted) and
every available model with its pool state. Each reading goes through the public
contract: :meth:`~omlx_core.engine.Engine.progress`, :meth:`~omlx_core.engine.Engine.stats`,
:meth:`~omlx_core.engine.Engine.limits`, the admission queue's waiting list and
:meth:`~omlx_core.pool.ModelPool.describe`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omlx_core.engine import RequestProgress

if TYPE_CHECKING:
    from omlx_core.engine import Engine
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)


class NotCancellable(Exception):
    """The request exists but cannot be cancelled from here (it waits for memory)."""


def requests_now(context: ServerContext) -> list[dict[str, Any]]:
    """Every request in flight, waiting for memory first (in queue order), then each
    engine's, oldest first."""
    rows: list[dict[str, Any]] = []
    guard = context.memory_guard
    if guard is not None:
        for position, waiting in enumerate(guard.admission.waiting_requests(), 1):
            rows.append({"request_id": waiting.request_id, "model": waiting.model_id,
                         "stage": "queued", "queue": "memory", "queue_position": position,
                         "detail": f"waiting for memory, #{position} in line",
                         "prompt_tokens": waiting.prompt_tokens, "completion_tokens": 0,
                         "reserve_bytes": waiting.reserve_bytes,
                         "age_s": round(waiting.waited_s, 3), "cancellable": False})
    engine_rows = []
    for model_id, engine in list(context.engines.items()):
        for progress in _progress(model_id, engine):
            engine_rows.append(_engine_row(model_id, progress))
    engine_rows.sort(key=lambda row: -row["age_s"])
    return rows + engine_rows


def _progress(model_id: str, engine: Engine) -> list[RequestProgress]:
    try:
        return list(engine.progress())
    except Exception:
        log.warning("engine.progress() of %s failed", model_id, exc_info=True)
        return []


def _engine_row(model_id: str, progress: RequestProgress) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": progress.request_id, "model": model_id, "stage": progress.phase,
        "prompt_tokens": progress.prompt_tokens, "completion_tokens": progress.completion_tokens,
        "max_tokens": progress.max_tokens, "age_s": round(progress.age_s, 3),
        "cancellable": True}
    if progress.phase == "waiting":
        row.update(stage="preempted" if progress.preempted else "queued", queue="engine",
                   queue_position=progress.queue_position)
        row["detail"] = ("preempted for memory, resumes when it fits" if progress.preempted
                         else f"waiting for a batch slot, #{progress.queue_position} in line")
    elif progress.phase == "encoding":
        done, total = progress.prefilled_tokens, progress.prefill_tokens
        row.update(encoded_tokens=done, encode_tokens=total)
        row["detail"] = f"encoding {done}/{total} tokens (embeddings or rerank)"
    elif progress.phase == "prefilling":
        done, total = progress.prefilled_tokens, progress.prefill_tokens
        rate = done / progress.prefill_s if done and progress.prefill_s > 0 else None
        eta = (total - done) / rate if rate else None
        row.update(prefilled_tokens=done, prefill_tokens=total,
                   eta_s=round(eta, 1) if eta is not None else None)
        row["detail"] = f"prefilling {done}/{total}" + (f", ETA {eta:.1f} s" if eta is not None else "")
    else:
        rate = (progress.completion_tokens / progress.decode_s if progress.decode_s > 0 else None)
        row["tokens_per_s"] = round(rate, 1) if rate is not None else None
        row["detail"] = "decoding" + (f", {rate:.1f} tok/s" if rate is not None else "")
    return row


def cancel(context: ServerContext, request_id: str) -> str:
    """Abort a request an engine holds; returns the model it ran on.

    :raises KeyError: no request with that id is in flight.
    :raises NotCancellable: it waits for memory and has not reached its engine yet.
    """
    for model_id, engine in list(context.engines.items()):
        if any(p.request_id == request_id for p in _progress(model_id, engine)):
            engine.abort(request_id)
            return model_id
    guard = context.memory_guard
    if guard is not None and any(w.request_id == request_id
                                 for w in guard.admission.waiting_requests()):
        raise NotCancellable(f"request {request_id} waits for memory and has not reached its "
                             "engine yet; cancel it once it runs, or let it time out "
                             "(memory.queue_timeout_s)")
    raise KeyError(request_id)


def models(context: ServerContext) -> list[dict[str, Any]]:
    """Every model the server can serve, in the pool's order (the configured ones first,
    then those found under ``server.model_dirs``): the pool's own view of each
    (:meth:`~omlx_core.pool.ModelPool.describe`: state, engine, pinned, weights, planned,
    measured and resident bytes, context length, last use, keep-alive expiry, requests in
    flight and waiting for the load, the last load error), and for a resident one what
    its engine reports: the context a request may use, running and queued requests, and
    its caches' counters. A context built without a pool lists its engines only."""
    pool = context.pool
    engines = dict(context.engines)
    rows = []
    records = pool.records() if pool is not None else []
    for record in records:
        rows.append(_engine_side({"model": record.id, **pool.describe(record)},
                                 engines.get(record.id)))
    known = {record.id for record in records}
    for model_id, engine in engines.items():
        if model_id not in known:
            rows.append(_engine_side(_poolless_row(model_id, engine), engine))
    return rows


def _poolless_row(model_id: str, engine: Engine) -> dict[str, Any]:
    """The keys ``describe`` gives, for an engine no pool manages (a hand-built context):
    resident, nothing planned, its weights from the safetensors headers."""
    from omlx_core.pool.catalog import weights_bytes

    try:
        weights: int | None = weights_bytes(Path(engine.model.path))
    except Exception:  # a model without safetensors (another engine's format)
        weights = None
    task = "generate" if "generate" in engine.tasks else min(engine.tasks)
    return {"model": model_id, "state": "resident", "task": task, "engine": engine.model.engine,
            "pinned": None, "planned_bytes": None, "weights_bytes": weights,
            "measured_bytes": None, "resident_bytes": weights, "context_length": None,
            "last_used_s_ago": None, "keep_alive_s": None, "expires_in_s": None,
            "in_flight": None, "waiting": None, "load_seconds": None, "error": None}


def _engine_side(row: dict[str, Any], engine: Engine | None) -> dict[str, Any]:
    """``row`` with what a resident ``engine`` reports (``None`` for each when the model
    is not resident)."""
    row.update(source=None, max_context=None, running=None, queue_depth=None,
               prefix_cache=None, ssd_cache=None, kv_cache=None)
    if engine is None:
        return row
    try:
        stats = engine.stats() or {}
    except Exception as exc:
        stats = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        max_context = engine.limits().context_length
    except Exception:  # an engine not started has no limits yet
        max_context = None
    cache = stats.get("prefix_cache") if isinstance(stats.get("prefix_cache"), dict) else {}
    row.update(source=engine.model.source, max_context=max_context,
               kv_cache=stats.get("kv_cache"),
               running=stats.get("running"), queue_depth=stats.get("queue_depth"),
               prefix_cache={k: v for k, v in cache.items() if k != "lower"},
               ssd_cache=cache.get("lower") if isinstance(cache.get("lower"), dict) else None)
    return row
