"""Regenerate the command outputs shown in README.md (between the outputs markers), or
check that they are still what the commands print.

    .venv/bin/python scripts/readme_outputs.py           # rewrite the block
    .venv/bin/python scripts/readme_outputs.py --check   # exit 1 if it no longer matches

Runs ``omlx-core plugins``, ``omlx-core config show --tier cpu-small`` (first rows) and
``omlx-core doctor`` and writes what they print, with this machine's paths replaced by
placeholders (``<checkout>``, ``<venv>``, ``~``, ``<cgroup>``): the README shows what a
reader will see, not where one developer's files are. ``--check`` compares the plugins
and configuration outputs line for line and the doctor's report by its checks (their
details are this machine's: versions, memory, timings); the test suite runs it.
"""

from __future__ import annotations

import difflib
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


def outputs(text: str) -> dict[str, list[str]]:
    """Each command of a block (its ``$ ...`` line) and the lines it printed."""
    found: dict[str, list[str]] = {}
    for fenced in re.findall(r"```\n(.*?)```", text, flags=re.S):
        command, *lines = fenced.rstrip("\n").split("\n")
        found[command.split("#")[0].strip()] = lines
    return found


def comparable(command: str, lines: list[str]) -> list[str]:
    """What of a command's output must match on every machine: all of it, but of the
    doctor's report only which checks it ran, in order."""
    if command != "$ omlx-core doctor":
        return lines
    header = lines[0]
    check, detail = header.index("CHECK"), header.index("DETAIL")
    return [header] + [line[check:detail].strip() for line in lines[1:] if line.strip()
                       and not re.match(r"\d+ checks:", line)]


def differences(readme_block: str, fresh_block: str) -> list[str]:
    """How README's block differs from what the commands print now (empty: it does not)."""
    shown, now = outputs(readme_block), outputs(fresh_block)
    found = []
    if list(shown) != list(now):
        found.append(f"README shows the commands {list(shown)}, the script runs {list(now)}")
    for command in shown.keys() & now.keys():
        was, is_now = comparable(command, shown[command]), comparable(command, now[command])
        if was != is_now:
            diff = difflib.unified_diff(was, is_now, "README.md", "now", lineterm="")
            found.append(f"{command}:\n" + "\n".join(diff))
    return found


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    fresh = block()
    if check:
        found = differences(text[start:end], fresh)
        for difference in found:
            print(difference)
        if found:
            print("README.md's command outputs are out of date: run scripts/readme_outputs.py")
        return 1 if found else 0
    readme.write_text(text[:start] + "\n" + fresh + "\n" + text[end:])
    print(f"README.md outputs regenerated ({os.path.relpath(readme)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
