"""mlx-lm's tokenizer loader reads only the ``decoder`` entry of ``tokenizer.json``.

To pick its streaming detokenizer, mlx-lm parses all of ``tokenizer.json`` (the
vocabulary and merges: 16 MB of strings, lists and dicts for the default model) and
keeps it through the whole tokenizer load. Python's small-object allocator hands a
1 MiB arena back to the system only once every object in it is freed: fresh arenas
filled with the parsed file at each load, every long-lived object made meanwhile (a
request's counters, the memory enforcer's reading, the model's record) landed among
its objects and kept its arena after the unload, and the resident set grew by
megabytes over load/unload cycles (issue 20, item 4).

:func:`read_tokenizer_json` has that loader read the file as a
:class:`LazyTokenizerJson`: the ``decoder`` entry is decoded from the text alone, and
anything else it asks for parses the whole file as before.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from typing import Any, Iterator

#: a JSON string, or a bracket (what changes the nesting depth)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_COLON = re.compile(r"\s*:\s*")
_MISSING = object()


def top_level_value(text: str, key: str) -> Any:
    """The value of ``key`` in the JSON object ``text``, decoding only that value (the
    first one, if the key repeats); ``KeyError`` when the object has no such key.

    :raises ValueError: ``text`` is not a JSON object (or not well formed where read).
    """
    start = json.decoder.WHITESPACE.match(text, 0).end()
    if not text.startswith("{", start):
        raise ValueError("not a JSON object")
    depth = 0
    for match in _TOKEN.finditer(text, start):
        opening = text[match.start()]
        if opening in "{[":
            depth += 1
        elif opening in "}]":
            depth -= 1
            if depth == 0:
                break
        elif depth == 1:
            colon = _COLON.match(text, match.end())
            if colon is not None and json.decoder.scanstring(text, match.start() + 1)[0] == key:
                return json.JSONDecoder().raw_decode(text, colon.end())[0]
    raise KeyError(key)


class LazyTokenizerJson(Mapping):
    """``tokenizer.json`` as mlx-lm's tokenizer loader reads it: ``decoder`` is decoded
    from the text alone; any other use parses the whole file (once). A file malformed
    where the decoder is read fails as ``json.loads`` would (a malformed vocabulary is
    left to the tokenizer's own parser)."""

    def __init__(self, text: str):
        self._text = text
        self._decoder: Any = _MISSING
        self._parsed: dict[str, Any] | None = None

    def _whole(self) -> dict[str, Any]:
        if self._parsed is None:
            self._parsed = json.loads(self._text)
        return self._parsed

    def _decoder_entry(self) -> Any:
        """The decoder, or ``_MISSING`` when there is none."""
        if self._parsed is not None:
            return self._parsed.get("decoder", _MISSING)
        if self._decoder is _MISSING:
            try:
                self._decoder = top_level_value(self._text, "decoder")
            except KeyError:
                return _MISSING
            except ValueError:
                return self._whole().get("decoder", _MISSING)
        return self._decoder

    def __getitem__(self, key: str) -> Any:
        if key != "decoder":
            return self._whole()[key]
        value = self._decoder_entry()
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        if key != "decoder":
            return key in self._whole()
        return self._decoder_entry() is not _MISSING

    def __iter__(self) -> Iterator[str]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())


class _JsonForTokenizerLoader:
    """The ``json`` module as mlx-lm's ``tokenizer_utils`` sees it: ``load`` of a file
    answers a :class:`LazyTokenizerJson`; everything else is the json module's."""

    def __init__(self, module: Any):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def load(self, file: Any, **kwargs: Any) -> Any:
        if kwargs:
            return self._module.load(file, **kwargs)
        text = file.read()
        if not text.lstrip().startswith("{"):  # not an object: fail (or load) as before
            return self._module.loads(text)
        return LazyTokenizerJson(text)


_install_lock = threading.Lock()


def read_tokenizer_json() -> None:
    """Have mlx-lm's tokenizer loader read ``tokenizer.json`` with
    :class:`LazyTokenizerJson` (idempotent; only that module's ``json`` changes)."""
    import mlx_lm.tokenizer_utils as tokenizer_utils

    with _install_lock:
        if not isinstance(tokenizer_utils.json, _JsonForTokenizerLoader):
            tokenizer_utils.json = _JsonForTokenizerLoader(tokenizer_utils.json)
