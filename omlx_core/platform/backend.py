"""What mlx runs on here: versions, default device, accelerators, the host platform."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

# The wheel that carries mlx's compiled backend; `mlx` itself is only the front.
_BACKEND_DISTRIBUTIONS = ("mlx-metal", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda", "mlx-cpu")


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
    try:
        import mlx.core as mx
    except ImportError as error:
        raise ImportError(
            f"mlx is not importable ({error}); install it with "
            "pip install 'mlx[cpu]' (Linux CPU), 'mlx[cuda13]' (NVIDIA) or 'mlx' (macOS)"
        ) from error
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
        "metal_available": bool(mx.metal.is_available()) if hasattr(mx, "metal") else False,
        # None: this mlx build has no CUDA module at all.
        "cuda_available": bool(cuda.is_available()) if cuda is not None else None,
        "device_info": device_info,
        "os": platform.system(),
        "os_release": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
    }
