"""Local image files a client names (``plugin.vlm.allowed_image_dirs``): nothing about
the rest of the file system leaks through the answers, and what is checked is what is
read, however the path is swapped between the two."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omlx_core.engine import ImagePart
from omlx_core.plugins.vlm import images
from omlx_core.plugins.vlm.images import ImageLimits, check_parts, read_bytes

PARAM = "messages[0].content[0]"


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path, ImageLimits]:
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(b"allowed image bytes")
    (outside / "secret.png").write_bytes(b"secret bytes")
    limits = ImageLimits(max_images=4, max_image_pixels=10**6, max_image_bytes=1000,
                         allowed_dirs=(allowed.resolve(),))
    return allowed, outside, limits


def refusal(path: Path | str, limits: ImageLimits) -> str:
    part = ImagePart(index=0, param=PARAM, path=str(path))
    with pytest.raises(ValueError) as caught:
        read_bytes(part, limits)
    with pytest.raises(ValueError) as caught_by_check:
        check_parts([part], limits)
    assert str(caught_by_check.value) == str(caught.value)
    return str(caught.value).replace(str(path), "<path>")


def test_a_file_in_an_allowed_directory_is_read(dirs) -> None:
    allowed, _, limits = dirs
    part = ImagePart(index=0, param=PARAM, path=str(allowed / "ok.png"))
    check_parts([part], limits)
    assert read_bytes(part, limits) == b"allowed image bytes"


def test_missing_and_existing_files_outside_get_the_same_answer(dirs) -> None:
    allowed, outside, limits = dirs
    existing = refusal(outside / "secret.png", limits)
    missing = refusal(outside / "missing.png", limits)
    missing_dir = refusal(outside / "no-such-dir" / "x.png", limits)
    assert existing == missing == missing_dir
    assert "not in the directories" in existing and str(allowed.resolve()) in existing
    # through the allowed directory and back out again: resolved before anything else
    assert refusal(allowed / ".." / "outside" / "secret.png", limits) == existing
    assert refusal(allowed / ".." / "outside" / "missing.png", limits) == existing


def test_a_symlink_out_of_the_allowed_directory_is_outside(dirs) -> None:
    allowed, outside, limits = dirs
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "dangling.png").symlink_to(outside / "missing.png")
    (allowed / "sub").symlink_to(outside, target_is_directory=True)
    answers = {refusal(allowed / name, limits)
               for name in ("link.png", "dangling.png", "sub/secret.png", "sub/missing.png")}
    assert len(answers) == 1 and "not in the directories" in answers.pop()


def test_a_missing_file_inside_says_so(dirs) -> None:
    allowed, _, limits = dirs
    assert "does not exist" in refusal(allowed / "missing.png", limits)


def test_directories_and_fifos_are_not_files_and_do_not_hang(dirs) -> None:
    allowed, _, limits = dirs
    (allowed / "folder").mkdir()
    os.mkfifo(allowed / "pipe")
    assert "is not a file" in refusal(allowed / "folder", limits)
    assert "is not a file" in refusal(allowed / "pipe", limits)


@pytest.mark.parametrize("swap", ["file", "directory"])
def test_a_swap_between_the_check_and_the_open_is_caught(dirs, monkeypatch, swap) -> None:
    """The path is checked, then replaced by a symlink out of the allowed directory
    before it is opened (the race a client with write access to the directory could
    try): the opened descriptor is what is checked, so the secret is never read."""
    allowed, outside, limits = dirs
    (allowed / "sub").mkdir()
    (allowed / "sub" / "secret.png").write_bytes(b"harmless")
    target = allowed / "sub" / "secret.png"
    real_open = os.open

    def open_after_a_swap(path, flags, *args, **kwargs):
        if swap == "file":
            target.unlink()
            target.symlink_to(outside / "secret.png")
        else:
            (allowed / "sub" / "secret.png").unlink()
            (allowed / "sub").rmdir()
            (allowed / "sub").symlink_to(outside, target_is_directory=True)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(images.os, "open", open_after_a_swap)
    part = ImagePart(index=0, param=PARAM, path=str(target))
    with pytest.raises(ValueError) as caught:
        read_bytes(part, limits)
    assert "not in the directories" in str(caught.value)
    assert "secret bytes" not in str(caught.value)


# -- which formats are decoded ---------------------------------------------------------------


def _encoded(fmt: str) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buffer, format=fmt)
    return buffer.getvalue()


DECODE_LIMITS = ImageLimits(max_images=4, max_image_pixels=1 << 20, max_image_bytes=1 << 20)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_the_common_web_formats_are_decoded(fmt) -> None:
    part = ImagePart(0, "messages[0].content[1]", data=_encoded(fmt))
    assert images.decode(part, part.data, DECODE_LIMITS).size == (4, 3)


@pytest.mark.parametrize("data", [
    _encoded("TIFF"), _encoded("ICO"), _encoded("PPM"),
    # PostScript: PIL's EPS plugin would hand it to Ghostscript when decoding
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 3\nshowpage\n",
], ids=["tiff", "ico", "ppm", "eps"])
def test_other_formats_are_refused_before_any_decoder_sees_them(data, monkeypatch) -> None:
    from PIL import EpsImagePlugin

    opened: list[bytes] = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open",
                        lambda self: opened.append(b"eps") or (_ for _ in ()).throw(SyntaxError()))
    part = ImagePart(0, "messages[0].content[1]", data=data)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\]: not a PNG, JPEG, GIF, "
                                         r"WebP or BMP image"):
        images.decode(part, data, DECODE_LIMITS)
    assert opened == []
