"""Client images: the checks that need no decoding, then decoding, then pixels.

Everything here runs on the request's thread, before the request reaches the MLX
thread: a bad image is a 400 naming the part and the limit it broke, never a failure
inside the engine. The order follows what it costs: count, encoded size and file
location first (:func:`check_parts`, before preflight); decoding (:func:`decode`) only
for a request preflight let through, with the pixel count read from the header before
a single pixel is decompressed (a decompression bomb stops there).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

from omlx_core.engine import ImagePart
from omlx_core.settings import format_size


@dataclass(frozen=True)
class ImageLimits:
    """The operator's limits (``[plugin.vlm]``)."""

    max_images: int
    max_image_pixels: int
    max_image_bytes: int
    #: directories a client may name local image files in (none: local files refused)
    allowed_dirs: tuple[Path, ...] = ()


@dataclass(frozen=True)
class PreparedImage:
    """A decoded, checked image and its pixels as the model's processor made them."""

    index: int
    param: str
    #: sha256 of the encoded bytes: what the prefix cache keys the image's tokens by
    digest: bytes
    width: int
    height: int
    #: ``(channels, height, width)`` float32 pixels
    pixel_values: Any


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes" if nbytes < 1024 else format_size(nbytes)


def _outside(part: ImagePart, raw: str, limits: ImageLimits) -> ValueError:
    # One answer whether or not the file exists: anything else lets a client probe the
    # server's file system through error messages.
    return ValueError(f"{part.param}: image file {raw!r} is not in the directories this server "
                      f"reads images from ({', '.join(str(d) for d in limits.allowed_dirs)})")


def _inside(path: Path, limits: ImageLimits) -> bool:
    return any(path.is_relative_to(root) for root in limits.allowed_dirs)


def _opened_path(fd: int) -> Path | None:
    """The path the kernel has for an open descriptor: what was really opened, whatever
    was swapped on the way there (``None`` where the platform cannot say)."""
    proc = Path(f"/proc/self/fd/{fd}")
    if proc.parent.is_dir():
        return Path(os.readlink(proc))
    if hasattr(fcntl, "F_GETPATH"):  # macOS
        return Path(fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).rstrip(b"\0").decode())
    return None


def _open_local_file(part: ImagePart, limits: ImageLimits) -> BinaryIO:
    """The client's image file, opened: checked to lie in an allowed directory and to be
    a regular file *after* it was opened, by the descriptor's own path and ``fstat``, so
    what was checked is what is read. ``ValueError`` naming the part otherwise."""
    raw = part.path or ""
    if not limits.allowed_dirs:
        raise ValueError(f"{part.param}: local image files are not allowed on this server; send "
                         "the image inline as a data URL (data:image/png;base64,...), or ask the "
                         "operator to allow a directory (plugin.vlm.allowed_image_dirs)")
    try:
        path = Path(raw).expanduser().resolve(strict=False)
    except (OSError, RuntimeError):  # a symlink loop, an unknown ~user
        raise _outside(part, raw, limits) from None
    if not _inside(path, limits):
        raise _outside(part, raw, limits)
    # O_NOFOLLOW: a symlink put in the resolved path's place after resolving is refused,
    # O_NONBLOCK: a FIFO put there does not hang the request's thread.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ValueError(f"{part.param}: image file {raw!r} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _outside(part, raw, limits) from None
        raise ValueError(f"{part.param}: image file {raw!r} cannot be read "
                         f"({exc.strerror})") from None
    try:
        opened = _opened_path(fd)
        if opened is not None and not _inside(opened, limits):
            raise _outside(part, raw, limits)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{part.param}: {raw!r} is not a file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_parts(parts: Sequence[ImagePart], limits: ImageLimits) -> None:
    """Refuse a request whose images break a limit that needs no decoding: how many, how
    large encoded, whether a named local file may be read. ``ValueError`` naming the part."""
    if len(parts) > limits.max_images:
        raise ValueError(f"{parts[limits.max_images].param}: the request has {len(parts)} images, "
                         f"more than the {limits.max_images} this server takes per request "
                         "(plugin.vlm.max_images); send fewer images")
    for part in parts:
        if part.data is not None:
            size = len(part.data)
        else:
            with _open_local_file(part, limits) as handle:
                size = os.fstat(handle.fileno()).st_size
        if size == 0:
            raise ValueError(f"{part.param}: the image is empty (0 bytes)")
        if size > limits.max_image_bytes:
            raise ValueError(f"{part.param}: the image is {_size(size)}, over the "
                             f"{_size(limits.max_image_bytes)} limit per image "
                             "(plugin.vlm.max_image_bytes); send a smaller or more compressed image")


