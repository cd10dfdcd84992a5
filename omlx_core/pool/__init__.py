"""The model pool: available and resident models under one memory budget
(:mod:`.pool`), and the catalog of what is available (:mod:`.catalog`)."""

from omlx_core.pool.pool import (
    AVAILABLE,
    FAILED,
    LOADING,
    RESIDENT,
    UNLOADING,
    Lease,
    ModelLoadFailed,
    ModelPool,
    ModelRecord,
    PoolError,
)

__all__ = ["AVAILABLE", "FAILED", "LOADING", "Lease", "ModelLoadFailed", "ModelPool",
           "ModelRecord", "PoolError", "RESIDENT", "UNLOADING"]
