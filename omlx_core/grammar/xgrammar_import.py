"""The ``xgrammar`` module, imported once with the torch stub in place first, and the
check that the installed release is the one the stub and the grammar workarounds are
tested with.

Both the server (:mod:`omlx_core.grammar.compiler`, :mod:`omlx_core.grammar.constraint`)
and a compile worker process (:mod:`omlx_core.grammar.compile_worker`) import xgrammar
through :func:`import_xgrammar`, so this module depends on neither.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from omlx_core.grammar import torch_stub
from omlx_core.grammar.errors import GrammarUnavailable

log = logging.getLogger(__name__)

__all__ = ["INSTALL_HINT", "XGRAMMAR_TESTED", "check_xgrammar_version", "import_xgrammar"]

# The release the torch stub and the grammar workarounds are tested with (setup.sh pins it).
XGRAMMAR_TESTED = "0.2.8"
INSTALL_HINT = (
    "install the grammar extra without torch: pip install 'omlx-core[grammar]' && "
    f"pip install --no-deps 'xgrammar=={XGRAMMAR_TESTED}' (./setup.sh does both)"
)

_xgrammar: Any = None
_import_lock = threading.Lock()


def import_xgrammar() -> Any:
    """The ``xgrammar`` module, imported once, with the torch stub in place first."""
    global _xgrammar
    if _xgrammar is not None:
        return _xgrammar
    with _import_lock:
        if _xgrammar is None:
            torch_stub.install()
            try:
                import xgrammar
            except ImportError as exc:
                raise GrammarUnavailable(
                    f"structured output needs xgrammar, which does not import ({exc}); {INSTALL_HINT}"
                ) from exc
            check_xgrammar_version()
            _xgrammar = xgrammar
    return _xgrammar


def check_xgrammar_version() -> str | None:
    """Log a warning, and return it, when the installed xgrammar is not the release the
    torch stub and the grammar workarounds are tested with (``None``: it is, or none is
    installed)."""
    try:
        installed = version("xgrammar")
    except PackageNotFoundError:
        return None
    if installed == XGRAMMAR_TESTED:
        return None
    warning = (f"xgrammar {installed} is installed; omlx-core's torch stub and grammar "
               f"workarounds are tested with {XGRAMMAR_TESTED}. If constrained decoding "
               f"misbehaves, pip install --no-deps 'xgrammar=={XGRAMMAR_TESTED}'")
    log.warning(warning)
    return warning

