"""The dashboard's ring buffer: one :class:`Sample` per enforcer poll, the last
:data:`HISTORY_S` seconds of them.

The samples are kept as rows of floats in one array allocated up front and written in
place (``None`` as NaN; a :class:`Sample` is built again when read): a poll leaves no
Python object of its own behind. Kept as objects, each poll's sample (a dataclass, its
dict of ceilings, its ints and floats) lived for the whole window, and those made while
a model was loading sat among the load's freed strings: each kept a 1 MiB arena of
Python's small-object allocator resident after the model was unloaded.
"""

from __future__ import annotations

import math
import threading
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Sequence

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


class ColumnRing:
    """The last ``capacity`` rows of ``width`` floats, in one array allocated up front;
    the oldest row is overwritten. Not locked: its owner locks."""

    def __init__(self, capacity: int, width: int):
        self.capacity, self.width = capacity, width
        self._data = array("d", bytes(8 * capacity * width))
        self._first = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, row: Sequence[float]) -> None:
        if len(row) != self.width:
            raise ValueError(f"a row of {len(row)} values, not {self.width}")
        slot = (self._first + self._count) % self.capacity
        if self._count == self.capacity:
            self._first = (self._first + 1) % self.capacity
        else:
            self._count += 1
        base = slot * self.width
        for offset, value in enumerate(row):
            self._data[base + offset] = value

    def popleft(self) -> None:
        if self._count:
            self._first = (self._first + 1) % self.capacity
            self._count -= 1

    def row(self, index: int) -> list[float]:
        """The row ``index`` (0 the oldest, -1 the newest)."""
        if not -self._count <= index < self._count:
            raise IndexError(index)
        base = (self._first + index % self._count) % self.capacity * self.width
        return self._data[base:base + self.width].tolist()

    def rows(self) -> list[list[float]]:
        """Every row, oldest first."""
        return [self.row(index) for index in range(self._count)]


def none_to_nan(value: float | None) -> float:
    return math.nan if value is None else value


def nan_to_none(value: float) -> float | None:
    return None if math.isnan(value) else value


#: the fields stored as one column each (``ceilings`` is a column per ceiling name and
#: ``binding`` the index of its name); those declared ``int`` are read back as ints
_SCALARS = tuple(f.name for f in fields(Sample) if f.name not in ("ceilings", "binding"))
_INTS = frozenset(f.name for f in fields(Sample) if str(f.type).split(" |")[0] == "int")


class History:
    """The last ``window_s`` seconds of samples taken every ``interval_s``."""

    def __init__(self, window_s: float = HISTORY_S, interval_s: float = 1.0):
        self.window_s = window_s
        self._rows = ColumnRing(max(2, math.ceil(window_s / interval_s) + 1),
                                len(_SCALARS) + len(CEILING_NAMES) + 1)
        #: the names ``binding`` columns index: the ceilings, then any other seen
        self._names = list(CEILING_NAMES)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def append(self, sample: Sample) -> None:
        row = [none_to_nan(getattr(sample, name)) for name in _SCALARS]
        row += [none_to_nan(sample.ceilings.get(name)) for name in CEILING_NAMES]
        with self._lock:
            if sample.binding is not None and sample.binding not in self._names:
                self._names.append(sample.binding)
            row.append(math.nan if sample.binding is None else self._names.index(sample.binding))
            self._rows.append(row)

    def samples(self, since: float | None = None) -> list[Sample]:
        """The samples taken after ``since`` (all of them for ``None``), oldest first."""
        with self._lock:
            samples = self._decode(self._rows.rows())
        cutoff = samples[-1].t - self.window_s if samples else 0.0
        return [s for s in samples if s.t > cutoff and (since is None or s.t > since)]

    def latest(self) -> Sample | None:
        with self._lock:
            return self._decode([self._rows.row(-1)])[0] if len(self._rows) else None

    def _decode(self, rows: Iterable[list[float]]) -> list[Sample]:
        ceilings_at = len(_SCALARS)
        decoded = []
        for row in rows:
            values: dict[str, Any] = {}
            for name, value in zip(_SCALARS, row):
                values[name] = nan_to_none(value)
                if name in _INTS and values[name] is not None:
                    values[name] = int(value)
            ceilings = {name: int(value) for name, value
                        in zip(CEILING_NAMES, row[ceilings_at:]) if not math.isnan(value)}
            binding = row[-1]
            decoded.append(Sample(**values, ceilings=ceilings,
                                  binding=None if math.isnan(binding) else self._names[int(binding)]))
        return decoded


def columns(samples: list[Sample]) -> dict[str, list[Any]]:
    """The samples as one list per field (the layout plotting libraries take); each
    ceiling is its own ``ceiling_<name>`` column, ``None`` while it is not set."""
    names = [f for f in Sample.__dataclass_fields__ if f != "ceilings"]
    table: dict[str, list[Any]] = {name: [] for name in names}
    table.update({f"ceiling_{name}": [] for name in CEILING_NAMES})
    for sample in samples:
        for name in names:
            table[name].append(getattr(sample, name))
        for name in CEILING_NAMES:
            table[f"ceiling_{name}"].append(sample.ceilings.get(name))
    return table
