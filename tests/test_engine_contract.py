"""The engine contract as the server enforces it: an engine the memory guard cannot
protect is refused at start unless the operator opts out, a guarded engine must be
reachable by the enforcer, and the front end and the guard know engines only through
the typed contract (no probing, no model-config or tokenizer knowledge in ``http/``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.engine import (
    ASSUMED_PREFILL_STEP,
    Engine,
    EngineLimits,
    GenerationOutput,
    GenerationRequest,
    GuardedEngine,
    MemoryHints,
    RequestHandle,
    Usage,
)
from omlx_core.hookspecs import hookimpl
from omlx_core.pluginmanager import PluginError
from omlx_core.testing import cached_model
from omlx_core.testing.detokenizer import TableDetokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


class _Done(RequestHandle):
    def __init__(self, request: GenerationRequest):
        self.request_id = request.request_id
        self._request = request

    def __iter__(self) -> Iterator[GenerationOutput]:
        yield GenerationOutput(self.request_id, token_ids=(5,), finish_reason="length",
                               usage=Usage(len(self._request.prompt_tokens), 1))

    def close(self) -> None:
        pass


class UnguardedEngine(Engine):
    """Keeps the pipeline's side of the contract, gives the guard nothing."""

    def __init__(self, model: Any, config: Any):
        self.model = model

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def limits(self) -> EngineLimits:
        return EngineLimits(context_length=4096, vocab_size=512)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        return [1, 2, 3]

    def tokenize(self, text: str) -> list[int]:
        return [1, 2, 3]

    def detokenizer(self) -> TableDetokenizer:
        return TableDetokenizer({5: "ok"})

    def submit(self, request: GenerationRequest) -> RequestHandle:
        return _Done(request)

    def abort(self, request_id: str) -> None:
        pass


class UnreachableEngine(UnguardedEngine, GuardedEngine):
    """Guarded in name, but nothing resolves it to a memory receiver."""

    def memory_hints(self) -> MemoryHints:
        return MemoryHints(prefill_step_size=64, prefill_full_logits=False)


class _Plugin:
    def __init__(self, name: str, engine: type):
        self.name, self.engine = name, engine

    @hookimpl
    def register_engines(self, register):
        register(self.name, self.engine)


def setup_for(tmp_path: Path, engine_name: str, engine: type, *overrides: tuple[str, str]):
    model_dir = cached_model("llama", 0, cache_dir=tmp_path / "models")
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["{MODEL}"]\n\n[models.{MODEL}]\npath = "{model_dir}"\n'
                      f'engine = "{engine_name}"\n')
    setup = load_setup("cpu-small", [config], [(k, v, "test") for k, v in overrides])
    setup.plugins.register(_Plugin(engine_name, engine), f"test-{engine_name}")
    return setup


def test_an_unguarded_engine_is_refused_at_start_and_the_error_names_the_opt_out(tmp_path) -> None:
    setup = setup_for(tmp_path, "bare", UnguardedEngine)
    with pytest.raises(PluginError) as refused:
        start_engines(setup, progress=False)
    message = str(refused.value)
    assert "not memory-guarded" in message and "memory.unguarded_engines=bare" in message


def test_an_opted_out_engine_runs_with_assumed_hints_through_preflight_and_admission(tmp_path) -> None:
    from omlx_core.serving import Job, ServingPipeline
    from omlx_core.engine import SamplingParams

    setup = setup_for(tmp_path, "bare", UnguardedEngine, ("memory.unguarded_engines", "bare"))
    context = start_engines(setup, progress=False)
    try:
        engine = context.engines[MODEL]
        query = context.memory_guard.peak_query(engine, [1, 2, 3])
        assert query.chunk_size == ASSUMED_PREFILL_STEP and query.full_logits
        assert not query.cached_kv_resident
        generation = ServingPipeline(context).start(Job(MODEL, SamplingParams(), text="hi"))
        assert "".join(d.text for d in generation.deltas()) == "ok"
        assert generation.finish_reason == "length"
        generation.close()
        assert context.memory_guard.admission.idle()
    finally:
        stop_engines(context)


def test_a_guarded_engine_no_plugin_resolves_is_refused(tmp_path) -> None:
    setup = setup_for(tmp_path, "lost", UnreachableEngine)
    with pytest.raises(PluginError, match="no plugin's resolve_scheduler returns a MemoryReceiver"):
        start_engines(setup, progress=False)


