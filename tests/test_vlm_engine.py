"""The ``vlm`` engine on tiny random-weight mlx-vlm models of two families (llava,
gemma3): the conformance suite on text requests, then image requests against mlx-vlm's
own forward, the prefix cache keyed by image bytes, cancellation and batching."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, ImagePart, SamplingParams
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.vlm.engine import VLMEngine
from omlx_core.testing.conformance import EngineConformance, collect, run_until_stop, text_of, tokens_of
from omlx_core.testing.host import make_test_host
from omlx_core.testing.waiting import wait_for
from omlx_core.testing.sampling_check import mlx_vlm_reference

FAMILIES = ("llava", "gemma3")


def png(color: tuple[int, int, int], size: tuple[int, int] = (80, 60), noise: int = 0) -> bytes:
    from PIL import Image

    pixels = np.full((size[1], size[0], 3), color, dtype=np.uint8)
    if noise:
        rng = np.random.default_rng(noise)
        pixels = rng.integers(0, 256, pixels.shape, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def image_messages(images: list[bytes], text: str = "Describe the picture, please.") -> list[dict]:
    parts: list[dict] = [{"type": "image", "image": ImagePart(i, f"messages[0].content[{i}]", data=data)}
                         for i, data in enumerate(images)]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def image_request(engine: VLMEngine, request_id: str, images: list[bytes], text: str = "Describe the picture, please.",
                  **sampling: object) -> GenerationRequest:
    messages = image_messages(images, text)
    prepared = engine.prepare_images([p["image"] for p in messages[0]["content"] if p["type"] == "image"])
    tokens = engine.tokenize_chat(messages, images=prepared)
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **sampling})  # type: ignore[arg-type]
    return GenerationRequest(request_id, tokens, params, images=prepared)


def start(path, **overrides) -> VLMEngine:
    config = load_config("cpu-small", overrides=[(k, str(v), "test") for k, v in overrides.items()])
    engine = VLMEngine(spec_for_path(path, "vlm"), make_test_host(config))
    engine.start()
    return engine


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_engine(request, tiny_vlm_path):
    engine = start(tiny_vlm_path(request.param))
    yield engine
    engine.shutdown()


class TestVLMEngineLlava(EngineConformance):
    reference_forward = staticmethod(mlx_vlm_reference)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_vlm_path):
        engine = start(tiny_vlm_path("llava"))
        yield engine
        engine.shutdown()


class TestVLMEngineGemma3(EngineConformance):
    reference_forward = staticmethod(mlx_vlm_reference)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_vlm_path):
        engine = start(tiny_vlm_path("gemma3"))
        yield engine
        engine.shutdown()


def test_an_image_prompt_matches_mlx_vlms_own_forward(vlm_engine):
    """The first token's logits: the served path (mlx-lm language model, chunked
    prefill with input_embeddings) against mlx-vlm's model run on the whole prompt."""
    request = image_request(vlm_engine, "ref", [png((200, 30, 30))], max_tokens=1, logprobs=5)
    outputs = collect(vlm_engine.submit(request))
    served = outputs[0].logprobs[0]

    scheduler = vlm_engine.scheduler
    vlm = scheduler.vlm
    ids = mx.array(request.prompt_tokens)[None]
    pixels = mx.array(np.stack([image.pixel_values for image in request.images]))
    kwargs = {"mask": mx.ones(ids.shape)} if vlm_engine.family == "gemma3" else {}
    embeddings = vlm.get_input_embeddings(ids, pixels, **kwargs).inputs_embeds
    logits = vlm.language_model(ids, inputs_embeds=embeddings).logits[0, -1]
    logprobs = logits - mx.logsumexp(logits)
    expected = np.argsort(-np.array(logprobs))[:5].tolist()
    assert served.token_id == expected[0]
    assert [t for t, _ in served.top] == expected
    assert served.logprob == pytest.approx(float(logprobs[expected[0]]), abs=1e-3)


def test_the_image_changes_the_answer_and_the_same_image_repeats_it(vlm_engine):
    red = text_of(vlm_engine, collect(vlm_engine.submit(image_request(vlm_engine, "a1", [png((255, 0, 0), noise=1)]))))
    red_again = text_of(vlm_engine, collect(vlm_engine.submit(image_request(vlm_engine, "a2", [png((255, 0, 0), noise=1)]))))
    other = text_of(vlm_engine, collect(vlm_engine.submit(image_request(vlm_engine, "a3", [png((0, 0, 255), noise=2)]))))
    assert red == red_again
    assert red != other


