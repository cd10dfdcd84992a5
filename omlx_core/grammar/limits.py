"""What a client's grammar may be, checked before it is compiled.

A grammar costs its compile in time and memory roughly by its size and its
alternatives: an ``enum`` of 60,000 strings took ~10 s and ~400 MiB to compile, and three
at once held 1.2 GiB beyond any ceiling. So a grammar's text, each ``enum``/``anyOf``/
``oneOf`` list, the alternatives in all, and its nesting are capped (``[grammar]``
settings); a grammar over a cap is a 400 naming the cap and the setting that raises it.
Tool definitions are grammars too: their structural tag is checked the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from omlx_core.grammar.errors import GrammarError
from omlx_core.settings import format_size

__all__ = ["GrammarLimits", "configure_limits", "current_limits"]

#: JSON Schema keywords whose list is a choice between alternatives
ALTERNATIVE_KEYWORDS = ("enum", "anyOf", "oneOf")


@dataclass(frozen=True)
class GrammarLimits:
    """The caps (``grammar.*``); their defaults are ``tiers/base.toml``'s."""

    #: bytes of a grammar's canonical text (schema JSON, regex, EBNF, structural tag)
    max_grammar_bytes: int = 512 * 1024
    #: entries of one ``enum``, ``anyOf`` or ``oneOf`` list
    max_alternatives: int = 500
    #: such entries over the whole grammar (every list added up)
    max_total_alternatives: int = 1000
    #: how deep the grammar's JSON nests (objects and lists)
    max_depth: int = 32

    @classmethod
    def from_config(cls, config: Any) -> GrammarLimits:
        return cls(int(config["grammar.max_grammar_bytes"]), int(config["grammar.max_alternatives"]),
                   int(config["grammar.max_total_alternatives"]), int(config["grammar.max_depth"]))

    def check(self, kind: str, text: str, field: str) -> None:
        """Raise :class:`GrammarError` (naming ``field``, the cap and its setting) if the
        grammar ``text`` of ``kind`` breaks a cap."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_grammar_bytes:
            raise GrammarError(field, f"the grammar is {format_size(size)}, over the "
                               f"{format_size(self.max_grammar_bytes)} this server compiles "
                               "(grammar.max_grammar_bytes); send a smaller one")
        if kind in ("json_schema", "structural_tag"):
            self._check_tree(json.loads(text), field)

    def _check_tree(self, root: Any, field: str) -> None:
        total = 0
        stack: list[tuple[Any, int]] = [(root, 1)]
        while stack:  # iteratively: the nesting is what is being checked
            value, depth = stack.pop()
            if depth > self.max_depth:
                raise GrammarError(field, f"the grammar nests deeper than {self.max_depth} "
                                   "levels (grammar.max_depth); flatten it")
            if isinstance(value, list):
                stack.extend((item, depth + 1) for item in value)
                continue
            if not isinstance(value, dict):
                continue
            for keyword in ALTERNATIVE_KEYWORDS:
                choices = value.get(keyword)
                if not isinstance(choices, list):
                    continue
                if len(choices) > self.max_alternatives:
                    raise GrammarError(field, f"an {keyword} has {len(choices)} entries, over the "
                                       f"{self.max_alternatives} this server compiles "
                                       "(grammar.max_alternatives); send fewer alternatives")
                total += len(choices)
                if total > self.max_total_alternatives:
                    raise GrammarError(field, f"the grammar's enum, anyOf and oneOf lists hold "
                                       f"more than {self.max_total_alternatives} entries in all "
                                       "(grammar.max_total_alternatives); send fewer")
            stack.extend((item, depth + 1) for item in value.values())


_LIMITS = GrammarLimits()


def configure_limits(limits: GrammarLimits) -> None:
    """Set the caps every grammar is checked against from now on (the server's)."""
    global _LIMITS
    _LIMITS = limits


def current_limits() -> GrammarLimits:
    return _LIMITS

