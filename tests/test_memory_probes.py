"""Memory probes against fake /proc and /sys/fs/cgroup trees, plus the live machine."""

from __future__ import annotations

import mmap
import subprocess
from pathlib import Path

import pytest

from omlx_core.memory.probes import (
    CgroupMemory,
    CudaMemory,
    LinuxMeminfo,
    MacMemory,
    ProbeUnavailable,
    ProcessFootprint,
    probe_cgroup_limit,
    probe_cuda_memory,
    probe_linux_meminfo,
    probe_macos_memory,
    probe_process_footprint,
)

GIB = 1024**3
MIB = 1024**2
V1_UNLIMITED = "9223372036854771712"


def write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def mountinfo_line(mount_root: str, mountpoint: str, fstype: str, superopts: str) -> str:
    return f"35 31 0:32 {mount_root} {mountpoint} rw,relatime - {fstype} {fstype} {superopts}\n"


# --- /proc/meminfo ---------------------------------------------------------------------

MEMINFO = """\
MemTotal:       16384000 kB
MemFree:         2048000 kB
MemAvailable:    8192000 kB
Buffers:          100000 kB
Cached:          4000000 kB
SwapTotal:       1024000 kB
SwapFree:         512000 kB
"""


def test_meminfo_reads_total_available_and_reclaimable(tmp_path: Path) -> None:
    write(tmp_path, "proc/meminfo", MEMINFO)
    meminfo = probe_linux_meminfo(tmp_path)
    assert meminfo == LinuxMeminfo(
        total_bytes=16384000 * 1024,
        available_bytes=8192000 * 1024,
        free_bytes=2048000 * 1024,
        reclaimable_bytes=8192000 * 1024,
        swap_total_bytes=1024000 * 1024,
        swap_free_bytes=512000 * 1024,
        available_estimated=False,
    )


def test_meminfo_without_memavailable_estimates_from_free_and_caches(tmp_path: Path) -> None:
    write(tmp_path, "proc/meminfo", "\n".join(l for l in MEMINFO.splitlines() if "MemAvailable" not in l))
    meminfo = probe_linux_meminfo(tmp_path)
    assert meminfo.available_estimated
    assert meminfo.available_bytes == (2048000 + 100000 + 4000000) * 1024


@pytest.mark.parametrize("content", [None, "garbage without colons\n", "MemFree: lots kB\n"])
def test_meminfo_missing_or_garbage_is_unavailable_with_reason(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        write(tmp_path, "proc/meminfo", content)
    result = probe_linux_meminfo(tmp_path)
    assert isinstance(result, ProbeUnavailable) and not result
    assert "meminfo" in result.reason


def test_meminfo_of_this_machine_is_plausible() -> None:
    meminfo = probe_linux_meminfo()
    if not meminfo:
        pytest.skip(f"no /proc/meminfo here: {meminfo.reason}")
    assert 0 < meminfo.available_bytes <= meminfo.total_bytes


# --- cgroups ---------------------------------------------------------------------------


def make_cgroup_v2(root: Path, cgroup_path: str, limits: dict[str, str], mount_root: str = "/") -> Path:
    """A v2 hierarchy at /sys/fs/cgroup; ``limits`` maps a cgroup path to its memory.max."""
    write(root, "proc/self/cgroup", f"0::{cgroup_path}\n")
    write(root, "proc/self/mountinfo", mountinfo_line(mount_root, "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate"))
    base = root / "sys/fs/cgroup"
    write(base, "cgroup.controllers", "cpu io memory pids\n")
    for path, limit in limits.items():
        directory = base / path.strip("/") if path.strip("/") else base
        write(directory, "memory.max", limit + "\n")
        write(directory, "cgroup.controllers", "memory\n")
    return base


def test_cgroup_v2_takes_the_tightest_limit_up_the_hierarchy(tmp_path: Path) -> None:
    base = make_cgroup_v2(
        tmp_path, "/user.slice/app.scope", {"/user.slice": str(1 * GIB), "/user.slice/app.scope": str(2 * GIB)}
    )
    own = base / "user.slice/app.scope"
    write(own, "memory.current", str(700 * MIB))
    write(own, "memory.stat", f"anon 123\ninactive_file {200 * MIB}\nactive_file 5\n")
    cgroup = probe_cgroup_limit(tmp_path)
    assert isinstance(cgroup, CgroupMemory)
    assert (cgroup.version, cgroup.path, cgroup.limit_bytes) == (2, own, 1 * GIB)
    assert cgroup.limiting_path == base / "user.slice"
    assert cgroup.usage_bytes == 700 * MIB
    assert cgroup.working_set_bytes == 500 * MIB
    assert not cgroup.unlimited


def test_cgroup_v2_max_everywhere_is_unlimited(tmp_path: Path) -> None:
    base = make_cgroup_v2(tmp_path, "/app", {"/app": "max"})
    write(base / "app", "memory.current", "4096")
    cgroup = probe_cgroup_limit(tmp_path)
    assert cgroup and cgroup.unlimited and cgroup.limit_bytes is None
    assert cgroup.usage_bytes == 4096


def test_cgroup_v2_in_a_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    # In a container with its own cgroup namespace, /proc/self/cgroup says "/".
    base = make_cgroup_v2(tmp_path, "/", {"/": str(512 * MIB)})
    cgroup = probe_cgroup_limit(tmp_path)
    assert cgroup and cgroup.path == base and cgroup.limit_bytes == 512 * MIB


def test_cgroup_v2_host_path_under_a_container_mount_root(tmp_path: Path) -> None:
    # Without a cgroup namespace the host path is reported, but only that subtree is mounted.
    base = make_cgroup_v2(tmp_path, "/docker/abc123", {"/": str(3 * GIB)}, mount_root="/docker/abc123")
    cgroup = probe_cgroup_limit(tmp_path)
    assert cgroup and cgroup.path == base and cgroup.limit_bytes == 3 * GIB


def test_cgroup_v1_memory_controller_with_hierarchical_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "9:name=systemd:/\n4:memory:/jobs/job1\n1:cpu:/\n0::/\n")
    write(
        tmp_path,
        "proc/self/mountinfo",
        mountinfo_line("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")
        + mountinfo_line("/", "/sys/fs/cgroup/unified", "cgroup2", "rw"),
    )
    own = tmp_path / "sys/fs/cgroup/memory/jobs/job1"
    write(own, "memory.limit_in_bytes", str(1 * GIB))
    write(own, "memory.usage_in_bytes", str(300 * MIB))
    write(own, "memory.stat", f"cache 10\nhierarchical_memory_limit {768 * MIB}\ntotal_inactive_file {100 * MIB}\n")
    cgroup = probe_cgroup_limit(tmp_path)
    assert isinstance(cgroup, CgroupMemory)
    assert (cgroup.version, cgroup.path, cgroup.limit_bytes) == (1, own, 768 * MIB)
    assert (cgroup.usage_bytes, cgroup.working_set_bytes) == (300 * MIB, 200 * MIB)


