"""Benchmark prompt text of a chosen length in a model's own tokens.

Text is built from seeded, varied sentences (no repeated paragraph a prefix cache or a
tokenizer could shortcut) and cut to the target with the model's ``tokenizer.json``,
so "a 2.3k-token system prompt" means the same for any model and both servers.
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

_SUBJECTS = ("the harbour master", "a night-shift nurse", "the archive", "every courier",
             "the orchard cooperative", "a visiting inspector", "the ferry crew",
             "the bakery on Mill Street", "each apprentice", "the weather station",
             "the village council", "a lost traveller", "the signal tower", "the school library")
_ACTIONS = ("must log", "may postpone", "should double-check", "never discards",
            "always reports", "can borrow", "is asked to summarise", "will reroute",
            "is allowed to inspect", "has to confirm")
_OBJECTS = ("the tide tables", "unsealed parcels", "the spare lantern oil",
            "late deliveries", "the seed inventory", "damaged maps", "the visitor ledger",
            "overdue invoices", "the emergency radio", "borrowed ladders", "cold-storage logs",
            "the evening bread order")
_CONDITIONS = ("before the first bell", "when the north road floods",
               "unless a supervisor objects", "after every storm warning",
               "during the spring fair", "if the ledger is incomplete",
               "whenever the river rises", "at the end of each quarter")


@lru_cache(maxsize=4)
def _tokenizer(model_dir: str):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the benchmark needs the model's "
                                "tokenizer.json to size its prompts")
    return Tokenizer.from_file(str(path))


def token_count(model_dir: Path, text: str) -> int:
    """Tokens of ``text`` alone (no chat template, no special tokens)."""
    return len(_tokenizer(str(model_dir)).encode(text, add_special_tokens=False).ids)


def text_of_tokens(model_dir: Path, tokens: int, seed: int, heading: str = "") -> str:
    """Prose of ``tokens`` tokens by the model's tokenizer (give or take one where it is
    cut), ``heading`` first."""
    rng = random.Random(seed)
    tokenizer = _tokenizer(str(model_dir))
    parts = [heading] if heading else []
    rule = 0
    # Overshoot, then cut at a token boundary: appending sentence by sentence while
    # re-encoding the whole text would be quadratic.
    while len(tokenizer.encode(" ".join(parts), add_special_tokens=False).ids) < tokens:
        for _ in range(32):
            rule += 1
            parts.append(f"Rule {rule}: {rng.choice(_SUBJECTS).capitalize()} "
                         f"{rng.choice(_ACTIONS)} {rng.choice(_OBJECTS)} "
                         f"{rng.choice(_CONDITIONS)}.")
    encoding = tokenizer.encode(" ".join(parts), add_special_tokens=False)
    end = encoding.offsets[tokens - 1][1] if tokens > 0 else 0
    return " ".join(parts)[:end]
