"""The allocator a serving process runs Python's objects on: the C library's.

CPython's small-object allocator (pymalloc) takes memory from the system in 1 MiB arenas
and gives an arena back only when every object in it is gone. Loading a model allocates
tens of megabytes of small objects (a tokenizer's vocabulary, its configuration read
from JSON) that unloading frees; but the server's long-lived objects made meanwhile (a
dashboard sample, a request's bookkeeping, a counter) land in the same arenas, and one of
them is enough to keep a whole arena. So each load/unload cycle of the default model kept
1-3 MB for good (issue 20: twenty cycles must stay within 5 % of one model's bytes). On
the C allocator freed objects return to its free lists, which the memory guard's heap
trim hands back to the system: the same twenty cycles grow by a few megabytes in all.
Serving speed is level (decode tok/s at 1 and 8 streams within 2 %, BENCHMARKS.md).

``PYTHONMALLOC`` is read once, when the interpreter starts, so ``omlx-core serve`` sets
it and the process re-executes itself (the optimized BLAS's re-exec carries it, and then
there is no second one). An operator's own ``PYTHONMALLOC`` is kept.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

#: the allocator a serving process asks for
SERVING_ALLOCATOR = "malloc"
#: set to 1 to keep the allocator this process started with
NO_REEXEC_ENV = "OMLX_NO_ALLOCATOR_REEXEC"

#: ``PYTHONMALLOC`` as this interpreter started with it (what is in effect)
STARTED_WITH = os.environ.get("PYTHONMALLOC")


def choose_serving_allocator() -> bool:
    """Ask for the C allocator in this process's environment, for a re-exec to take up.
    Returns whether one is needed (the interpreter runs another allocator now)."""
    if STARTED_WITH or os.environ.get(NO_REEXEC_ENV) == "1" or not sys.executable:
        return False
    os.environ["PYTHONMALLOC"] = SERVING_ALLOCATOR
    return True


def reexec_for_allocator() -> None:
    """Re-execute this command once so the allocator :func:`choose_serving_allocator`
    asked for is in effect (a no-op when it is, or when none was asked for)."""
    if STARTED_WITH or os.environ.get("PYTHONMALLOC") != SERVING_ALLOCATOR:
        return
    log.info("re-executing with PYTHONMALLOC=%s (freed objects go back to the system)",
             SERVING_ALLOCATOR)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ))
