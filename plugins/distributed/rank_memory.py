"""Every rank's memory as rank 0 sees it, and what one rank's share of a request costs.

Each rank's own memory guard probes its own machine and ceilings. Once per step (idle:
once per heartbeat) every rank's latest measured limit snapshot is gathered onto rank 0
by a collective (:meth:`RankMemoryBoard.gather`, called from the step exchange). Rank
0 judges against the tightest rank:

- ``preflight`` refuses a request that can never fit on *any* rank with a 413 naming
  that rank and its binding ceiling;
- admission and the forward gate judge by :func:`judged_limits`: rank 0's snapshot
  with the least headroom over the ranks in rank 0's terms (the ``adjust_limits``
  hook hands it to rank 0's guard, which gives it to the admission ledger and to the
  scheduler's forward gate);
- the estimator's answer for a sharded model is scaled to one rank's share
  (:func:`per_rank_estimate`), the same on every rank.

A follower admits nothing (rank 0 does), so its guard's ledger is always idle and every
poll there reads a "baseline" that holds the running requests' KV and whatever transient
a forward had at that moment. The board sends a follower's baseline only from a poll
that no sequence ran through (:meth:`RankMemoryBoard.observe`), otherwise the last such
one: rank 0 would count the running requests twice and refuse ones that fit.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from omlx_core.scheduling import CEILING_NAMES, CeilingBreakdown
from omlx_core.settings import format_size

if TYPE_CHECKING:
    from omlx_core.scheduling import LimitSnapshot, PeakEstimate
    from omlx_core.plugins.distributed.cluster import Cluster

#: a row's text: the tier and the kind of device, ``tier,device_kind``
_TEXT_CHARS = 24
_KIB = 1024


@dataclass(frozen=True)
class RankMemory:
    """One rank's latest limit snapshot, as gathered."""

    rank: int
    hard_bytes: int | None
    baseline_bytes: int
    in_use_bytes: int
    #: that rank's ceilings (its tier, machine's memory and kind of device): which binds
    breakdown: CeilingBreakdown = field(default_factory=CeilingBreakdown)
    #: the transient margin that rank charges, and its admission watermark
    margin_bytes: int = 0
    admit_watermark: float = 1.0

    @property
    def binding(self) -> str:
        """The name of the ceiling that binds there (``"unknown"``: none)."""
        return self.breakdown.binding or "unknown"

    @property
    def forward_room(self) -> float:
        """What a forward may add there now: hard - in use - margin (inf: no limit)."""
        if self.hard_bytes is None:
            return math.inf
        return self.hard_bytes - self.in_use_bytes - self.margin_bytes

    @property
    def admission_budget(self) -> float:
        """What running requests may reserve there in all: hard × watermark - baseline
        - margin (inf: no limit)."""
        if self.hard_bytes is None:
            return math.inf
        return (int(self.hard_bytes * self.admit_watermark) - self.baseline_bytes
                - self.margin_bytes)

    def describe(self, size: int) -> str:
        hard = format_size(self.hard_bytes) if self.hard_bytes is not None else "no"
        return (f"rank {self.rank} of {size}, whose {self.binding} ceiling ({hard}; "
                f"{format_size(self.in_use_bytes)} in use there, "
                f"{format_size(self.baseline_bytes)} idle)")

    def binding_breakdown(self, size: int, where: str) -> CeilingBreakdown:
        """This rank's ceilings as the ones that bind a refusal on rank 0, ``where``
        saying so in words."""
        return replace(self.breakdown, rank=self.rank, ranks=size, elsewhere=where)


class RankMemoryBoard:
    """The memory readings of every rank serving one model, and its split."""

    def __init__(self, cluster: Cluster, mode: str, layers: int,
                 admit_watermark: float,
                 activity: Callable[[], tuple[int, bool]] = lambda: (0, False)) -> None:
        self.cluster = cluster
        self.mode = mode
        self.layers = layers
        #: this rank's admission watermark (its memory tier's)
        self.admit_watermark = admit_watermark
        #: (sequences this rank has started so far, whether one is running now)
        self._activity = activity
        self._lock = threading.Lock()
        self.ranks: list[RankMemory] = []
        #: this rank's latest measured snapshot (``adjust_limits`` sees each)
        self.own: LimitSnapshot | None = None
        #: a follower's idle baseline, and its started count at the last observation
        #: when nothing ran then (``None``: something ran)
        self._idle_baseline: int | None = None
        self._quiet_at: int | None = None

    def observe(self, snapshot: LimitSnapshot) -> None:
        """This rank's guard measured ``snapshot`` (the enforcer's thread)."""
        if not self.cluster.leader:
            snapshot = self._with_idle_baseline(snapshot)
        with self._lock:
            self.own = snapshot

    def _with_idle_baseline(self, snapshot: LimitSnapshot) -> LimitSnapshot:
        """``snapshot`` with the follower's idle baseline: its own when no sequence ran
        between the previous observation and this one (the memory was read in between),
        else the last one read so."""
        started, running = self._activity()
        if self._idle_baseline is None or (self._quiet_at == started and not running):
            self._idle_baseline = snapshot.baseline_bytes
        self._quiet_at = None if running else started
        if snapshot.baseline_bytes == self._idle_baseline:
            return snapshot
        return replace(snapshot, baseline_bytes=self._idle_baseline)

    def gather(self) -> None:
        """Collective: every rank sends its reading; rank 0 keeps them all."""
        with self._lock:
            own = self.own
        rows = self.cluster.gather(_encode(own, self.admit_watermark))
        if self.cluster.leader:
            with self._lock:
                self.ranks = [_decode(rank, row) for rank, row in enumerate(rows)]

    def readings(self) -> list[RankMemory]:
        with self._lock:
            return list(self.ranks)

    def judged(self, snapshot: LimitSnapshot) -> LimitSnapshot | None:
        """Rank 0's measured ``snapshot`` judged against every rank's latest reading
        (:func:`judged_limits`); ``None`` where rank 0 binds."""
        return judged_limits(snapshot, self.admit_watermark, self.readings(), self.cluster.size)

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


