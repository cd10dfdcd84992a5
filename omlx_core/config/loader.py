"""Layered configuration: tier files (with ``base = [...]`` inheritance), then extra
files, then ``OMLX_*`` environment variables, then command-line overrides. Every value
remembers where it came from, and every problem names the file, the key and the fix."""

from __future__ import annotations

import difflib
import os
import platform
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from omlx_core.config.schema import CORE_SETTINGS, MODEL_SETTINGS, TIER_FILE_KEYS
from omlx_core.platform.backend import cuda_available
from omlx_core.settings import Setting

TIERS_DIR = Path(__file__).parent / "tiers"
#: keys that moved to the plugin that reads them: an old configuration is told where
MOVED = {
    "engine.max_batch_size": "plugin.batched.max_batch_size",
    "engine.prefill_step_size": "plugin.batched.prefill_step_size",
    "engine.batch_window_s": "plugin.batched.batch_window_s",
    "engine.max_decode_gap_ms": "plugin.batched.max_decode_gap_ms",
    "cache.block_size": "plugin.batched.block_size",
    "cache.memory_budget": "plugin.batched.prefix_cache_budget",
    "cache.ssd_dir": "plugin.ssd_cache.dir",
    "cache.ssd_budget": "plugin.ssd_cache.budget",
}
DEFAULT_ENGINE = "batched"
#: the engine of a model served for embeddings or reranking when its table names none
ENCODER_ENGINE = "encoder"
# Variables with these names configure the process, not a setting.
_PROCESS_ENV = {
    "OMLX_TIER", "OMLX_CONFIG", "OMLX_CACHE_DIR", "OMLX_BLAS_LIBRARY", "OMLX_BLAS_REEXEC",
    "OMLX_NO_BLAS_REEXEC", "OMLX_LOG_LEVEL",
}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration, phrased so the operator can fix it."""

    source: str
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.key}: {self.message}" if self.key else f"{where}{self.message}"


class ConfigError(Exception):
    """The configuration cannot be used; ``problems`` lists every reason found."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        lines = [str(p) for p in self.problems]
        super().__init__("invalid configuration:\n  " + "\n  ".join(lines) if len(lines) > 1
                         else "invalid configuration: " + lines[0])


@dataclass(frozen=True)
class Sourced:
    """A configuration value and where it was set (a file, ``env NAME`` or ``cli --flag``)."""

    value: Any
    source: str


@dataclass(frozen=True)
class ModelEntry:
    """One ``[models.<id>]`` table."""

    id: str
    fields: Mapping[str, Sourced]

    def get(self, key: str, default: Any = None) -> Any:
        item = self.fields.get(key)
        return default if item is None else item.value

    @property
    def engine(self) -> str:
        default = ENCODER_ENGINE if self.get("task") in ("embed", "rerank") else DEFAULT_ENGINE
        return self.get("engine", default)

    @property
    def task(self) -> str:
        """What the model is served for: ``generate``, ``embed`` or ``rerank``."""
        return self.get("task") or "generate"


@dataclass
class Config:
    """The effective configuration. ``config["plugin.batched.max_batch_size"]`` reads a value."""

    tier: str
    files: list[Path]
    values: dict[str, Sourced]
    models: dict[str, ModelEntry] = field(default_factory=dict)
    plugin_values: dict[str, dict[str, Sourced]] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self._sourced(key).value

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self._sourced(key).value
        except KeyError:
            return default

    def source(self, key: str) -> str:
        return self._sourced(key).source

    def _sourced(self, key: str) -> Sourced:
        """A core key, or a plugin's as ``plugin.<name>.<key>``."""
        if key.startswith("plugin."):
            _, name, leaf = key.split(".", 2)
            return self.plugin_values[name][leaf]
        return self.values[key]

    def plugin(self, name: str) -> dict[str, Any]:
        """Settings of ``[plugin.<name>]``, defaults filled in."""
        return {k: v.value for k, v in self.plugin_values.get(name, {}).items()}

    def memory_tier(self) -> dict[str, Any]:
        """Reserve, factor and watermark of the active memory tier."""
        prefix = f"memory.tiers.{self['memory.tier']}."
        return {k[len(prefix):]: v.value for k, v in self.values.items() if k.startswith(prefix)}

    def rows(self) -> list[tuple[str, Any, str]]:
        """``(key, value, source)`` for every setting, models and plugin tables included."""
        out = [(k, v.value, v.source) for k, v in sorted(self.values.items())]
        for model_id, entry in self.models.items():
            out += [(f"models.{model_id}.{k}", v.value, v.source) for k, v in entry.fields.items()]
        for name, table in self.plugin_values.items():
            out += [(f"plugin.{name}.{k}", v.value, v.source) for k, v in table.items()]
        return out


