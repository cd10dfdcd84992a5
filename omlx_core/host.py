"""What an engine may use of the server: one :class:`EngineHost`, handed over at construction.

An engine factory (``register_engines``) is called as ``factory(model, host)``. The host
is the engine's whole view of the server; an engine imports nothing else of it and
calls no hook itself:

- ``config`` and :meth:`EngineHost.model_setting`: its plugin's settings, and the
  model's own ``[models.<id>]`` choices over them;
- ``thread``: the process's one MLX thread, where all of its mlx work runs;
- ``memory``: the latest memory limits and the forward gate, for an engine that
  schedules its own prefills (an engine whose scheduler is a separate
  :class:`~omlx_core.memory.gate.MemoryReceiver` has its plugin's ``resolve_scheduler``
  name that object instead, and the host's stays unused);
- ``lower_tiers``: the cache tiers other plugins registered (``register_caches``),
  built for this model, for an engine with a prefix cache to put behind it;
- ``on_boundary_snapshot`` / ``on_request_finished``: the sinks that reach the hooks of
  the same names.

Core builds hosts in one place (:func:`omlx_core.bootstrap.create_engine`), so an engine
loaded while serving gets exactly what one loaded at start-up gets; tests build them
with :func:`omlx_core.testing.host.make_test_host`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from omlx_core.memory.gate import ForwardGate, MemoryReceiver

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.kvblocks import BlockStore
    from omlx_core.memory.types import BoundarySnapshot, LimitSnapshot
    from omlx_core.mlx_thread import MLXThread


class HostMemory(MemoryReceiver):
    """The latest limit snapshot and the forward gate the enforcer gave an engine.

    The enforcer publishes here when nothing more specific receives the engine's limits
    (the built-in ``memory_guard`` plugin's ``resolve_scheduler`` answers, last, with
    it); the engine reads :attr:`limits` and :attr:`forward_gate` before each prefill.
    """

    def __init__(self) -> None:
        self.limits: LimitSnapshot | None = None
        self.forward_gate: ForwardGate | None = None

    def apply_memory_limits(self, snapshot: LimitSnapshot) -> None:
        self.limits = snapshot

    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        self.forward_gate = gate


def _ignore(*_args: Any) -> None:
    """A sink no plugin listens to."""


@dataclass
class EngineHost:
    """Everything of the server one engine may use (see the module docstring)."""

    #: the model the engine serves
    model_id: str
    #: the effective configuration (plugin settings under ``plugin.<name>.<key>``)
    config: Config
    #: the process's MLX thread
    thread: MLXThread
    memory: HostMemory = field(default_factory=HostMemory)
    #: lower cache tiers for this model, in plugin order
    lower_tiers: Sequence[BlockStore] = ()
    #: ``on_boundary_snapshot(snapshot)``: call from the MLX thread; never blocks
    on_boundary_snapshot: Callable[[BoundarySnapshot], None] = _ignore
    #: ``on_request_finished(request_id, finish_reason)``: call once per request, after
    #: its memory is released and before its final output
    on_request_finished: Callable[[str, str], None] = _ignore

    def model_entry(self, key: str) -> Any:
        """The model's own ``[models.<id>] key`` (``None`` where unset): what an engine
        reads of a model's table beyond its plugin's settings (an encoder's ``task``)."""
        entry = self.config.models.get(self.model_id)
        own = entry.get(key) if entry is not None else None
        return None if own == "" else own

    def model_setting(self, key: str, default_key: str) -> Any:
        """The model's own ``[models.<id>] key`` when set, else ``config[default_key]``."""
        entry = self.config.models.get(self.model_id)
        own = entry.get(key) if entry is not None else None
        return own if own not in (None, "") else self.config[default_key]


__all__ = ["EngineHost", "HostMemory"]
