"""Read-only probes of how much memory this machine, this cgroup and this process have.

Every probe returns a frozen dataclass on success, or a :class:`ProbeUnavailable` that
says why not. ``ProbeUnavailable`` is falsy, so ``if probe_cgroup_limit():`` reads
like a None check while the reason stays available for ``doctor`` and for naming a
missing ceiling. No probe raises. File-reading probes take ``root`` so tests can build
a fake ``/proc`` and ``/sys/fs/cgroup`` under a temporary directory.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Union

from omlx_core.platform.backend import cuda_available, gpu_device_info

logger = logging.getLogger(__name__)

# Kernels report "no limit" as the largest page-aligned counter (0x7FFFFFFFFFFFF000 on
# cgroup v1) or LONG_MAX; no real machine has 4 EiB, so anything that large is unlimited.
UNLIMITED_THRESHOLD = 1 << 62

RunCommand = Callable[[list[str]], str]


@dataclass(frozen=True)
class ProbeUnavailable:
    """A probe that could not measure: which one and why. Always falsy."""

    probe: str
    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class LinuxMeminfo:
    """System-wide memory from ``/proc/meminfo``, in bytes."""

    total_bytes: int
    available_bytes: int
    free_bytes: int
    # What could be handed to a new allocation without swapping: the kernel's MemAvailable.
    reclaimable_bytes: int
    swap_total_bytes: int
    swap_free_bytes: int
    # True on kernels older than 3.14, which lack MemAvailable: estimated from free + caches.
    available_estimated: bool = False


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit and usage of this process's own cgroup, in bytes."""

    version: int
    path: Path
    limit_bytes: int | None  # None: no limit anywhere up the hierarchy
    usage_bytes: int | None  # None: not reported (the root cgroup on v2)
    inactive_file_bytes: int | None  # page cache the kernel drops before it OOM-kills
    limiting_path: Path | None = None  # the cgroup directory whose limit binds

    @property
    def unlimited(self) -> bool:
        return self.limit_bytes is None

    @property
    def working_set_bytes(self) -> int | None:
        """Usage minus inactive page cache: what the OOM killer weighs against the limit."""
        if self.usage_bytes is None:
            return None
        return max(0, self.usage_bytes - (self.inactive_file_bytes or 0))


@dataclass(frozen=True)
class MacMemory:
    """macOS unified memory, in bytes."""

    total_bytes: int
    reclaimable_bytes: int  # (free + inactive + purgeable) pages
    page_size: int
    # None: iogpu.wired_limit_mb is 0 or absent, so the OS default GPU wired limit applies.
    wired_limit_bytes: int | None


@dataclass(frozen=True)
class CudaMemory:
    """The CUDA device mlx runs on, as ``mx.device_info()`` reports it."""

    device_name: str
    total_bytes: int


@dataclass(frozen=True)
class ProcessFootprint:
    """This process's resident memory, in bytes."""

    rss_bytes: int
    peak_rss_bytes: int | None
    source: str


MeminfoResult = Union[LinuxMeminfo, ProbeUnavailable]
CgroupResult = Union[CgroupMemory, ProbeUnavailable]
MacMemoryResult = Union[MacMemory, ProbeUnavailable]
CudaMemoryResult = Union[CudaMemory, ProbeUnavailable]
FootprintResult = Union[ProcessFootprint, ProbeUnavailable]


def _unavailable(probe: str, reason: str) -> ProbeUnavailable:
    logger.debug("memory probe %s unavailable: %s", probe, reason)
    return ProbeUnavailable(probe, reason)


def _run_command(args: list[str]) -> str:
    return subprocess.run(args, capture_output=True, text=True, timeout=5, check=True).stdout


