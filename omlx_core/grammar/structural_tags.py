"""Pieces of xgrammar structural tags that every tool-call format builds its grammar from:
constant strings, sequences, markers that may be special tokens, a function's arguments.

A structural tag is a plain dict; xgrammar reads it only when the grammar is compiled.
"""

from __future__ import annotations

from typing import Any, Collection

from omlx_core.grammar.function_tools import FunctionTool

__all__ = [
    "arguments_format",
    "const_string",
    "marker_parts",
    "sequence_of",
    "split_marker",
]


def const_string(text: str) -> dict[str, Any]:
    """A structural-tag format matching ``text`` exactly."""
    return {"type": "const_string", "value": text}


def split_marker(text: str) -> tuple[str, str, str]:
    """``text`` as (leading whitespace, marker, trailing whitespace)."""
    core = text.strip()
    lead = text[:text.index(core)] if core else text
    return lead, core, text[len(lead) + len(core):]


def sequence_of(elements: list[dict[str, Any]]) -> dict[str, Any]:
    """``elements`` in order (empty constant strings dropped; one element stands alone)."""
    elements = [e for e in elements if not (e.get("type") == "const_string" and not e["value"])]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def marker_parts(text: str, special_tokens: Collection[str]) -> list[dict[str, Any]]:
    """``text`` as structural-tag formats: its core a token when it is a special token."""
    # xgrammar never matches a special token as text, so a marker that is one (Mistral's
    # [TOOL_CALLS] in its v3 vocabulary, <tool_call> in some) is named as a token.
    lead, core, trail = split_marker(text)
    if not core or core not in special_tokens:
        return [const_string(text)] if text else []
    return [const_string(lead), {"type": "token", "token": core}, const_string(trail)]


def arguments_format(tool: FunctionTool, max_whitespace: int | None, style: str = "json") -> dict[str, Any]:
    """The structural-tag format of ``tool``'s arguments, written in ``style`` (xgrammar's
    ``json``, ``qwen_xml``, ``glm_xml``)."""
    # Arguments always follow the schema; strict: false (OpenAI) only lets through the
    # properties it does not declare, which xgrammar otherwise forbids.
    schema: Any = tool.parameters
    if not tool.strict and "additionalProperties" not in schema:
        schema = {**schema, "additionalProperties": True}
    content: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
    if style != "json":
        content["style"] = style
    if max_whitespace is not None:
        content["max_whitespace_cnt"] = max_whitespace
    return content
