"""The memory estimate of a vision model's prefill: the language model's dims from the
nested text config, the vision tower's activations and the image features on top,
measured against real prefills with images, and the forward gate told which chunk
encodes the images."""

from __future__ import annotations

import pytest

from omlx_core.config import load_config
from omlx_core.plugins.estimator.dims import ModelDims
from omlx_core.plugins.estimator.prefill import estimate_prefill_peak
from omlx_core.plugins.estimator.vision import (
    VisionDims,
    estimate_vision_peak,
    estimate_with_images,
    image_features_bytes,
)
from omlx_core.memory.gate import ForwardGate, PrefillStep
from omlx_core.memory.types import PeakQuery
from omlx_core.testing.host import make_test_host
from omlx_core.testing.vlm_models import vlm_family_config
from tests.test_memory_estimate import TINY_MAX_RATIO_LONG

FAMILIES = ("llava", "gemma3")


@pytest.mark.parametrize("family", FAMILIES)
def test_dims_come_from_the_text_config_not_the_vision_tower(family) -> None:
    config = vlm_family_config(family)
    dims = ModelDims.from_config(config)
    text = config["text_config"]
    assert dims.source == "text_config"
    assert dims.num_layers == text["num_hidden_layers"] != config["vision_config"]["num_hidden_layers"]
    assert dims.hidden_size == text["hidden_size"] != config["vision_config"]["hidden_size"]
    vision = VisionDims.from_config(config)
    assert vision.hidden_size == config["vision_config"]["hidden_size"]
    patches = (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]) ** 2
    assert vision.positions == patches + (1 if family == "llava" else 0)


def test_images_raise_the_estimate_by_the_vision_tower() -> None:
    from omlx_core.plugins.estimator import estimate_peak

    config = vlm_family_config("llava", image_size=448)
    text_only = estimate_peak(PeakQuery(config, new_tokens=2000, chunk_size=512))
    with_images = estimate_peak(PeakQuery(config, new_tokens=2000, chunk_size=512, images=3))
    vision = VisionDims.from_config(config)
    scores = 3 * vision.num_heads * vision.positions ** 2 * 4
    assert with_images.total >= scores > 0
    assert with_images.total > text_only.total
    more = estimate_peak(PeakQuery(config, new_tokens=2000, chunk_size=512, images=6))
    assert more.total > with_images.total
    # The images' features are the extra bytes the request holds beside its KV; the KV
    # per token is the language model's alone.
    hidden = ModelDims.from_config(config).hidden_size
    assert text_only.extra_bytes == 0
    assert with_images.extra_bytes == image_features_bytes(vision, hidden, 3) > 0
    assert with_images.kv_bytes_per_token == text_only.kv_bytes_per_token > 0
    assert with_images.held_bytes >= with_images.extra_bytes


def test_a_vision_model_without_vision_dims_is_not_guessed(caplog) -> None:
    from omlx_core.plugins.estimator import estimate_peak

    config = vlm_family_config("gemma3")
    del config["vision_config"]["patch_size"]
    assert estimate_peak(PeakQuery(config, new_tokens=100, chunk_size=512, images=1)) is None
    assert "vision_config.patch_size is missing" in caplog.text
    assert estimate_peak(PeakQuery(config, new_tokens=100, chunk_size=512)) is not None


@pytest.mark.parametrize("family", ["vlm-llava", "vlm-gemma3"])
def test_estimate_covers_a_real_prefill_with_images(family, tmp_path, capsys) -> None:
    """The accuracy benchmark's quick runs: never under the measured peak, at most
    TINY_MAX_RATIO_LONG over it, the text models' bound (the text side takes the CPU
    attention route, which holds no mask; the estimate counts one: 1.188 alone, 1.214 in
    one clean-clone run)."""
    from benchmarks.estimator import QUICK_VLM_GRID, VLM_IMAGE_SIZE, run_vlm_model
    from omlx_core.testing.vlm_models import build_vlm_model

    path = build_vlm_model(family.removeprefix("vlm-"), tmp_path / family, image_size=VLM_IMAGE_SIZE)
    # The same prefill's measured peak varies by a few percent between runs (when
    # temporaries are freed): the estimate must cover the highest of them.
    runs = [run_vlm_model(family, path, QUICK_VLM_GRID) for _ in range(3)]
    for rows in zip(*runs):
        highest = max(row.measured.peak_bytes for row in rows)
        ratio = rows[0].estimate.total / highest
        with capsys.disabled():
            print(f"\n{family} {rows[0].prompt_tokens} tokens, {rows[0].images} image(s), chunk "
                  f"{rows[0].chunk_size}: ratio {ratio:.3f} ({rows[0].estimate.dominant})", end="")
        assert all(row.ratio >= 1.0 for row in rows), [row.measured for row in rows]
        assert ratio <= TINY_MAX_RATIO_LONG, (highest, rows[0].estimate.describe())


def test_vision_phase_wins_when_it_is_larger() -> None:
    config = vlm_family_config("llava", image_size=896)
    dims, vision = ModelDims.from_config(config), VisionDims.from_config(config)
    text = estimate_prefill_peak(dims, 100, 0, 512)
    combined = estimate_with_images(dims, vision, text, images=2, new_tokens=100)
    assert combined.total >= estimate_vision_peak(vision, dims.hidden_size, 2).total
    assert combined.dominant.startswith("vision") or combined.dominant == "pixels"


class RecordingGate(ForwardGate):
    def __init__(self) -> None:
        self.steps: list[PrefillStep] = []

    def check_prefill(self, step: PrefillStep):
        self.steps.append(step)
        return {}

    def check_after_prefill(self, step: PrefillStep):
        return {}


def test_the_gate_is_told_which_chunk_encodes_the_images(tiny_vlm_path) -> None:
    from omlx_core.models.registry import spec_for_path
    from omlx_core.plugins.vlm.engine import VLMEngine
    from omlx_core.testing.conformance import collect
    from tests.test_vlm_engine import image_request, png

    config = load_config("cpu-small", overrides=[("plugin.batched.prefill_step_size", "16", "test"),
                                                 ("plugin.batched.prefix_cache_budget", "0", "test")])
    engine = VLMEngine(spec_for_path(tiny_vlm_path("llava"), "vlm"), make_test_host(config))
    engine.start()
    try:
        gate = RecordingGate()
        engine.scheduler.set_forward_gate(gate)
        request = image_request(engine, "gated", [png((3, 3, 3)), png((4, 4, 4), noise=4)])
        collect(engine.submit(request))
        chunks = [chunk for step in gate.steps for chunk in step.chunks]
        assert len(chunks) > 3
        assert [chunk.images for chunk in chunks if chunk.images] == [2]
        first = next(chunk for chunk in chunks if chunk.images)
        image_start = request.prompt_tokens.index(engine.layout.image_token_id)
        assert first.cached_tokens <= image_start < first.cached_tokens + first.new_tokens
    finally:
        engine.shutdown()
