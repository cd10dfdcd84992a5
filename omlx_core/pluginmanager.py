"""Discovers and loads plugins, built-in and third-party alike, through one entry-point group.

Every plugin, including omlx-core's own engines and caches, is an entry point in the
``omlx_core`` group. Which ones load is decided by ``[plugins]`` in the configuration;
a plugin that fails to import or implements a hook that does not exist is recorded as
broken with the reason, and :meth:`PluginManager.require` turns that into an error for
plugins the server cannot run without.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable

import pluggy

from omlx_core.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME
from omlx_core.hookspecs import specs as hookspecs_module
from omlx_core.settings import Setting

log = logging.getLogger(__name__)
OWN_DISTRIBUTION = "omlx-core"


class PluginError(Exception):
    """A plugin the server needs could not be loaded or used."""


@dataclass
class PluginInfo:
    """What ``omlx-core plugins`` shows for one plugin."""

    name: str
    distribution: str | None
    version: str | None
    module: str
    hooks: list[str] = field(default_factory=list)
    error: str | None = None
    enabled: bool = True

    @property
    def source(self) -> str:
        if self.distribution is None:
            return "registered in-process"
        if _canonical(self.distribution) == _canonical(OWN_DISTRIBUTION):
            return "built-in"
        return f"distribution {self.distribution}"

    @property
    def status(self) -> str:
        if self.error:
            return "broken"
        return "loaded" if self.enabled else "disabled"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


class PluginManager:
    """A pluggy manager plus what a server needs around it: selection, errors, registries."""

    def __init__(self, enabled: Iterable[str] = ("*",), disabled: Iterable[str] = ()):
        self.hook_manager = pluggy.PluginManager(PROJECT_NAME)
        self.hook_manager.add_hookspecs(hookspecs_module)
        self.enabled = list(enabled)
        self.disabled = set(disabled)
        self.infos: dict[str, PluginInfo] = {}

    @property
    def hook(self) -> Any:
        return self.hook_manager.hook

    # -- loading ---------------------------------------------------------------------

    def _wanted(self, name: str) -> bool:
        if name in self.disabled:
            return False
        return "*" in self.enabled or name in self.enabled

    def load_entrypoints(self) -> None:
        """Load every selected plugin of the ``omlx_core`` entry-point group."""
        seen: set[str] = set()
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in seen:
                # The same distribution found twice on sys.path (e.g. editable + site).
                continue
            seen.add(ep.name)
            dist = ep.dist.metadata["Name"] if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            info = PluginInfo(ep.name, dist, version, ep.value)
            self.infos[ep.name] = info
            if not self._wanted(ep.name):
                info.enabled = False
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # any import-time failure is the plugin's, not ours
                info.error = f"failed to import {ep.value}: {type(exc).__name__}: {exc}"
                log.warning("plugin %r from %s is broken: %s", ep.name, info.source, info.error)
                continue
            self._register(plugin, info)
        unknown = [n for n in self.enabled if n != "*" and n not in self.infos]
        for name in unknown:
            self.infos[name] = PluginInfo(name, None, None, "?", error=(
                f"enabled in the configuration but not installed; installed plugins: "
                f"{', '.join(sorted(self.infos)) or 'none'}"))

    def register(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, embedding applications)."""
        self._register(plugin, PluginInfo(name, None, None, getattr(plugin, "__name__", repr(plugin))))

    def unregister(self, name: str) -> None:
        self.hook_manager.unregister(name=name)
        self.infos.pop(name, None)

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        self.infos[info.name] = info
        try:
            self.hook_manager.register(plugin, name=info.name)
            # Hook implementations whose name matches no specification.
            self.hook_manager.check_pending()
        except pluggy.PluginValidationError as exc:
            if self.hook_manager.is_registered(plugin):
                self.hook_manager.unregister(plugin)
            info.error = _explain_validation(exc)
            log.warning("plugin %r from %s is broken: %s", info.name, info.source, info.error)
            return
        info.hooks = sorted(
            impl.function.__name__ if hasattr(impl, "function") else caller.name
            for caller in self.hook_manager.get_hookcallers(plugin) or []
            for impl in caller.get_hookimpls() if impl.plugin is plugin
        )

    # -- using -----------------------------------------------------------------------

    def require(self, names: Iterable[str]) -> None:
        """Raise :class:`PluginError` naming each required plugin that is missing or broken."""
        problems = []
        for name in names:
            info = self.infos.get(name)
            if info is None:
                problems.append(f"plugin {name!r} is required but not installed "
                                f"(installed: {', '.join(sorted(self.infos)) or 'none'})")
            elif info.error:
                problems.append(f"plugin {name!r} from {info.source} is broken: {info.error}")
            elif not info.enabled:
                problems.append(f"plugin {name!r} is required but disabled in [plugins]; "
                                "remove it from plugins.disabled or add it to plugins.enabled")
        if problems:
            raise PluginError("cannot start: " + "; ".join(problems))

    def settings(self) -> dict[str, list[Setting]]:
        """Settings each loaded plugin declared through ``register_settings``."""
        declared: dict[str, list[Setting]] = {}
        for impl in self.hook.register_settings.get_hookimpls():
            found: list[Setting] = []
            impl.function(register=found.append)
            if found:
                declared[self.hook_manager.get_name(impl.plugin)] = found
        return declared

    def engines(self) -> dict[str, Callable[..., Any]]:
        """Engine factories by name, from every plugin's ``register_engines``."""
        return {name: factory for name, (factory, _owner) in self.registered_engines().items()}

    def registered_engines(self) -> dict[str, tuple[Callable[..., Any], str]]:
        """``name -> (factory, name of the plugin that registered it)``."""
        return self._collect(self.hook.register_engines, "engine")

    def caches(self) -> dict[str, Callable[..., Any]]:
        """Lower cache tier factories by name, from every plugin's ``register_caches``, in
        plugin order (core builds each engine's ``host.lower_tiers`` from them)."""
        return {name: factory for name, (factory, _owner)
                in self._collect(self.hook.register_caches, "cache").items()}

    def _collect(self, hook: Any, what: str) -> dict[str, tuple[Callable[..., Any], str]]:
        found: dict[str, tuple[Callable[..., Any], str]] = {}

        for impl in reversed(hook.get_hookimpls()):
            owner = self.hook_manager.get_name(impl.plugin)

            def register(name: str, factory: Callable[..., Any], _owner: str = owner) -> None:
                if name in found and found[name][1] != _owner:
                    raise PluginError(f"{what} {name!r} is registered by both plugin "
                                      f"{found[name][1]!r} and plugin {_owner!r}; disable one "
                                      "in [plugins] disabled")
                found[name] = (factory, _owner)

            impl.function(register=register)
        return found

    def list(self) -> list[PluginInfo]:
        return sorted(self.infos.values(), key=lambda i: (i.source != "built-in", i.name))


