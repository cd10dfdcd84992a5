"""mlx-lm's tokenizer loader reads only the ``decoder`` entry of ``tokenizer.json``
(:mod:`omlx_core.models.tokenizer_json`): it picks the same streaming detokenizer as
from the whole file, without parsing the vocabulary into Python objects (16 MB of
small objects for the default model, which fragmented the allocator's arenas at each
load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx_core.models.tokenizer_json import (LazyTokenizerJson, read_tokenizer_json,
                                               top_level_value)
from omlx_core.testing.tokenizer import build_tokenizer

DOCUMENTS = [
    '{"decoder": {"type": "ByteLevel"}, "model": {"vocab": {"a": 0}}}',
    ' {"a": {"decoder": 1}, "b": "x\\"}\\"decoder\\":", "c": [{"decoder": 2}, "]"],\n'
    '  "decoder" : [1, {"k": "]"}], "model": {}}',
    '{"model": {"vocab": {"decoder": 3, "{": 4}, "merges": ["a b", "[ ]"]}, "decoder": null}',
    '{"decoder": "\\u2581"}',
    '{"x": ["decoder", ":"], "y": {}}',
    '{}',
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_the_decoder_entry_read_alone_is_what_the_whole_parse_gives(text: str) -> None:
    whole = json.loads(text)
    if "decoder" in whole:
        assert top_level_value(text, "decoder") == whole["decoder"]
    else:
        with pytest.raises(KeyError):
            top_level_value(text, "decoder")
    lazy = LazyTokenizerJson(text)
    assert ("decoder" in lazy) == ("decoder" in whole)
    assert lazy.get("decoder", "absent") == whole.get("decoder", "absent")
    assert lazy._parsed is None  # the decoder alone was decoded
    assert dict(lazy) == whole  # anything else reads the whole file


def test_a_document_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ValueError):
        top_level_value('["decoder"]', "decoder")


def _tokenizer_dir(out: Path, decoder: object | None) -> Path:
    build_tokenizer(out)
    if decoder is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        tokenizer.decoder = decoder
        tokenizer.save(str(out / "tokenizer.json"))
    return out


def test_mlx_lm_picks_the_same_detokenizer_without_parsing_the_vocabulary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm import tokenizer_utils
    from tokenizers import decoders

    read_tokenizer_json()
    read: list[LazyTokenizerJson] = []
    setup = LazyTokenizerJson.__init__
    monkeypatch.setattr(LazyTokenizerJson, "__init__",
                        lambda self, text: read.append(self) or setup(self, text))
    spm = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    cases = {"byte-level": (None, "BPEStreamingDetokenizer"),
             "sentencepiece": (spm, "SPMStreamingDetokenizer")}
    for name, (decoder, expected) in cases.items():
        directory = _tokenizer_dir(tmp_path / name, decoder)
        content = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        assert len(content["model"]["vocab"]) > 100
        wrapper = tokenizer_utils.load(directory)
        assert type(wrapper._detokenizer).__name__ == expected, name
        if decoder is not None:  # the test vocabulary is byte-level: only its own decodes
            continue
        detokenizer = wrapper.detokenizer
        for token in wrapper.encode("hello world", add_special_tokens=False):
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text.strip() == "hello world"
    assert len(read) == len(cases) and all(lazy._parsed is None for lazy in read)