def test_cgroup_v1_huge_limit_is_unlimited_and_mountinfo_is_optional(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "4:memory:/\n")
    own = tmp_path / "sys/fs/cgroup/memory"
    write(own, "memory.limit_in_bytes", V1_UNLIMITED)
    write(own, "memory.usage_in_bytes", "12345")
    write(own, "memory.stat", f"hierarchical_memory_limit {V1_UNLIMITED}\n")
    cgroup = probe_cgroup_limit(tmp_path)
    assert cgroup and cgroup.version == 1 and cgroup.unlimited and cgroup.usage_bytes == 12345


def test_cgroup_missing_everything_is_unavailable(tmp_path: Path) -> None:
    result = probe_cgroup_limit(tmp_path)
    assert isinstance(result, ProbeUnavailable) and not result
    assert "proc/self/cgroup" in result.reason


def test_cgroup_listed_but_not_mounted_is_unavailable(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "4:memory:/jobs/job1\n")
    result = probe_cgroup_limit(tmp_path)
    assert not result and "memory.limit_in_bytes" in result.reason


@pytest.mark.parametrize("garbage", ["lots\n", "-1\n", "", "12 34\n"])
def test_cgroup_garbage_limit_is_unavailable_not_an_exception(tmp_path: Path, garbage: str) -> None:
    make_cgroup_v2(tmp_path, "/app", {"/app": "max"})
    write(tmp_path, "sys/fs/cgroup/app/memory.max", garbage)
    result = probe_cgroup_limit(tmp_path)
    assert isinstance(result, ProbeUnavailable)
    assert "cannot parse" in result.reason and "memory.max" in result.reason


def test_cgroup_undecodable_proc_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_bytes(b"\xff\xfe\x00garbage")
    assert isinstance(probe_cgroup_limit(tmp_path), ProbeUnavailable)


def test_cgroup_of_this_process_never_raises() -> None:
    result = probe_cgroup_limit()
    assert isinstance(result, (CgroupMemory, ProbeUnavailable))


# --- macOS -----------------------------------------------------------------------------

VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               10000.
Pages active:                            200000.
Pages inactive:                           30000.
Pages speculative:                         5000.
Pages wired down:                         90000.
Pages purgeable:                           2000.
"Translation faults":                  12345678.
"""


def fake_macos(outputs: dict[str, str]):
    def run(args: list[str]) -> str:
        key = " ".join(args)
        if key not in outputs:
            raise subprocess.CalledProcessError(1, args, stderr="unknown oid")
        return outputs[key]

    return run


def test_macos_memory_from_sysctl_and_vm_stat() -> None:
    run = fake_macos(
        {"sysctl -n hw.memsize": "34359738368\n", "vm_stat": VM_STAT, "sysctl -n iogpu.wired_limit_mb": "24576\n"}
    )
    mac = probe_macos_memory(run=run, system="Darwin")
    assert mac == MacMemory(
        total_bytes=32 * GIB,
        reclaimable_bytes=(10000 + 30000 + 2000) * 16384,
        page_size=16384,
        wired_limit_bytes=24 * GIB,
    )


def test_macos_default_wired_limit_is_none() -> None:
    run = fake_macos({"sysctl -n hw.memsize": "17179869184", "vm_stat": VM_STAT, "sysctl -n iogpu.wired_limit_mb": "0"})
    assert probe_macos_memory(run=run, system="Darwin").wired_limit_bytes is None
    older = fake_macos({"sysctl -n hw.memsize": "17179869184", "vm_stat": VM_STAT})
    assert probe_macos_memory(run=older, system="Darwin").wired_limit_bytes is None


def test_macos_probe_failures_are_unavailable() -> None:
    assert "not macOS" in probe_macos_memory(system="Linux").reason
    broken = fake_macos({"sysctl -n hw.memsize": "many", "vm_stat": VM_STAT})
    assert not probe_macos_memory(run=broken, system="Darwin")
    no_header = fake_macos({"sysctl -n hw.memsize": "1024", "vm_stat": "Pages free: 3.\n"})
    assert "page size" in probe_macos_memory(run=no_header, system="Darwin").reason


# --- CUDA ------------------------------------------------------------------------------


def test_cuda_memory_from_device_info() -> None:
    info = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 85 * 10**9}
    assert probe_cuda_memory(info) == CudaMemory("NVIDIA H100 80GB HBM3", 85 * 10**9)
    assert probe_cuda_memory({"device_name": "x", "memory_size": 1024}).total_bytes == 1024


def test_cuda_memory_without_size_is_unavailable() -> None:
    result = probe_cuda_memory({"device_name": "AMD EPYC", "architecture": "x86_64"})
    assert not result and "no memory size" in result.reason


def test_cuda_probe_on_a_cpu_only_mlx_says_why() -> None:
    import mlx.core as mx

    if hasattr(mx, "cuda") and mx.cuda.is_available():
        pytest.skip("this machine has CUDA: covered by the device-info tests")
    result = probe_cuda_memory()
    assert isinstance(result, ProbeUnavailable) and "CUDA" in result.reason


# --- process footprint -----------------------------------------------------------------


def test_footprint_from_fake_proc_status(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/status", "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n")
    footprint = probe_process_footprint(tmp_path, system="Linux")
    assert footprint == ProcessFootprint(100 * MIB, 200 * MIB, "/proc/self/status")


def test_footprint_missing_vmrss_is_unavailable(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/status", "Name:\tkthread\n")
    assert "VmRSS" in probe_process_footprint(tmp_path, system="Linux").reason
    assert not probe_process_footprint(tmp_path / "nowhere", system="Linux")


def test_footprint_on_macos_uses_ps() -> None:
    footprint = probe_process_footprint(system="Darwin", run=lambda args: "  51200\n")
    assert footprint and footprint.rss_bytes == 50 * MIB and footprint.source == "ps + getrusage"


def test_footprint_of_this_process_tracks_an_allocation() -> None:
    before = probe_process_footprint()
    if not before:
        pytest.skip(f"no footprint probe here: {before.reason}")
    # A fresh anonymous mapping, written through: malloc could hand back pages an earlier
    # test freed, which are resident already and would not move the reading.
    ballast = mmap.mmap(-1, 64 * MIB)
    ballast.write(b"\x01" * (64 * MIB))
    after = probe_process_footprint()
    assert after.rss_bytes - before.rss_bytes >= 48 * MIB
    ballast.close()


# -- one module asks mlx -------------------------------------------------------------------

#: mlx calls that say which backend and devices mlx has, and what it holds
MLX_BACKEND_CALLS = ("get_active_memory", "get_cache_memory", "get_peak_memory",
                     "reset_peak_memory", "set_cache_limit", "set_memory_limit",
                     "set_wired_limit", "clear_cache", "device_info", "default_device",
                     "is_available")


def test_only_the_backend_module_asks_mlx_about_backends_devices_and_memory():
    """The memory guard, the configuration and the platform report ask
    ``omlx_core.platform.backend``; none of them imports mlx itself (``blas`` times a
    matmul with it, which is not a question about the backend)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "omlx_core"
    allowed = {root / "platform" / "backend.py", root / "platform" / "blas.py"}
    offenders = []
    for folder in ("memory", "config", "platform"):
        for path in sorted((root / folder).rglob("*.py")):
            if path in allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                called = (node.attr if isinstance(node, ast.Attribute)
                          and node.attr in MLX_BACKEND_CALLS
                          and isinstance(node.value, ast.Name) and node.value.id == "mx" else None)
                if any(name == "mlx" or name.startswith("mlx.") for name in names) or called:
                    offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not offenders, "mlx asked outside omlx_core/platform/backend.py:\n" + "\n".join(offenders)
