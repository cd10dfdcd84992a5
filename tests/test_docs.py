"""Committed docs show no developer machine's paths: a reader's checkout, virtualenv,
home and cgroup are their own (placeholders and relative paths only)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MACHINE_PATHS = re.compile(
    r"(?<![\w~<])/(?:work|root|home|tmp|Users)/[\w.-]+"   # checkouts, homes, temp venvs
    r"|/sys/fs/cgroup/\S*[0-9a-f]{16,}"                    # a container's cgroup id
    r"|\.venv/bin/python3?\.\d")                           # an interpreter's own version path


def docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md",
            *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def test_docs_show_no_machine_paths() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {match.group(0)}" for path in docs()
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for match in MACHINE_PATHS.finditer(line)]
    assert not found, ("machine paths in committed docs (use ~/.cache/..., <venv>, <checkout> "
                       "or relative paths; scripts/readme_outputs.py redacts README's):\n"
                       + "\n".join(found))


def test_the_pattern_catches_what_it_is_for() -> None:
    for leak in ("/work/main/omlx_core", "/root/.cache/omlx-core", "/tmp/venv/bin/python3",
                 "/sys/fs/cgroup/memory/process_api/838191dab32f129a30ad9c5e249932d4"):
        assert MACHINE_PATHS.search(leak), leak
    for fine in ("~/.cache/omlx-core", "<venv>/bin/python", "omlx_core/config/tiers/base.toml",
                 "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                 "/var/cache/omlx-core/ssd"):
        assert not MACHINE_PATHS.search(fine), fine
