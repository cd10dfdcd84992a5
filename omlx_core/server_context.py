"""The running server as plugins see it in ``startup``/``shutdown``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.engine import Engine
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.pluginmanager import PluginManager
    from omlx_core.pool import ModelPool


@dataclass
class ServerContext:
    """Configuration, plugin manager and loaded engines (by model id)."""

    config: Config
    plugins: PluginManager
    engines: dict[str, Engine] = field(default_factory=dict)
    #: set by the memory package at start-up; None only when memory guarding is off
    memory_guard: MemoryGuard | None = None
    #: the models available and resident; None where a context is built by hand (the
    #: pipeline then serves exactly ``engines``)
    pool: ModelPool | None = None

    @property
    def default_model(self) -> str | None:
        return next(iter(self.engines), None)
