"""From command-line arguments to a running set of engines: configuration, plugins, models.

The order matters: the raw tier files say which plugins to load, the loaded plugins
declare their settings, and only then can the whole configuration be validated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from omlx_core.config import Config, ModelEntry, Sourced, load_config, raw_value, read_layers
from omlx_core.engine import Engine, GuardedEngine
from omlx_core.memory.gate import MemoryReceiver
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.usage import return_freed_buffers_to_the_os
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


def served_models(setup: Setup, requested: Iterable[str]) -> list[str] | None:
    """The model ids to serve for ``requested`` (``omlx-core serve --model``, a
    benchmark's ``--model``): each a configured model id, or a model directory, which
    becomes an ad-hoc entry served by the batched engine. ``None`` when nothing is
    requested (serve ``server.models``); pass the answer to :func:`start_engines`.

    :raises ModelError: an item is neither a configured model nor a directory.
    """
    from omlx_core.models.errors import ModelError

    requested = list(requested)
    if not requested:
        return None
    ids = []
    for item in requested:
        if item in setup.config.models:
            ids.append(item)
            continue
        path = Path(item).expanduser()
        if not path.is_dir():
            known = ", ".join(setup.config.models)
            raise ModelError(f"--model {item!r} is neither a configured model ({known}) nor a "
                             "model directory")
        model_id = path.resolve().name
        setup.config.models[model_id] = ModelEntry(model_id, {
            "path": Sourced(str(path.resolve()), "cli --model"),
            "engine": Sourced("batched", "cli --model"),
        })
        ids.append(model_id)
    return ids


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
    try:
        for entry in entries:
            spec = resolve_model(entry, progress=progress)
            engine = registered[entry.engine][0](spec, config)
            _check_guarded(entry.engine, engine, config)
            log.info("starting engine %r for model %r (%s)", entry.engine, spec.id, spec.path)
            engine.start()
            context.engines[spec.id] = engine
        guard = install_memory_guard(context)
        for model_id, engine in context.engines.items():
            _check_resolvable(model_id, engine, plugins)
            _check_estimable(model_id, engine, guard)
    except BaseException:
        # Nothing has seen startup yet: stop only what was started.
        if context.memory_guard is not None:
            context.memory_guard.close()
        for engine in context.engines.values():
            engine.shutdown()
        raise
    plugins.hook.startup(context=context)
    return context


def _check_guarded(name: str, engine: Engine, config: Config) -> None:
    """Refuse an engine the memory guard cannot protect, unless the operator opted out."""
    if isinstance(engine, GuardedEngine):
        return
    if name in config["memory.unguarded_engines"]:
        log.warning("engine %r is not memory-guarded (it gives no memory hints and takes no "
                    "forward gate); it runs because memory.unguarded_engines lists it: its "
                    "requests get preflight and admission from assumed hints, no per-chunk "
                    "check", name)
        return
    raise PluginError(
        f"engine {name!r} ({type(engine).__module__}.{type(engine).__qualname__}) is not "
        "memory-guarded: it does not implement omlx_core.engine.GuardedEngine, so its prefills "
        "could run the machine out of memory. Use a guarded engine, or accept the risk with "
        f"--set memory.unguarded_engines={name} (see CONTRIBUTING.md, 'Write an engine')")


def _check_resolvable(model_id: str, engine: Engine, plugins: PluginManager) -> None:
    """A guarded engine must reach the enforcer: refuse to serve one no plugin resolves."""
    if not isinstance(engine, GuardedEngine):
        return
    receiver = plugins.hook.resolve_scheduler(engine=engine)
    if not isinstance(receiver, MemoryReceiver):
        raise PluginError(
            f"model {model_id!r}: no plugin's resolve_scheduler returns a MemoryReceiver for "
            f"engine type {type(engine).__qualname__} (got {type(receiver).__name__}), so it "
            "would get no memory limits and no forward gate; implement resolve_scheduler for it "
            "or make the engine its own MemoryReceiver")


def _check_estimable(model_id: str, engine: Engine, guard: MemoryGuard) -> None:
    """A guarded engine whose model no estimator can cost would be refused chunk after
    chunk with a retry hint that never helps: say so at load time instead."""
    if not isinstance(engine, GuardedEngine):
        return
    if guard.estimate(guard.peak_query(engine, [0, 0])) is not None:
        return
    model_type = engine.model.config.get("model_type")
    name = engine.model.engine
    raise PluginError(
        f"model {model_id!r} (model_type {model_type!r}): no estimate_peak plugin can estimate "
        "its prefill memory, so the memory guard cannot protect it and would refuse every "
        "request. Enable the built-in 'estimator' plugin if it is disabled, install an "
        f"estimator plugin for {model_type!r}, or run it without the guard's protection with "
        f"--set memory.unguarded_engines={name} (its requests are then not costed)")


def install_memory_guard(context: ServerContext) -> MemoryGuard:
    """Create the guard for a started server, start its enforcer over the context's
    engines and set ``context.memory_guard``."""
    return_freed_buffers_to_the_os()
    for hook, consequence in (
            ("estimate_peak", "no request is checked against memory"),
            ("preflight", "requests that can never fit are not refused before streaming"),
            ("resolve_scheduler", "engines without their own resolver get no memory limits")):
        if not getattr(context.plugins.hook, hook).get_hookimpls():
            log.warning("no loaded plugin implements %s: %s (enable the built-in "
                        "'estimator' and 'memory_guard' plugins)", hook, consequence)
    guard = MemoryGuard(context.plugins, context.config)
    guard.start(lambda: context.engines.values())
    context.memory_guard = guard
    return guard


def stop_engines(context: ServerContext) -> None:
    """Stop the memory enforcer, run ``shutdown`` hooks (every plugin gets its turn),
    then stop each engine."""
    if context.memory_guard is not None:
        context.memory_guard.close()
    for impl in reversed(context.plugins.hook.shutdown.get_hookimpls()):
        try:
            impl.function(context=context)
        except Exception:
            log.exception("shutdown hook of plugin %r failed",
                          context.plugins.hook_manager.get_name(impl.plugin))
    for engine in context.engines.values():
        engine.shutdown()
