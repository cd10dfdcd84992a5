"""The most tokens one image can take, from the model's configs, without decoding it.

Preflight runs before any image is decoded (a request that can never fit is refused
before the server spends a decode on it), so it counts every image at this bound; the
tokens an image actually takes once decoded and resized never exceed it.

- Dynamic-resolution processors (Qwen2-VL style: ``max_pixels``, ``patch_size``,
  ``merge_size``) resize an image to at most ``max_pixels`` pixels in
  ``patch_size * merge_size`` squares, one token each: at most
  ``max_pixels // (patch_size * merge_size) ** 2`` tokens.
- Fixed-count families take the same number for every image: Gemma 3's
  ``mm_tokens_per_image``; LLaVA's ``(image_size // patch_size) ** 2`` patches of its
  vision tower (one more when it keeps the CLS feature).
- Anything else counts :data:`FALLBACK_IMAGE_TOKENS`, a deliberately high figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

#: the per-image count when the configs say nothing usable (above every processor's
#: default maximum this module knows: Qwen2-VL's 16384-token ``max_pixels`` ceiling)
FALLBACK_IMAGE_TOKENS = 16384


@dataclass(frozen=True)
class ImageTokenBound:
    tokens: int
    #: where it came from, for messages: ``"max_pixels 1003520 / (14*2)^2"``
    source: str


def read_processor_config(path: Path | str) -> dict[str, Any]:
    """``preprocessor_config.json`` of a model directory (``{}`` when it has none)."""
    try:
        return json.loads((Path(path) / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return {}


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return int(value)


def _max_pixels(processor: Mapping[str, Any]) -> int | None:
    size = processor.get("size") if isinstance(processor.get("size"), Mapping) else {}
    for value in (processor.get("max_pixels"), size.get("max_pixels"), size.get("longest_edge")):
        if _positive(value):
            return int(value)
    return None


def image_token_bound(processor: Mapping[str, Any], model_config: Mapping[str, Any]) -> ImageTokenBound:
    """The most tokens one image of a model takes (see the module)."""
    max_pixels = _max_pixels(processor)
    patch = _positive(processor.get("patch_size"))
    merge = _positive(processor.get("merge_size"))
    if max_pixels and patch and merge:
        return ImageTokenBound(max_pixels // (patch * merge) ** 2,
                               f"max_pixels {max_pixels} / ({patch}*{merge})^2")
    text = model_config.get("text_config") if isinstance(model_config.get("text_config"), Mapping) else {}
    per_image = _positive(model_config.get("mm_tokens_per_image")) or _positive(text.get("mm_tokens_per_image"))
    if per_image:
        return ImageTokenBound(per_image, f"mm_tokens_per_image {per_image}")
    vision = model_config.get("vision_config") if isinstance(model_config.get("vision_config"), Mapping) else {}
    image_size, patch_size = _positive(vision.get("image_size")), _positive(vision.get("patch_size"))
    if model_config.get("model_type") == "llava" and image_size and patch_size:
        tokens = (image_size // patch_size) ** 2
        if model_config.get("vision_feature_select_strategy", "default") == "full":
            tokens += 1
        return ImageTokenBound(tokens, f"(image_size {image_size} / patch_size {patch_size})^2")
    return ImageTokenBound(FALLBACK_IMAGE_TOKENS, "fallback (the configs give no image size)")