def parse_kib_fields(text: str) -> dict[str, int]:
    """``Key:   1234 kB`` lines (``/proc/meminfo``, ``/proc/<pid>/status``) -> bytes; a
    line without a unit (``Threads:  12``) keeps its number as it is."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        values[key.strip()] = int(parts[0]) * (1024 if unit == "kb" else 1)
    return values


def probe_linux_meminfo(root: Path = Path("/")) -> MeminfoResult:
    """Total, available and reclaimable system memory from ``/proc/meminfo``."""
    path = root / "proc/meminfo"
    try:
        fields = parse_kib_fields(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        return _unavailable("meminfo", f"cannot read {path}: {error}")
    if "MemTotal" not in fields or "MemFree" not in fields:
        return _unavailable("meminfo", f"{path} has no MemTotal/MemFree lines")
    estimated = "MemAvailable" not in fields
    available = (
        fields["MemAvailable"]
        if not estimated
        else fields["MemFree"] + fields.get("Buffers", 0) + fields.get("Cached", 0)
    )
    return LinuxMeminfo(
        total_bytes=fields["MemTotal"],
        available_bytes=available,
        free_bytes=fields["MemFree"],
        reclaimable_bytes=available,
        swap_total_bytes=fields.get("SwapTotal", 0),
        swap_free_bytes=fields.get("SwapFree", 0),
        available_estimated=estimated,
    )


@dataclass(frozen=True)
class _CgroupMount:
    mount_root: str  # the part of the hierarchy this mount shows
    mountpoint: str


def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _cgroup_mounts(root: Path) -> dict[int, _CgroupMount]:
    """Version -> the mount of the v2 hierarchy and of the v1 memory controller."""
    mounts: dict[int, _CgroupMount] = {}
    try:
        text = (root / "proc/self/mountinfo").read_text()
    except (OSError, UnicodeDecodeError):
        return mounts
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, fs_fields = before.split(), after.split()
        if not sep or len(fields) < 5 or len(fs_fields) < 3:
            continue
        mount = _CgroupMount(_unescape_mountinfo(fields[3]), _unescape_mountinfo(fields[4]))
        if fs_fields[0] == "cgroup2":
            mounts.setdefault(2, mount)
        elif fs_fields[0] == "cgroup" and "memory" in fs_fields[2].split(","):
            mounts.setdefault(1, mount)
    return mounts


def _cgroup_directory(root: Path, mount: _CgroupMount, cgroup_path: str) -> tuple[Path, Path]:
    """(the mount's directory, this process's cgroup directory under it)."""
    base = root / mount.mountpoint.lstrip("/")
    try:
        relative = PurePosixPath(cgroup_path).relative_to(mount.mount_root)
    except ValueError:
        # Our cgroup lies outside the mounted subtree (a cgroup namespace): the mount is our view.
        return base, base
    directory = base / relative
    # Some containers report the host path in /proc/self/cgroup but mount only their own subtree.
    return base, directory if directory.is_dir() else base


def _read_limit(path: Path) -> int | None:
    """A limit file's value; None for unlimited. Raises ValueError on garbage."""
    text = path.read_text().strip()
    if text == "max":
        return None
    if not text.isdigit():
        raise ValueError(f"cannot parse {path}: {text[:40]!r} is neither a number nor 'max'")
    value = int(text)
    return None if value >= UNLIMITED_THRESHOLD else value


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    stat: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stat[parts[0]] = int(parts[1])
    return stat


def _tightest_limit(base: Path, directory: Path, limit_file: str) -> tuple[int | None, Path | None, bool]:
    """The smallest limit from ``directory`` up to ``base``: (bytes, where, any file seen)."""
    tightest: int | None = None
    where: Path | None = None
    seen = False
    current = directory
    while True:
        limit_path = current / limit_file
        if limit_path.is_file():
            seen = True
            value = _read_limit(limit_path)
            if value is not None and (tightest is None or value < tightest):
                tightest, where = value, current
        if current == base or base not in current.parents:
            break
        current = current.parent
    return tightest, where, seen


def _probe_cgroup_v2(root: Path, mount: _CgroupMount, cgroup_path: str) -> CgroupResult:
    base, directory = _cgroup_directory(root, mount, cgroup_path)
    if not directory.is_dir():
        return _unavailable("cgroup", f"cgroup v2 directory {directory} does not exist")
    try:
        limit, where, seen = _tightest_limit(base, directory, "memory.max")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return _unavailable("cgroup", str(error))
    if not seen and not (directory / "cgroup.controllers").is_file():
        return _unavailable("cgroup", f"{directory} is not a cgroup v2 directory (no cgroup.controllers)")
    return CgroupMemory(
        version=2,
        path=directory,
        limit_bytes=limit,
        usage_bytes=_read_int(directory / "memory.current"),
        inactive_file_bytes=_read_stat(directory / "memory.stat").get("inactive_file"),
        limiting_path=where,
    )


def _probe_cgroup_v1(root: Path, mount: _CgroupMount, cgroup_path: str) -> CgroupResult:
    base, directory = _cgroup_directory(root, mount, cgroup_path)
    if not (directory / "memory.limit_in_bytes").is_file():
        return _unavailable("cgroup", f"no memory.limit_in_bytes in {directory}")
    try:
        limit, where, _ = _tightest_limit(base, directory, "memory.limit_in_bytes")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return _unavailable("cgroup", str(error))
    stat = _read_stat(directory / "memory.stat")
    # With use_hierarchy the kernel folds every ancestor's limit into this one value.
    hierarchical = stat.get("hierarchical_memory_limit")
    if hierarchical is not None and hierarchical < UNLIMITED_THRESHOLD and (limit is None or hierarchical < limit):
        limit, where = hierarchical, directory
    return CgroupMemory(
        version=1,
        path=directory,
        limit_bytes=limit,
        usage_bytes=_read_int(directory / "memory.usage_in_bytes"),
        inactive_file_bytes=stat.get("total_inactive_file", stat.get("inactive_file")),
        limiting_path=where,
    )


