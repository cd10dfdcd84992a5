"""The text and bytes of single tokens, for logprobs (the default of ``Engine.token_bytes``).

Logprobs name each token by its exact bytes; this reads them from a model directory's
own ``tokenizer.json``. Byte-level BPE vocabularies (GPT-2,
Llama 3, SmolLM, Qwen) spell bytes as printable characters; mapping them back gives the
exact bytes of a token even when it is half of a UTF-8 character.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def _mentions_byte_level(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_mentions_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_byte_level(v) for v in node)
    return False


class TokenTexts:
    """Looks up what a token id spells, from a model directory's ``tokenizer.json`` (or,
    for a model that has none, its Hugging Face tokenizer)."""

    def __init__(self, model_path: Path):
        path = Path(model_path) / "tokenizer.json"
        self._cache: dict[int, bytes] = {}
        self._special: set[int] = set()
        self._byte_level = False
        if path.is_file():
            from tokenizers import Tokenizer

            self._tokenizer: Any = Tokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
            self._byte_level = _mentions_byte_level(spec.get("decoder"))
            self._special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        else:
            from transformers import AutoTokenizer

            self._tokenizer = _SlowTokenizer(AutoTokenizer.from_pretrained(str(model_path)))

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            value = b""
        elif self._byte_level and token_id not in self._special:
            table = _byte_decoder()
            value = b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)
        else:
            value = self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._cache[token_id] = value
        return value

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


class _SlowTokenizer:
    """The two calls :class:`TokenTexts` makes, on a ``transformers`` tokenizer."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.convert_ids_to_tokens(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


_loaded: dict[Path, TokenTexts] = {}
_lock = threading.Lock()


def token_texts(model_path: Path) -> TokenTexts:
    """The (shared) lookup for one model directory."""
    with _lock:
        texts = _loaded.get(Path(model_path))
        if texts is None:
            texts = _loaded[Path(model_path)] = TokenTexts(model_path)
        return texts