def test_two_images_in_one_prompt(vlm_engine):
    request = image_request(vlm_engine, "two", [png((10, 200, 10)), png((10, 10, 200), noise=3)])
    layout = vlm_engine.layout
    assert request.prompt_tokens.count(layout.image_token_id) == 2 * layout.tokens_per_image
    outputs = collect(vlm_engine.submit(request))
    assert outputs[-1].finish_reason == "length"
    assert len(tokens_of(outputs)) == 6


def test_prefix_cache_hits_the_same_image_and_never_a_different_one(tiny_vlm_path):
    """Same text around a different image must prefill the image again: its tokens are
    the same ids, only the image-keyed cache tells them apart."""
    engine = start(tiny_vlm_path("llava"))
    try:
        text = "Describe the picture, please. " * 4
        first = collect(engine.submit(image_request(engine, "p1", [png((1, 2, 3), noise=5)], text)))
        same = collect(engine.submit(image_request(engine, "p2", [png((1, 2, 3), noise=5)], text)))
        other = collect(engine.submit(image_request(engine, "p3", [png((1, 2, 3), noise=6)], text)))
        prompt = first[-1].usage.prompt_tokens
        assert first[-1].usage.cached_tokens == 0
        assert same[-1].usage.cached_tokens == prompt - 1
        # Only the system turn before the image can be reused.
        image_start = engine.scheduler.prefix_cache.block_size
        assert other[-1].usage.cached_tokens < image_start
        assert tokens_of(same) == tokens_of(first)
        # The reused prefix held the whole image: it was not encoded again.
        assert engine.stats()["images_encoded"] == 2
    finally:
        engine.shutdown()


def test_gemma3_prefix_cache_with_sliding_window_layers(tiny_vlm_path):
    """Gemma 3's sliding-window layers reuse only block boundaries: a long prompt
    behind the image still hits with the same image and misses with another."""
    engine = start(tiny_vlm_path("gemma3"))
    try:
        text = "The quick brown fox jumps over the lazy dog. " * 12
        first = collect(engine.submit(image_request(engine, "g1", [png((9, 9, 9), noise=7)], text)))
        same = collect(engine.submit(image_request(engine, "g2", [png((9, 9, 9), noise=7)], text)))
        other = collect(engine.submit(image_request(engine, "g3", [png((9, 9, 9), noise=8)], text)))
        assert same[-1].usage.cached_tokens >= engine.scheduler.prefix_cache.block_size
        assert other[-1].usage.cached_tokens == 0
        assert tokens_of(same) == tokens_of(first)
    finally:
        engine.shutdown()


def test_image_requests_batch_with_text_requests_and_cancel_alone(vlm_engine):
    long_run = vlm_engine.submit(image_request(vlm_engine, "long", [png((5, 5, 5), noise=9)], max_tokens=200))
    text_tokens = vlm_engine.tokenize_chat([{"role": "user", "content": "Hello there"}])
    text = vlm_engine.submit(GenerationRequest("text", text_tokens, SamplingParams(temperature=0, max_tokens=4)))
    first = long_run.next_output(timeout=60)
    assert first is not None and not first.finished
    long_run.close()
    outputs = collect(text)
    assert outputs[-1].finish_reason == "length"
    assert wait_for(lambda: not (vlm_engine.stats()["running"] or vlm_engine.stats()["prefilling"]),
                    60), vlm_engine.stats()
    assert vlm_engine.stats()["finished"]["abort"] >= 1


def test_a_request_whose_images_do_not_match_its_prompt_is_refused(vlm_engine):
    request = image_request(vlm_engine, "mismatch", [png((1, 1, 1))])
    request.images = []
    with pytest.raises(ValueError, match="images' tokens for 0 images"):
        vlm_engine.submit(request)


def test_text_only_model_families_are_refused_at_load(tiny_model_path):
    from omlx_core.models.registry import ModelError

    with pytest.raises(ModelError, match="vlm engine serves model types llava, gemma3"):
        VLMEngine(spec_for_path(tiny_model_path("llama"), "vlm"), make_test_host("cpu-small"))