def probe_cgroup_limit(root: Path = Path("/")) -> CgroupResult:
    """The memory limit of this process's own cgroup (v1 memory controller or v2).

    On hybrid systems the memory controller lives on the v1 hierarchy, so v1 is tried
    first when ``/proc/self/cgroup`` lists it. An unlimited cgroup is a success with
    ``limit_bytes=None``.
    """
    path = root / "proc/self/cgroup"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        return _unavailable("cgroup", f"cannot read {path}: {error}")
    v1_path: str | None = None
    v2_path: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, cgroup_path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = cgroup_path
        elif "memory" in controllers.split(","):
            v1_path = cgroup_path
    if v1_path is None and v2_path is None:
        return _unavailable("cgroup", f"{path} names no memory controller and no cgroup v2 hierarchy")
    mounts = _cgroup_mounts(root)
    reasons: list[str] = []
    if v1_path is not None:
        result = _probe_cgroup_v1(root, mounts.get(1, _CgroupMount("/", "/sys/fs/cgroup/memory")), v1_path)
        if result:
            return result
        reasons.append(result.reason)
    if v2_path is not None:
        result = _probe_cgroup_v2(root, mounts.get(2, _CgroupMount("/", "/sys/fs/cgroup")), v2_path)
        if result:
            return result
        reasons.append(result.reason)
    return ProbeUnavailable("cgroup", "; ".join(reasons))


def _parse_vm_stat(text: str) -> tuple[int, dict[str, int]]:
    """``vm_stat`` output -> (page size, {"free": pages, "inactive": pages, ...})."""
    header = re.search(r"page size of (\d+) bytes", text)
    if not header:
        raise ValueError("vm_stat printed no page size")
    pages: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r'^"?Pages ([\w -]+?)"?:\s+(\d+)\.?\s*$', line.strip())
        if match:
            pages[match.group(1).strip()] = int(match.group(2))
    return int(header.group(1)), pages


def probe_macos_memory(run: RunCommand = _run_command, system: str | None = None) -> MacMemoryResult:
    """Total RAM, reclaimable pages and the GPU wired limit on macOS (``sysctl``, ``vm_stat``)."""
    system = system or platform.system()
    if system != "Darwin":
        return _unavailable("macos", f"not macOS ({system})")
    try:
        total = int(run(["sysctl", "-n", "hw.memsize"]).strip())
        page_size, pages = _parse_vm_stat(run(["vm_stat"]))
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return _unavailable("macos", f"sysctl/vm_stat failed: {error}")
    missing = [name for name in ("free", "inactive") if name not in pages]
    if missing:
        return _unavailable("macos", f"vm_stat reported no 'Pages {missing[0]}' line")
    reclaimable_pages = pages["free"] + pages["inactive"] + pages.get("purgeable", 0)
    wired_limit: int | None = None
    try:
        wired_mb = int(run(["sysctl", "-n", "iogpu.wired_limit_mb"]).strip())
        wired_limit = wired_mb * 1024 * 1024 if wired_mb > 0 else None
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        logger.debug("iogpu.wired_limit_mb unreadable (macOS < 14?): %s", error)
    return MacMemory(
        total_bytes=total,
        reclaimable_bytes=reclaimable_pages * page_size,
        page_size=page_size,
        wired_limit_bytes=wired_limit,
    )


def _mlx_cuda_device_info() -> Mapping[str, Any] | ProbeUnavailable:
    if not cuda_available():
        return _unavailable("cuda", "this mlx has no CUDA backend (install mlx[cuda13])")
    try:
        return gpu_device_info()
    except (ImportError, RuntimeError) as error:
        return _unavailable("cuda", str(error))


def probe_cuda_memory(device_info: Mapping[str, Any] | None = None) -> CudaMemoryResult:
    """The CUDA device's memory size from ``mx.device_info()``.

    ``device_info`` replaces the query to mlx (for tests and for callers that already hold it).
    """
    info = device_info if device_info is not None else _mlx_cuda_device_info()
    if isinstance(info, ProbeUnavailable):
        return info
    total = info.get("total_memory", info.get("memory_size"))
    if not isinstance(total, int) or total <= 0:
        return _unavailable("cuda", f"mx.device_info() reports no memory size (keys: {sorted(info)})")
    return CudaMemory(device_name=str(info.get("device_name", "unknown")), total_bytes=total)


def probe_process_footprint(
    root: Path = Path("/"), system: str | None = None, run: RunCommand = _run_command
) -> FootprintResult:
    """This process's resident set: ``/proc/self/status`` on Linux, ``ps`` and
    ``getrusage`` on macOS."""
    system = system or platform.system()
    if system == "Linux":
        path = root / "proc/self/status"
        try:
            fields = parse_kib_fields(path.read_text())
        except (OSError, UnicodeDecodeError) as error:
            return _unavailable("footprint", f"cannot read {path}: {error}")
        if "VmRSS" not in fields:
            return _unavailable("footprint", f"{path} has no VmRSS line")
        return ProcessFootprint(fields["VmRSS"], fields.get("VmHWM"), "/proc/self/status")
    if system == "Darwin":
        import resource

        # getrusage gives only the peak (in bytes on macOS); the current RSS comes from ps.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            rss_kib = int(run(["ps", "-o", "rss=", "-p", str(os.getpid())]).strip())
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            return _unavailable("footprint", f"ps failed: {error}")
        return ProcessFootprint(rss_kib * 1024, peak, "ps + getrusage")
    return _unavailable("footprint", f"no footprint probe for {system}")
