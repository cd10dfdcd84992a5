"""Packaging keeps its promises: every package ships, and no generic names leak into
site-packages."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def declared():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = data["tool"]["setuptools"]
    return tool["packages"], tool["package-dir"], data


def test_every_package_directory_is_declared():
    packages, package_dir, _ = declared()
    expected = set()
    for dotted, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            parts = [p for p in relative.parts]
            expected.add(".".join([dotted, *parts]))
    missing = expected - set(packages)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_no_generic_top_level_names():
    packages, _, _ = declared()
    assert all(p == "omlx_core" or p.startswith("omlx_core.") for p in packages)


def test_builtin_entry_points_resolve_to_declared_packages():
    packages, _, data = declared()
    for name, target in data["project"]["entry-points"]["omlx_core"].items():
        module = target.split(":")[0]
        assert module in packages or module.rsplit(".", 1)[0] in packages, name
