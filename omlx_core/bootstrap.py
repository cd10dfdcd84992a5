"""From command-line arguments to a running set of engines: configuration, plugins, models.

The order matters: the raw tier files say which plugins to load, the loaded plugins
declare their settings, and only then can the whole configuration be validated.

Every engine is made by :func:`create_engine` and closed by :func:`close_engine`, at
start-up as later (a model loaded while serving): it builds the engine's
:class:`~omlx_core.host.EngineHost` (lower cache tiers from ``register_caches``, the
``on_boundary_snapshot`` and ``on_request_finished`` sinks, the MLX thread, the
configuration) and calls the engine's factory with ``(model, host)``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from omlx_core.config import Config, ModelEntry, Sourced, load_config, raw_value, read_layers
from omlx_core.engine import Engine, GuardedEngine
from omlx_core.host import EngineHost
from omlx_core.memory.gate import MemoryReceiver
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.usage import footprint_bytes, return_freed_buffers_to_the_os
from omlx_core.mlx_thread import mlx_thread
from omlx_core.pluginmanager import PluginError, PluginManager, build_plugin_manager
from omlx_core.pool import ModelPool
from omlx_core.pool.catalog import discover_models
from omlx_core.server_context import ServerContext

if TYPE_CHECKING:
    from omlx_core.kvblocks import BlockStore
    from omlx_core.memory.types import BoundarySnapshot
    from omlx_core.models.registry import ModelSpec

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
    """Resolve, load and start an engine for each served model; make every other
    available model (``[models.<id>]``, ``server.model_dirs``) loadable through the
    context's :class:`~omlx_core.pool.ModelPool`; run ``startup`` hooks.

    :raises PluginError: an engine's plugin is missing or broken, or a required plugin is.
    """
    config, plugins = setup.config, setup.plugins
    model_ids = list(model_ids or config["server.models"])
    discover_models(config)
    check_kv_formats(config)
    offer_embedding_models(config, model_ids, progress=progress)
    required = set(config["plugins.required"])
    for model_id in model_ids:
        required.add(_engine_factory(plugins, config.models[model_id].engine, model_id)[1])
    plugins.require(sorted(required))

    from omlx_core.grammar.configure import configure_grammar

    configure_grammar(config)
    context = ServerContext(config=config, plugins=plugins)
    context.pool = build_pool(context, progress=progress)
    try:
        for model_id in model_ids:
            started, before = time.monotonic(), footprint_bytes()
            engine = create_engine(context, model_id, progress=progress)
            context.pool.adopt(model_id, engine,
                               pinned=bool(config.models[model_id].get("pinned", True)),
                               seconds=time.monotonic() - started,
                               footprint_growth=max(0, footprint_bytes() - before) or None)
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
    context.pool.plan_local()
    context.pool.start()
    plugins.hook.startup(context=context)
    return context


def check_kv_formats(config: Config) -> None:
    """Refuse to start when a model with a directory (not loaded yet) is configured
    with a ``kv_bits`` its cache cannot take; the rest are checked as they load.

    :raises ModelError: naming the model, the value and what it allows.
    """
    from omlx_core.models.errors import ModelError
    from omlx_core.models.registry import read_model_config
    from omlx_core.scheduling.kv_cache import KVFormat, check_config_kv_format

    for model_id, entry in config.models.items():
        if entry.get("task") in ("embed", "rerank"):
            continue  # an encoder keeps no KV cache
        bits = entry.get("kv_bits")
        bits = config["engine.kv_bits"] if bits is None else bits
        group = entry.get("kv_group_size") or config["engine.kv_group_size"]
        kv_format = KVFormat.from_settings(bits, group)
        try:
            kv_format.check_block_size(int(config.get("plugin.batched.block_size", 64)))
        except ValueError as exc:
            raise ModelError(f"model {model_id!r}: {exc}") from None
        path = entry.get("path")
        if not kv_format.quantized or not path or not Path(path).expanduser().is_dir():
            continue
        try:
            check_config_kv_format(read_model_config(Path(path).expanduser()), kv_format, model_id)
        except ValueError as exc:
            raise ModelError(str(exc)) from None


def offer_embedding_models(config: Config, served: Iterable[str], *, progress: bool = True) -> None:
    """The shipped embedding model's part in a start: with ``server.embeddings`` on, its
    zip is unpacked into the model cache now (a progress bar the first time), so that
    its first request only loads it; off, its entry is dropped (unless ``served``
    names it). A missing package is logged, and its load fails saying how to install it."""
    from omlx_core.models.default_embedding import (
        DEFAULT_EMBEDDING_MODEL_ID,
        ensure_default_embedding_model,
    )

    shipped = [model_id for model_id, entry in config.models.items()
               if entry.get("embedded") == DEFAULT_EMBEDDING_MODEL_ID]
    if not config["server.embeddings"]:
        for model_id in shipped:
            if model_id not in served:
                del config.models[model_id]
        return
    if shipped:
        try:
            ensure_default_embedding_model(progress=progress)
        except Exception as exc:  # the model's load reports it to its requests
            log.warning("the shipped embedding model is not available: %s", exc)


def build_pool(context: ServerContext, *, progress: bool = True) -> ModelPool:
    """The model pool of ``context``: it loads through :func:`create_engine` and
    unloads through :func:`close_engine`, plans against the context's memory guard."""
    from omlx_core.models.registry import resolve_model

    def advice(rejection):  # type: ignore[no-untyped-def]
        guard = context.memory_guard
        return guard.advice(rejection) if guard is not None else []

    return ModelPool(
        context.config,
        create=lambda model_id: create_engine(context, model_id, progress=progress),
        close=lambda model_id: close_engine(context, model_id),
        resolve=lambda model_id: resolve_model(context.config.models[model_id],
                                               progress=progress),
        guard=lambda: context.memory_guard,
        estimate_peak=context.plugins.hook.estimate_peak, advice=advice)


