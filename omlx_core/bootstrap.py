"""From command-line arguments to a running set of engines: configuration, plugins, models.

The order matters: the raw tier files say which plugins to load, the loaded plugins
declare their settings, and only then can the whole configuration be validated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from omlx_core.config import Config, load_config, raw_value, read_layers
from omlx_core.memory.guard import install_memory_guard
from omlx_core.pluginmanager import PluginError, PluginManager, build_plugin_manager
from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)


@dataclass
class Setup:
    config: Config
    plugins: PluginManager
    warnings: list[str] = field(default_factory=list)


def load_setup(tier: str | None = None, files: Iterable[str | Path] = (),
               overrides: Iterable[tuple[str, str, str]] = ()) -> Setup:
    """Validated configuration plus the plugin manager it selects."""
    overrides = list(overrides)
    files = list(files)
    _tier, _paths, items = read_layers(tier, files)
    enabled = _override(overrides, "plugins.enabled") or raw_value(items, "plugins.enabled", ["*"])
    disabled = _override(overrides, "plugins.disabled") or raw_value(items, "plugins.disabled", [])
    plugins = build_plugin_manager(_as_list(enabled), _as_list(disabled))
    warnings: list[str] = []
    config = load_config(tier, files, overrides, plugin_settings=plugins.settings(),
                         warnings=warnings)
    return Setup(config, plugins, warnings)


def _override(overrides: list[tuple[str, str, str]], key: str) -> str | None:
    values = [text for k, text, _source in overrides if k == key]
    return values[-1] if values else None


def _as_list(value: object) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value) if isinstance(value, list) else []


def start_engines(setup: Setup, model_ids: Iterable[str] | None = None, *,
                  progress: bool = True) -> ServerContext:
    """Resolve, load and start an engine for each served model; run ``startup`` hooks.

    :raises PluginError: an engine's plugin is missing or broken, or a required plugin is.
    """
    from omlx_core.models.registry import resolve_model

    config, plugins = setup.config, setup.plugins
    model_ids = list(model_ids or config["server.models"])
    entries = [config.models[m] for m in model_ids]
    registered = plugins.registered_engines()
    required = set(config["plugins.required"])
    for entry in entries:
        if entry.engine not in registered:
            broken = [info for info in plugins.list() if info.error]
            hint = "; ".join(f"{i.name}: {i.error}" for i in broken)
            raise PluginError(
                f"model {entry.id!r} needs engine {entry.engine!r}, which no loaded plugin "
                f"registers (engines available: {', '.join(sorted(registered)) or 'none'})"
                + (f". Broken plugins: {hint}" if hint else ""))
        required.add(registered[entry.engine][1])
    plugins.require(sorted(required))

    context = ServerContext(config=config, plugins=plugins)
    for entry in entries:
        spec = resolve_model(entry, progress=progress)
        engine = registered[entry.engine][0](spec, config)
        log.info("starting engine %r for model %r (%s)", entry.engine, spec.id, spec.path)
        engine.start()
        context.engines[spec.id] = engine
    install_memory_guard(context)
    plugins.hook.startup(context=context)
    return context


def stop_engines(context: ServerContext) -> None:
    """Stop the memory enforcer, run ``shutdown`` hooks (every plugin gets its turn),
    then stop each engine."""
    close_guard = getattr(context.memory_guard, "close", None)
    if callable(close_guard):
        close_guard()
    for impl in reversed(context.plugins.hook.shutdown.get_hookimpls()):
        try:
            impl.function(context=context)
        except Exception:
            log.exception("shutdown hook of plugin %r failed",
                          context.plugins.hook_manager.get_name(impl.plugin))
    for engine in context.engines.values():
        engine.shutdown()
