"""How many bytes the SSD store may hold: a configured budget, or a share of the disk.

With no budget (``plugin.ssd_cache.budget = "auto"``) the limit is ``auto_share`` of the
room: free disk plus what the cache holds. The free space is re-read at most every
``ttl_s`` seconds (a save must not pay a ``statvfs`` each), and at once after a write
failed for lack of space. A configured budget never exceeds that room either.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class DiskQuota:
    """The byte limit of the files under ``directory``."""

    def __init__(self, directory: Path, *, budget: int | None, auto_share: float, ttl_s: float) -> None:
        self.directory = directory
        self.budget = budget
        self.auto_share = auto_share
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        #: (monotonic time, room bytes) of the last reading of the disk
        self._reading: tuple[float, int] | None = None

    @property
    def has_reading(self) -> bool:
        with self._lock:
            return self._reading is not None

    def limit(self, held: int) -> int:
        """The limit now, the cache holding ``held`` bytes."""
        now = time.monotonic()
        with self._lock:
            if self._reading is None or now - self._reading[0] > self.ttl_s:
                try:
                    free = shutil.disk_usage(self.directory).free
                except OSError as exc:
                    log.warning("SSD cache: cannot read the free space of %s (%s); saving nothing "
                                "until it can", self.directory, exc)
                    free = 0
                self._reading = (now, free + held)
            room = self._reading[1]
        if self.budget is None:
            return int(room * self.auto_share)
        return min(self.budget, room)

    def invalidate(self) -> None:
        """Forget the disk reading: the next limit reads the true free space (a write just
        failed with the disk full)."""
        with self._lock:
            self._reading = None


__all__ = ["DiskQuota"]
