"""Pythonic tool calls: a Python list of calls with keyword arguments, as Llama-4 and
Gemma-style prompts ask for, ``[get_weather(city="Paris", days=2), get_time(zone="UTC")]``.

The grammar writes each call's keyword arguments in the order the function's schema
declares them (required ones first), each value a Python literal of its schema: JSON for
strings, numbers, arrays and objects (which Python reads the same), ``True``/``False``/
``None`` for booleans and null. :class:`PythonicToolCallParser` reads the list back with
:mod:`ast` (literals only: nothing is evaluated), one call at a time as each closes.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any, Callable, Sequence

from omlx_core.grammar.function_tools import FunctionTool
from omlx_core.grammar.structural_tags import const_string, sequence_of
from omlx_core.grammar.tool_events import (
    ContentDelta,
    Event,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)

__all__ = ["PythonicToolCallParser", "pythonic_calls_format", "python_literal"]


def _value(schema: Any, max_whitespace: int | None) -> dict[str, Any]:
    if isinstance(schema, dict) and not ({"enum", "const", "anyOf", "oneOf"} & schema.keys()):
        if schema.get("type") == "boolean":
            return {"type": "or", "elements": [const_string("True"), const_string("False")]}
        if schema.get("type") == "null":
            return const_string("None")
    content: dict[str, Any] = {"type": "json_schema", "json_schema": schema if schema is not None else True}
    if max_whitespace is not None:
        content["max_whitespace_cnt"] = max_whitespace
    return content


def _keyword_arguments(tool: FunctionTool, max_whitespace: int | None) -> dict[str, Any] | None:
    """``key=value, ...`` for ``tool`` (``None``: it takes none)."""
    properties: dict[str, Any] = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    needed = [k for k in properties if k in required]
    optional = [k for k in properties if k not in required]

    def pair(key: str) -> dict[str, Any]:
        return sequence_of([const_string(f"{key}="), _value(properties[key], max_whitespace)])

    def more(keys: list[str]) -> list[dict[str, Any]]:
        return [{"type": "optional", "content": sequence_of([const_string(", "), pair(k)])} for k in keys]

    if needed:
        return sequence_of([pair(needed[0]), *(sequence_of([const_string(", "), pair(k)]) for k in needed[1:]),
                            *more(optional)])
    if not optional:
        return None
    # No argument is required: whichever comes first has no comma before it.
    firsts = [sequence_of([pair(key), *more(optional[i + 1:])]) for i, key in enumerate(optional)]
    return {"type": "optional", "content": firsts[0] if len(firsts) == 1 else {"type": "or", "elements": firsts}}


def _call(tool: FunctionTool, max_whitespace: int | None, *, opened: bool = False) -> list[dict[str, Any]]:
    """A call's formats; ``opened``: its ``name(`` is already matched (a tag's begin)."""
    arguments = _keyword_arguments(tool, max_whitespace)
    parts = [] if opened else [const_string(f"{tool.name}(")]
    return parts + ([arguments] if arguments is not None else []) + [const_string(")")]


def pythonic_calls_format(tools: Sequence[FunctionTool], mode: str, *, one: bool,
                          max_whitespace: int | None = None) -> dict[str, Any]:
    """The structural-tag format of a call list to ``tools``: after free text
    (``mode="auto"``: a list begins where ``[`` and a function's name and ``(`` do) or
    alone (``"required"``, ``"forced"``); ``one``: a list of a single call."""
    calls = [sequence_of(_call(tool, max_whitespace)) for tool in tools]
    any_call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    more = [] if one else [{"type": "star", "content": sequence_of([const_string(", "), any_call])}]
    if mode != "auto":
        return sequence_of([const_string("["), any_call, *more, const_string("]")])
    tags = [{"type": "tag", "begin": f"[{tool.name}(",
             "content": sequence_of([*_call(tool, max_whitespace, opened=True), *more]), "end": "]"}
            for tool in tools]
    return {"type": "triggered_tags", "triggers": [f"[{tool.name}(" for tool in tools], "tags": tags,
            "stop_after_first": True}


# -- reading the calls back -----------------------------------------------------------------


_LITERAL_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def python_literal(node: ast.AST, source: str) -> Any:
    """The JSON value of a literal expression: constants, lists, tuples, dicts with string
    keys, ``True``/``False``/``None`` (and JSON's spellings), signed numbers. Anything
    else raises ``ValueError``: nothing is evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        if isinstance(node.value, str):
            segment = ast.get_source_segment(source, node) or ""
            if segment.startswith('"'):
                try:  # JSON's escapes (\/) where it and Python differ
                    return json.loads(segment)
                except ValueError:
                    pass
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [python_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key, value in zip(node.keys, node.values):
            name = python_literal(key, source) if key is not None else None
            if not isinstance(name, str):
                raise ValueError("a dict argument needs string keys")
            result[name] = python_literal(value, source)
        return result
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = python_literal(node.operand, source)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise ValueError(f"{type(node).__name__} is not a literal")


def _parse_call(source: str) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of one ``name(key=literal, ...)``; ``ValueError`` otherwise."""
    try:
        with warnings.catch_warnings():  # JSON's \/ is an invalid escape to Python: read as JSON
            warnings.simplefilter("ignore")
            tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(str(exc)) from None
    call = tree.body
    if not isinstance(call, ast.Call) or call.args or not isinstance(call.func, (ast.Name, ast.Attribute)):
        raise ValueError("not a call with keyword arguments")
    name = ast.get_source_segment(source.strip(), call.func) or ""
    arguments = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError("**arguments are not literal")
        arguments[keyword.arg] = python_literal(keyword.value, source.strip())
    return name, arguments


_OPENER = re.compile(r"\[[ \t\n\r]*([A-Za-z_][\w.\-]*)\(")
_OPENER_SO_FAR = re.compile(r"\[[ \t\n\r]*[A-Za-z_]?[\w.\-]*$")


class PythonicToolCallParser:
    """Splits output with pythonic call lists, fed as it streams, into content and calls;
    each call is announced with its whole arguments once its ``)`` arrives. The interface
    of :class:`~omlx_core.grammar.toolcalls.ToolCallParser`. With ``tools``, only a list
    that starts with one of their names is read as calls."""

    def __init__(self, tools: Sequence[FunctionTool] = (), *,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._names = {tool.name for tool in tools}
        self._pending = ""
        self._in_list = False
        self._list_text = ""  # the list's text not yet read into calls
        self._depth = 0
        self._quote = ""
        self._escaped = False
        self._call_start = -1

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending:
            before = (self._in_list, len(self._pending))
            if self._in_list:
                self._scan_list(events)
            else:
                self._scan_text(events)
            if (self._in_list, len(self._pending)) == before:
                break
        return events

    def finish(self) -> list[Event]:
        """Flush at the end of the output: a list cut off (``max_tokens``) keeps the
        calls it finished; the rest of it is dropped."""
        events: list[Event] = []
        rest = "" if self._in_list else self._pending
        if rest and not (self.calls and not rest.strip()):
            events.append(ContentDelta(rest))
        self._pending, self._list_text, self._in_list = "", "", False
        return events

    def _scan_text(self, events: list[Event]) -> None:
        pending = self._pending
        for match in _OPENER.finditer(pending):
            if self._names and match.group(1) not in self._names:
                continue
            before = pending[:match.start()]
            if before and not (self.calls and not before.strip()):
                events.append(ContentDelta(before))
            self._pending = pending[match.start():]
            self._in_list, self._list_text = True, ""
            self._depth, self._quote, self._escaped, self._call_start = 0, "", False, -1
            return
        cut = pending.rfind("[")
        hold = len(pending) - cut if cut >= 0 and _OPENER_SO_FAR.match(pending, cut) else 0
        keep = pending[:len(pending) - hold]
        if keep and not (self.calls and not keep.strip()):
            events.append(ContentDelta(keep))
            self._pending = pending[len(keep):]

    def _scan_list(self, events: list[Event]) -> None:
        consumed = 0
        for char in self._pending:
            consumed += 1
            position = len(self._list_text)
            self._list_text += char
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = ""
                continue
            if char in "\"'":
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 1 and char == ")" and self._call_start >= 0:
                    if not self._read_call(self._list_text[self._call_start:], events):
                        break
                    self._call_start = -1
                elif self._depth == 0:
                    self._pending = self._pending[consumed:]
                    self._in_list, self._list_text = False, ""
                    return
            elif self._depth == 1 and self._call_start < 0 and (char.isalpha() or char == "_"):
                self._call_start = position
            elif self._depth == 1 and self._call_start < 0 and char not in ", \t\n\r":
                self._broken(events)
                self._pending = self._pending[consumed:]
                return
        else:
            self._pending = ""
            return
        self._pending = self._pending[consumed:]

    def _read_call(self, source: str, events: list[Event]) -> bool:
        try:
            name, arguments = _parse_call(source)
        except ValueError:
            self._broken(events)
            return False
        call = ToolCall(index=len(self.calls), id=self.new_id(), name=name,
                        arguments=json.dumps(arguments, ensure_ascii=False), complete=True)
        self.calls.append(call)
        self._list_text = self._list_text[:self._call_start]
        events += [ToolCallStart(call.index, call.id, name),
                   ToolCallArgumentsDelta(call.index, call.arguments), ToolCallEnd(call.index, call)]
        return True

    def _broken(self, events: list[Event]) -> None:
        """Not a call list after all: what was held of it is content."""
        events.append(ContentDelta(self._list_text))
        self._in_list, self._list_text = False, ""