def read_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    if part.data is not None:
        return part.data
    with _open_local_file(part, limits) as handle:
        data = handle.read(limits.max_image_bytes + 1)
    if len(data) > limits.max_image_bytes:
        raise ValueError(f"{part.param}: the image is over the {_size(limits.max_image_bytes)} "
                         "limit per image (plugin.vlm.max_image_bytes)")
    return data


#: the formats PIL may decode a client's image as (its names); PIL knows dozens more,
#: some of which hand the bytes to other programs (EPS to Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
_FORMATS_TEXT = "a PNG, JPEG, GIF, WebP or BMP image"


def decode(part: ImagePart, data: bytes, limits: ImageLimits) -> Any:
    """The RGB ``PIL.Image`` of ``data``; ``ValueError`` naming the part and the limit."""
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        # PIL's own bomb check: past its limit a warning, past twice that an error.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            width, height = image.size
        except UnidentifiedImageError:
            raise ValueError(f"{part.param}: not {_FORMATS_TEXT} (the formats this server "
                             "decodes); convert it to one of them") from None
        except Exception as exc:  # hostile bytes raise all kinds (struct.error, EOFError, ...)
            if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
                raise ValueError(f"{part.param}: the image is over the {limits.max_image_pixels} "
                                 "limit per image (plugin.vlm.max_image_pixels), a possible "
                                 f"decompression bomb ({exc}); send a smaller image") from None
            raise ValueError(f"{part.param}: not a decodable image ({type(exc).__name__}: {exc}); "
                             f"send {_FORMATS_TEXT}") from None
        if width <= 0 or height <= 0:
            raise ValueError(f"{part.param}: the image is {width}x{height} pixels; it needs at "
                             "least one pixel each way")
        if width * height > limits.max_image_pixels:
            raise ValueError(f"{part.param}: the image is {width}x{height} = {width * height} pixels, "
                             f"over the {limits.max_image_pixels} limit per image "
                             "(plugin.vlm.max_image_pixels); send a smaller image")
        try:
            image.load()
            return image.convert("RGB")
        except Exception as exc:  # a decoder's error on broken data, whichever it is
            raise ValueError(f"{part.param}: the image data is broken or truncated "
                             f"({type(exc).__name__}: {exc}); send the whole file") from None


def prepare(parts: Sequence[ImagePart], limits: ImageLimits, processor: Any) -> list[PreparedImage]:
    """Decode and check every image, then run the model's image processor on it."""
    import numpy as np

    prepared = []
    for part in parts:
        data = read_bytes(part, limits)
        image = decode(part, data, limits)
        try:
            pixels = processor(images=[image], return_tensors="np")["pixel_values"]
        except Exception as exc:  # e.g. an aspect ratio the processor refuses
            raise ValueError(f"{part.param}: the model's image processor cannot take this "
                             f"{image.width}x{image.height} image ({type(exc).__name__}: {exc})") from None
        pixels = np.asarray(pixels, dtype=np.float32)
        if pixels.ndim == 4:
            if pixels.shape[0] != 1:
                raise ValueError(f"{part.param}: the image processor made {pixels.shape[0]} crops "
                                 "of one image; this engine feeds one per image")
            pixels = pixels[0]
        prepared.append(PreparedImage(part.index, part.param, hashlib.sha256(data).digest(),
                                      image.width, image.height, pixels))
    return prepared
