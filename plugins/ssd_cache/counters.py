"""The SSD store's counters, kept by its parts and read as one set (``/metrics``)."""

from __future__ import annotations

import threading

#: ``saves`` passed the quota gate, ``saves_persisted`` were renamed into place; the rest
#: as named (``declined``: over the quota, ``drops``: no room in the write queue)
COUNTERS = ("saves", "saves_persisted", "loads", "hits", "misses", "evictions", "drops",
            "declined", "errors", "snapshots", "snapshots_persisted", "tokens_loaded")


class Counters:
    """Thread-safe event counts under the names in :data:`COUNTERS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


__all__ = ["COUNTERS", "Counters"]
