"""Packaging keeps its promises: every package ships, no generic names leak into
site-packages, what omlx-core relies on is bounded to the versions the suite runs, and the
Python floor is the one its dependencies set, stated alike everywhere."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
#: dependencies omlx-core relies on beyond their public API (tests/test_upstream_surfaces.py)
RELIED_ON = ("mlx", "mlx-lm", "waitress")


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


def _upper_bounded(specifier: SpecifierSet) -> bool:
    return any(spec.operator in ("<", "<=", "==", "~=") for spec in specifier)


def test_relied_on_dependencies_are_bounded_to_the_versions_the_suite_runs():
    _, _, data = declared()
    requirements = [Requirement(r) for r in data["project"]["dependencies"]]
    requirements += [Requirement(r) for extra in data["project"]["optional-dependencies"].values()
                     for r in extra]
    for name in RELIED_ON:
        found = [r for r in requirements if r.name == name]
        assert found, f"{name} is no longer a dependency: drop it from RELIED_ON"
        for requirement in found:
            assert _upper_bounded(requirement.specifier), (
                f"pyproject.toml: {requirement} has no upper bound: the next release would "
                "install untested (bound it to the minor version the suite runs)")
            installed = metadata.version(name)
            assert requirement.specifier.contains(installed, prereleases=True), (
                f"{name} {installed} is installed but pyproject.toml says {requirement}")


NO_DEPS = re.compile(r'install --no-deps "([^"]+)"')


def test_every_no_deps_install_in_setup_sh_is_bounded_and_installed():
    # pip checks nothing of a --no-deps package against the rest: its pin is the check.
    pins = [Requirement(spec) for spec in NO_DEPS.findall((ROOT / "setup.sh").read_text())]
    assert len(pins) >= 4, "setup.sh installs fewer --no-deps packages: is the pattern stale?"
    for requirement in pins:
        assert _upper_bounded(requirement.specifier), f"setup.sh: bound {requirement} from above"
        installed = metadata.version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{requirement.name} {installed} is installed but setup.sh installs {requirement}")


def _floor(requires_python: str) -> tuple[int, int]:
    versions = [tuple(int(p) for p in spec.version.split(".")[:2])
                for spec in SpecifierSet(requires_python) if spec.operator == ">="]
    return max(versions)


def test_the_python_floor_is_the_dependencies_and_is_stated_alike_everywhere():
    from omlx_core.platform.doctor import MINIMUM_PYTHON

    _, _, data = declared()
    ours = _floor(data["project"]["requires-python"])
    theirs = {name: _floor(metadata.metadata(name)["Requires-Python"] or ">=3.0")
              for name in ("mlx", "mlx-lm", "waitress", "falcon", "pluggy")}
    highest = max(theirs.values())
    assert ours == highest, (
        f"pyproject.toml's requires-python floor is {ours}, but the dependencies need "
        f"{highest} ({theirs}): state the real floor")
    floor = ".".join(map(str, ours))
    assert MINIMUM_PYTHON == ours, "omlx_core/platform/doctor.py MINIMUM_PYTHON"
    assert f'MINIMUM="{floor}"' in (ROOT / "scripts" / "find_python.sh").read_text()
    for doc in ("README.md", "CONTRIBUTING.md"):
        text = (ROOT / doc).read_text()
        assert f"Python ≥ {floor}" in text, f"{doc} states another Python floor"
        assert not re.search(r"Python ≥ 3\.(?!%s\b)\d+" % ours[1], text), doc