def judged_limits(own: LimitSnapshot, admit_watermark: float, ranks: list[RankMemory],
                  size: int) -> LimitSnapshot | None:
    """Rank 0's snapshot ``own`` (its admission watermark ``admit_watermark``) with the
    least headroom over ``ranks`` (the gathered readings; rank 0's own is ``own``),
    expressed in rank 0's terms; ``None`` when rank 0 is the tightest for both.

    - the forward gate compares memory in use on rank 0 now + estimate + margin with
      ``hard_bytes``: that becomes rank 0's hard limit less how much less room the
      tightest rank had at its last reading, ``min over r of (hard_r - in use_r -
      margin_r)``, than rank 0 (so rank 0's use now plus the tightest room);
    - admission's budget ``hard × watermark - baseline - margin`` becomes the least
      over the ranks, ``min over r of (hard_r × watermark_r - baseline_r - margin_r)``,
      through the baseline (the ledger still adds model loads and unloads to it);
    - ``margin_bytes`` stays rank 0's, the least the gate and the ledger charge;
    - the breakdown (admission's, and ``forward_breakdown`` the forward gate's) is the
      binding rank's ceilings, ``rank`` naming it and ``elsewhere`` saying so in words,
      so a refusal's binding ceiling and its advice are that rank's.
    """
    mine = RankMemory(rank=0, hard_bytes=own.hard_bytes, baseline_bytes=own.baseline_bytes,
                      in_use_bytes=own.in_use_bytes, breakdown=own.breakdown or CeilingBreakdown(),
                      margin_bytes=own.margin_bytes, admit_watermark=admit_watermark)
    others = [r for r in ranks if r.rank != 0 and r.hard_bytes is not None]
    if not others:
        return None
    forward = min(others, key=lambda r: r.forward_room)
    admission = min(others, key=lambda r: r.admission_budget)
    forward_binds = forward.forward_room < mine.forward_room
    admission_binds = admission.admission_budget < mine.admission_budget
    if not forward_binds and not admission_binds:
        return None
    # In rank 0's terms: its own use (read again by the gate) plus the least room.
    hard = own.in_use_bytes + own.margin_bytes + int(
        forward.forward_room if forward_binds else mine.forward_room)
    budget = int(admission.admission_budget if admission_binds else mine.admission_budget)
    baseline = int(hard * admit_watermark) - own.margin_bytes - budget
    both = forward_binds and admission_binds and forward.rank == admission.rank
    breakdown = forward_breakdown = own.breakdown
    if admission_binds:
        what = "admission and the forward gate" if both else "admission"
        breakdown = admission.binding_breakdown(size, f"on {admission.describe(size)}, "
                                                      f"which binds {what}")
    if both:
        forward_breakdown = breakdown
    elif forward_binds:
        forward_breakdown = forward.binding_breakdown(
            size, f"on {forward.describe(size)}, which binds the forward gate")
    return replace(own, hard_bytes=hard, baseline_bytes=baseline, breakdown=breakdown,
                   forward_breakdown=forward_breakdown)


def _encode(snapshot: LimitSnapshot | None, admit_watermark: float) -> list[float]:
    # float32 carries KiB exactly up to 16 GiB and within a KiB per 16 GiB past it.
    breakdown = snapshot.breakdown if snapshot is not None else None
    if snapshot is None or breakdown is None:
        breakdown = CeilingBreakdown()
    hard = snapshot.hard_bytes if snapshot is not None else None
    sizes = [hard, *(getattr(breakdown, name) for name in CEILING_NAMES),
             breakdown.total_ram, breakdown.reclaimable]
    text = f"{breakdown.tier},{breakdown.device_kind or ''}"[:_TEXT_CHARS]
    counts = ([snapshot.baseline_bytes / _KIB, snapshot.in_use_bytes / _KIB,
               snapshot.margin_bytes / _KIB] if snapshot is not None else [0.0, 0.0, 0.0])
    return ([-1.0 if size is None else size / _KIB for size in sizes] + counts
            + [admit_watermark] + [float(ord(c)) for c in text.ljust(_TEXT_CHARS, "\0")])


def _decode(rank: int, row: list[Any]) -> RankMemory:
    def size(value: Any) -> int | None:
        return None if value < 0 else int(value * _KIB)

    hard, *ceilings = (size(value) for value in row[:1 + len(CEILING_NAMES)])
    total_ram, reclaimable, baseline, in_use, margin, watermark = row[
        1 + len(CEILING_NAMES):7 + len(CEILING_NAMES)]
    text = "".join(chr(int(c)) for c in row[7 + len(CEILING_NAMES):] if int(c))
    tier, _, device_kind = text.partition(",")
    breakdown = CeilingBreakdown(**dict(zip(CEILING_NAMES, ceilings)), tier=tier or "balanced",
                                 total_ram=size(total_ram), reclaimable=size(reclaimable),
                                 device_kind=device_kind or None)
    return RankMemory(rank=rank, hard_bytes=hard, baseline_bytes=int(baseline * _KIB),
                      in_use_bytes=int(in_use * _KIB), breakdown=breakdown,
                      margin_bytes=int(margin * _KIB), admit_watermark=float(watermark))


#: the boards of the models this process serves distributed, by model id
BOARDS: dict[str, RankMemoryBoard] = {}
