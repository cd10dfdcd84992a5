"""Structure of the core and the built-in plugins: classes small enough to hold one idea,
the scheduler extended through its declared extension points only, engine plugins built
on the declared surface (``omlx_core.scheduling``) and never on another plugin, and no
private name of a dependency used anywhere."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
#: the most lines one class may span (its docstring and comments included)
MAX_CLASS_LINES = 400
#: a class over the limit says why in its docstring with this phrase
OVER_THE_LIMIT = "over 400 lines because"
#: engine plugins, and the example engine: they import only the declared surface
ENGINE_PLUGINS = ("batched", "dflash", "vlm", "distributed")
EXAMPLES = ROOT / "examples"
#: what an engine plugin may import from omlx-core (besides its own package)
SURFACE = ("omlx_core.engine", "omlx_core.host", "omlx_core.hookspecs", "omlx_core.settings",
           "omlx_core.scheduling")
#: dependencies whose internals the code could reach into (their source is scanned)
DEPENDENCIES = ("mlx_lm", "mlx_vlm", "mlx", "waitress", "falcon", "xgrammar", "pluggy")
#: an identifier that starts with an underscore (after a non-word character)
PRIVATE_IDENTIFIER = re.compile(r"\b_\w+")


def _classes(path: Path) -> list[ast.ClassDef]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def _span(node: ast.ClassDef) -> int:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - first + 1  # type: ignore[operator]


def _sources() -> list[Path]:
    return sorted((ROOT / "omlx_core").rglob("*.py")) + sorted(PLUGINS.rglob("*.py"))


def test_no_class_is_over_the_line_limit() -> None:
    over = [f"{path.relative_to(ROOT)}: class {node.name} spans {_span(node)} lines"
            for path in _sources() for node in _classes(path)
            if _span(node) > MAX_CLASS_LINES and OVER_THE_LIMIT not in (ast.get_docstring(node) or "")]
    assert not over, (f"classes over {MAX_CLASS_LINES} lines (split them into composed parts, "
                      f"one idea each, or say why in the docstring: '{OVER_THE_LIMIT} ...'):\n"
                      + "\n".join(over))


def test_the_line_limit_counts_a_class_from_its_decorators_to_its_last_line() -> None:
    source = "@dataclass\nclass Big:\n" + "    x: int = 0\n" * (MAX_CLASS_LINES - 1) + "\ny = 1\n"
    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    assert _span(node) == MAX_CLASS_LINES + 1


def _bases(node: ast.ClassDef) -> set[str]:
    return {base.id if isinstance(base, ast.Name) else base.attr
            for base in node.bases if isinstance(base, (ast.Name, ast.Attribute))}


def test_schedulers_are_extended_without_overriding_private_methods() -> None:
    """A subclass of the batched Scheduler composes extension points
    (``omlx_core.scheduling.extensions``) and overrides no private method."""
    found = []
    for path in sorted(PLUGINS.rglob("*.py")):
        for node in _classes(path):
            if "Scheduler" not in _bases(node):
                continue
            found.append(node.name)
            private = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and f.name.startswith("_") and not f.name.startswith("__")]
            assert not private, f"{path.relative_to(ROOT)}: {node.name} overrides {private}"
    assert "VLMScheduler" in found



def _imported_modules(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every absolute import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
    return found


def _plugin_of(path: Path) -> str:
    return path.relative_to(PLUGINS).parts[0]


def test_no_plugin_imports_another_plugin() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
                 for path in sorted(PLUGINS.rglob("*.py"))
                 for line, module, _ in _imported_modules(path)
                 if module.startswith("omlx_core.plugins.")
                 and module.split(".")[2] != _plugin_of(path)]
    assert not offenders, ("a plugin builds on omlx-core's declared surface, never on another "
                           "plugin's internals:\n" + "\n".join(offenders))


def _engine_modules() -> list[Path]:
    return ([p for name in ENGINE_PLUGINS for p in sorted((PLUGINS / name).rglob("*.py"))]
            + sorted(EXAMPLES.rglob("*.py")))


def test_engine_plugins_import_only_the_declared_surface() -> None:
    offenders = []
    for path in _engine_modules():
        own = f"omlx_core.plugins.{_plugin_of(path)}" if PLUGINS in path.parents else None
        for line, module, _ in _imported_modules(path):
            if not module.startswith("omlx_core") or module in SURFACE:
                continue
            if own and (module == own or module.startswith(own + ".")):
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not offenders, ("engine plugins import from omlx-core only " + ", ".join(SURFACE)
                           + " (omlx_core.scheduling lists what they may use):\n"
                           + "\n".join(offenders))


def test_the_declared_surface_names_what_it_exports() -> None:
    import omlx_core.scheduling as surface

    missing = [name for name in surface.__all__ if not hasattr(surface, name)]
    assert not missing, f"omlx_core.scheduling.__all__ names what it lacks: {missing}"
    documented = ast.get_docstring(ast.parse((ROOT / "omlx_core/scheduling/__init__.py").read_text()))
    assert documented and "engine plugin" in documented


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, attributes and names it
    assigns, parameters, import aliases."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
    return {name for name in names if _private(name)}


def _dependency_private_names(package: str, candidates: set[str]) -> set[str]:
    """Which of ``candidates`` (private names) ``package`` defines, read from its installed
    source. A module defines a name only where the name is one of its identifiers, so
    only the modules that spell a candidate are parsed (parsing all of mlx-lm, mlx-vlm
    and the others took most of this file's 20 s)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{package} is not installed: it is a dependency whose source this test scans")
    names: set[str] = set()
    for location in spec.submodule_search_locations:
        for path in Path(location).rglob("*.py"):
            text = path.read_text(errors="replace")
            if candidates.isdisjoint(PRIVATE_IDENTIFIER.findall(text)):
                continue
            try:
                names |= _defined_private_names(ast.parse(text)) & candidates
            except SyntaxError:
                continue
    return names


def test_no_private_name_of_a_dependency_is_used() -> None:
    """mlx-lm and the other dependencies rename their private names without notice: code
    that reaches into one breaks on the next release. Every private name those packages
    define (read from their installed source) that omlx-core does not define itself must
    appear nowhere in ``omlx_core/`` or ``plugins/``: not imported, not read as an
    attribute, not named in ``getattr``."""
    trees = [(path, ast.parse(path.read_text())) for path in _sources()]
    ours = set().union(*(_defined_private_names(tree) for _, tree in trees))
    offenders = []
    # (where, name) of each private name read but not defined here: an offence where a
    # dependency defines it
    uses = []
    for path, tree in trees:
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                package = node.module.split(".")[0]
                private = [a.name for a in node.names if _private(a.name)]
                if package in DEPENDENCIES and (private or any(_private(p) for p in node.module.split("."))):
                    offenders.append(f"{where}:{node.lineno}: from {node.module} import {private}")
                continue
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                name = node.args[1].value
            if name is None or not _private(name) or name in ours:
                continue
            uses.append((f"{where}:{node.lineno}", name))
    # _generation_batch: a name mlx-lm defines, asked for to show the scan reads its source
    candidates = {name for _, name in uses} | {"_generation_batch"}
    theirs = {package: _dependency_private_names(package, candidates) for package in DEPENDENCIES}
    assert "_generation_batch" in theirs["mlx_lm"], "the scan no longer reads mlx-lm's source"
    for where, name in uses:
        owners = [package for package, names in theirs.items() if name in names]
        if owners:
            offenders.append(f"{where}: {name} (private in {', '.join(owners)})")
    assert not offenders, ("private names of dependencies (use their public API; where there "
                           "is none, say so in a bounded, tested surface):\n" + "\n".join(offenders))
