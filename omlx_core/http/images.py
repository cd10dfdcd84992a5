"""Image content parts, as clients send them, into :class:`~omlx_core.engine.ImagePart`.

Translation only: what an image is, how large, and whether a local file may be read
are the engine's to judge. The server never fetches a remote URL for a client (it may
have no network, and must not be made to reach one): those are refused here, with how
to send the image instead.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

from omlx_core.engine import ImagePart
from omlx_core.http.errors import bad_request

_INLINE_HINT = "send the image inline as a data URL (data:image/png;base64,...)"


def _base64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the image data is not valid base64", param) from None


def openai_image(part: Mapping[str, Any], param: str, index: int) -> ImagePart:
    """An ``image_url`` content part (``param``: where it is in the request)."""
    image_url = part.get("image_url")
    if not isinstance(image_url, Mapping) or not isinstance(image_url.get("url"), str):
        raise bad_request(f"{param}.image_url.url is missing; {_INLINE_HINT}", f"{param}.image_url")
    url = image_url["url"].strip()
    where = f"{param}.image_url.url"
    if url.startswith("data:"):
        header, comma, payload = url[5:].partition(",")
        if not comma or not header.endswith(";base64"):
            raise bad_request(f"{where}: only base64 data URLs are supported "
                              "(data:image/png;base64,...)", where)
        return ImagePart(index, param, data=_base64(payload, where))
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        return ImagePart(index, param, path=unquote(urlsplit(url).path))
    if url.startswith("/") or url.startswith("~"):
        return ImagePart(index, param, path=url)
    if scheme in ("http", "https"):
        raise bad_request(f"{where}: remote image URLs are not fetched (this server does not "
                          f"download on a client's behalf); {_INLINE_HINT}", where)
    raise bad_request(f"{where}: unsupported image URL {url[:40]!r}; {_INLINE_HINT}", where)


def anthropic_image(block: Mapping[str, Any], param: str, index: int) -> ImagePart:
    """An Anthropic ``image`` block (base64 source)."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise bad_request(f"{param}.source is missing; give a base64 source "
                          "({\"type\": \"base64\", \"media_type\": \"image/png\", \"data\": ...})",
                          f"{param}.source")
    where = f"{param}.source"
    kind = source.get("type")
    if kind == "base64":
        if not isinstance(source.get("data"), str):
            raise bad_request(f"{where}.data is missing", f"{where}.data")
        return ImagePart(index, param, data=_base64(source["data"], f"{where}.data"))
    if kind == "url":
        raise bad_request(f"{where}: remote image URLs are not fetched (this server does not "
                          "download on a client's behalf); send a base64 source", where)
    raise bad_request(f"{where}.type must be 'base64', not {kind!r}", f"{where}.type")
