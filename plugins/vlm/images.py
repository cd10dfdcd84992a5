"""Client images: the checks that need no decoding, then decoding, then pixels.

Everything here runs on the request's thread, before the request reaches the MLX
thread: a bad image is a 400 naming the part and the limit it broke, never a failure
inside the engine. The order follows what it costs: count, encoded size and file
location first (:func:`check_parts`, before preflight); decoding (:func:`decode`) only
for a request preflight let through, with the pixel count read from the header before
a single pixel is decompressed (a decompression bomb stops there).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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


def _local_file(part: ImagePart, limits: ImageLimits) -> Path:
    raw = part.path or ""
    if not limits.allowed_dirs:
        raise ValueError(f"{part.param}: local image files are not allowed on this server; send "
                         "the image inline as a data URL (data:image/png;base64,...), or ask the "
                         "operator to allow a directory (plugin.vlm.allowed_image_dirs)")
    try:
        path = Path(raw).expanduser().resolve(strict=True)
    except (OSError, RuntimeError):
        raise ValueError(f"{part.param}: image file {raw!r} does not exist") from None
    if not any(path.is_relative_to(root) for root in limits.allowed_dirs):
        raise ValueError(f"{part.param}: image file {raw!r} is outside the directories this server "
                         f"reads images from ({', '.join(str(d) for d in limits.allowed_dirs)})")
    if not path.is_file():
        raise ValueError(f"{part.param}: {raw!r} is not a file")
    return path


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
            size = _local_file(part, limits).stat().st_size
        if size == 0:
            raise ValueError(f"{part.param}: the image is empty (0 bytes)")
        if size > limits.max_image_bytes:
            raise ValueError(f"{part.param}: the image is {_size(size)}, over the "
                             f"{_size(limits.max_image_bytes)} limit per image "
                             "(plugin.vlm.max_image_bytes); send a smaller or more compressed image")


def read_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    if part.data is not None:
        return part.data
    path = _local_file(part, limits)
    with open(path, "rb") as handle:
        data = handle.read(limits.max_image_bytes + 1)
    if len(data) > limits.max_image_bytes:
        raise ValueError(f"{part.param}: the image is over the {_size(limits.max_image_bytes)} "
                         "limit per image (plugin.vlm.max_image_bytes)")
    return data


def decode(part: ImagePart, data: bytes, limits: ImageLimits) -> Any:
    """The RGB ``PIL.Image`` of ``data``; ``ValueError`` naming the part and the limit."""
    from PIL import Image

    with warnings.catch_warnings():
        # PIL's own bomb check: past its limit a warning, past twice that an error.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
        except Exception as exc:  # hostile bytes raise all kinds (struct.error, EOFError, ...)
            if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
                raise ValueError(f"{part.param}: the image is over the {limits.max_image_pixels} "
                                 "limit per image (plugin.vlm.max_image_pixels), a possible "
                                 f"decompression bomb ({exc}); send a smaller image") from None
            raise ValueError(f"{part.param}: not a decodable image ({type(exc).__name__}: {exc}); "
                             "send a PNG, JPEG, GIF or WebP file") from None
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