def create_engine(context: ServerContext, model_id: str, *, progress: bool = True) -> Engine:
    """Build the engine of ``model_id`` with its host, start it and add it to
    ``context.engines``: the one way an engine comes to life, at start-up or later.

    With the memory guard running, the engine must be reachable and costable by it
    (checked before it serves); at start-up the guard is installed after every engine
    started and :func:`start_engines` checks them then.

    :raises PluginError: no loaded plugin registers the model's engine, or the engine
        cannot be guarded.
    """
    from omlx_core.models.registry import resolve_model

    config, plugins = context.config, context.plugins
    entry = config.models[model_id]
    factory, _owner = _engine_factory(plugins, entry.engine, model_id)
    spec = resolve_model(entry, progress=progress)
    engine = factory(spec, build_host(context, spec))
    _check_guarded(entry.engine, engine, config)
    log.info("starting engine %r for model %r (%s)", entry.engine, spec.id, spec.path)
    engine.start()
    try:
        if context.memory_guard is not None:
            _check_resolvable(spec.id, engine, plugins)
            _check_estimable(spec.id, engine, context.memory_guard)
    except BaseException:
        engine.shutdown()
        raise
    context.engines[spec.id] = engine
    return engine


def close_engine(context: ServerContext, model_id: str) -> None:
    """Take ``model_id``'s engine out of ``context`` (no new request reaches it), then
    stop it: its outstanding requests are aborted and its memory released."""
    engine = context.engines.pop(model_id, None)
    if engine is not None:
        engine.shutdown()
        if context.memory_guard is not None:
            context.memory_guard.forget(engine)


def build_host(context: ServerContext, model: ModelSpec) -> EngineHost:
    """The host of ``model``'s engine: its lower cache tiers built from every
    ``register_caches`` factory, and sinks to the ``on_boundary_snapshot`` and
    ``on_request_finished`` hooks."""
    return EngineHost(model_id=model.id, config=context.config, thread=mlx_thread(),
                      lower_tiers=_lower_tiers(context, model),
                      on_boundary_snapshot=_boundary_sink(context.plugins),
                      on_request_finished=_finish_sink(context.plugins, model.id))


def _engine_factory(plugins: PluginManager, name: str, model_id: str) -> tuple[Callable[..., Engine], str]:
    registered = plugins.registered_engines()
    if name not in registered:
        broken = [info for info in plugins.list() if info.error]
        hint = "; ".join(f"{i.name}: {i.error}" for i in broken)
        raise PluginError(
            f"model {model_id!r} needs engine {name!r}, which no loaded plugin "
            f"registers (engines available: {', '.join(sorted(registered)) or 'none'})"
            + (f". Broken plugins: {hint}" if hint else ""))
    return registered[name]


def _lower_tiers(context: ServerContext, model: ModelSpec) -> tuple[BlockStore, ...]:
    tiers = []
    for name, factory in context.plugins.caches().items():
        store = factory(model, context.config)
        if store is not None:
            log.info("model %r: cache tier %r", model.id, name)
            store.yield_to(mlx_thread().wait_quiet)
            tiers.append(store)
    return tuple(tiers)


def _boundary_sink(plugins: PluginManager) -> Callable[[BoundarySnapshot], None]:
    hook = plugins.hook.on_boundary_snapshot

    def on_boundary_snapshot(snapshot: BoundarySnapshot) -> None:
        hook(snapshot=snapshot)

    return on_boundary_snapshot


def _finish_sink(plugins: PluginManager, model_id: str) -> Callable[[str, str], None]:
    hook = plugins.hook.on_request_finished

    def on_request_finished(request_id: str, finish_reason: str) -> None:
        hook(model_id=model_id, request_id=request_id, finish_reason=finish_reason)

    return on_request_finished


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
            "would get no memory limits and no forward gate; pass the host to "
            "Engine.__init__(model, host) and read host.memory, or implement resolve_scheduler "
            "for it")


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
