"""The four memory ceilings, computed from probe readings and the active tier.

``static`` is total RAM less the tier's reserve; ``dynamic`` is what this process
could grow to right now (reclaimable memory plus its own footprint) times the tier's
factor; ``device`` is the accelerator's or the container's own limit (Metal wired
limit or recommended working set, CUDA device memory, cgroup ``memory.max``);
``custom`` is the ceiling an operator pinned with tier ``custom``. The hard limit is the
smallest; :class:`~omlx_core.memory.types.CeilingBreakdown` names the binding one.

:func:`compute_ceilings` is a pure function of a :class:`ProbeReadings`, so every case
is testable with made-up numbers; :func:`read_probes` takes the live readings. A probe
that fails drops only the ceilings it feeds, and says why in ``breakdown.notes``.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Union

from omlx_core.memory import probes
from omlx_core.memory.probes import ProbeUnavailable
from omlx_core.memory.types import CeilingBreakdown
from omlx_core.platform.backend import cuda_available, gpu_device_info, metal_available
from omlx_core.settings import format_size

if TYPE_CHECKING:
    from omlx_core.config import Config

MetalWorkingSetResult = Union[int, ProbeUnavailable]


@dataclass(frozen=True)
class TierPolicy:
    """The active memory tier's numbers, read from ``[memory]`` and ``[memory.tiers.<tier>]``."""

    name: str
    reserve_fraction: float
    reserve_min: int
    dynamic_factor: float
    admit_watermark: float
    custom_ceiling: int = 0
    #: the transient margin: at least ``margin_floor`` bytes, at least ``margin_share``
    #: of the hard limit (what a forward allocates beyond any estimate grows with the
    #: model, and so with the machine it was sized for)
    margin_floor: int = 0
    margin_share: float = 0.0
    #: the share of the margin mlx's buffer cache may keep (:meth:`buffer_cache_cap`)
    buffer_cache_share: float = 1.0

    @classmethod
    def from_config(cls, config: Config) -> "TierPolicy":
        tier = config.memory_tier()
        return cls(
            name=config["memory.tier"],
            reserve_fraction=tier["reserve_fraction"],
            reserve_min=tier["reserve_min"],
            dynamic_factor=tier["dynamic_factor"],
            admit_watermark=tier["admit_watermark"],
            custom_ceiling=config["memory.custom_ceiling"],
            margin_floor=config["memory.transient_margin"],
            margin_share=config["memory.transient_margin_share"],
            buffer_cache_share=config["memory.buffer_cache_share"],
        )

    def margin(self, hard_bytes: int | None) -> int:
        """The transient margin charged on top of every estimate under ``hard_bytes``."""
        share = int(self.margin_share * hard_bytes) if hard_bytes else 0
        return max(self.margin_floor, share)

    def buffer_cache_cap(self, margin_bytes: int) -> int:
        """The most mlx's buffer cache may keep under a limit whose margin is
        ``margin_bytes``: buffers it keeps during a forward are resident, so they take
        their share of the margin and leave the rest for what no estimate counts."""
        return int(self.buffer_cache_share * margin_bytes)

    def reserve(self, total_bytes: int) -> int:
        return max(self.reserve_min, int(total_bytes * self.reserve_fraction))


@dataclass(frozen=True)
class ProbeReadings:
    """What the probes said. ``None``: not asked on this platform; a falsy
    :class:`ProbeUnavailable`: asked, and it failed."""

    system: str
    meminfo: probes.MeminfoResult | None = None
    mac: probes.MacMemoryResult | None = None
    metal_working_set: MetalWorkingSetResult | None = None
    cuda: probes.CudaMemoryResult | None = None
    cgroup: probes.CgroupResult | None = None
    footprint: probes.FootprintResult | None = None


def _failed(result: Any) -> bool:
    return isinstance(result, ProbeUnavailable)


def _host_memory(readings: ProbeReadings, notes: list[str]) -> tuple[int | None, int | None]:
    """(total RAM, reclaimable now) from the platform's own probe."""
    source = readings.mac if readings.system == "Darwin" else readings.meminfo
    if source is None:
        notes.append(f"no RAM probe for {readings.system}: static and dynamic ceilings are unset")
        return None, None
    if _failed(source):
        notes.append(f"RAM probe failed ({source.reason}): static and dynamic ceilings are unset")
        return None, None
    return source.total_bytes, source.reclaimable_bytes


def _cgroup_limit(readings: ProbeReadings, notes: list[str]) -> probes.CgroupMemory | None:
    cgroup = readings.cgroup
    if cgroup is None:
        return None
    if _failed(cgroup):
        notes.append(f"cgroup probe failed ({cgroup.reason}): no container limit is applied")
        return None
    return None if cgroup.limit_bytes is None else cgroup


