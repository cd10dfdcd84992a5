"""Which BLAS serves mlx's CPU matmuls, and swapping in an optimized one.

The ``mlx-cpu`` wheel links the netlib *reference* BLAS, about 80x slower than
OpenBLAS on a prefill-sized matmul. mlx resolves ``cblas_sgemm`` through the global
symbol scope first, so a library in ``LD_PRELOAD`` wins over the bundled one. The
preload must be in place before the dynamic loader maps mlx, which only a fresh
process guarantees: :func:`ensure_optimized_blas` re-executes the interpreter once
with ``LD_PRELOAD`` set. This module must not import mlx at import time.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BLAS_LIBRARY_ENV = "OMLX_BLAS_LIBRARY"
REEXEC_MARKER_ENV = "OMLX_BLAS_REEXEC"
NO_REEXEC_ENV = "OMLX_NO_BLAS_REEXEC"

DEBIAN_OPENBLAS_PACKAGE = "libopenblas0-pthread"
INSTALL_HINT = (
    f"apt-get install {DEBIAN_OPENBLAS_PACKAGE} "
    f"(or set {BLAS_LIBRARY_ENV}=/path/to/libopenblas.so.0)"
)

OPTIMIZED_KINDS = frozenset({"openblas", "mkl", "blis", "accelerate"})

_MULTIARCH_TRIPLETS = {
    "x86_64": "x86_64-linux-gnu",
    "amd64": "x86_64-linux-gnu",
    "aarch64": "aarch64-linux-gnu",
    "arm64": "aarch64-linux-gnu",
}

# Threading flavours in order of preference: pthread and openmp use every core, serial one.
_DEBIAN_OPENBLAS_DIRS = ("openblas-pthread", "openblas-openmp", "openblas-serial")
_OTHER_DISTRO_CANDIDATES = (
    "usr/lib64/libopenblasp.so.0",  # Fedora/RHEL, pthread
    "usr/lib64/libopenblaso.so.0",  # Fedora/RHEL, openmp
    "usr/lib64/libopenblas.so.0",
    "usr/lib/libopenblas.so.0",  # Arch
    "usr/local/lib/libopenblas.so.0",  # built from source
)

# Preference when several BLAS libraries are mapped: an optimized one that is mapped at
# all was preloaded (or loaded globally) and shadows the bundled reference library.
_KIND_PRIORITY = ("mkl", "blis", "openblas", "accelerate", "reference")


@dataclass(frozen=True)
class MappedBlas:
    """A BLAS library mapped into a process: its kind and file."""

    kind: str
    path: str


def classify_blas_path(path: str) -> str | None:
    """The BLAS kind of a shared-library path, or None when it cannot serve mlx's calls.

    Kinds: ``openblas``, ``mkl``, ``blis``, ``accelerate``, ``reference``.
    """
    lowered = path.lower()
    name = lowered.rsplit("/", 1)[-1]
    if "accelerate.framework" in lowered or "veclib" in lowered:
        return "accelerate"
    # numpy/scipy wheels vendor OpenBLAS with prefixed or ILP64-suffixed symbols (e.g.
    # scipy_cblas_sgemm64_): mapped, but never the library answering mlx's cblas_sgemm.
    if "scipy_openblas" in name or "openblas64" in name:
        return None
    if name.startswith("libmkl_rt") or name.startswith("libmkl_core"):
        return "mkl"
    if name.startswith("libblis"):
        return "blis"
    if "openblas" in lowered:
        return "openblas"
    if name.startswith("libblas") or name.startswith("libcblas"):
        return "reference"
    return None


def mapped_blas_libraries(maps_text: str) -> list[MappedBlas]:
    """The distinct BLAS libraries named in the text of a ``/proc/<pid>/maps`` file."""
    found: dict[str, MappedBlas] = {}
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].strip()
        kind = classify_blas_path(path)
        if kind is not None and path not in found:
            found[path] = MappedBlas(kind, path)
    return list(found.values())


def _read_maps(maps_path: Path) -> str | None:
    try:
        return maps_path.read_text(errors="replace")
    except OSError as error:
        logger.debug("cannot read %s: %s", maps_path, error)
        return None


def _preferred(libraries: list[MappedBlas]) -> MappedBlas | None:
    for kind in _KIND_PRIORITY:
        for library in libraries:
            if library.kind == kind:
                return library
    return None


def blas_library_in_use(maps_path: Path | None = None) -> MappedBlas | None:
    """The BLAS library that serves this process's CPU matmuls, or None if none is mapped
    (mlx not imported yet) or the maps file is unreadable.

    ``maps_path`` defaults to ``/proc/self/maps``; on macOS mlx always uses Accelerate.
    """
    if maps_path is None and sys.platform == "darwin":
        return MappedBlas("accelerate", "/System/Library/Frameworks/Accelerate.framework")
    text = _read_maps(maps_path or Path("/proc/self/maps"))
    return _preferred(mapped_blas_libraries(text)) if text is not None else None


def blas_in_use(maps_path: Path | None = None) -> str:
    """The kind of BLAS serving CPU matmuls: ``openblas``, ``mkl``, ``blis``,
    ``accelerate``, ``reference``, ``none`` (no BLAS mapped yet: mlx not imported) or
    ``unknown`` (the maps file could not be read)."""
    if maps_path is None and sys.platform == "darwin":
        return "accelerate"
    text = _read_maps(maps_path or Path("/proc/self/maps"))
    if text is None:
        return "unknown"
    library = _preferred(mapped_blas_libraries(text))
    return library.kind if library else "none"


def find_optimized_blas(root: Path = Path("/"), machine: str | None = None) -> Path | None:
    """An optimized BLAS shared library to preload, or None.

    ``$OMLX_BLAS_LIBRARY`` wins when it names an existing file; otherwise the Debian/Ubuntu
    OpenBLAS flavours for this architecture, then common paths of other distributions.
    ``root`` and ``machine`` let tests describe another file system.
    """
    override = os.environ.get(BLAS_LIBRARY_ENV, "").strip()
    if override:
        if Path(override).is_file():
            return Path(override)
        logger.warning(
            "%s=%s is not a file; looking for OpenBLAS in the usual places instead",
            BLAS_LIBRARY_ENV,
            override,
        )
    triplet = _MULTIARCH_TRIPLETS.get((machine or platform.machine()).lower())
    candidates: list[str] = []
    if triplet:
        candidates += [f"usr/lib/{triplet}/{flavour}/libopenblas.so.0" for flavour in _DEBIAN_OPENBLAS_DIRS]
        candidates.append(f"usr/lib/{triplet}/libopenblas.so.0")
    candidates += _OTHER_DISTRO_CANDIDATES
    for candidate in candidates:
        path = root / candidate
        if path.is_file():
            return path
    return None


def _split_preload(value: str) -> list[str]:
    # ld.so accepts both spaces and colons between LD_PRELOAD entries.
    return [entry for entry in re.split(r"[\s:]+", value) if entry]


def preloaded_optimized_blas(env: Mapping[str, str]) -> str | None:
    """The first optimized BLAS named in ``env['LD_PRELOAD']``, or None."""
    for entry in _split_preload(env.get("LD_PRELOAD", "")):
        kind = classify_blas_path(os.path.realpath(entry))
        if kind in OPTIMIZED_KINDS:
            return entry
    return None


def preload_environment(env: Mapping[str, str], library: Path) -> dict[str, str]:
    """A copy of ``env`` with ``library`` first in ``LD_PRELOAD`` and the re-exec marker set."""
    new_env = dict(env)
    existing = env.get("LD_PRELOAD", "").strip()
    new_env["LD_PRELOAD"] = f"{library}:{existing}" if existing else str(library)
    new_env[REEXEC_MARKER_ENV] = "1"
    return new_env


def ensure_optimized_blas(argv: Sequence[str] | None = None) -> None:
    """Re-execute this process once with an optimized BLAS preloaded, if one is installed.

    Call it first thing in the CLI, before anything imports mlx. ``argv`` is what follows
    the interpreter on the command line; the default, ``sys.orig_argv[1:]``, keeps
    ``-m package`` and ``-X`` options intact (``sys.argv`` also works for a console
    script). Returns without re-executing on non-Linux systems, when
    ``OMLX_NO_BLAS_REEXEC=1``, after the one re-exec (``OMLX_BLAS_REEXEC=1``), when an
    optimized BLAS is already preloaded, and when none is installed (with a warning).
    """
    if not sys.platform.startswith("linux"):
        return
    if os.environ.get(NO_REEXEC_ENV) == "1":
        logger.debug("%s=1: keeping the BLAS this process started with", NO_REEXEC_ENV)
        return
    if os.environ.get(REEXEC_MARKER_ENV) == "1":
        # A preloaded library is mapped before any Python runs, so it must show by now.
        if blas_in_use() not in OPTIMIZED_KINDS:
            logger.warning(
                "re-executed with LD_PRELOAD=%r, but no optimized BLAS is mapped (the "
                "dynamic loader ignored it, or it was removed); CPU matmuls will use the "
                "reference BLAS. Fix: %s",
                os.environ.get("LD_PRELOAD", ""),
                INSTALL_HINT,
            )
        return
    if preloaded_optimized_blas(os.environ) or blas_in_use() in OPTIMIZED_KINDS:
        return
    library = find_optimized_blas()
    if library is None:
        logger.warning(
            "no optimized BLAS found: CPU matmuls use mlx's bundled reference BLAS, about "
            "80x slower. Fix: %s", INSTALL_HINT,
        )
        return
    if not sys.executable:
        logger.warning("cannot re-execute to preload %s: sys.executable is unknown", library)
        return
    args = list(argv) if argv is not None else list(sys.orig_argv[1:])
    logger.info("re-executing with LD_PRELOAD=%s for fast CPU matmuls", library)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], preload_environment(os.environ, library))


def matmul_benchmark_ms(repeats: int = 5) -> float:
    """Median milliseconds of a 256x576 @ 576x1536 float32 matmul on the CPU device.

    The shape is one prefill chunk through a small model's MLP: the reference BLAS takes
    ~80 ms on it, OpenBLAS ~2 ms.
    """
    import mlx.core as mx

    with mx.stream(mx.cpu):
        key_a, key_b = mx.random.split(mx.random.key(0))
        left = mx.random.normal((256, 576), key=key_a)
        right = mx.random.normal((576, 1536), key=key_b)
        mx.eval(left, right)
        mx.eval(left @ right)
        timings = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            mx.eval(left @ right)
            timings.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(timings)
