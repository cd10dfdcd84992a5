"""One process owns an SSD cache directory at a time: an advisory lock on ``.lock``.

Two servers on one directory would evict and clean up each other's files; the second
one is refused with the owner's process id, read from the lock file.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class DirectoryInUseError(RuntimeError):
    """Another process serves from this SSD cache directory."""


def take_directory(directory: Path) -> IO[str]:
    """Lock ``directory`` for this process; the open lock file, for :func:`release_directory`."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.fchmod(fd, 0o600)
    handle = os.fdopen(fd, "r+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise DirectoryInUseError(
            f"SSD cache directory {directory} is in use by {owner}; give each "
            "server its own plugin.ssd_cache.dir (two processes would evict and clean up each "
            "other's files)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()}")
    handle.flush()
    return handle


def release_directory(handle: IO[str]) -> None:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()


__all__ = ["DirectoryInUseError", "release_directory", "take_directory"]
