"""The built-in ``ssd_cache`` plugin: a paged SSD tier behind the in-memory prefix cache.

On by default: ``plugin.ssd_cache.dir = "auto"`` keeps the blocks under omlx-core's cache
root (``~/.cache/omlx-core/ssd``, or ``$OMLX_CACHE_DIR/ssd``), a path puts them there, and
``""`` turns the tier off. It uses ``plugin.ssd_cache.budget`` bytes at most (``"auto"``:
``plugin.ssd_cache.auto_share`` of the free disk, re-read as the disk fills). Blocks waiting
for the writer are host copies, bounded by ``plugin.ssd_cache.queue_bytes`` and counted
by the engine as memory it can give back (the memory guard drops them before it refuses
work). Through the public hooks:

- ``register_caches``: ``"ssd"`` -> a :class:`~.store.PagedSSDStore` per model, which core
  hands to the model's engine as a lower tier (``EngineHost.lower_tiers``) and the
  batched engine puts behind its prefix cache: every block the prefix cache stores is
  written to disk, a lookup that misses in memory reads blocks back, and a restarted
  server serves the blocks the previous process wrote;
- ``on_boundary_snapshot``: stages non-cuttable layer states per request id as prefill
  crosses block boundaries (hybrid models resume from them after a restart);
- ``on_request_finished``: drops a request's staged snapshots (queued behind its writes
  when it completed, at once when it was aborted or failed);
- ``register_settings``: the ``[plugin.ssd_cache]`` table;
- ``shutdown``: staged snapshots removed, queued block writes flushed, writer stopped.

The writer leaves the cores to the forwards: while the MLX thread has work (core hands
the store its ``wait_quiet``, ``BlockStore.yield_to``) it puts writes off
(``plugin.ssd_cache.defer_s``, 30 s), unless its queue is half full or a flush waits, so
a turn's blocks are written while the agent works between turns, not beside the turn's
own prefill.

Counters (``saves`` passed the quota gate, ``saves_persisted`` renamed into place, loads,
hits, misses, evictions, drops, declined, errors) appear in ``/metrics`` as
``omlx_engine_prefix_cache_lower_<counter>``. Benchmark:
``python -m benchmarks.ssd_cache``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from omlx_core.hookspecs import hookimpl
from omlx_core.models.default import model_cache_dir
from omlx_core.plugins.ssd_cache.store import (DEFAULT_DEFER_S, DEFAULT_QUEUE_BYTES, DirectoryInUseError,
                                              PagedSSDStore)
from omlx_core.settings import Setting

log = logging.getLogger(__name__)

CACHE_NAME = "ssd"
PLUGIN = "ssd_cache"
#: ``plugin.ssd_cache.dir`` value that places the cache under omlx-core's cache root
AUTO_DIR = "auto"

_lock = threading.Lock()
#: open stores, by directory (one writer per directory) and by model id (hook routing)
_by_directory: dict[Path, PagedSSDStore] = {}
_by_model: dict[str, PagedSSDStore] = {}


def model_identity(path: Path) -> str:
    """A digest of a model directory's config and weight files (names, sizes, mtimes):
    blocks computed with other weights are never served, even at the same path."""
    digest = hashlib.blake2b(digest_size=16)
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for weights in sorted(path.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"\0{weights.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _plugin_settings(config: Any) -> dict[str, Any]:
    defaults = {s.key: s.default for s in SETTINGS}
    try:
        return defaults | dict(config.plugin(PLUGIN))
    except (AttributeError, KeyError):  # a configuration built without this plugin loaded
        return defaults


SETTINGS = (
    Setting("dir", "str", "directory of the paged SSD KV cache: \"auto\" (omlx-core's cache root, "
            "~/.cache/omlx-core/ssd), a path, or \"\" to turn it off", default=AUTO_DIR),
    Setting("budget", "size", "bytes the SSD cache may use; \"auto\": auto_share of the free "
            "disk", allow=("auto",), default="auto"),
    Setting("auto_share", "float", 'share of the free disk an "auto" plugin.ssd_cache.budget may use',
            minimum=0.01, maximum=0.95, default=0.5),
    Setting("queue_size", "int", "block writes the writer thread may have queued",
            minimum=1, maximum=65536, default=64),
    Setting("queue_bytes", "size", "host memory the queued block writes may hold (counted as "
            "memory the engine can give back)", minimum=1 << 20, default=DEFAULT_QUEUE_BYTES),
    Setting("save_timeout_s", "float", "how long a save waits for room in a full write queue "
            "before the block is dropped", minimum=0.0, maximum=10.0, default=0.25),
    Setting("defer_s", "float", "how long the writer puts a write off while the MLX thread has "
            "work (forwards keep the cores; it writes at once when its queue is half full); 0: "
            "write beside the forwards", minimum=0.0, maximum=600.0, default=DEFAULT_DEFER_S),
    Setting("eviction_burst", "int", "files one save may unlink to make room; the rest are "
            "evicted by later saves", minimum=1, maximum=4096, default=32),
)


@hookimpl
def register_settings(register: Callable[[Setting], None]) -> None:
    for setting in SETTINGS:
        register(setting)


def ssd_directory(config: Any) -> Path | None:
    """Where the SSD cache lives under this configuration; ``None`` when it is off."""
    directory = str(config["plugin.ssd_cache.dir"] or "").strip()
    if not directory:
        return None
    if directory == AUTO_DIR:
        return model_cache_dir() / "ssd"
    return Path(directory).expanduser()


def create_store(model: Any, config: Any) -> PagedSSDStore | None:
    """The ``register_caches`` factory (core calls it when it builds the model's engine
    host): the model's store, or ``None`` when the tier is off.

    With ``dir = "auto"`` a directory that cannot be used (another server holds it, or
    it is not writable) turns the tier off for this model with a warning: the default
    must never stop a server from starting. A directory the operator named is an error.
    """
    directory = ssd_directory(config)
    if directory is None:
        return None
    automatic = str(config["plugin.ssd_cache.dir"]).strip() == AUTO_DIR
    identity = model_identity(Path(model.path))
    safe_id = re.sub(r"[^A-Za-z0-9._-]", "_", model.id)
    root = (directory / f"{safe_id}-{identity[:16]}").resolve()
    budget = config["plugin.ssd_cache.budget"]
    settings = _plugin_settings(config)
    with _lock:
        store = _by_directory.get(root)
        if store is None or store.closed:
            try:
                store = PagedSSDStore(root, identity=identity,
                                      budget=None if budget == "auto" else int(budget),
                                      auto_share=float(settings["auto_share"]),
                                      queue_size=int(settings["queue_size"]),
                                      queue_bytes=int(settings["queue_bytes"]),
                                      save_timeout_s=float(settings["save_timeout_s"]),
                                      eviction_burst=int(settings["eviction_burst"]),
                                      defer_s=float(settings["defer_s"]))
            except (OSError, DirectoryInUseError) as exc:
                if automatic:
                    log.warning("model %r: serving without the SSD cache: %s (set plugin.ssd_cache.dir "
                                "to a directory of this server's own to keep it)", model.id, exc)
                    return None
                if isinstance(exc, DirectoryInUseError):
                    raise
                raise RuntimeError(f"plugin.ssd_cache.dir {str(directory)!r}: cannot use {root} for model "
                                   f"{model.id!r}: {exc}; set plugin.ssd_cache.dir to a writable "
                                   "directory, or to \"\" to turn the SSD cache off") from None
            _by_directory[root] = store
        _by_model[model.id] = store
    log.info("model %r: SSD cache in %s, limit %d bytes now", model.id, root, store.limit_bytes())
    return store


@hookimpl
def doctor_checks(config: Any) -> list[Any]:
    """Where the SSD cache lives, what it holds, and whether it can write there."""
    from omlx_core.platform.doctor import DoctorCheck
    from omlx_core.settings import format_size

    directory = ssd_directory(config)
    if directory is None:
        return [DoctorCheck("ssd cache", "ok", 'off (plugin.ssd_cache.dir = ""): a restarted server '
                            "recomputes every prompt", data={"enabled": False})]
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError as exc:
        return [DoctorCheck("ssd cache", "warn", f"{directory}: cannot read the free space: {exc}",
                            "set plugin.ssd_cache.dir to a directory on a working disk")]
    files = [f for f in directory.glob("*/blocks/*.safetensors")] if directory.is_dir() else []
    held = sum(f.stat().st_size for f in files if f.is_file())
    budget = config["plugin.ssd_cache.budget"]
    share = float(_plugin_settings(config)["auto_share"])
    limit = (f"auto: {share:.0%} of the free disk and what it holds, {format_size(int(share * (free + held)))} now"
             if budget == "auto" else f"{format_size(int(budget))}")
    data = {"enabled": True, "dir": str(directory), "budget": budget, "free_bytes": free,
            "held_bytes": held, "block_files": len(files)}
    detail = (f"{_shown(directory)}: {len(files)} block files ({format_size(held)}), budget {limit}; "
              f"free disk {format_size(free)}")
    if not os.access(existing, os.W_OK):
        return [DoctorCheck("ssd cache", "warn", detail + "; not writable",
                            "set plugin.ssd_cache.dir to a writable directory, or \"\" to turn the tier off",
                            data)]
    return [DoctorCheck("ssd cache", "ok", detail, data=data)]


def _shown(path: Path) -> str:
    """``path`` with the home directory written as ``~``."""
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


@hookimpl
def register_caches(register: Callable[..., None]) -> None:
    register(CACHE_NAME, create_store)


def store_for(model_id: str) -> PagedSSDStore | None:
    with _lock:
        store = _by_model.get(model_id)
    return None if store is None or store.closed else store


@hookimpl
def on_boundary_snapshot(snapshot: Any) -> None:
    store = store_for(snapshot.model_id)
    if store is not None:
        store.save_snapshot(snapshot.request_id, snapshot.block_index, snapshot.block_hash,
                            snapshot.token_count, snapshot.layer_states)


@hookimpl
def on_request_finished(model_id: str, request_id: str, finish_reason: str) -> None:
    store = store_for(model_id)
    if store is None:
        return
    if finish_reason in ("stop", "length"):
        store.finish_request(request_id)
    else:
        store.cleanup_request(request_id)


@hookimpl
def shutdown(context: Any) -> None:
    with _lock:
        stores = {id(s): s for m, s in _by_model.items() if m in context.engines}
        for model_id in [m for m in _by_model if m in context.engines]:
            del _by_model[model_id]
        for directory in [d for d, s in _by_directory.items() if id(s) in stores]:
            del _by_directory[directory]
    for store in stores.values():
        store.close(cleanup=True)


__all__ = ["AUTO_DIR", "CACHE_NAME", "PagedSSDStore", "create_store", "model_identity", "ssd_directory",
           "store_for"]
