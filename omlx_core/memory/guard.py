"""The memory guard as the front end sees it: two calls made in the HTTP responder,
before any response byte.

``preflight`` refuses a request that can never fit (HTTP 413); ``admit`` waits until a
request that fits alone also fits next to the running ones, or raises
:class:`~omlx_core.memory.types.AdmissionQueueFullError` (HTTP 503). The returned
ticket is released when the request ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ContextManager, Protocol, Sequence

if TYPE_CHECKING:
    from omlx_core.engine import Engine


class MemoryGuard(Protocol):
    def preflight(self, engine: Engine, request_id: str, prompt_tokens: Sequence[int]) -> None:
        """Raise PrefillMemoryExceededError if the request can never fit."""

    def admit(self, engine: Engine, request_id: str,
              prompt_tokens: Sequence[int]) -> ContextManager[None]:
        """Block until admitted; the context manager releases the reservation on exit."""
