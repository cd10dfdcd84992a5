"""Image + text chat over HTTP with the official openai and anthropic SDKs, on a tiny
random-weight llava served by the ``vlm`` engine through the model registry
(``[models.<id>] engine = "vlm"``) next to a text-only model: streaming, the prefix
cache (same image hits, another image behind the same text misses), 413 for an
image-heavy request before any byte, and every kind of bad image a 400 naming its part
and the limit, with the server alive after each."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.http import HTTPServer
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model
from omlx_core.testing.vlm_models import cached_vlm_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

VLM = "tiny-vlm"
BIG_VLM = "tiny-vlm-big-images"
TEXT = "tiny-text"
MAX_IMAGES = 3
MAX_PIXELS = 1_000_000
MAX_BYTES = 200_000


def png_bytes(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width`` x ``height`` (a decompression bomb
    when large: its few bytes inflate to width * height pixels)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = zlib.compress(b"\0" * (min(width, 64) + 1) * min(height, 64), 9)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("allowed-images")
    (directory / "photo.png").write_bytes(png_bytes(42))
    return directory


@pytest.fixture(scope="module")
def context(tmp_path_factory, image_dir) -> Iterator[ServerContext]:
    models = tmp_path_factory.mktemp("vlm-models")
    vlm_dir = cached_vlm_model("llava", cache_dir=models)
    from omlx_core.testing.vlm_models import build_vlm_model

    # 1792-pixel images: 16384 tokens each, which no tiny ceiling holds.
    big_dir = build_vlm_model("llava", models / "big-images", image_size=1792)
    text_dir = cached_model("llama", cache_dir=models)
    config = tmp_path_factory.mktemp("config") / "omlx.toml"
    config.write_text(
        f'[server]\nmodels = ["{VLM}", "{BIG_VLM}", "{TEXT}"]\n\n'
        f'[models.{VLM}]\npath = "{vlm_dir}"\nengine = "vlm"\n\n'
        f'[models.{BIG_VLM}]\npath = "{big_dir}"\nengine = "vlm"\n\n'
        f'[models.{TEXT}]\npath = "{text_dir}"\n\n'
        f'[plugin.vlm]\nmax_images = {MAX_IMAGES}\nmax_image_pixels = {MAX_PIXELS}\n'
        f'max_image_bytes = {MAX_BYTES}\nallowed_image_dirs = ["{image_dir}"]\n')
    from tests.test_http_api import small_ceiling

    context = start_engines(load_setup("cpu-small", [config], [
        ("memory.tier", "custom", "test"), ("memory.custom_ceiling", small_ceiling(), "test"),
        ("engine.max_context", "2000000", "test")]), progress=False)
    yield context
    stop_engines(context)


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


def image_message(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def chat(client, messages, model=VLM, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=kwargs.pop("max_tokens", 6), **kwargs)


# -- answers -------------------------------------------------------------------------------


def test_openai_image_and_text_streams(client, context) -> None:
    stream = chat(client, image_message(data_url(png_bytes(1))), stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    layout = context.engines[VLM].layout
    assert usage.prompt_tokens > layout.tokens_per_image


def test_anthropic_image_block_streams(claude) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(2)).decode()}}
    # Greedy (this SDK version takes no temperature argument): at the default temperature
    # the tiny random model's answer depends on the random state every earlier test in
    # this process left, and it once ended within 6 tokens.
    with claude.messages.stream(model=VLM, max_tokens=6, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens > 16


def test_same_image_hits_the_prefix_cache_and_another_image_misses(client) -> None:
    text = "Tell me everything about this picture, in detail. " * 3
    first = chat(client, image_message(data_url(png_bytes(10)), text))
    again = chat(client, image_message(data_url(png_bytes(10)), text))
    other = chat(client, image_message(data_url(png_bytes(11)), text))
    prompt = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    # Only the system turn before the image may be reused behind a different image.
    assert other.usage.prompt_tokens_details.cached_tokens < 64
    assert other.usage.prompt_tokens == prompt


def test_local_file_in_an_allowed_directory(client, image_dir) -> None:
    path = image_dir / "photo.png"
    by_url = chat(client, image_message(f"file://{path}"))
    by_path = chat(client, image_message(str(path)))
    inline = chat(client, image_message(data_url(path.read_bytes())))
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    assert by_path.choices[0].message.content == inline.choices[0].message.content


def test_image_heavy_request_over_the_ceiling_is_413_before_any_byte(client, context) -> None:
    engine = context.engines[BIG_VLM]
    before = engine.stats()
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            chat(client, image_message(data_url(png_bytes(3))), model=BIG_VLM, stream=stream)
        assert caught.value.status_code == 413
        assert caught.value.body["code"] == "prefill_memory_exceeded"
    # Refused on the bound: even a broken image is never decoded, the 413 comes first.
    with pytest.raises(openai.APIStatusError) as caught:
        chat(client, image_message(data_url(b"not an image at all")), model=BIG_VLM)
    assert caught.value.status_code == 413
    after = engine.stats()
    assert after["images_encoded"] == before["images_encoded"] == 0
    assert after["prompt_tokens_prefilled"] == before["prompt_tokens_prefilled"]
    # The same model still answers text.
    answer = chat(client, [{"role": "user", "content": "Hello"}], model=BIG_VLM)
    assert answer.choices[0].finish_reason == "length"


# -- refusals -------------------------------------------------------------------------------


def bad_request(client, messages, model=VLM):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages, model=model)
    return caught.value.body


BAD_IMAGES = {
    "not an image": (b"plain text, certainly not a picture " * 4,
                     "not a PNG, JPEG, GIF, WebP or BMP image"),
    "truncated": (png_bytes(5, (200, 150))[:400], "broken or truncated"),
    "zero by zero": (png_declaring(0, 0), "not a decodable image|not a PNG|0x0"),
    "20k x 20k": (png_declaring(20_000, 20_000), f"over the {MAX_PIXELS} limit"),
    "decompression bomb": (png_declaring(3000, 3000), f"over the {MAX_PIXELS} limit"),
    "too many bytes": (png_bytes(6, (400, 400)), "limit per image"),
    "empty": (b"", "not valid base64|empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_is_400_naming_the_part(client, case) -> None:
    data, message = BAD_IMAGES[case]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "First a good one:"},
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(7))}},
        {"type": "image_url", "image_url": {"url": data_url(data) if data else "data:image/png;base64,"}},
        {"type": "text", "text": "What changed?"}]}]
    body = bad_request(client, messages)
    assert body["param"].startswith("messages[0].content[2]"), body
    assert "messages[0].content[2]" in body["message"]
    import re

    assert re.search(message, body["message"]), body["message"]
    # The server is alive and serves the next request.
    assert chat(client, image_message(data_url(png_bytes(8)))).choices[0].finish_reason == "length"


def test_too_many_images_is_400_naming_the_limit(client) -> None:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(20 + i))}}
             for i in range(MAX_IMAGES + 1)]
    body = bad_request(client, [{"role": "user", "content": parts + [{"type": "text", "text": "?"}]}])
    assert body["param"] == f"messages[0].content[{MAX_IMAGES}]"
    assert f"more than the {MAX_IMAGES}" in body["message"] and "max_images" in body["message"]


def test_remote_url_is_refused_without_fetching(client, claude) -> None:
    body = bad_request(client, image_message("https://example.com/cat.png"))
    assert "not fetched" in body["message"] and "data URL" in body["message"]
    assert body["param"] == "messages[0].content[0].image_url.url"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
            {"type": "text", "text": "?"}]}])
    assert "not fetched" in str(caught.value)


def test_local_file_outside_the_allowed_directory_is_refused(client, tmp_path) -> None:
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(9))
    existing = bad_request(client, image_message(f"file://{outside}"))
    assert "not in the directories" in existing["message"]
    missing = bad_request(client, image_message(f"file://{tmp_path}/missing.png"))
    # the same answer: a client cannot probe which paths exist on the server
    assert (missing["message"].replace("missing.png", "secret.png") == existing["message"])


def test_text_only_model_refuses_images_clearly(client, claude) -> None:
    body = bad_request(client, image_message(data_url(png_bytes(12))), model=TEXT)
    assert body["param"] == "messages[0].content[0]"
    assert "takes text only" in body["message"] and 'engine = "vlm"' in body["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=TEXT, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(13)).decode()}},
            {"type": "text", "text": "?"}]}])
    assert "takes text only" in str(caught.value)


def test_bad_base64_is_400(client) -> None:
    body = bad_request(client, image_message("data:image/png;base64,@@@not-base64@@@"))
    assert "not valid base64" in body["message"]


def test_images_with_tools(client) -> None:
    tools = [{"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"color": {"type": "string"}}}}}]
    answer = chat(client, image_message(data_url(png_bytes(14))), tools=tools, max_tokens=8)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert answer.usage.prompt_tokens > 16


def test_fuzzed_images_are_a_400_or_an_answer_never_a_500(client) -> None:
    """Seeded mutations of real PNG, JPEG and GIF files (bytes flipped, cut short,
    headers kept): each request is refused with a 400 naming the part or answered."""
    from PIL import Image

    rng = np.random.default_rng(2024)
    originals = []
    for fmt in ("PNG", "JPEG", "GIF"):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(buffer, fmt)
        originals.append(buffer.getvalue())
    outcomes = {"answered": 0, "refused": 0}
    for case in range(24):
        data = bytearray(originals[case % len(originals)])
        if case % 2:
            data = data[:int(rng.integers(8, len(data)))]
        for _ in range(int(rng.integers(1, 6))):
            position = int(rng.integers(8, len(data)))
            data[position] = int(rng.integers(0, 256))
        try:
            chat(client, image_message(data_url(bytes(data))), max_tokens=1)
            outcomes["answered"] += 1
        except openai.BadRequestError as exc:
            assert exc.body["param"].startswith("messages[0].content[0]"), exc.body
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0
    assert chat(client, image_message(data_url(png_bytes(15)))).choices[0].finish_reason == "length"
