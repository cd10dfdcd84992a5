"""Structure of the built-in plugins: classes small enough to hold one idea, and the
scheduler extended through its declared extension points only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
#: the most lines one class may span (its docstring and comments included)
MAX_CLASS_LINES = 400


def _classes(path: Path) -> list[ast.ClassDef]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def _span(node: ast.ClassDef) -> int:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - first + 1  # type: ignore[operator]


def test_no_plugin_class_is_over_the_line_limit() -> None:
    over = [f"{path.relative_to(ROOT)}: class {node.name} spans {_span(node)} lines"
            for path in sorted(PLUGINS.rglob("*.py")) for node in _classes(path)
            if _span(node) > MAX_CLASS_LINES]
    assert not over, (f"classes over {MAX_CLASS_LINES} lines (split them into composed parts, "
                      "one idea each):\n" + "\n".join(over))


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

