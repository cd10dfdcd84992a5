"""A stand-in ``torch`` that lets ``import xgrammar`` succeed where torch is not installed.

xgrammar 0.2.x declares ``torch`` as a dependency but needs it only at import time
(dtype constants, ``torch.Tensor`` in annotations, one ``torch.tensor(-1)`` constant)
and in helpers omlx-core never calls (its CUDA/Triton bitmask kernels,
``allocate_token_bitmask``). omlx-core keeps bitmasks in numpy int32 and applies them
in MLX, so a ~500 MB-2 GB torch wheel would be dead weight. ``install()`` puts a small
module tree under ``sys.modules["torch"]`` before xgrammar is imported; when a real
torch is importable it does nothing, so users who have torch keep it.

Everything here is inert: tensors cannot be built or used, and any attribute the stub
does not define raises ``AttributeError`` after one WARNING per name, so a future
xgrammar release that reaches for more of torch fails loudly and diagnosably.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
from typing import Any, NoReturn

log = logging.getLogger(__name__)

__all__ = ["STUB_VERSION", "TorchNotInstalled", "install", "installed", "is_stub"]

# Only torch.version.__version__ carries it. The top-level torch.__version__ is left
# undefined on purpose: transformers (loaded by mlx-lm in the same process) reads it when
# torch has no distribution metadata, and a stub without one is correctly judged "not
# installed" instead of "too old" (a warning on every start) or "usable" (a crash).
STUB_VERSION = "0.0.0+omlx.stub"

# tvm-ffi (xgrammar's FFI layer) JIT-builds a torch C-DLPack addon on import when it sees
# torch; with the stub there is nothing to build against.
TVM_FFI_ENV = "TVM_FFI_DISABLE_TORCH_C_DLPACK"

_MARKER = "__omlx_torch_stub__"

# Plain dtype names, then the aliases torch defines for them. tvm-ffi builds a dict
# keyed by these at import and probes the optional ones with hasattr, so all are defined
# (a probe of an undefined one would log the missing-attribute warning on every start).
_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
_DTYPE_ALIASES = {
    "short": "int16", "int": "int32", "long": "int64", "half": "float16",
    "float": "float32", "double": "float64", "cfloat": "complex64", "cdouble": "complex128",
}

_lock = threading.Lock()
_state: str | None = None  # None (not decided yet), "stub" or "real"
_warned: set[str] = set()
_warned_lock = threading.Lock()


class TorchNotInstalled(RuntimeError):
    """A torch feature was used but only omlx-core's import stub is present."""


def _unavailable(what: str) -> NoReturn:
    raise TorchNotInstalled(
        f"{what} needs PyTorch, which is not installed: omlx-core put an import stub in its "
        "place so that xgrammar imports without it. omlx-core never needs this call; if "
        "your code does, install torch (pip install torch) and restart the process"
    )


class dtype:  # noqa: N801 - torch's spelling, code compares against torch.dtype
    """A named dtype token: hashable, comparable by identity, usable as a dict key."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class Tensor:
    """``isinstance(x, torch.Tensor)`` is false for every real object; instances exist only
    as module-level placeholders (xgrammar builds one constant at import) and refuse use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _unavailable(f"torch.Tensor.{name}")

    def __repr__(self) -> str:
        return "<torch.Tensor placeholder (omlx-core torch stub)>"


def _placeholder_tensor(*args: Any, **kwargs: Any) -> Tensor:
    return Tensor()


def _raiser(qualified: str):
    def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        _unavailable(qualified)

    unavailable.__name__ = qualified.rsplit(".", 1)[-1]
    unavailable.__qualname__ = qualified
    return unavailable


def _compile(model: Any = None, **kwargs: Any) -> Any:
    # torch.compile is applied as a decorator at import of xgrammar's torch.compile kernel
    # module; calling the undecorated function then fails in the torch calls inside it.
    if model is None:
        return lambda fn: fn
    return model


