"""What the pool tracks of each model (:class:`ModelRecord`), its states, what it has
done since start (:class:`PoolCounters`), its errors, and one model as the listings show
it (:func:`describe_record`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from omlx_core.redaction import redact_paths

if TYPE_CHECKING:
    from omlx_core.engine import Engine

log = logging.getLogger("omlx_core.pool.pool")

AVAILABLE, LOADING, RESIDENT, UNLOADING, FAILED = (
    "available", "loading", "resident", "unloading", "failed")
#: why a model was unloaded (the ``reason`` label of the unload metrics)
UNLOAD_REASONS = ("evicted", "keep_alive", "admin", "shutdown")


class ModelLoadFailed(Exception):
    """Loading a model failed (missing file, corrupt weights, unsupported architecture):
    the message names the model and the cause."""

    def __init__(self, model_id: str, cause: str):
        super().__init__(f"model {model_id!r} failed to load: {cause}")
        self.model_id = model_id
        self.cause = cause


class PoolError(Exception):
    """An operator's pool request cannot be done as asked (HTTP 409), e.g. unloading a
    model that is loading."""


@dataclass
class ModelRecord:
    """One available model as the pool tracks it."""

    id: str
    engine_name: str
    pinned: bool
    #: seconds an idle model stays resident (``None``: forever)
    keep_alive_s: float | None
    #: what it is served for: ``generate``, ``embed`` or ``rerank``
    task: str = "generate"
    state: str = AVAILABLE
    engine: Engine | None = None
    #: leases held now (requests running) and requests waiting for the model to load
    users: int = 0
    waiters: int = 0
    last_used: float = 0.0
    #: weights bytes from the safetensors headers, the planned total (weights plus the
    #: working set), and the footprint growth the load was measured at
    weights_bytes: int | None = None
    planned_bytes: int | None = None
    measured_bytes: int | None = None
    context_length: int | None = None
    #: the error of the latest load (a refusal or a failure) and, for a failure, until
    #: when it is answered without another attempt
    error: Exception | None = None
    failed_until: float = 0.0
    load_seconds: float | None = None
    loaded_at: float | None = None
    #: an operator asked for an unload: new leases wait until it is done
    draining: bool = False
    #: bumped by each finished load attempt (waiters know theirs ended)
    attempt: int = 0

    @property
    def idle(self) -> bool:
        return self.users == 0 and self.waiters == 0

    def bytes(self) -> int:
        """What the model holds while resident: measured when known, else planned."""
        return self.measured_bytes or self.planned_bytes or self.weights_bytes or 0

    def held_bytes(self) -> int:
        """At least its weights: a footprint growth measured while other models were
        unloaded can read low."""
        return max(self.measured_bytes or 0, self.weights_bytes or 0)


@dataclass
class PoolCounters:
    """What the pool has done since start (the metrics read these)."""

    loads: int = 0
    load_failures: int = 0
    #: seconds all ``loads`` took together (a sum, not a list: a list of every load's
    #: time grew for good, and each new float pinned an allocator arena of its load)
    load_seconds_total: float = 0.0
    unloads: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)


def load_failure(model_id: str, exc: Exception) -> ModelLoadFailed:
    """The error every request for the model gets until the retry window ends, logged
    once: a ``ModelError`` says what is wrong for the operator to fix; anything else is a
    bug whose text stays in the log."""
    from omlx_core.models.errors import ModelError

    known = isinstance(exc, ModelError)
    log.error("model %r failed to load: %s", model_id,
              exc if known else f"{type(exc).__name__}: {exc}", exc_info=not known)
    return ModelLoadFailed(model_id, str(exc) if known else
                           f"an unexpected {type(exc).__name__} (the server log has the details)")


def keep_alive_expired(records: Iterable[ModelRecord], now: float) -> list[ModelRecord]:
    """The resident models idle for longer than their keep-alive (never a pinned one)."""
    return [r for r in records
            if r.state == RESIDENT and not r.pinned and r.idle and not r.draining
            and r.keep_alive_s is not None and now - r.last_used >= r.keep_alive_s]


def describe_record(record: ModelRecord) -> dict[str, Any]:
    """One model as ``GET /v1/models`` and ``omlx-core ps`` show it (under the pool's lock)."""
    now = time.monotonic()
    state = record.state
    if state == AVAILABLE and isinstance(record.error, ModelLoadFailed):
        state = FAILED
    expires = None
    if state == RESIDENT and not record.pinned and record.keep_alive_s is not None:
        expires = max(0.0, record.keep_alive_s - (now - record.last_used)) \
            if record.idle else record.keep_alive_s
    return {
        "state": state, "task": record.task, "engine": record.engine_name,
        "pinned": record.pinned,
        "planned_bytes": record.planned_bytes, "weights_bytes": record.weights_bytes,
        "measured_bytes": record.measured_bytes,
        "resident_bytes": record.bytes() if state == RESIDENT else 0,
        "context_length": record.context_length,
        "last_used_s_ago": round(now - record.last_used, 3) if record.last_used else None,
        "keep_alive_s": record.keep_alive_s, "expires_in_s": expires,
        "in_flight": record.users, "waiting": record.waiters,
        "load_seconds": record.load_seconds,
        "kv_cache": (record.engine.kv_cache_format()
                     if state == RESIDENT and record.engine is not None else None),
        "error": redact_paths(str(record.error)) if record.error is not None else None,
    }


__all__ = ["AVAILABLE", "FAILED", "LOADING", "ModelLoadFailed", "ModelRecord", "PoolCounters",
           "PoolError", "RESIDENT", "UNLOADING", "UNLOAD_REASONS", "describe_record",
           "keep_alive_expired", "load_failure"]
