"""Room for a model to load: what it takes (:func:`plan_load`), what stays held with
every unpinned model gone (:func:`floor_bytes`), which idle model goes first
(:func:`unload_candidate`), the refusals when it does not fit, and giving an unloaded
model's memory back (:func:`return_memory`). :class:`~omlx_core.pool.pool.ModelPool`
composes them under its lock."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from omlx_core.memory.types import PeakQuery, Rejection, RequestRejected
from omlx_core.pool.catalog import tensor_headers, tensors_bytes
from omlx_core.pool.records import RESIDENT, UNLOADING, ModelRecord
from omlx_core.settings import format_size

if TYPE_CHECKING:
    from omlx_core.models.registry import ModelSpec

Advice = Callable[[Rejection], list[str]]


@dataclass(frozen=True)
class LoadPlan:
    """What loading a model takes, read before a byte of it is."""

    weights_bytes: int
    #: weights plus the working set of one prefill chunk
    planned_bytes: int
    context_length: int | None


def plan_load(spec: ModelSpec, estimate_peak: Callable[..., Any] | None, backend: str) -> LoadPlan:
    """Weights from the safetensors headers, plus the more of: the ``estimate_peak``
    answer for one 512-token prefill chunk (none without the hook or an answer), and what
    the load itself holds beyond the weights (a weight packed for the CPU kernels is held
    twice while it is copied: :func:`~omlx_core.models.packed_linear.packing_bytes`)."""
    from omlx_core.models.packed_linear import packing_bytes

    tensors = tensor_headers(spec.path)
    weights = tensors_bytes(tensors)
    working = 0
    if estimate_peak is not None:
        query = PeakQuery(model_config=dict(spec.config), new_tokens=512, model_id=spec.id,
                          backend=backend)
        estimate = estimate_peak(query=query)
        working = estimate.total if estimate is not None else 0
    loading = packing_bytes(tensors)
    return LoadPlan(weights, weights + max(working, loading), context_length(spec.config))


def context_length(config: Any) -> int | None:
    """The longest context a model's config declares (its text model's for a VLM)."""
    config = dict(config)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("max_position_embeddings") or text.get("max_position_embeddings")


def floor_bytes(records: Iterable[ModelRecord], snapshot: Any, bare_bytes: int | None) -> int:
    """What stays held with every unpinned model gone: the lowest footprint without
    models seen at a settled reading (``bare_bytes``), plus the pinned models. The
    baseline (with the ledger's model changes since it was read) less the unpinned
    models only bounds this from above (a model can hold more than its weights); a floor
    too low only turns a 413 into a bounded wait."""
    resident = [r for r in records if r.state in (RESIDENT, UNLOADING)]
    pinned = sum(r.held_bytes() for r in resident if r.pinned)
    from_baseline = snapshot.baseline_bytes - sum(r.held_bytes() for r in resident if not r.pinned)
    if bare_bytes is None:
        return from_baseline
    return min(from_baseline, bare_bytes + pinned)


def bare_bytes(records: Iterable[ModelRecord], snapshot: Any, claimed_bytes: int) -> int:
    """What a settled reading says the process holds without any model: a model whose
    engine exists is in the reading; the claim of a load still in the ledger may be in
    part (taking it off can only make the floor lower)."""
    models = sum(r.held_bytes() for r in records if r.engine is not None)
    return snapshot.in_use_bytes - snapshot.reclaimable_bytes - models - claimed_bytes


def unload_candidate(records: Iterable[ModelRecord]) -> ModelRecord | None:
    """The least recently used resident model that may be unloaded now."""
    candidates = [r for r in records
                  if r.state == RESIDENT and not r.pinned and r.idle and not r.draining]
    return min(candidates, key=lambda r: r.last_used) if candidates else None


# -- refusals ---------------------------------------------------------------------------


def _rejection(record: ModelRecord, snapshot: Any, records: Iterable[ModelRecord], cause: str,
               detail: str, base: int) -> Rejection:
    return Rejection(
        estimated_bytes=record.planned_bytes or 0, limit_bytes=snapshot.hard_bytes,
        breakdown=snapshot.breakdown, model_id=record.id, stage="load", base_bytes=base,
        cause=cause, detail=detail, margin_bytes=snapshot.margin_bytes,
        pinned_models=tuple(sorted(r.id for r in records if r.pinned and r.state == RESIDENT)))


def never_fits(record: ModelRecord, snapshot: Any, floor: int, records: Iterable[ModelRecord],
               advice: Advice) -> RequestRejected:
    """The load could not fit even with every unpinned model unloaded (HTTP 413)."""
    detail = (f"model {record.id!r} needs {format_size(record.planned_bytes or 0)} to load "
              f"({format_size(record.weights_bytes or 0)} of weights plus its working "
              f"set), over the {format_size(snapshot.hard_bytes)} memory limit with "
              f"{format_size(max(0, floor))} held even with every unpinned model unloaded")
    rejection = _rejection(record, snapshot, records, "never_fits", detail, max(0, floor))
    return RequestRejected(rejection, advice(rejection))


def no_room(record: ModelRecord, snapshot: Any, room: int, records: Iterable[ModelRecord],
            advice: Advice, wait_s: float, retry_s: float) -> RequestRejected:
    """Busy or pinned models held the room for the whole wait (HTTP 503, Retry-After)."""
    records = list(records)
    busy = sorted(r.id for r in records if r.state == RESIDENT and not r.idle)
    detail = (f"model {record.id!r} needs {format_size(record.planned_bytes or 0)} to load "
              f"and only {format_size(max(0, room))} is free; the models holding the rest "
              f"are busy or pinned ({', '.join(busy) or 'none busy'}) and stayed so for "
              f"{wait_s:g} s (server.model_load_wait_s)")
    rejection = _rejection(record, snapshot, records, "memory_short", detail, 0)
    return RequestRejected(rejection, advice(rejection), retry_after_s=retry_s)


def wait_timeout(record: ModelRecord, snapshot: Any, wait_s: float,
                 retry_s: float) -> RequestRejected:
    """The model stayed loading, unloading or draining for the whole wait."""
    detail = (f"model {record.id!r} is {record.state} and did not become ready within "
              f"{wait_s:g} s (server.model_load_wait_s)")
    rejection = Rejection(
        estimated_bytes=record.planned_bytes or 0,
        limit_bytes=snapshot.hard_bytes if snapshot is not None else None,
        breakdown=snapshot.breakdown if snapshot is not None else None, model_id=record.id,
        stage="load", cause="queue_timeout", detail=detail)
    return RequestRejected(rejection, [], retry_after_s=retry_s)


# -- giving memory back -----------------------------------------------------------------


def return_memory() -> None:
    """Give what an unloaded model held back to the system.

    CPython's type attribute cache keeps a reference to the last 4096 attribute names
    looked up; loading a tokenizer looks up names built from its JSON files, so a few
    strings of every load stayed, each keeping a 1 MiB arena of the small-object
    allocator that the load's other strings had filled (in one process, 12.9 MB over
    sixteen load/unload cycles; with the cache cleared, 0.1 MB). mlx's buffer cache is
    cleared on the MLX thread (another thread's call may wait for a step while holding
    the GIL)."""
    from omlx_core.memory.usage import trim_heap
    from omlx_core.mlx_thread import mlx_thread
    from omlx_core.platform.backend import clear_cache

    sys._clear_type_cache()
    gc.collect()
    mlx_thread().run(clear_cache)
    trim_heap()


__all__ = ["LoadPlan", "bare_bytes", "context_length", "floor_bytes", "never_fits", "no_room", "plan_load", "return_memory",
           "unload_candidate", "wait_timeout"]