def _device_ceiling(readings: ProbeReadings, cgroup: probes.CgroupMemory | None,
                    notes: list[str]) -> tuple[int | None, str | None]:
    """The smallest accelerator or container limit, and which kind it is."""
    candidates: dict[str, int] = {}
    if readings.system == "Darwin":
        mac = readings.mac
        if mac and mac.wired_limit_bytes is not None:
            candidates["metal"] = mac.wired_limit_bytes
        elif readings.metal_working_set is not None:
            if _failed(readings.metal_working_set):
                notes.append("Metal recommended working set unknown "
                             f"({readings.metal_working_set.reason}): no Metal device ceiling")
            else:
                candidates["metal"] = readings.metal_working_set
    if readings.cuda is not None:
        if _failed(readings.cuda):
            notes.append(f"CUDA memory unknown ({readings.cuda.reason}): no CUDA device ceiling")
        else:
            candidates["cuda"] = readings.cuda.total_bytes
    if cgroup is not None and cgroup.limit_bytes is not None:
        candidates["cgroup"] = cgroup.limit_bytes
    if not candidates:
        return None, None
    kind = min(candidates, key=lambda name: candidates[name])
    if len(candidates) > 1:
        others = ", ".join(f"{name} {format_size(value)}" for name, value in candidates.items()
                           if name != kind)
        notes.append(f"device ceiling is the {kind} limit; also seen: {others}")
    return candidates[kind], kind


def compute_ceilings(readings: ProbeReadings, policy: TierPolicy) -> CeilingBreakdown:
    """Every ceiling that the readings support, plus notes on the ones they do not."""
    notes: list[str] = []
    total, reclaimable = _host_memory(readings, notes)
    cgroup = _cgroup_limit(readings, notes)

    footprint: int | None = None
    if readings.footprint is not None and not _failed(readings.footprint):
        footprint = readings.footprint.rss_bytes
    elif readings.footprint is not None:
        notes.append(f"own footprint unknown ({readings.footprint.reason}): the dynamic "
                     "ceiling counts reclaimable memory only")

    if reclaimable is not None and cgroup is not None and cgroup.working_set_bytes is not None:
        # Inside a container MemAvailable describes the host; what this cgroup can still
        # take before the OOM killer acts is its limit less its working set.
        room = max(0, cgroup.limit_bytes - cgroup.working_set_bytes)
        if room < reclaimable:
            notes.append(f"reclaimable is the cgroup's room ({format_size(room)}), "
                         f"below the host's {format_size(reclaimable)}")
            reclaimable = room

    static = None if total is None else max(0, total - policy.reserve(total))
    dynamic = None
    if reclaimable is not None:
        dynamic = int((reclaimable + (footprint or 0)) * policy.dynamic_factor)
    device, device_kind = _device_ceiling(readings, cgroup, notes)

    custom = None
    if policy.name == "custom":
        if policy.custom_ceiling > 0:
            custom = policy.custom_ceiling
        else:
            notes.append("tier is custom but memory.custom_ceiling is 0: set it (or pass "
                         "--memory-ceiling) to pin a ceiling")
    elif policy.custom_ceiling > 0:
        notes.append(f"memory.custom_ceiling is ignored under tier {policy.name!r}; "
                     "set memory.tier = \"custom\" to use it")

    breakdown = CeilingBreakdown(
        static=static, dynamic=dynamic, device=device, custom=custom, tier=policy.name,
        total_ram=total, reclaimable=reclaimable, own_footprint=footprint,
        device_kind=device_kind, notes=tuple(notes))
    if breakdown.hard is None:
        breakdown = replace(breakdown, notes=(
            *notes, "no ceiling could be computed: requests are not limited by memory"))
    return breakdown


def _metal_working_set() -> MetalWorkingSetResult:
    if not metal_available():
        return ProbeUnavailable("metal", "Metal is not available to mlx")
    try:
        size = gpu_device_info().get("max_recommended_working_set_size")
    except (ImportError, RuntimeError) as error:
        return ProbeUnavailable("metal", str(error))
    if not isinstance(size, int) or size <= 0:
        return ProbeUnavailable("metal", "mx.device_info() has no max_recommended_working_set_size")
    return size


def read_probes(system: str | None = None) -> ProbeReadings:
    """Live readings of this machine, asking only the probes that apply to it."""
    system = system or platform.system()
    if system == "Darwin":
        return ProbeReadings(
            system=system, mac=probes.probe_macos_memory(system=system),
            metal_working_set=_metal_working_set(),
            footprint=probes.probe_process_footprint(system=system))
    return ProbeReadings(
        system=system,
        meminfo=probes.probe_linux_meminfo() if system == "Linux" else None,
        cuda=probes.probe_cuda_memory() if cuda_available() else None,
        cgroup=probes.probe_cgroup_limit() if system == "Linux" else None,
        footprint=probes.probe_process_footprint(system=system))
