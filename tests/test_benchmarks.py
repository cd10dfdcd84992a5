"""The developer benchmarks under ``benchmarks/`` stay outside the runtime: no installed
module imports them, and they use omlx-core only through public names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RUNTIME = ("omlx_core", "plugins", "hookspecs")


def private_imports(source: str) -> list[str]:
    """Every ``_name`` imported from omlx_core (``from omlx_core.x import _y``,
    ``import omlx_core._x``, ``from omlx_core._x import y``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "omlx_core":
                continue
            private_module = any(p.startswith("_") for p in node.module.split("."))
            found += [f"{node.module}.{a.name}" for a in node.names
                      if private_module or a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "omlx_core"
                      and any(p.startswith("_") for p in a.name.split("."))]
    return found


def test_benchmarks_import_no_private_names_from_omlx_core() -> None:
    files = sorted(BENCHMARKS.rglob("*.py"))
    assert len(files) > 5, "the benchmarks moved?"
    found = [f"{path.relative_to(ROOT)}: {name}" for path in files
             for name in private_imports(path.read_text())]
    assert not found, ("give these a public, documented name instead:\n" + "\n".join(found))


def test_the_scan_catches_what_it_is_for() -> None:
    assert private_imports("from omlx_core.cli import _served_models\n"
                           "from omlx_core._private import x\n"
                           "import omlx_core.memory._probe\n") == [
        "omlx_core.cli._served_models", "omlx_core._private.x", "omlx_core.memory._probe"]
    assert private_imports("from omlx_core.bootstrap import served_models\n"
                           "from .helpers import _local\nimport _thread\n") == []


def test_no_runtime_module_imports_a_benchmark() -> None:
    offenders = []
    for package in RUNTIME:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                              if n.split(".")[0] == "benchmarks"]
    assert not offenders, "\n".join(offenders)


def test_every_benchmark_runs_both_ways_and_says_how() -> None:
    for path in sorted(BENCHMARKS.glob("[!_]*.py")):
        source = path.read_text()
        assert f"python -m benchmarks.{path.stem}" in source, f"{path.name} names its command"
        assert 'if __name__ == "__main__"' in source, path.name
    script = subprocess.run([sys.executable, str(BENCHMARKS / "http_cost.py"), "--help"],
                            capture_output=True, text=True, cwd=ROOT / "docs", timeout=300)
    module = subprocess.run([sys.executable, "-m", "benchmarks.ssd_cache", "--help"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert script.returncode == 0 and "--streams" in script.stdout, script.stderr
    assert module.returncode == 0 and "--prompt-tokens" in module.stdout, module.stderr


@pytest.mark.slow
def test_the_benchmark_commands_the_docs_show_exist_with_their_flags() -> None:
    """Every ``python -m benchmarks.NAME --flag ...`` BENCHMARKS.md and CONTRIBUTING.md
    show names a benchmark that exists, and each flag is in its ``--help``: a renamed
    benchmark or flag fails here instead of in a reader's terminal."""
    shown: dict[str, set[str]] = {}
    for doc in ("BENCHMARKS.md", "CONTRIBUTING.md"):
        for name, rest in re.findall(r"python -m benchmarks\.([a-z_]+)([^`|\n]*)",
                                     (ROOT / doc).read_text()):
            shown.setdefault(name, set()).update(re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest))
    assert len(shown) >= 10, shown
    missing = sorted(name for name in shown if not (BENCHMARKS / f"{name}.py").is_file())
    assert not missing, f"the docs show benchmarks that do not exist: {missing}"
    for name, flags in sorted(shown.items()):
        result = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"],
                                capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode == 0, f"benchmarks.{name} --help: {result.stderr[-2000:]}"
        unknown = sorted(flag for flag in flags if flag not in result.stdout)
        assert not unknown, f"benchmarks.{name} has no {unknown} (the docs show them)"
