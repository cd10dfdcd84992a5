"""An engine started the way ``serve`` starts one, in this process: its host built by
core (the SSD tier and the snapshot and finish sinks from the plugins), then the
plugins' ``startup``; :meth:`ServedEngine.stop` runs their ``shutdown`` (the SSD tier
flushes its queued writes) before the engine stops. Two of them on the same SSD
directory, one after the other, are a server and the same server restarted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omlx_core.bootstrap import build_host
from omlx_core.config import load_config
from omlx_core.models.registry import spec_for_path
from omlx_core.pluginmanager import build_plugin_manager
from omlx_core.server_context import ServerContext


class ServedEngine:
    """A batched engine over the model at ``path`` with its SSD tier in ``ssd_dir`` (``""``:
    none), under ``tier`` with ``overrides`` (configuration keys to values)."""

    def __init__(self, path: Path, ssd_dir: Path | str, tier: str = "base",
                 **overrides: object) -> None:
        from omlx_core.plugins import ssd_cache
        from omlx_core.plugins.batched import BatchedEngine

        values = {"plugin.ssd_cache.dir": str(ssd_dir), **overrides}
        self.config = load_config(tier, overrides=[(k, str(v), "test") for k, v in values.items()],
                                  env={})
        self.plugins = build_plugin_manager()
        self.context = ServerContext(config=self.config, plugins=self.plugins)
        spec = spec_for_path(path)
        self.engine = BatchedEngine(spec, build_host(self.context, spec))
        self.engine.start()
        self.context.engines[spec.id] = self.engine
        self.plugins.hook.startup(context=self.context)
        self.store: Any = ssd_cache.store_for(self.engine.model.id) if ssd_dir else None

    def stop(self) -> None:
        self.plugins.hook.shutdown(context=self.context)
        self.engine.shutdown()

    def __enter__(self) -> "ServedEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ServedEngine"]
