"""The functions a request offers the model (``tools``) and which it must call
(``tool_choice``), checked: every bad entry is a :class:`GrammarError` naming its field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from omlx_core.grammar.errors import GrammarError

__all__ = [
    "FunctionTool",
    "ToolChoice",
    "normalize_tools",
    "resolve_tool_choice",
]


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call, checked."""

    name: str
    parameters: dict[str, Any]
    description: str = ""
    strict: bool = True


_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

ToolChoice = Literal["auto", "none", "required"] | dict


def normalize_tools(tools: Any, *, field: str = "tools") -> list[FunctionTool]:
    """The function tools of an OpenAI ``tools`` list (``[{"type": "function", "function":
    {"name", "description", "parameters", "strict"}}]``); an Anthropic-style flat entry
    (``{"name", "description", "input_schema"}``) is accepted too. Raises
    :class:`GrammarError` naming the first bad entry."""
    if not isinstance(tools, list) or not tools:
        raise GrammarError(field, "must be a non-empty array of tools")
    result: list[FunctionTool] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"{field}[{index}]"
        if not isinstance(tool, dict):
            raise GrammarError(where, "must be an object")
        if "function" in tool or tool.get("type") == "function":
            if tool.get("type", "function") != "function":
                raise GrammarError(f"{where}.type", f"unsupported tool type {tool.get('type')!r}; use \"function\"")
            function = tool.get("function")
            where = f"{where}.function"
            if not isinstance(function, dict):
                raise GrammarError(where, "must be an object with name and parameters")
            schema_key = "parameters"
        elif "input_schema" in tool or tool.get("type") in (None, "custom"):
            function, schema_key = tool, "input_schema"
        else:
            raise GrammarError(f"{where}.type", f"unsupported tool type {tool.get('type')!r}; only "
                               "function tools (OpenAI) and custom tools (Anthropic) can be constrained")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise GrammarError(f"{where}.name", "must be 1-64 letters, digits, underscores, dots or dashes")
        if name in seen:
            raise GrammarError(f"{where}.name", f"{name!r} is defined twice; function names must be unique")
        seen.add(name)
        parameters = function.get(schema_key, {"type": "object", "properties": {}})
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise GrammarError(
                f"{where}.{schema_key}",
                'must be a JSON Schema of type "object" (a function takes named arguments), e.g. '
                '{"type": "object", "properties": {"city": {"type": "string"}}}')
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise GrammarError(f"{where}.description", "must be a string")
        strict = function.get("strict")
        result.append(FunctionTool(name, {"type": "object", **parameters}, description,
                                   True if strict is None else bool(strict)))
    return result


def _resolve_choice(tools: list[FunctionTool], tool_choice: Any, field: str
                    ) -> tuple[Literal["none", "auto", "required", "forced"], list[FunctionTool]]:
    if tool_choice is None or tool_choice == "auto":
        return "auto", tools
    if tool_choice in ("none", "required"):
        return tool_choice, tools
    if isinstance(tool_choice, dict):
        # OpenAI {"type": "function", "function": {"name"}}; Anthropic {"type": "tool", "name"},
        # {"type": "any"} (required), {"type": "auto"}, {"type": "none"}.
        kind = tool_choice.get("type")
        if kind in ("auto", "none"):
            return kind, tools
        if kind == "any":
            return "required", tools
        name = (tool_choice.get("function") or {}).get("name") if kind == "function" else (
            tool_choice.get("name") if kind == "tool" else None)
        if isinstance(name, str):
            chosen = [tool for tool in tools if tool.name == name]
            if not chosen:
                known = ", ".join(tool.name for tool in tools)
                raise GrammarError(f"{field}.function.name" if kind == "function" else f"{field}.name",
                                   f"names {name!r}, which is not among the tools ({known})")
            return "forced", chosen
    raise GrammarError(field, 'must be "auto", "none", "required" or {"type": "function", '
                       '"function": {"name": ...}}')


def resolve_tool_choice(tools: Sequence[FunctionTool], tool_choice: Any, field: str = "tool_choice"
                        ) -> tuple[str, list[FunctionTool]]:
    """``("none" | "auto" | "required" | "forced", the tools it leaves)`` for a request's
    ``tool_choice``; :class:`GrammarError` naming the field for a bad one."""
    return _resolve_choice(list(tools), tool_choice, field)