@pytest.mark.parametrize("cache_budget", ["0", "64MiB"])
def test_a_preempted_image_request_resumes_with_the_same_output(tiny_vlm_path, cache_budget) -> None:
    """Taken out of the decode batch and resumed, an image request prefills its prompt
    and completion again (re-encoding its image when the prefix cache does not hold it)
    and goes on as if never paused."""
    from tests.test_batched_preemption import PreemptingGate

    engine = start(tiny_vlm_path("llava"), **{"plugin.batched.prefix_cache_budget": cache_budget})
    try:
        image = png((30, 60, 90), noise=11)
        plain = tokens_of(collect(engine.submit(image_request(engine, "plain", [image], max_tokens=24))))
        engine.prefix_cache.clear()
        encoded = engine.stats()["images_encoded"]
        gate = PreemptingGate("paused", at=3)
        engine.scheduler.set_forward_gate(gate)
        try:
            outputs = collect(engine.submit(image_request(engine, "paused", [image], max_tokens=24)))
        finally:
            engine.scheduler.set_forward_gate(None)
        assert gate.preempted == 1
        assert outputs[-1].finish_reason == "length"
        assert tokens_of(outputs) == plain
        encodes = engine.stats()["images_encoded"] - encoded
        assert encodes == (2 if cache_budget == "0" else 1)
    finally:
        engine.shutdown()


def test_a_chat_template_kept_beside_the_processor_is_used(tiny_vlm_path, tmp_path) -> None:
    """Many LLaVA conversions keep the template in chat_template.json, not in the
    tokenizer's config: such a directory works unchanged."""
    import json
    import shutil

    model = tmp_path / "llava-template-apart"
    shutil.copytree(tiny_vlm_path("llava"), model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    template = tokenizer_config.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    engine = start(model)
    try:
        request = image_request(engine, "apart", [png((7, 7, 7))])
        assert request.prompt_tokens.count(engine.layout.image_token_id) == engine.layout.tokens_per_image
        assert collect(engine.submit(request))[-1].finish_reason == "length"
    finally:
        engine.shutdown()


def test_a_sparse_hf_text_config_is_completed_from_mlx_vlms_defaults(tiny_vlm_path, tmp_path) -> None:
    """A LLaVA conversion's text_config may leave out what mlx-vlm defaults (here
    rms_norm_eps, which mlx-lm's llama requires): the model loads, and the memory
    estimate reads the completed dims."""
    import json
    import shutil

    from omlx_core.plugins.estimator.dims import ModelDims

    model = tmp_path / "llava-sparse"
    shutil.copytree(tiny_vlm_path("llava"), model)
    config = json.loads((model / "config.json").read_text())
    for key in ("rms_norm_eps", "rope_theta", "max_position_embeddings"):
        del config["text_config"][key]
    (model / "config.json").write_text(json.dumps(config))
    engine = start(model)
    try:
        assert engine.model.config["text_config"]["rms_norm_eps"] == 1e-6
        assert ModelDims.from_config(engine.model.config).hidden_size == 64
        request = image_request(engine, "sparse", [png((8, 8, 8))])
        assert collect(engine.submit(request))[-1].finish_reason == "length"
    finally:
        engine.shutdown()


def test_the_image_placeholder_typed_as_text_is_refused(vlm_engine) -> None:
    placeholder = vlm_engine.layout.placeholder
    with pytest.raises(ValueError, match="remove it from the text"):
        vlm_engine.tokenize_chat([{"role": "user", "content": f"look: {placeholder}"}])


def test_image_requests_honour_stop_strings_and_seeds(vlm_engine) -> None:
    image = png((90, 20, 200), noise=12)
    full = text_of(vlm_engine, collect(vlm_engine.submit(image_request(vlm_engine, "full", [image], max_tokens=16))))
    stop = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip()), None)
    assert stop is not None, f"the tiny model's answer {full!r} has no stop string to cut at"
    text, outputs, processor = run_until_stop(
        vlm_engine, image_request(vlm_engine, "cut", [image], max_tokens=10_000), stop)
    assert processor.stop_sequence == stop and text == full[:full.index(stop)]
    ran_past_reference = len(tokens_of(outputs)) >= 16
    assert outputs[-1].finish_reason == "abort" or (
        ran_past_reference and outputs[-1].finish_reason == "stop"), "the stop did not abort the request"
    sampled = [tokens_of(collect(vlm_engine.submit(image_request(
        vlm_engine, f"seeded{i}", [image], max_tokens=12, temperature=1.0, seed=7)))) for i in range(2)]
    assert sampled[0] == sampled[1]
