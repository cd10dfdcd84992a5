"""What mlx runs on here, and the one place that asks it.

Every question to mlx about its backend (Metal, CUDA, CPU), its devices and its memory
counters goes through this module; the memory guard, the ceilings, the probes and the
tier picker import these functions instead of probing ``mlx.core`` themselves. Each
one works without mlx installed (a CPU answer, zero bytes, or an error that says how
to install it), so the modules above can be imported and tested anywhere.

Memory counters are read by the enforcer's thread and the MLX thread; the HTTP request
thread reads only the enforcer's published limit snapshot, never these.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from types import ModuleType
from typing import Any, Mapping

# The wheel that carries mlx's compiled backend; `mlx` itself is only the front.
_BACKEND_DISTRIBUTIONS = ("mlx-metal", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda", "mlx-cpu")

INSTALL_HINT = ("install it with pip install 'mlx[cpu]' (Linux CPU), 'mlx[cuda13]' (NVIDIA) "
                "or 'mlx' (macOS)")


def _mlx() -> ModuleType | None:
    try:
        import mlx.core as mx
    except ImportError:
        return None
    return mx


def _require_mlx() -> ModuleType:
    try:
        import mlx.core as mx
    except ImportError as error:
        raise ImportError(f"mlx is not importable ({error}); {INSTALL_HINT}") from error
    return mx


# -- backends and devices ------------------------------------------------------------------


def metal_available() -> bool:
    """Whether this mlx runs on Metal (False without mlx)."""
    mx = _mlx()
    return bool(mx is not None and hasattr(mx, "metal") and mx.metal.is_available())


def cuda_available() -> bool:
    """Whether this mlx has a CUDA backend with a device (False without mlx)."""
    mx = _mlx()
    cuda = getattr(mx, "cuda", None) if mx is not None else None
    return bool(cuda is not None and cuda.is_available())


def mlx_backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where mlx runs prefills in this process."""
    mx = _mlx()
    if mx is None or mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return "metal" if metal_available() else "cuda"


def gpu_device_info() -> Mapping[str, Any]:
    """``mx.device_info()`` of the GPU.

    :raises ImportError: mlx is missing (the message says how to install it).
    :raises RuntimeError: mlx has no GPU here, or refused the query.
    """
    mx = _require_mlx()
    if not (metal_available() or cuda_available()):
        raise RuntimeError("this mlx has no GPU backend (no Metal, no CUDA)")
    try:
        return mx.device_info(mx.gpu)
    except Exception as error:  # an mlx runtime error must not take a caller down
        raise RuntimeError(f"mx.device_info(mx.gpu) failed: {error}") from error


# -- memory counters -------------------------------------------------------------------------


def active_bytes() -> int:
    """Bytes mlx holds in live arrays (0 without mlx)."""
    mx = _mlx()
    return int(mx.get_active_memory()) if mx is not None else 0


def cache_bytes() -> int:
    """Bytes in mlx's buffer cache: freed buffers it keeps for reuse (0 without mlx)."""
    mx = _mlx()
    return int(mx.get_cache_memory()) if mx is not None else 0


def held_bytes() -> int:
    """What mlx holds: its live arrays and its buffer cache (0 without mlx)."""
    mx = _mlx()
    return int(mx.get_active_memory()) + int(mx.get_cache_memory()) if mx is not None else 0


def peak_bytes() -> int:
    """The most mlx has held in live arrays since its peak was last reset."""
    return int(_require_mlx().get_peak_memory())


def limit_cache(nbytes: int) -> None:
    """Cap mlx's buffer cache at ``nbytes`` (freed buffers past it go back at once)."""
    mx = _mlx()
    if mx is not None:
        mx.set_cache_limit(max(0, int(nbytes)))


def clear_cache() -> None:
    """Hand mlx's buffer cache back to the system."""
    mx = _mlx()
    if mx is not None:
        mx.clear_cache()


# -- the report ------------------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed_backend_wheels() -> list[str]:
    return [name for name in _BACKEND_DISTRIBUTIONS if _distribution_version(name) is not None]


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def backend_info() -> dict[str, Any]:
    """mlx and mlx-lm versions, backend wheel, default device, Metal/CUDA availability,
    ``mx.device_info()`` of the default device, and the host OS, machine and Python.

    Raises ``ImportError`` with the install command when mlx is missing.
    """
    mx = _require_mlx()
    default_device = mx.default_device()
    cuda = getattr(mx, "cuda", None)
    try:
        device_info = {key: _jsonable(value) for key, value in mx.device_info(default_device).items()}
    except Exception as error:  # older mlx lacks device_info, some backends refuse it
        device_info = {"error": f"{type(error).__name__}: {error}"}
    return {
        "mlx_version": _distribution_version("mlx") or getattr(mx, "__version__", None),
        "mlx_lm_version": _distribution_version("mlx-lm"),
        "backend_wheels": _installed_backend_wheels(),
        "default_device": "gpu" if default_device.type == mx.DeviceType.gpu else "cpu",
        "metal_available": metal_available(),
        # None: this mlx build has no CUDA module at all.
        "cuda_available": bool(cuda.is_available()) if cuda is not None else None,
        "device_info": device_info,
        "os": platform.system(),
        "os_release": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
    }