class _StubLoader:
    """The loader named by every stub module's ``__spec__``: the modules are built in
    memory, so there is nothing to load or reload."""

    @staticmethod
    def create_module(spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = sys.modules.get(spec.name)
        if module is None or not getattr(module, _MARKER, False):
            raise ImportError(f"{spec.name} is part of omlx-core's torch stub and cannot be reloaded")
        return module

    @staticmethod
    def exec_module(module: types.ModuleType) -> None:
        pass


def _top_level_getattr(name: str) -> Any:
    # Dunder probes (copy, pickle, inspect, import machinery) are routine and not a sign
    # of a missing torch feature.
    if not (name.startswith("__") and name.endswith("__")):
        with _warned_lock:
            first = name not in _warned
            _warned.add(name)
        if first:
            log.warning(
                "torch.%s was requested, but torch is omlx-core's import stub (torch is not "
                "installed); the installed xgrammar may need a newer stub, or install torch",
                name,
            )
    raise AttributeError(f"module 'torch' has no attribute {name!r} (omlx-core torch stub)")


def _module(name: str, *, package: bool, attrs: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name, f"omlx-core's stand-in for {name} (torch is not installed)")
    spec = importlib.machinery.ModuleSpec(name, _StubLoader, is_package=package)
    if package:
        # An empty search path: importing a submodule the stub lacks fails with the
        # ordinary ModuleNotFoundError instead of finding something half-real.
        spec.submodule_search_locations = []
        module.__path__ = []
    module.__spec__ = spec
    module.__loader__ = _StubLoader
    module.__package__ = name if package else name.rpartition(".")[0]
    setattr(module, _MARKER, True)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _build_modules() -> dict[str, types.ModuleType]:
    dtypes = {name: dtype(name) for name in _DTYPES}
    dtypes.update({alias: dtypes[target] for alias, target in _DTYPE_ALIASES.items()})

    version = _module("torch.version", package=False, attrs={
        "__version__": STUB_VERSION, "cuda": None, "hip": None, "git_version": None,
    })
    cuda = _module("torch.cuda", package=True, attrs={
        "is_available": lambda: False,
        "device_count": lambda: 0,
        "current_stream": _raiser("torch.cuda.current_stream"),
        "get_device_properties": _raiser("torch.cuda.get_device_properties"),
        "Stream": type("Stream", (), {}),
    })
    functional = _module("torch.nn.functional", package=False, attrs={
        "pad": _raiser("torch.nn.functional.pad"),
    })
    nn = _module("torch.nn", package=True, attrs={
        "functional": functional,
        "Module": type("Module", (), {}),
    })
    dlpack = _module("torch.utils.dlpack", package=False, attrs={
        "to_dlpack": _raiser("torch.utils.dlpack.to_dlpack"),
        "from_dlpack": _raiser("torch.utils.dlpack.from_dlpack"),
    })
    utils = _module("torch.utils", package=True, attrs={"dlpack": dlpack})
    library = _module("torch.library", package=False, attrs={})

    torch_attrs: dict[str, Any] = {
        **dtypes,
        "dtype": dtype,
        "Tensor": Tensor,
        # Legacy typed-tensor names appear in xgrammar's annotations.
        "LongTensor": Tensor,
        "FloatTensor": Tensor,
        "IntTensor": Tensor,
        "BoolTensor": Tensor,
        "Size": tuple,
        "tensor": _placeholder_tensor,
        "compile": _compile,
        "compiled_with_cxx11_abi": lambda: True,
        "device": _raiser("torch.device"),
        "empty": _raiser("torch.empty"),
        "zeros": _raiser("torch.zeros"),
        "ones": _raiser("torch.ones"),
        "full": _raiser("torch.full"),
        "arange": _raiser("torch.arange"),
        "from_numpy": _raiser("torch.from_numpy"),
        "from_dlpack": _raiser("torch.from_dlpack"),
        "repeat_interleave": _raiser("torch.repeat_interleave"),
        "where": _raiser("torch.where"),
        "version": version,
        "cuda": cuda,
        "nn": nn,
        "utils": utils,
        "library": library,
        "__getattr__": _top_level_getattr,
    }
    torch = _module("torch", package=True, attrs=torch_attrs)
    return {module.__name__: module for module in (torch, version, cuda, nn, functional, utils, dlpack, library)}


def is_stub(module: Any) -> bool:
    """Whether ``module`` is one of the stub's modules (not a real torch)."""
    return bool(getattr(module, _MARKER, False))


def installed() -> bool:
    """Whether the stub is what ``import torch`` gives in this process."""
    return is_stub(sys.modules.get("torch"))


def _real_torch_importable() -> bool:
    present = sys.modules.get("torch")
    if present is not None:
        return not is_stub(present)
    try:
        if importlib.util.find_spec("torch") is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        importlib.import_module("torch")
    except Exception as exc:  # a broken torch (missing CUDA libraries, ABI mismatch)
        log.warning("torch is installed but fails to import (%s: %s); using omlx-core's torch "
                    "stub so that xgrammar still imports", type(exc).__name__, exc)
        for name in [n for n in sys.modules if n == "torch" or n.startswith("torch.")]:
            del sys.modules[name]
        return False
    return True


def install() -> bool:
    """Make ``import torch`` succeed for xgrammar: the stub when no real torch imports.

    Call it before the first ``import xgrammar``. Idempotent and thread-safe; a no-op
    (returns ``False``) when a real torch is importable or already imported, in which case
    the environment is left untouched. Returns ``True`` when the stub is in place.
    """
    global _state
    with _lock:
        # A stub removed from sys.modules (a test restoring import state) is put back.
        if _state is None or (_state == "stub" and not installed()):
            if _real_torch_importable():
                _state = "real"
            else:
                os.environ[TVM_FFI_ENV] = "1"
                sys.modules.update(_build_modules())
                _state = "stub"
        return _state == "stub"
