"""Every rank's memory as rank 0 sees it, and what one rank's share of a request costs.

Each rank's own memory guard probes its own machine and ceilings. Once per step (idle:
once per heartbeat) every rank's latest limit snapshot is gathered onto rank 0 by a
collective (:meth:`RankMemoryBoard.gather`, called from the step exchange). Rank 0's
``preflight`` then refuses a request that can never fit on *any* rank with a 413
naming that rank and its binding ceiling, and the estimator's answer for a sharded
model is scaled to one rank's share (:func:`per_rank_estimate`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from omlx_core.memory.types import LimitSnapshot, PeakEstimate
    from omlx_core.plugins.distributed.cluster import Cluster

_NAME_CHARS = 16
_KIB = 1024


@dataclass(frozen=True)
class RankMemory:
    """One rank's latest limit snapshot, as gathered."""

    rank: int
    hard_bytes: int | None
    baseline_bytes: int
    in_use_bytes: int
    binding: str


class RankMemoryBoard:
    """The memory readings of every rank serving one model, and its split."""

    def __init__(self, cluster: Cluster, mode: str, layers: int,
                 read: Callable[[], LimitSnapshot | None]) -> None:
        self.cluster = cluster
        self.mode = mode
        self.layers = layers
        self._read = read
        self._lock = threading.Lock()
        self.ranks: list[RankMemory] = []

    def gather(self) -> None:
        """Collective: every rank sends its reading; rank 0 keeps them all."""
        rows = self.cluster.gather(_encode(self._read()))
        if self.cluster.leader:
            with self._lock:
                self.ranks = [_decode(rank, row) for rank, row in enumerate(rows)]

    def readings(self) -> list[RankMemory]:
        with self._lock:
            return list(self.ranks)

    @property
    def kv_share(self) -> float:
        """The largest share of the model's KV cache one rank holds."""
        size = self.cluster.size
        if size <= 1:
            return 1.0
        if self.mode == "pipeline" and self.layers:
            return math.ceil(self.layers / size) / self.layers
        return 1.0 / size


def per_rank_estimate(estimate: PeakEstimate, kv_share: float) -> PeakEstimate:
    """One rank's part of ``estimate``: its share of the KV cache. The transients stay
    whole: the hidden states, the last token's logits and the copies are not split."""
    if kv_share >= 1.0:
        return estimate
    return replace(estimate,
                   kv_bytes=math.ceil(estimate.kv_bytes * kv_share),
                   kv_bytes_per_token=math.ceil(estimate.kv_bytes_per_token * kv_share))


def _encode(snapshot: LimitSnapshot | None) -> list[float]:
    # float32 carries KiB exactly up to 16 GiB and within a KiB per 16 GiB past it.
    if snapshot is None:
        return [-1.0, 0.0, 0.0] + [0.0] * _NAME_CHARS
    hard = -1.0 if snapshot.hard_bytes is None else snapshot.hard_bytes / _KIB
    name = (snapshot.breakdown.binding or "")[:_NAME_CHARS] if snapshot.breakdown else ""
    return ([hard, snapshot.baseline_bytes / _KIB, snapshot.in_use_bytes / _KIB]
            + [float(ord(c)) for c in name.ljust(_NAME_CHARS, "\0")])


def _decode(rank: int, row: list[Any]) -> RankMemory:
    hard = None if row[0] < 0 else int(row[0] * _KIB)
    name = "".join(chr(int(c)) for c in row[3:] if int(c)).strip()
    return RankMemory(rank=rank, hard_bytes=hard, baseline_bytes=int(row[1] * _KIB),
                      in_use_bytes=int(row[2] * _KIB), binding=name or "unknown")


#: the boards of the models this process serves distributed, by model id
BOARDS: dict[str, RankMemoryBoard] = {}
