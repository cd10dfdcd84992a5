"""A vision-language model's images in the prefill estimate: the vision tower's
activations while it encodes them, and the features the language model is fed.

Measured on the CPU backend like the text estimate (``python -m benchmarks.estimator``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from omlx_core.plugins.estimator.dims import EstimatorDisabledError, ModelDims, positive_int
from omlx_core.plugins.estimator.prefill import FIXED_OVERHEAD_BYTES, PeakBreakdown, check_counts

#: vision configs under these keys hold a VLM's image encoder
VISION_CONFIG_KEYS = ("vision_config", "vision_tower_config")


@dataclass(frozen=True)
class VisionDims:
    """The numbers of a VLM's vision tower that decide the memory encoding images takes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_size: int
    #: positions one image runs through the tower (its patches, plus a CLS token)
    positions: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionDims:
        """Dims of the vision tower of a VLM ``config.json`` mapping.

        :raises EstimatorDisabledError: the config has no vision block, or a needed dim is
            missing or not a positive int.
        """
        block = next((config[key] for key in VISION_CONFIG_KEYS
                      if isinstance(config.get(key), Mapping)), None)
        if block is None:
            raise EstimatorDisabledError("the model config has no vision_config; it cannot "
                                         "encode images")
        where = "vision_config."
        values = {}
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "image_size", "patch_size"):
            if key not in block:
                raise EstimatorDisabledError(f"{where}{key} is missing")
            values[key] = positive_int(block[key], where + key)
        patches = (values["image_size"] // values["patch_size"]) ** 2
        # CLIP towers (LLaVA's) prepend a class token to the patches.
        cls_token = 1 if "clip" in str(block.get("model_type", "")) else 0
        return cls(values["num_hidden_layers"], values["hidden_size"], values["intermediate_size"],
                   values["num_attention_heads"], values["image_size"], patches + cls_token)


def image_features_bytes(vision: VisionDims, text_hidden: int, images: int, dtype_bytes: int = 4) -> int:
    """The images' features the language model takes (one row per image token, at most
    one per vision position), held while prefill feeds them."""
    return images * vision.positions * text_hidden * dtype_bytes


def estimate_vision_peak(vision: VisionDims, text_hidden: int, images: int,
                         dtype_bytes: int = 4) -> PeakBreakdown:
    """Peak bytes encoding ``images`` images (all at once, as the vlm engine does) adds.

    Measured on the CPU backend (``python -m benchmarks.estimator``): the pixels
    arrive as float32 and the patch embedding holds two more copies of them (the
    channels-last transpose and the patch unfold); one attention layer's scores
    (heads x positions^2) live at a time, next to its queries, keys, values and
    output; every layer's hidden states are kept (mlx-vlm
    asks the tower for them all); the projector and the merge write each position in
    the text width, three copies at most.
    """
    check_counts(new_tokens=images, cached_tokens=0, chunk_size=1, dtype_bytes=dtype_bytes)
    if images == 0:
        return PeakBreakdown(0, {}, "no images")
    p = vision.positions
    pixels = images * 3 * vision.image_size ** 2 * 4
    components = {
        "pixels": 3 * pixels,
        "vision_scores": images * vision.num_heads * p * p * max(dtype_bytes, 4),
        "vision_attention": 4 * images * p * vision.hidden_size * dtype_bytes,
        "vision_hidden_states": images * (vision.num_layers + 1) * p * vision.hidden_size * dtype_bytes,
        "vision_mlp": 2 * images * p * vision.intermediate_size * dtype_bytes,
        "image_features": 3 * image_features_bytes(vision, text_hidden, images, dtype_bytes),
        "overhead": FIXED_OVERHEAD_BYTES,
    }
    return PeakBreakdown(sum(components.values()), components, f"encoding {images} image(s)")


def estimate_with_images(dims: ModelDims, vision: VisionDims, text: PeakBreakdown, *,
                         images: int, new_tokens: int, dtype_bytes: int = 4,
                         kv_bits: int | None = None, kv_group_size: int = 64) -> PeakBreakdown:
    """``text`` (the prefill of ``new_tokens``) with ``images`` encoded first
    (:func:`combine_vision_peak`)."""
    encoding = estimate_vision_peak(vision, dims.hidden_size, images, dtype_bytes)
    features = image_features_bytes(vision, dims.hidden_size, images, dtype_bytes)
    kv = dims.kv_bytes_per_token(dtype_bytes, kv_bits, kv_group_size) * len(dims.layer_kinds) * new_tokens
    return combine_vision_peak(text, encoding, features, kv)


def combine_vision_peak(text: PeakBreakdown, vision: PeakBreakdown, features_bytes: int,
                        kv_bytes: int) -> PeakBreakdown:
    """A VLM prefill's peak: the larger of encoding the images (over the KV the prompt
    may hold by then, ``kv_bytes`` at most) and the text prefill with the image features
    (``features_bytes``) held. Either way the features are its extra bytes, held while
    prefill feeds them, and the text prefill's cache is what it leaves held."""
    if not vision.components:
        return text
    encoding = vision.total + kv_bytes
    if encoding > text.total:
        components = {**vision.components, "kv_cache_before_images": kv_bytes}
        return replace(text, total=encoding, components=components, step=vision.step,
                       kv_bytes=min(text.kv_bytes, encoding - features_bytes),
                       extra_bytes=features_bytes)
    components = {**text.components, "image_features": features_bytes}
    return replace(text, total=text.total + features_bytes, components=components,
                   extra_bytes=text.extra_bytes + features_bytes)
