"""Grammars for models that think before they answer: the thinking is free text, the
answer is what the request constrains (a JSON schema, a regex, tool calls), and a
thinking budget closes the thinking after so many tokens.

A ``<think>…</think>`` model's output is ``[<think>] thinking </think> answer``: the
opening tag is in the prompt when the chat template opened the block (DeepSeek-R1's),
in the output when the model opens it (Qwen3's, GLM's: then it is optional). The budget
is xgrammar's token limit on the thinking text (``any_text.max_tokens``): once spent,
only the closing tag may follow, so every engine that honours ``grammar`` honours the
budget, with no knowledge of thinking of its own. Harmony's analysis channel is built
the same way in :mod:`omlx_core.grammar.harmony`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from omlx_core.grammar.compiler import ANY_JSON_SCHEMA, GrammarSpec

__all__ = ["Marker", "ThinkTags", "answer_format", "with_thinking"]

#: whitespace a model writes around its thinking block ("\n\n" after </think>)
_LAYOUT = {"type": "regex", "pattern": r"[ \n]{0,4}"}


@dataclass(frozen=True)
class Marker:
    """A thinking marker as the model's tokenizer has it."""

    text: str
    #: the token that is the marker, when the vocabulary has one
    token_id: int | None = None
    #: how many tokens the marker takes
    tokens: int = 1

    def format(self) -> dict[str, Any]:
        if self.token_id is not None:
            return {"type": "token", "token": self.token_id}
        return {"type": "const_string", "value": self.text}


@dataclass(frozen=True)
class ThinkTags:
    """Where the output's thinking is and how long it may be.

    ``mode``: ``"open"`` (the prompt opened the block: the output starts inside it),
    ``"optional"`` (the output may open one first) or ``"off"`` (the prompt closed it:
    no thinking). ``budget``: the most tokens the thinking may take, its tags included.
    """

    open: Marker
    close: Marker
    mode: Literal["open", "optional", "off"]
    budget: int | None = None

    def prefix(self) -> dict[str, Any] | None:
        """The thinking block as a structural-tag format (``None`` when off)."""
        if self.mode == "off":
            return None
        text: dict[str, Any] = {"type": "any_text"}
        overhead = self.close.tokens + (self.open.tokens if self.mode == "optional" else 0)
        if self.budget is not None:
            text["max_tokens"] = max(0, self.budget - overhead)
        # A marker matched as its token must not also be spelled out in the text: the
        # parser of the output would read the spelling as the marker.
        excludes = [m.text for m in (self.open, self.close) if m.token_id is not None]
        if excludes:
            text["excludes"] = excludes
        block = [text, self.close.format(), _LAYOUT]
        if self.mode == "open":
            return {"type": "sequence", "elements": block}
        return {"type": "optional", "content": {"type": "sequence", "elements": [
            {"type": "regex", "pattern": r"\n?"}, self.open.format(), *block]}}

    @property
    def needs_grammar(self) -> bool:
        """Whether the thinking itself must be constrained (a budget to keep)."""
        return self.budget is not None and self.mode != "off"


def _not_opening(answer: dict[str, Any], opening: str) -> dict[str, Any]:
    """``answer`` with free text that never spells ``opening``: were an answer allowed to
    start with the thinking's opening tag, the grammar could read thinking as answer,
    where no budget holds."""
    if answer.get("type") in ("any_text", "triggered_tags"):
        return {**answer, "excludes": [*answer.get("excludes", ()), opening]}
    return answer


def answer_format(spec: GrammarSpec) -> dict[str, Any]:
    """``spec`` (a request's response format or tool grammar) as a structural-tag format,
    to follow the thinking."""
    if spec.kind == "structural_tag":
        return json.loads(spec.text)["format"]
    if spec.kind in ("json_schema", "any_json"):
        schema: Any = json.loads(spec.text) if spec.kind == "json_schema" else json.loads(ANY_JSON_SCHEMA)
        if spec.kind == "json_schema" and not spec.strict and isinstance(schema, dict) \
                and "additionalProperties" not in schema:
            schema = {**schema, "additionalProperties": True}
        content: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
        if spec.max_whitespace is not None:
            content["max_whitespace_cnt"] = spec.max_whitespace
        return content
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.text}
    return {"type": "grammar", "grammar": spec.text}


def with_thinking(answer: GrammarSpec | None, thinking: ThinkTags) -> GrammarSpec | None:
    """The grammar of an output that thinks as ``thinking`` says, then answers as
    ``answer`` says (``None``: freely). ``None`` when nothing needs constraining."""
    prefix = thinking.prefix()
    if prefix is None or (answer is None and not thinking.needs_grammar):
        return answer
    rest = answer_format(answer) if answer is not None else {"type": "any_text"}
    if thinking.mode == "optional":
        rest = _not_opening(rest, thinking.open.text)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [prefix, rest]}}
    return GrammarSpec.structural_tag(tag, field=answer.field if answer is not None else "thinking")
