"""Restart recovery: index the blocks a previous process left, remove what is unusable.

A block file counts only under its final name (the writer renames a complete temp file
into place), with a valid header of this model; a boundary file only next to its block.
Temp files of writes that never finished, foreign or damaged files, and boundary files
without their block are removed. Recency survives a restart in the files' mtimes (the
store's ``touch`` writes them): the oldest come first, and among equally old blocks the
deeper ones (leaves), as eviction wants them.
"""

from __future__ import annotations

import json
import logging
import os
import re
from array import array
from pathlib import Path

from omlx_core.plugins.ssd_cache.blockfile import (
    BLOCK_KIND, BLOCK_SUFFIX, BOUNDARY_KIND, BOUNDARY_SUFFIX, PRIVATE_FILE_MODE, BlockFileError, boundary_path,
    check_metadata, read_metadata, remove_file)
from omlx_core.plugins.ssd_cache.index import IndexEntry

log = logging.getLogger(__name__)

#: a model directory with more block files than this shows a progress bar while indexing
PROGRESS_FROM_FILES = 512
_HEX_NAME = re.compile(r"^[0-9a-f]{32}$")


def scan_blocks(blocks_dir: Path, identity: str, label: str) -> tuple[list[tuple[bytes, IndexEntry]], int]:
    """The usable blocks in ``blocks_dir``, least recent first, and how many files were
    removed as unusable. ``label`` names the directory on the progress bar."""
    names = sorted(os.listdir(blocks_dir))
    name_set = set(names)
    found: list[tuple[int, int, bytes, IndexEntry]] = []
    removed = 0
    boundaries = {n[:-len(BOUNDARY_SUFFIX)] for n in names if n.endswith(BOUNDARY_SUFFIX)}
    progress = None
    if len(names) > PROGRESS_FROM_FILES:
        from tqdm import tqdm

        progress = tqdm(total=len(names), desc=f"indexing SSD cache {label}", unit="file", leave=False)
    for name in names:
        if progress is not None:
            progress.update(1)
        path = blocks_dir / name
        _owner_only(path)
        if name.endswith(BOUNDARY_SUFFIX):
            if name[:-len(BOUNDARY_SUFFIX)] + BLOCK_SUFFIX not in name_set:
                removed += remove_file(path)
            continue
        stem = name[:-len(BLOCK_SUFFIX)] if name.endswith(BLOCK_SUFFIX) else ""
        if not _HEX_NAME.match(stem):
            removed += remove_file(path)  # temp files of a write that never finished
            continue
        block_hash = bytes.fromhex(stem)
        try:
            metadata = read_metadata(path)
            check_metadata(metadata, kind=BLOCK_KIND, block_hash=block_hash, identity=identity, name=name)
            stat = path.stat()
            size = stat.st_size
            has_boundary = False
            if stem in boundaries:
                side = boundary_path(blocks_dir, block_hash)
                try:
                    check_metadata(read_metadata(side), kind=BOUNDARY_KIND, block_hash=block_hash,
                                   identity=identity, name=side.name)
                    size += side.stat().st_size
                    has_boundary = True
                except (BlockFileError, OSError) as exc:
                    log.warning("SSD cache: removing %s: %s", side.name, exc)
                    removed += remove_file(side)
            depth = int(metadata.get("index", 0))
            parent, tokens = b"", array("q", json.loads(metadata.get("tokens", "[]")))
            cut_by_token = all(t == "KVCache" for t in json.loads(metadata.get("layer_types", "[]")))
            partial = len(tokens) < int(metadata.get("block_size", 0))
            if tokens and (cut_by_token or (has_boundary and partial)):
                parent = bytes.fromhex(metadata.get("parent_hash", ""))
            else:
                tokens = array("q")
        except (BlockFileError, OSError, ValueError) as exc:
            log.warning("SSD cache: removing %s: %s", name, exc)
            removed += remove_file(path)
            remove_file(boundary_path(blocks_dir, block_hash))
            continue
        found.append((stat.st_mtime_ns, -depth, block_hash, IndexEntry(size, True, has_boundary, parent, tokens)))
    if progress is not None:
        progress.close()
    found.sort(key=lambda f: (f[0], f[1]))
    return [(block_hash, entry) for _, _, block_hash, entry in found], removed


def _owner_only(path: Path) -> None:
    """A file an older version wrote readable by others, made its owner's only."""
    try:
        if path.stat().st_mode & 0o077:
            os.chmod(path, PRIVATE_FILE_MODE)
    except OSError:
        pass  # gone meanwhile, or not ours: the checks below decide what to do with it


__all__ = ["PROGRESS_FROM_FILES", "scan_blocks"]
