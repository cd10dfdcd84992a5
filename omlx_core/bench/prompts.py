"""Benchmark prompts: text of a chosen length in a model's own tokens, and the fixed
open-ended chat prompts (:data:`OPEN_ENDED`).

Text is built from seeded, varied sentences (no repeated paragraph a prefix cache or a
tokenizer could shortcut) and cut to the target with the model's ``tokenizer.json``,
so "a 2.3k-token system prompt" means the same for any model and both servers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
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


@dataclass(frozen=True)
class OpenEndedPrompt:
    """A fixed chat prompt of the serving benchmark's open-ended phases."""

    #: ``"question"`` or ``"story"``: the report gives each kind's decode rate and how
    #: much its answers repeat themselves (:func:`repeated_share`: what prompt-lookup
    #: drafting feeds on)
    kind: str
    text: str


#: The open-ended prompts, questions and stories alternating, so that any first ``n``
#: hold both kinds alike.
OPEN_ENDED: tuple[OpenEndedPrompt, ...] = tuple(
    OpenEndedPrompt(kind, text) for pair in zip(
        (("question", "Explain how a refrigerator keeps food cold, step by step."),
         ("question", "What are the main differences between a lake and a sea? Give examples."),
         ("question", "Give me advice for preparing for a job interview at a bakery."),
         ("question", "Why does the Earth have seasons?"),
         ("question", "Write a short letter to a neighbour asking to borrow a ladder."),
         ("question", "Suggest some healthy breakfast ideas and say why each one is good."),
         ("question", "How do the gears of a bicycle help a rider climb a hill?"),
         ("question", "Compare travelling by train and by plane for a trip of 500 km.")),
        (("story", "Write a long, detailed story about a lighthouse keeper."),
         ("story", "Write a long, detailed story about a clockmaker."),
         ("story", "Write a long, detailed story about a mountain village."),
         ("story", "Write a long, detailed story about a robot."),
         ("story", "Write a long, detailed story about a desert caravan."),
         ("story", "Write a long, detailed story about an old ship."),
         ("story", "Write a long, detailed story about a winter garden."),
         ("story", "Write a long, detailed story about a night train.")))
    for kind, text in pair)


def repeated_share(text: str, n: int = 4) -> float:
    """The share of ``text``'s word ``n``-grams that already occurred earlier in it: near 0
    for prose that moves on, high for a model that loops (what prompt lookup drafts from)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    repeated = 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(grams)
