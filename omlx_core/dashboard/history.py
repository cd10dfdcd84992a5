"""The dashboard's ring buffer: one :class:`Sample` per enforcer poll, the last
:data:`HISTORY_S` seconds of them."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from omlx_core.memory.types import CEILING_NAMES

#: how far back the plots reach
HISTORY_S = 15 * 60


@dataclass(frozen=True)
class Sample:
    """The server at one enforcer poll. Rates are over the time since the previous
    sample; ``None`` where there is nothing to measure (no limit, no request)."""

    t: float
    in_use_bytes: int | None = None
    reclaimable_bytes: int | None = None
    #: what admission has reserved for the running requests
    reserved_bytes: int | None = None
    hard_limit_bytes: int | None = None
    #: each ceiling that is set (``static``, ``dynamic``, ``device``, ``custom``)
    ceilings: dict[str, int] = field(default_factory=dict)
    binding: str | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    #: waiting for memory (admission) or for a slot in an engine
    queue_depth: int = 0
    running: int = 0
    preempted: int = 0
    #: prompt tokens served from the prefix cache (any tier), and from its SSD tier,
    #: over the prompt tokens admitted in the trailing window
    prefix_hit_rate: float | None = None
    ssd_hit_rate: float | None = None


class History:
    """The last ``window_s`` seconds of samples taken every ``interval_s``."""

    def __init__(self, window_s: float = HISTORY_S, interval_s: float = 1.0):
        self.window_s = window_s
        self._samples: deque[Sample] = deque(maxlen=max(2, math.ceil(window_s / interval_s) + 1))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._samples)

    def append(self, sample: Sample) -> None:
        with self._lock:
            self._samples.append(sample)

    def samples(self, since: float | None = None) -> list[Sample]:
        """The samples taken after ``since`` (all of them for ``None``), oldest first."""
        with self._lock:
            samples = list(self._samples)
        cutoff = samples[-1].t - self.window_s if samples else 0.0
        return [s for s in samples if s.t > cutoff and (since is None or s.t > since)]

    def latest(self) -> Sample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None


def columns(samples: list[Sample]) -> dict[str, list[Any]]:
    """The samples as one list per field (the layout plotting libraries take); each
    ceiling is its own ``ceiling_<name>`` column, ``None`` while it is not set."""
    names = [f for f in Sample.__dataclass_fields__ if f != "ceilings"]
    table: dict[str, list[Any]] = {name: [] for name in names}
    table.update({f"ceiling_{name}": [] for name in CEILING_NAMES})
    for sample in samples:
        row = asdict(sample)
        for name in names:
            table[name].append(row[name])
        for name in CEILING_NAMES:
            table[f"ceiling_{name}"].append(sample.ceilings.get(name))
    return table
