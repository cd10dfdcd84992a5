"""The per-image token bound preflight counts before decoding (plugins/vlm/bound.py)
against the real image processors over many image sizes and aspect ratios: the count
never exceeds the bound, and at the largest image the bound is within 1.15x of it.

Qwen2-VL's dynamic-resolution processor (transformers' PIL backend) is the case where
the count depends on the image; LLaVA and Gemma 3 take a fixed count per image, checked
through the vlm engine's own decode and tokenization."""

from __future__ import annotations

import io

import numpy as np
import pytest

from omlx_core.engine import ImagePart
from omlx_core.plugins.vlm.bound import (
    FALLBACK_IMAGE_TOKENS,
    image_token_bound,
    read_processor_config,
)
from omlx_core.testing.host import make_test_host

#: (width, height): tiny, odd, extreme aspect ratios (up to Qwen2-VL's 200:1), exact
#: multiples of 28, and past max_pixels (resized down)
SIZES = [(1, 1), (27, 29), (56, 56), (100, 30), (30, 100), (224, 224), (333, 517), (640, 480),
         (480, 640), (1024, 28), (28, 1024), (1000, 1000), (1280, 720), (720, 1280), (1920, 1080),
         (2000, 10), (10, 2000), (1003, 1001), (2048, 2048), (3000, 2000), (4000, 3000)]
LARGEST = (4000, 3000)
MAX_RATIO = 1.15


def rgb(size: tuple[int, int]):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(size[0] * 7 + size[1]).integers(
        0, 256, (size[1], size[0], 3), dtype=np.uint8))


def qwen2_vl_config(max_pixels: int) -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136,
            "max_pixels": max_pixels, "patch_size": 14, "merge_size": 2,
            "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711]}


@pytest.mark.parametrize("max_pixels", [1003520, 401408])
def test_qwen2_vl_count_never_exceeds_the_bound(max_pixels, capsys) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = qwen2_vl_config(max_pixels)
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": config["min_pixels"], "longest_edge": max_pixels},
        patch_size=14, merge_size=2, temporal_patch_size=2)
    bound = image_token_bound(config, {"model_type": "qwen2_vl"})
    assert bound.tokens == max_pixels // 28 ** 2
    rows = []
    for size in SIZES:
        grid = processor(images=[rgb(size)], return_tensors="np")["image_grid_thw"][0]
        tokens = int(np.prod(grid)) // 4
        rows.append((size, tokens))
        assert tokens <= bound.tokens, f"{size}: {tokens} tokens over the bound {bound.tokens}"
    with capsys.disabled():
        print(f"\nQwen2-VL, max_pixels {max_pixels}: bound {bound.tokens} ({bound.source})")
        print("| image | tokens | bound / tokens |")
        for (w, h), tokens in rows:
            print(f"| {w}x{h} | {tokens} | {bound.tokens / tokens:.3f} |")
    largest = dict(rows)[LARGEST]
    assert bound.tokens / largest <= MAX_RATIO


def test_bound_reads_the_nested_size_keys_and_falls_back() -> None:
    nested = {"size": {"longest_edge": 1003520, "shortest_edge": 3136}, "patch_size": 14,
              "merge_size": 2}
    assert image_token_bound(nested, {}).tokens == 1280
    assert image_token_bound({}, {"model_type": "gemma3", "mm_tokens_per_image": 256}).tokens == 256
    assert image_token_bound({}, {"text_config": {"mm_tokens_per_image": 64}}).tokens == 64
    llava = {"model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14}}
    assert image_token_bound({}, llava).tokens == 576
    assert image_token_bound({}, {**llava, "vision_feature_select_strategy": "full"}).tokens == 577
    unknown = image_token_bound({"max_pixels": "lots"}, {"model_type": "mystery"})
    assert unknown.tokens == FALLBACK_IMAGE_TOKENS and "fallback" in unknown.source


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_served_families_decode_to_at_most_the_bound(family, tiny_vlm_path, capsys) -> None:
    from omlx_core.models.registry import spec_for_path
    from omlx_core.plugins.vlm.engine import VLMEngine

    path = tiny_vlm_path(family)
    engine = VLMEngine(spec_for_path(path, "vlm"), make_test_host("cpu-small"))
    engine.start()
    try:
        bound = image_token_bound(read_processor_config(path), engine.model.config)
        image_id = engine.layout.image_token_id
        counts = []
        for size in SIZES[:-3]:
            buffer = io.BytesIO()
            rgb(size).save(buffer, "PNG")
            part = ImagePart(0, "messages[0].content[0]", data=buffer.getvalue())
            messages = [{"role": "user", "content": [{"type": "image", "image": part},
                                                     {"type": "text", "text": "?"}]}]
            prepared = engine.prepare_images([part])
            undecoded = engine.tokenize_chat(messages)
            decoded = engine.tokenize_chat(messages, images=prepared)
            count = decoded.count(image_id)
            counts.append(count)
            assert count <= bound.tokens
            assert len(decoded) <= len(undecoded)
        with capsys.disabled():
            print(f"\n{family}: bound {bound.tokens} ({bound.source}); tokens per image over "
                  f"{len(counts)} sizes: {sorted(set(counts))}")
        assert bound.tokens / max(counts) <= MAX_RATIO
    finally:
        engine.shutdown()