def hook_names() -> list[str]:
    """Every hook a plugin may implement, from the specification module."""
    marker = f"{PROJECT_NAME}_spec"
    return sorted(name for name, obj in vars(hookspecs_module).items() if hasattr(obj, marker))


def _explain_validation(exc: pluggy.PluginValidationError) -> str:
    text = str(exc)
    known = hook_names()
    if "unknown hook" in text:
        import difflib

        hook_name = text.split("unknown hook", 1)[1].split()[0].strip("'\"")
        close = difflib.get_close_matches(hook_name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"implements unknown hook {hook_name!r}.{hint} Known hooks: {', '.join(known)}"
    return text


def build_plugin_manager(enabled: Iterable[str] = ("*",), disabled: Iterable[str] = ()) -> PluginManager:
    """A manager with every selected entry-point plugin loaded."""
    manager = PluginManager(enabled, disabled)
    manager.load_entrypoints()
    return manager


@functools.lru_cache(maxsize=1)
def _installed_settings() -> tuple[tuple[str, tuple[Setting, ...]], ...]:
    manager = build_plugin_manager()
    return tuple((name, tuple(settings)) for name, settings in manager.settings().items())


def installed_plugin_settings() -> dict[str, list[Setting]]:
    """Settings every installed plugin declares (for a configuration read without a
    plugin manager of its own)."""
    return {name: list(settings) for name, settings in _installed_settings()}


def installed_plugin_names() -> set[str]:
    """Names of the plugins installed in the ``omlx_core`` entry-point group."""
    return {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