# -- reading files ----------------------------------------------------------------------


def tier_names() -> list[str]:
    """Shipped tiers (``base`` is the shared parent, not a tier of its own)."""
    return sorted(p.stem for p in TIERS_DIR.glob("*.toml") if p.stem != "base")


def tier_description(name: str) -> str:
    return _read_toml(TIERS_DIR / f"{name}.toml").get("description", "")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError([Problem(str(path), "", "file not found")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([Problem(str(path), "", f"not valid TOML: {exc}")]) from None


def _resolve_tier_ref(ref: str, relative_to: Path | None) -> Path:
    """A tier reference is a shipped tier's name or a path to a TOML file."""
    candidate = Path(os.path.expanduser(ref))
    if candidate.suffix == ".toml" or os.sep in ref:
        if not candidate.is_absolute() and relative_to is not None:
            candidate = relative_to / candidate
        return candidate
    shipped = TIERS_DIR / f"{ref}.toml"
    if shipped.exists():
        return shipped
    if relative_to is not None and (relative_to / f"{ref}.toml").exists():
        return relative_to / f"{ref}.toml"
    known = ["base", *tier_names()]
    hint = _suggest(ref, known)
    raise ConfigError([Problem(
        str(relative_to) if relative_to else "", "base" if relative_to else "tier",
        f"no tier named {ref!r}; {hint}shipped tiers are {', '.join(known)}, or give a path "
        "to a .toml file")])


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(TIERS_DIR.parent.parent.parent)) if path.is_relative_to(
            TIERS_DIR) else str(path)
    except ValueError:
        return str(path)


def _flatten_file(path: Path, chain: tuple[Path, ...] = ()) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, source)`` for a file and, first, everything it inherits."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise ConfigError([Problem(str(path), "base", f"inheritance cycle: {cycle}")])
    data = _read_toml(path)
    source = _display(path)
    items: list[tuple[str, Any, str]] = []
    bases = data.get("base", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError([Problem(source, "base", 'expected a list of tier names, e.g. base = ["base"]')])
    for ref in bases:
        items += _flatten_file(_resolve_tier_ref(ref, path.parent), (*chain, path))
    for key, value in _walk(data):
        if key not in TIER_FILE_KEYS:
            items.append((key, value, source))
    return items


def _walk(table: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _walk(value, dotted + ".")
        else:
            yield dotted, value


# -- the schema ------------------------------------------------------------------------------


@dataclass
class _Schema:
    core: dict[str, Setting]
    model: dict[str, Setting]
    plugins: dict[str, dict[str, Setting]]
    #: installed plugins this configuration does not load: their tables are ignored
    inactive: frozenset[str] = frozenset()

    @classmethod
    def build(cls, plugin_settings: Mapping[str, Iterable[Setting]],
              inactive: Iterable[str] = ()) -> "_Schema":
        return cls(
            core={s.key: s for s in CORE_SETTINGS},
            model={s.key: s for s in MODEL_SETTINGS},
            plugins={name: {s.key: s for s in settings} for name, settings in plugin_settings.items()},
            inactive=frozenset(inactive) - set(plugin_settings),
        )

    def lookup(self, key: str) -> tuple[str, Setting | None, str]:
        """Classify a dotted key: ``("core"|"model"|"plugin", setting or None, hint)``."""
        if key.startswith("models."):
            parts = key.split(".")
            if len(parts) != 3:
                return "model", None, ("a model is a table [models.<id>] with keys "
                                       + ", ".join(self.model))
            setting = self.model.get(parts[2])
            return "model", setting, "" if setting else _suggest(parts[2], self.model)
        if key.startswith("plugin."):
            parts = key.split(".", 2)
            if len(parts) != 3:
                return "plugin", None, "plugin settings are tables [plugin.<name>]"
            table = self.plugins.get(parts[1])
            if table is None and parts[1] in self.inactive:
                return "inactive", None, ""
            if table is None:
                known = ", ".join(sorted(self.plugins)) or "none"
                return "plugin", None, (f"no loaded plugin named {parts[1]!r} declares settings "
                                        f"(plugins with settings: {known}). "
                                        + _suggest(parts[1], self.plugins))
            setting = table.get(parts[2])
            return "plugin", setting, "" if setting else _suggest(parts[2], table)
        setting = self.core.get(key)
        if setting is None and key in MOVED:
            return "core", None, f"this setting moved to {MOVED[key]!r} (its plugin owns it now)"
        everything = [*self.core, *(f"plugin.{name}.{leaf}" for name, table in self.plugins.items()
                                    for leaf in table)]
        return "core", setting, "" if setting else _suggest(key, everything)


def _suggest(word: str, options: Iterable[str]) -> str:
    options = list(options)
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if not match and "." in word:
        # Compare the last part so "engine.max_batch_sise" finds "plugin.batched.max_batch_size".
        leaf = word.rsplit(".", 1)[1]
        by_leaf = {o.rsplit(".", 1)[-1]: o for o in options}
        leaf_match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        match = [by_leaf[leaf_match[0]]] if leaf_match else []
    return f"did you mean {match[0]!r}? " if match else ""


# -- environment and command line --------------------------------------------------------


def env_name(key: str) -> str:
    """``plugin.batched.max_batch_size`` -> ``OMLX_PLUGIN_BATCHED_MAX_BATCH_SIZE``."""
    return "OMLX_" + key.upper().replace(".", "_").replace("-", "_")


def _env_overrides(env: Mapping[str, str], schema: _Schema) -> tuple[list, list[str]]:
    by_name = {env_name(k): k for k in schema.core}
    for name, table in schema.plugins.items():
        by_name.update({env_name(f"plugin.{name}.{k}"): f"plugin.{name}.{k}" for k in table})
    items, warnings = [], []
    for name, text in sorted(env.items()):
        if not name.startswith("OMLX_") or name in _PROCESS_ENV:
            continue
        key = by_name.get(name)
        if key is None:
            warnings.append(f"environment variable {name} is not an omlx-core setting; "
                            + _suggest(name, by_name).replace("did you mean", "did you mean"))
            continue
        items.append((key, text, f"env {name}"))
    return items, warnings


# -- tier selection ------------------------------------------------------------------------


def pick_tier(system: str | None = None, total_ram: int | None = None,
              cuda: bool | None = None) -> str:
    """The shipped tier that fits this machine, for ``serve`` with no ``--tier``."""
    system = system or platform.system()
    if cuda is None:
        cuda = cuda_available()
    if total_ram is None:
        total_ram = _total_ram()
    if cuda:
        return "cuda-80gb"
    if system == "Darwin":
        return "workstation-128gb" if total_ram >= 64 * 1024**3 else "laptop-16gb"
    return "cpu-small"


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# -- putting it together --------------------------------------------------------------------


def read_layers(tier: str | None = None, files: Iterable[str | Path] = (),
                env: Mapping[str, str] | None = None) -> tuple[str, list[Path], list[tuple]]:
    """Raw ``(key, value, source)`` items from the tier chain and extra files, in order.

    Used before plugins load, to know which plugins to load; :func:`load_config`
    validates the same items once plugin settings are known.
    """
    env = os.environ if env is None else env
    tier = tier or env.get("OMLX_TIER") or pick_tier()
    tier_path = _resolve_tier_ref(tier, None)
    tier_name = tier_path.stem if tier_path.parent == TIERS_DIR else str(tier_path)
    paths = [tier_path]
    extra = list(files)
    if env.get("OMLX_CONFIG"):
        extra.insert(0, env["OMLX_CONFIG"])
    paths += [Path(os.path.expanduser(str(f))) for f in extra]
    items: list[tuple] = []
    for path in paths:
        items += _flatten_file(path)
    return tier_name, paths, items


def raw_value(items: list[tuple], key: str, default: Any = None) -> Any:
    """The last value set for ``key`` among raw items (before validation)."""
    for item_key, value, _source in reversed(items):
        if item_key == key:
            return value
    return default


def load_config(tier: str | None = None, files: Iterable[str | Path] = (),
                overrides: Iterable[tuple[str, str, str]] = (),
                env: Mapping[str, str] | None = None,
                plugin_settings: Mapping[str, Iterable[Setting]] | None = None,
                warnings: list[str] | None = None) -> Config:
    """Build the effective configuration.

    :param tier: a shipped tier name or a path; default ``$OMLX_TIER`` or :func:`pick_tier`.
    :param files: extra TOML files layered over the tier, in order.
    :param overrides: ``(key, text, source)`` from the command line, applied last.
    :param env: the environment to read ``OMLX_*`` from (default ``os.environ``).
    :param plugin_settings: settings declared by loaded plugins, by plugin name.
    :param warnings: receives non-fatal notes (e.g. an unknown ``OMLX_*`` variable).
    :raises ConfigError: listing every problem, each with its file, key and the fix.
    """
    env = os.environ if env is None else env
    inactive: Iterable[str] = ()
    if plugin_settings is None:
        # Not given (a caller that builds no plugin manager): every installed plugin's.
        from omlx_core.pluginmanager import installed_plugin_settings

        plugin_settings = installed_plugin_settings()
    else:
        from omlx_core.pluginmanager import installed_plugin_names

        inactive = installed_plugin_names()
    schema = _Schema.build(plugin_settings, inactive)
    tier_name, paths, file_items = read_layers(tier, files, env)
    env_items, env_warnings = _env_overrides(env, schema)
    if warnings is not None:
        warnings.extend(env_warnings)

    problems: list[Problem] = []
    values: dict[str, Sourced] = {}
    model_fields: dict[str, dict[str, Sourced]] = {}
    plugin_values: dict[str, dict[str, Sourced]] = {
        name: {k: Sourced(s.default, "plugin default") for k, s in table.items()}
        for name, table in schema.plugins.items()
    }
    layered = [(k, v, s, False) for k, v, s in file_items]
    layered += [(k, v, s, True) for k, v, s in env_items]
    layered += [(k, v, s, True) for k, v, s in overrides]
    for key, value, source, from_text in layered:
        kind, setting, hint = schema.lookup(key)
        if kind == "inactive":
            continue  # a table for a plugin this configuration disables
        if setting is None:
            problems.append(Problem(source, key, f"unknown key; {hint}".rstrip("; ").rstrip()))
            continue
        try:
            coerced = setting.coerce(value, from_text=from_text and isinstance(value, str))
        except ValueError as exc:
            problems.append(Problem(source, key, f"{exc}; expected {setting.expected} "
                                                 f"({setting.doc})"))
            continue
        if kind == "core":
            values[key] = Sourced(coerced, source)
        elif kind == "model":
            _, model_id, leaf = key.split(".")
            model_fields.setdefault(model_id, {})[leaf] = Sourced(coerced, source)
        else:
            _, name, leaf = key.split(".", 2)
            plugin_values[name][leaf] = Sourced(coerced, source)

    missing = [k for k in schema.core if k not in values]
    problems += [Problem(_display(TIERS_DIR / "base.toml"), k,
                         "no value set; every tier must inherit base (base = [\"base\"])")
                 for k in missing]
    models = {mid: ModelEntry(mid, f) for mid, f in model_fields.items()}
    problems += _check_models(models, values)
    if problems:
        raise ConfigError(problems)
    return Config(tier=tier_name, files=paths, values=values, models=models,
                  plugin_values=plugin_values)


def _check_models(models: dict[str, ModelEntry], values: dict[str, Sourced]) -> list[Problem]:
    problems = []
    for model_id, entry in models.items():
        sources = [k for k in ("path", "hub_id", "gguf") if entry.get(k)]
        if entry.get("embedded"):
            sources.append("embedded")
        if len(sources) != 1:
            where = next(iter(entry.fields.values())).source
            found = ", ".join(sources) or "none"
            problems.append(Problem(where, f"models.{model_id}",
                                    "set exactly one of path, hub_id, gguf or embedded = true "
                                    f"(found: {found})"))
    served = values.get("server.models")
    if served is not None:
        for model_id in served.value:
            if model_id not in models:
                hint = _suggest(model_id, models)
                problems.append(Problem(served.source, "server.models",
                                        f"no model {model_id!r} is defined; {hint}add a "
                                        f"[models.{model_id}] table or use one of: "
                                        + ", ".join(models)))
    return problems


def parse_set_flag(text: str) -> tuple[str, str]:
    """``--set plugin.batched.max_batch_size=8`` -> ``("plugin.batched.max_batch_size", "8")``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([Problem("cli --set", text, "expected KEY=VALUE, e.g. "
                                                      "--set plugin.batched.max_batch_size=8")])
    return key.strip(), value.strip()
