"""The paged SSD cache's files: one safetensors file per block, one per boundary state.

A **block file** ``<hash>.safetensors`` holds the keys and values of one block's tokens
for every layer that can be cut at any token (tensors ``kv.<layer>.k`` / ``kv.<layer>.v``;
a quantized layer's six arrays, packed values, scales and biases of keys then values, as
``kv.<layer>.0`` ... ``kv.<layer>.5``, stored as they are).
A **boundary file** holds the whole state of every layer that cannot be cut (recurrent
``ArraysCache`` state, rotating windows) at the block's end: tensors ``s.<n>`` plus a JSON
description of each layer's cache class and state structure, rebuilt with mlx-lm's
``from_state``. Both carry metadata: format version, kind, block hash, index, token
count, layer count, model identity, cache type per layer, and a CRC-32 per tensor so a
flipped or truncated byte is detected on load.

Split of work by thread: :func:`payload_of_kv` / :func:`payload_of_states` describe a file
and :meth:`Payload.to_host` copies its arrays to host memory (numpy), on the MLX thread;
:func:`write_payload` runs on the writer thread and touches no mlx; :func:`read_arrays`
(the MLX thread again) builds mlx arrays.

Where files live is named here too (:func:`block_path`, :func:`boundary_path`, a
request's staging directory :func:`snapshot_dir`), and how they are removed: quietly
when already gone, with a warning when they cannot be.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from safetensors import SafetensorError, TensorSpec, safe_open, serialize

FORMAT_VERSION = "1"
BLOCK_KIND = "omlx-kv-block"
BOUNDARY_KIND = "omlx-kv-boundary"
BLOCK_SUFFIX = ".safetensors"
BOUNDARY_SUFFIX = ".boundary.safetensors"
TMP_SUFFIX = ".tmp"
#: per-tensor header bytes and JSON envelope margin on top of the metadata's own length
_HEADER_BYTES_PER_TENSOR = 128
_HEADER_ENVELOPE = 256

# mlx dtype name -> (safetensors dtype, numpy dtype holding the raw bytes)
_DTYPES: dict[str, tuple[str, Any]] = {
    "float32": ("F32", np.float32), "float16": ("F16", np.float16),
    "bfloat16": ("BF16", np.uint16), "float64": ("F64", np.float64),
    "int8": ("I8", np.int8), "int16": ("I16", np.int16), "int32": ("I32", np.int32),
    "int64": ("I64", np.int64), "uint8": ("U8", np.uint8), "uint16": ("U16", np.uint16),
    "uint32": ("U32", np.uint32), "uint64": ("U64", np.uint64), "bool": ("BOOL", np.bool_),
}
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")

log = logging.getLogger(__name__)


class BlockFileError(Exception):
    """A cache file that cannot be used: truncated, corrupt, foreign or of another format."""


@dataclass
class Payload:
    """A file's tensors and metadata. Built on the MLX thread holding mlx arrays, sized
    (:meth:`estimated_file_size`), then copied to host memory (:meth:`to_host`) before it
    goes to the writer thread, which never touches mlx."""

    #: tensor name -> host copy (after :meth:`to_host`)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    #: tensor name -> mlx dtype name (bfloat16 travels as uint16 bytes)
    dtypes: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    #: tensor name -> mlx array not yet copied
    pending: dict[str, mx.array] = field(default_factory=dict)

    def add(self, name: str, array: mx.array) -> None:
        dtype = str(array.dtype).removeprefix("mlx.core.")
        if dtype not in _DTYPES:
            raise BlockFileError(f"tensor {name}: dtype {dtype} cannot be stored in the SSD cache")
        self.pending[name] = array
        self.dtypes[name] = dtype

    def to_host(self) -> "Payload":
        """Copy the pending tensors to host memory (MLX thread); returns ``self``."""
        for name, array in self.pending.items():
            raw = array.view(mx.uint16) if self.dtypes[name] == "bfloat16" else array
            # A cut block is often a strided view; the file and its CRC need plain C order.
            self.tensors[name] = np.ascontiguousarray(np.array(raw, copy=True))
        self.pending = {}
        return self

    @property
    def tensor_bytes(self) -> int:
        return (sum(a.nbytes for a in self.tensors.values())
                + sum(a.nbytes for a in self.pending.values()))

    def estimated_file_size(self) -> int:
        """Bytes the file will take: tensors, the real metadata JSON, header overhead."""
        count = len(self.tensors) + len(self.pending)
        crc_text = count * 24  # '"name": 4294967295, ' per tensor, roughly
        meta = len(json.dumps(self.metadata)) + crc_text
        return self.tensor_bytes + meta + _HEADER_ENVELOPE + _HEADER_BYTES_PER_TENSOR * count


def _base_metadata(kind: str, block_hash: bytes, index: int, token_count: int, identity: str,
                   layer_types: Sequence[str]) -> dict[str, str]:
    return {
        "format": kind,
        "version": FORMAT_VERSION,
        "block_hash": block_hash.hex(),
        "index": str(index),
        "token_count": str(token_count),
        "layers": str(len(layer_types)),
        "model": identity,
        "layer_types": json.dumps(list(layer_types)),
    }


def payload_of_kv(kv: Sequence[Any], *, block_hash: bytes, parent_hash: bytes, index: int,
                  block_size: int, identity: str, layer_types: Sequence[str],
                  tokens: Sequence[int] = ()) -> Payload:
    """A block file's payload: ``kv`` is per layer ``(keys, values)`` or ``None``;
    ``tokens`` (the block's token ids) let a block read back be reused in part."""
    payload = Payload(metadata=_base_metadata(BLOCK_KIND, block_hash, index, block_size * (index + 1),
                                              identity, layer_types))
    payload.metadata["parent_hash"] = parent_hash.hex()
    payload.metadata["block_size"] = str(block_size)
    if tokens:
        payload.metadata["tokens"] = json.dumps([int(t) for t in tokens])
    for layer, parts in enumerate(kv):
        if parts is None:
            continue
        if len(parts) == 2:
            payload.add(f"kv.{layer}.k", parts[0])
            payload.add(f"kv.{layer}.v", parts[1])
        else:
            for index, part in enumerate(parts):
                payload.add(f"kv.{layer}.{index}", part)
    return payload


def _encode_tree(value: Any, payload: Payload) -> Any:
    if isinstance(value, mx.array):
        name = f"s.{len(payload.dtypes)}"
        payload.add(name, value)
        return {"t": name}
    if isinstance(value, list):
        return [_encode_tree(v, payload) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode_tree(v, payload) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise BlockFileError(f"cannot store a cache state holding {type(value).__name__}")


def payload_of_states(states: Sequence[Any], *, block_hash: bytes, index: int, token_count: int,
                      identity: str, layer_types: Sequence[str], request_id: str = "") -> Payload:
    """A boundary file's payload: ``states`` is per layer an mlx-lm cache object or ``None``."""
    payload = Payload(metadata=_base_metadata(BOUNDARY_KIND, block_hash, index, token_count,
                                              identity, layer_types))
    layers = []
    for layer in states:
        if layer is None:
            layers.append(None)
        else:
            layers.append({"class": type(layer).__name__, "state": _encode_tree(layer.state, payload)})
    payload.metadata["states"] = json.dumps(layers)
    if request_id:
        payload.metadata["request_id"] = request_id
    return payload


def write_payload(payload: Payload, path: Path) -> int:
    """Write ``payload`` to ``path`` (not atomically: callers write a temp file and rename).

    Returns the file's size. The bytes are written here, not by safetensors, so a full
    disk raises :class:`OSError` with its ``errno``. Touches no mlx, so it may run on any
    thread.
    """
    if payload.pending:
        raise ValueError("payload tensors are still mlx arrays; call to_host() on the MLX thread")
    metadata = dict(payload.metadata)
    metadata["crc32"] = json.dumps({name: zlib.crc32(array) for name, array in payload.tensors.items()})
    specs = {}
    for name, array in payload.tensors.items():
        specs[name] = TensorSpec(dtype=payload.dtypes[name], shape=array.shape,
                                 data_ptr=array.ctypes.data, data_len=array.nbytes)
    data = serialize(specs, metadata=metadata)
    with open_private(path) as handle:
        handle.write(data)
    return len(data)


#: who may read what the cache keeps: its owner only (a block's metadata holds the
#: token ids of the prompts it came from)
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def open_private(path: Path, mode: str = "wb") -> Any:
    """``path`` opened for writing, created (or truncated) readable by its owner only."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # a file left by an older version keeps its mode
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def make_private_dir(path: Path) -> None:
    """``path`` (and missing parents) as a directory only its owner may enter."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR_MODE)


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of a cache file, checking only its header (a truncated file fails here)."""
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise BlockFileError(f"{path.name}: unreadable header: {exc}") from None
    if metadata.get("version") != FORMAT_VERSION or metadata.get("format") not in (BLOCK_KIND,
                                                                                    BOUNDARY_KIND):
        raise BlockFileError(f"{path.name}: not an omlx-core cache file of format version "
                             f"{FORMAT_VERSION} (found {metadata.get('format')!r} "
                             f"version {metadata.get('version')!r})")
    return metadata


def check_metadata(metadata: dict[str, str], *, kind: str, block_hash: bytes, identity: str,
                   name: str) -> None:
    """Raise :class:`BlockFileError` unless the file is the ``kind`` file of this block and model."""
    if metadata.get("format") != kind:
        raise BlockFileError(f"{name}: a {metadata.get('format')} file where a {kind} was expected")
    if metadata.get("model") != identity:
        raise BlockFileError(f"{name}: written for another model ({metadata.get('model')!r})")
    if metadata.get("block_hash") != block_hash.hex():
        raise BlockFileError(f"{name}: holds block {metadata.get('block_hash')}, not {block_hash.hex()}")


def read_arrays(path: Path) -> tuple[dict[str, str], dict[str, mx.array]]:
    """Metadata and tensors of a cache file, every tensor's CRC checked (MLX thread).

    mlx reads the file straight into its own buffers and the CRC is taken through a
    view of them: no host copy of the file exists beside them. (Reading the bytes into
    Python first held two copies of every block, one of them outside mlx's accounting,
    and its freed pages stayed resident in the heap: loads of cached blocks took the
    server past its memory ceiling, docs/reliability.md.)
    """
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
        for array in arrays.values():
            mx.eval(array)
    except (RuntimeError, ValueError, OSError) as exc:
        raise BlockFileError(f"{path.name}: unreadable: {exc}") from None
    try:
        crcs = json.loads(metadata["crc32"])
    except (KeyError, json.JSONDecodeError):
        raise BlockFileError(f"{path.name}: no checksums in its metadata") from None
    for name, array in arrays.items():
        dtype = str(array.dtype).removeprefix("mlx.core.")
        if dtype not in _DTYPES:
            raise BlockFileError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        raw = array.view(mx.uint16) if dtype == "bfloat16" else array
        if zlib.crc32(memoryview(raw)) != crcs.get(name):
            raise BlockFileError(f"{path.name}: tensor {name} fails its CRC check (corrupt file)")
    if set(arrays) != set(crcs):
        raise BlockFileError(f"{path.name}: tensors {sorted(set(crcs) - set(arrays))} are missing")
    return metadata, arrays


def kv_of(arrays: dict[str, mx.array], layers: int) -> tuple[Any, ...]:
    """Per layer ``(keys, values)``, a quantized layer's six arrays, or ``None``, from a
    block file's tensors."""
    def layer(i: int) -> tuple[mx.array, ...] | None:
        if f"kv.{i}.k" in arrays:
            return arrays[f"kv.{i}.k"], arrays[f"kv.{i}.v"]
        if f"kv.{i}.0" in arrays:
            return tuple(arrays[f"kv.{i}.{j}"] for j in range(6))
        return None

    return tuple(layer(i) for i in range(layers))


def _decode_tree(value: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(value, list):
        return [_decode_tree(v, arrays) for v in value]
    if isinstance(value, dict):
        if "t" in value:
            return arrays[value["t"]]
        if "tuple" in value:
            return tuple(_decode_tree(v, arrays) for v in value["tuple"])
    return value


def states_of(metadata: dict[str, str], arrays: dict[str, mx.array]) -> tuple[Any, ...]:
    """Per layer an mlx-lm cache object rebuilt with ``from_state``, or ``None``."""
    from mlx_lm.models import cache as cache_classes

    try:
        layers = json.loads(metadata["states"])
        out = []
        for layer in layers:
            if layer is None:
                out.append(None)
                continue
            cls = getattr(cache_classes, layer["class"], None)
            if not isinstance(cls, type):
                raise BlockFileError(f"unknown cache class {layer['class']!r}")
            out.append(cls.from_state(_decode_tree(layer["state"], arrays)))
        return tuple(out)
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise BlockFileError(f"boundary state cannot be rebuilt: {exc}") from None


def block_path(directory: Path, block_hash: bytes) -> Path:
    return directory / f"{block_hash.hex()}{BLOCK_SUFFIX}"


def boundary_path(directory: Path, block_hash: bytes) -> Path:
    return directory / f"{block_hash.hex()}{BOUNDARY_SUFFIX}"


def snapshot_dir(snapshots_dir: Path, request_id: str) -> Path:
    """Where a request's boundary snapshots are staged: its id as the directory name when
    that is a safe file name, else a digest of it."""
    name = request_id if _SAFE_REQUEST_ID.match(request_id) else \
        "h-" + hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
    return snapshots_dir / name


def file_size(path: Path) -> int:
    """``path``'s size, 0 when it is gone."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def remove_file(path: Path) -> int:
    """Remove ``path``; 1 if it was removed, 0 if it was not there or cannot be (logged)."""
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("SSD cache: cannot remove %s: %s", path, exc)
        return 0


def remove_block_files(directory: Path, hashes: Sequence[bytes]) -> None:
    """Remove the block files and boundary files of ``hashes``."""
    for block_hash in hashes:
        remove_file(block_path(directory, block_hash))
        remove_file(boundary_path(directory, block_hash))


def remove_dir_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


__all__ = [
    "BLOCK_KIND", "BLOCK_SUFFIX", "BOUNDARY_KIND", "BOUNDARY_SUFFIX", "BlockFileError", "FORMAT_VERSION",
    "Payload", "TMP_SUFFIX", "block_path", "boundary_path", "check_metadata", "file_size", "kv_of",
    "payload_of_kv", "payload_of_states", "read_arrays", "read_metadata", "remove_block_files",
    "remove_dir_if_empty", "remove_file", "snapshot_dir", "states_of", "write_payload",
    "PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "make_private_dir", "open_private",
]
