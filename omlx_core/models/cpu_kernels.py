"""Vectorized softmax and SwiGLU primitives for mlx's CPU backend, built once from
``cpu_kernels.cpp``.

On the CPU backend mlx's elementwise kernels are scalar loops off Apple silicon, and the
exponentials of two calls dominate what is left of a batched decode step once the
matmuls are done: the attention softmax (16 rows over 400 keys: ~28 ms of a 127 ms step)
and the MLP's SiLU (~11 ms). The NumPy routes of :mod:`~omlx_core.models.attention` and
:mod:`~omlx_core.models.mlp_route` take the large calls (prefill chunks, verify steps) by
evaluating mid-forward, which would cost a plain decode step its overlap with the next
step's graph. These two primitives run inside the graph instead, so every other call
(plain decode steps, small chunks) gets a vectorized exponential without evaluating:
at a 16-row decode step's sizes the softmax runs 12.6x and the SwiGLU 18.4x as fast as
mlx's ops, and the default model's decode steps 1.14-1.38x at 8-16 rows
(``python -m benchmarks.cpu_kernels``, BENCHMARKS.md).

The extension is compiled against the installed mlx's headers and library with nanobind
(the same nanobind ABI and domain as mlx's own bindings, so it takes and returns
``mx.array``) into ``~/.cache/omlx-core/cpu-kernels/<key>/``, the key hashing the source,
the mlx and nanobind versions, the Python ABI and the compiler. ``./setup.sh`` builds it
(``python -m omlx_core.models.cpu_kernels``, ~10 s once); :func:`kernels` builds it on
first use otherwise. Where it cannot be built or loaded (no C++ compiler, no Python
headers, an mlx built with another nanobind ABI, not Linux), :func:`kernels` returns
``None``, says why once in the log, and the routes use mlx's ops as before.
``OMLX_CPU_KERNELS=0`` turns the kernels off (A/B measurements).

The encoder plugin's BERT forward takes three more (``gelu``, ``layer_norm``,
``packed_attention``: :mod:`omlx_core.plugins.encoder.cpu_routes`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

__all__ = ["DISABLE_ENV", "MODULE_NAME", "SOURCE", "build", "build_dir", "build_source",
           "kernels", "unavailable_reason", "using"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
MODULE_NAME = "_omlx_cpu_kernels"
#: ``OMLX_CPU_KERNELS=0`` keeps mlx's own ops (for A/B measurements).
DISABLE_ENV = "OMLX_CPU_KERNELS"
_COMPILER = os.environ.get("CXX", "g++")

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """The extension could not be built; the message says what is missing."""


def _versions() -> dict[str, str]:
    import mlx.core as mx
    import nanobind

    try:
        compiler = subprocess.run([_COMPILER, "-dumpfullversion", "-dumpversion"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"no C++ compiler ({_COMPILER}: {exc}); install g++ "
                               "(Debian: apt-get install g++)") from exc
    return {"mlx": mx.__version__, "nanobind": nanobind.__version__,
            "python": sysconfig.get_config_var("EXT_SUFFIX") or "", "compiler": compiler,
            "machine": platform.machine()}


def build_dir() -> Path:
    """Where this source, built for this mlx, nanobind, Python and compiler, lives."""
    from omlx_core.models.default import model_cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes())
    for name, value in sorted(_versions().items()):
        digest.update(f"{name}={value}\n".encode())
    return model_cache_dir() / "cpu-kernels" / digest.hexdigest()[:16]


def _library_path(directory: Path) -> Path:
    return directory / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _compile_command(output: Path, source: Path) -> list[str]:
    import mlx.core as mx
    import nanobind

    mlx_root = Path(mx.__file__).resolve().parent  # site-packages/mlx: include/, lib/
    nb_root = Path(nanobind.__file__).resolve().parent
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        raise KernelBuildError(f"no Python.h under {python_include}: install this Python's "
                               "headers (Debian: apt-get install python3-dev)")
    return [_COMPILER, "-std=c++20", "-O3", "-fPIC", "-shared", "-fvisibility=hidden",
            "-DNDEBUG", "-DNB_DOMAIN=mlx",  # mlx's bindings live in nanobind's "mlx" domain
            "-fno-math-errno", "-fno-trapping-math",
            # mlx rounds a product and a sum apart: so must the kernels that mirror it.
            "-ffp-contract=off",
            f"-I{nb_root / 'include'}", f"-I{nb_root / 'ext' / 'robin_map' / 'include'}",
            f"-I{mlx_root / 'include'}", f"-I{python_include}",
            str(source), str(nb_root / "src" / "nb_combined.cpp"),
            f"-L{mlx_root / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_root / 'lib'}",
            "-o", str(output)]


def build(*, force: bool = False, announce=print) -> Path:
    """Compile the extension unless this build of it exists; its path. Concurrent callers
    (ranks, test workers) wait for one build under a file lock."""
    if sys.platform != "linux":
        raise KernelBuildError("the CPU kernels are built on Linux only (other platforms "
                               "use mlx's ops)")
    if shutil.which(_COMPILER) is None:
        raise KernelBuildError(f"no C++ compiler ({_COMPILER} is not on PATH); install g++ "
                               "(Debian: apt-get install g++)")
    directory = build_dir()
    library = _library_path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file() and not force:
            return library
        announce(f"== building the CPU kernels (once, ~10 s) into {directory}")
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            output = Path(scratch) / library.name
            _compile(SOURCE, output)
            os.replace(output, library)
    return library


def _compile(source: Path, output: Path) -> None:
    result = subprocess.run(_compile_command(output, source), capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelBuildError(f"{_COMPILER} failed ({result.returncode}):\n"
                               f"{result.stderr[-4000:]}")


def build_source(source: Path, directory: Path) -> ModuleType:
    """The kernels built from another ``source`` (a past revision's, for a paired
    benchmark) into ``directory`` and imported beside the ones :func:`kernels` loads.

    :raises KernelBuildError: it did not compile (the compiler's message)."""
    library = _library_path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _compile(source, library)
    module = _import(library)
    _self_check(module)
    return module


@contextmanager
def using(module: ModuleType | None) -> Iterator[None]:
    """:func:`kernels` answers ``module`` inside the block (``None``: mlx's ops), for
    paired measurements in one process; what it answered before, after."""
    kernels()
    before = _loaded["module"]
    _loaded["module"] = module
    try:
        yield
    finally:
        _loaded["module"] = before


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_check(module: ModuleType) -> None:
    """The primitives take mlx's arrays (the nanobind ABI matches) and compute what mlx
    does."""
    import mlx.core as mx

    x = mx.array([[0.5, -1.0, 2.0, -80.0, 3.0, 0.0, 1.0, -2.0, 4.0]], dtype=mx.float32)
    try:
        got = module.softmax(x)
        gated = module.swiglu(x, x * 2.0)
    except TypeError as exc:
        raise KernelBuildError(f"the extension does not take mlx's arrays (a nanobind "
                               f"ABI other than mlx's?): {exc}") from exc
    want = mx.softmax(x, axis=-1, precise=True)
    want_gated = x * mx.sigmoid(x) * (x * 2.0)
    if not (mx.allclose(got, want, rtol=1e-5, atol=1e-7).item()
            and mx.allclose(gated, want_gated, rtol=1e-5, atol=1e-6).item()):
        raise KernelBuildError("the extension's softmax or SwiGLU differs from mlx's")


def kernels() -> ModuleType | None:
    """The loaded extension (``softmax(x)``, ``swiglu(gate, x)`` and the others of
    ``cpu_kernels.cpp``), built on first use; or
    ``None`` where it cannot be (:func:`unavailable_reason` says why)."""
    if "module" in _loaded:  # every attention and MLP call asks: no lock once loaded
        return _loaded["module"]  # type: ignore[return-value]
    with _lock:
        if "module" in _loaded:
            return _loaded["module"]  # type: ignore[return-value]
        module = None
        reason = None
        if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            reason = f"turned off by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        else:
            try:
                module = _import(build(announce=logger.info))
                _self_check(module)
            except (KernelBuildError, ImportError, OSError) as exc:
                module, reason = None, str(exc)
        if reason is not None:
            logger.warning("CPU kernels unavailable, mlx's softmax and SiLU are used: %s", reason)
        _loaded["module"], _loaded["reason"] = module, reason
        return module


def unavailable_reason() -> str | None:
    """Why :func:`kernels` returned ``None`` (``None`` if it loaded or was not asked)."""
    return _loaded.get("reason")  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m omlx_core.models.cpu_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if built")
    args = parser.parse_args(argv)
    try:
        library = build(force=args.force, announce=print)
        _self_check(_import(library))
    except (KernelBuildError, ImportError, OSError) as exc:
        print(f"CPU kernels not built: {exc}\nomlx-core runs without them (mlx's ops); "
              "the decode step is slower on the CPU backend.", file=sys.stderr)
        return 1
    print(f"CPU kernels ready: {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