# -- the structure the contract keeps ---------------------------------------------------------


def python_files(*parts: str) -> list[Path]:
    base = ROOT.joinpath(*parts)
    return [base] if base.suffix == ".py" else sorted(base.rglob("*.py"))


def test_http_knows_no_model_config_or_tokenizer_files() -> None:
    forbidden = re.compile(r"tokenizer\.json|max_position_embeddings|vocab_size|model\.config"
                           r"|\.model\.path|text_config")
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for path in python_files("omlx_core", "http")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if forbidden.search(line)]
    assert not offenders, "http/ reads model internals:\n" + "\n".join(offenders)


def test_engines_and_guards_are_not_probed() -> None:
    """Outside the one adapter for opted-out engines (``memory_hints_of``), nothing asks an
    engine or a guard what it has: the contract says."""
    probing = re.compile(r"inspect\.signature|(has|get)attr\((engine|receiver|guard|gate|"
                         r"scheduler|self\._gate|context\.memory_guard|node|candidate|"
                         r"(self\.)?fallback|host|config)\b")
    places = (python_files("omlx_core", "memory") + python_files("omlx_core", "serving")
              + python_files("omlx_core", "http") + python_files("omlx_core", "bootstrap.py")
              + python_files("omlx_core", "host.py") + python_files("plugins", "memory_guard")
              + python_files("plugins", "batched") + python_files("plugins", "dflash")
              + python_files("plugins", "vlm") + python_files("examples"))
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in places
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if probing.search(line)]
    assert not offenders, "engines or guards probed:\n" + "\n".join(offenders)


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports at any depth (TYPE_CHECKING blocks and function bodies too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _module_of(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "plugins":
        parts = ["omlx_core", "plugins", *parts[1:]]
    elif parts[0] == "hookspecs":
        parts = ["omlx_core", "hookspecs", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _production() -> dict[str, Path]:
    files = python_files("omlx_core") + python_files("plugins") + python_files("hookspecs")
    return {_module_of(p): p for p in files
            if "bench" not in p.parts and p.stem not in ("benchmark", "conformance")
            and "testing" not in p.parts}


def test_production_modules_never_import_benchmarks() -> None:
    offenders = [f"{module} imports {name}" for module, path in _production().items()
                 for name in _imports(path)
                 if name.startswith("omlx_core.bench") or name.endswith(".benchmark")]
    # The CLI's `bench` command is the one door to them, imported only when it runs.
    offenders = [o for o in offenders if not o.startswith("omlx_core.cli ")]
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles_among_production_modules() -> None:
    modules = _production()
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    # A package's own __init__ re-exporting its modules is not a cycle between ideas.
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_plugins_talk_through_core_not_through_each_other() -> None:
    """ssd_cache reaches the prefix cache through omlx_core.kvblocks' protocol only."""
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in python_files("plugins", "ssd_cache") for name in _imports(path)
                 if name.startswith("omlx_core.plugins.") and not name.startswith(
                     "omlx_core.plugins.ssd_cache")]
    assert not offenders, "\n".join(offenders)


def _engine_modules() -> list[Path]:
    """Plugin, example and core scheduling modules (what engines are built of), less the
    benchmarks (clients of a server, not part of one)."""
    return [p for p in python_files("plugins") + python_files("examples")
            + python_files("omlx_core/scheduling") if p.stem != "benchmark"]


def test_no_engine_handles_text() -> None:
    """Engines speak tokens: text handling (detokenizing for output, stop strings) is
    the serving pipeline's, so nothing under plugins/ or examples/ imports it."""
    offenders = [f"{path.relative_to(ROOT)} imports {name}" for path in _engine_modules()
                 for name in _imports(path)
                 if name == "omlx_core.text" or name.startswith("omlx_core.serving")]
    assert not offenders, "\n".join(offenders)


def test_engines_reach_the_server_only_through_their_host() -> None:
    """No engine module imports the plugin manager or the bootstrap, or calls a hook."""
    offenders = [f"{path.relative_to(ROOT)} imports {name}" for path in _engine_modules()
                 for name in _imports(path)
                 if name in ("omlx_core.pluginmanager", "omlx_core.bootstrap",
                             "omlx_core.server_context")]
    offenders += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in _engine_modules()
                  for n, line in enumerate(path.read_text().splitlines(), 1)
                  if re.search(r"\.hook\.|bind_plugins|mlx_thread\(\)", line)]
    assert not offenders, "\n".join(offenders)
