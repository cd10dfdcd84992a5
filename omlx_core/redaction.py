"""Text a client may read: no absolute paths of this machine.

Error messages name the file that is wrong (a model's missing ``config.json``, a weight
file that does not parse), and those names are useful; the directories above them tell a
client how the machine is laid out (a user name, a mount point) and are not. The log
keeps the whole path. URL paths (``/v1/models``, ``/admin/models/{id}/load``) are not
file paths and stay as they are.
"""

from __future__ import annotations

import os
import re

__all__ = ["redact_paths"]

# Roots a file path on a server starts with, whether or not this machine has them (the
# message may come from another rank's machine), and the ones this machine has.
_COMMON_ROOTS = {"home", "root", "tmp", "var", "opt", "usr", "srv", "mnt", "media", "etc",
                 "data", "work", "run", "proc", "sys", "dev", "nix", "snap", "Users", "Volumes",
                 "private", "Library", "System", "Applications"}
# The server's own URL paths begin with these.
_ROUTE_ROOTS = {"v1", "admin", "dashboard", "health", "metrics", "openapi.json"}


def _roots() -> frozenset[str]:
    try:
        here = {entry for entry in os.listdir("/") if os.path.isdir(os.path.join("/", entry))}
    except OSError:
        here = set()
    return frozenset((_COMMON_ROOTS | here) - _ROUTE_ROOTS)


_ROOTS = _roots()
# An absolute path: not inside a word, a URL (``http://host/...``) or a relative path.
_PATH = re.compile(r"(?<![\w/.~:%-])/([^\s/'\"`()\[\]{}<>,;]+)((?:/[^\s/'\"`()\[\]{}<>,;]*)*)")


def redact_paths(text: str) -> str:
    """``text`` with every absolute file path shortened to ``…/<its last part>``."""
    if "/" not in text:
        return text

    def shorten(match: re.Match[str]) -> str:
        if match.group(1) not in _ROOTS:
            return match.group(0)
        parts = [part for part in match.group(0).split("/") if part]
        return "…/" + parts[-1] if len(parts) > 1 else "…"

    return _PATH.sub(shorten, text)
