"""Regenerate the command outputs shown in README.md (between the outputs markers).

    .venv/bin/python scripts/readme_outputs.py

Runs ``omlx-core plugins``, ``omlx-core config show --tier cpu-small`` (first rows) and
``omlx-core doctor`` and writes what they print, with this machine's paths replaced by
placeholders (``<checkout>``, ``<venv>``, ``~``, ``<cgroup>``): the README shows what a
reader will see, not where one developer's files are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- outputs:begin -->", "<!-- outputs:end -->"
CONFIG_ROWS = 14


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "omlx_core", *args], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    return result.stdout


def redact(text: str) -> str:
    venv = str(Path(sys.prefix))
    text = text.replace(venv, "<venv>").replace(str(ROOT), "<checkout>")
    text = text.replace(str(Path.home()), "~")
    # A container's cgroup path names the container: only the hierarchy is worth showing.
    return re.sub(r"(/sys/fs/cgroup\S*?)/[0-9a-f]{16,}\b", r"\1/<cgroup>", text)


def block() -> str:
    config = run("config", "show", "--tier", "cpu-small").splitlines()
    parts = [
        "What they print on a 2-core Linux box without a GPU (CPU backend):", "",
        "```", "$ omlx-core plugins", run("plugins").rstrip(), "```", "",
        "```", "$ omlx-core config show --tier cpu-small        # first rows",
        "\n".join(config[:CONFIG_ROWS]), "...", "```", "",
        "```", "$ omlx-core doctor", run("doctor").rstrip(), "```",
    ]
    return redact("\n".join(parts))


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + block() + "\n" + text[end:])
    print(f"README.md outputs regenerated ({os.path.relpath(readme)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
