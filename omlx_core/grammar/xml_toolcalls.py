"""Tool calls whose arguments are XML parameters, not JSON: Qwen3-Coder's and GLM-4.5's.

- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

- ``glm45`` (GLM-4.5, GLM-4.6)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A string value is written as it is; any other value as JSON. xgrammar constrains the
parameters to the function's schema (its ``qwen_xml`` and ``glm_xml`` JSON-schema
styles), and :class:`XmlToolCallParser` reads them back into OpenAI's JSON arguments,
typed by the same schema, one parameter at a time as they complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from omlx_core.grammar.function_tools import FunctionTool
from omlx_core.grammar.structural_tags import arguments_format, const_string, sequence_of
from omlx_core.grammar.tool_call_formats import ToolCallFormat
from omlx_core.grammar.tool_events import (
    ContentDelta,
    Event,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)

__all__ = ["XmlToolCallParser", "typed_value", "xml_calls_format"]

#: the whitespace xgrammar lets a value carry around it, and JSON's
_SPACE = " \t\n\r"


@dataclass(frozen=True)
class _Framing:
    #: what follows the open marker, for a function name
    head: Callable[[str], str]
    #: xgrammar's JSON-schema style for the parameters
    style: str
    #: what precedes the close marker
    tail: str


_FRAMINGS = {
    "qwen3_coder": _Framing(lambda name: f"\n<function={name}>\n", "qwen_xml", "\n</function>\n"),
    "glm45": _Framing(lambda name: f"{name}\n", "glm_xml", ""),
}


def _call_tag(fmt: ToolCallFormat, tool: FunctionTool, special_tokens: Collection[str],
              max_whitespace: int | None) -> dict[str, Any]:
    framing = _FRAMINGS[fmt.name]
    content = arguments_format(tool, max_whitespace, framing.style)
    head, tail = framing.head(tool.name), framing.tail
    begin: Any = fmt.open + head
    end: Any = tail + fmt.close
    parts = [content]
    if fmt.open in special_tokens:
        begin = {"type": "token", "token": fmt.open}
        parts.insert(0, const_string(head))
    if fmt.close in special_tokens:
        end = {"type": "token", "token": fmt.close}
        parts.append(const_string(tail))
    return {"type": "tag", "begin": begin, "content": sequence_of(parts), "end": end}


def xml_calls_format(fmt: ToolCallFormat, tools: Sequence[FunctionTool], mode: str, *, one: bool,
                     special_tokens: Collection[str] = (),
                     max_whitespace: int | None = None) -> dict[str, Any]:
    """The structural-tag format of ``fmt``'s calls to ``tools``: free text with calls
    (``mode="auto"``), or calls only (``"required"``, ``"forced"``); ``one``: a single call."""
    tags = [_call_tag(fmt, tool, special_tokens, max_whitespace) for tool in tools]
    if mode != "auto":
        return {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                "at_least_one": True, "stop_after_first": one}
    if fmt.open in special_tokens:
        return {"type": "token_triggered_tags", "trigger_tokens": [fmt.open], "tags": tags,
                "stop_after_first": one}
    return {"type": "triggered_tags", "triggers": [fmt.open], "tags": tags, "stop_after_first": one}


# -- reading the calls back -----------------------------------------------------------------


def _kinds(schema: Any) -> set[str]:
    """The JSON types ``schema`` admits at its top level (empty: it does not say)."""
    if not isinstance(schema, dict):
        return set()
    kinds: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        kinds.add(declared)
    elif isinstance(declared, list):
        kinds.update(k for k in declared if isinstance(k, str))
    for value in _listed(schema):
        kinds.add(_json_kind(value))
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or ():
            kinds |= _kinds(option)
    if "integer" in kinds:
        kinds.add("number")
    return kinds


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for: a string as written (less
    the whitespace around it), anything else parsed as JSON when it is JSON of a type
    the schema admits."""
    text = raw.strip(_SPACE)
    kinds = _kinds(schema)
    if kinds == {"string"}:
        return _chosen_string(raw, text, schema)
    try:
        value = json.loads(text)
    except ValueError:
        return _chosen_string(raw, text, schema)
    kind = _json_kind(value)
    if kinds and kind not in kinds and not (kind == "integer" and "number" in kinds):
        return _chosen_string(raw, text, schema)
    return value


def _chosen_string(raw: str, text: str, schema: Any) -> str:
    """A string parameter's value: ``text`` (``raw`` less the whitespace around it),
    unless the schema lists the strings it may be (``enum``/``const``) and one of them
    has whitespace of its own at an end (``" "``, ``" a"``): the grammar lets the model
    pad a listed value with whitespace, so the one written inside ``raw`` is the value."""
    choices = _string_choices(schema)
    if not choices or text in choices:
        return text
    written = [choice for choice in choices if choice.strip(_SPACE) == text and choice in raw]
    return max(written, key=len) if written else text


def _listed(schema: dict[str, Any]) -> list[Any]:
    """The values ``schema`` lists at its top level (``enum`` and ``const``)."""
    return list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])


def _string_choices(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    choices = {value for value in _listed(schema) if isinstance(value, str)}
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            choices |= _string_choices(option)
    return choices


# The pieces of a call, each matched at the parser's position; ``(?s)`` lets values span lines.
_QWEN_NAME = re.compile(r"[ \t\n\r]*<function=([^>\n]+)>")
_QWEN_PARAMETER = re.compile(r"(?s)[ \t\n\r]*<parameter=([^>\n]+)>(.*?)</parameter>")
_QWEN_END = re.compile(r"[ \t\n\r]*</function>[ \t\n\r]*</tool_call>")
_GLM_NAME = re.compile(r"[ \t\n\r]*([^\s<]+)[ \t\n\r]*(?=<arg_key>|</tool_call>)")
_GLM_PARAMETER = re.compile(r"(?s)[ \t\n\r]*<arg_key>(.*?)</arg_key>[ \t\n\r]*<arg_value>(.*?)</arg_value>")
_GLM_END = re.compile(r"[ \t\n\r]*</tool_call>")
_GLM_NAME_SO_FAR = re.compile(r"[^\s<]*[ \t\n\r]*")
_PIECES = {"qwen3_coder": (_QWEN_NAME, _QWEN_PARAMETER, _QWEN_END,
                           ("<function=", "<parameter=", "</function>")),
           "glm45": (_GLM_NAME, _GLM_PARAMETER, _GLM_END, ("<arg_key>", "</tool_call>"))}
#: a call longer than this without its next piece is not one (a model's prose)
_MAX_PENDING = 1 << 16


class XmlToolCallParser:
    """Splits output in an XML tool-call format (``qwen3_coder``, ``glm45``), fed as it
    streams, into content and calls; arguments arrive one parameter at a time as JSON
    pieces whose concatenation is the call's ``arguments``. The interface of
    :class:`~omlx_core.grammar.toolcalls.ToolCallParser`."""

    def __init__(self, fmt: ToolCallFormat, tools: Sequence[FunctionTool] = (), *,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._schemas = {tool.name: tool.parameters for tool in tools}
        self._name, self._parameter, self._end, self._openings = _PIECES[fmt.name]
        self._pending = ""
        self._in_call = False
        self._call_text = ""  # the call's text so far, returned as content if it is not one
        self._current: ToolCall | None = None
        self._values = 0

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending:
            before = (self._in_call, len(self._pending))
            if self._in_call:
                self._scan_call(events)
            else:
                self._scan_text(events)
            if (self._in_call, len(self._pending)) == before:
                break
        return events

    def finish(self) -> list[Event]:
        """Flush at the end of the output; a call cut off (``max_tokens``) stays in
        ``calls`` incomplete, and one cut off before its name is dropped."""
        events: list[Event] = []
        if not self._in_call and self._pending and not self._is_gap(self._pending):
            events.append(ContentDelta(self._pending))
        self._pending = ""
        return events

    def _is_gap(self, text: str) -> bool:
        return bool(self.calls) and not text.strip()

    def _scan_text(self, events: list[Event]) -> None:
        pending, opener = self._pending, self.fmt.open
        found = pending.find(opener)
        if found >= 0:
            if found and not self._is_gap(pending[:found]):
                events.append(ContentDelta(pending[:found]))
            self._pending = pending[found + len(opener):]
            self._in_call, self._call_text = True, opener
            return
        hold = next((size for size in range(min(len(opener) - 1, len(pending)), 0, -1)
                     if opener.startswith(pending[-size:])), 0)
        keep = pending[:len(pending) - hold]
        if keep and not self._is_gap(keep):
            events.append(ContentDelta(keep))
            self._pending = pending[len(keep):]

    def _scan_call(self, events: list[Event]) -> None:
        if self._current is None:
            match = self._name.match(self._pending)
            if match is None:
                self._give_up_unless_coming(events)
                return
            self._consume(match)
            self._current = ToolCall(index=len(self.calls), id=self.new_id(), name=match.group(1).strip())
            self.calls.append(self._current)
            self._values = 0
            events.append(ToolCallStart(self._current.index, self._current.id, self._current.name))
            return
        end = self._end.match(self._pending)
        if end is not None:
            self._consume(end)
            self._close_call(events)
            return
        match = self._parameter.match(self._pending)
        if match is None:
            self._give_up_unless_coming(events)
            return
        self._consume(match)
        key = match.group(1).strip()
        schema = (self._schemas.get(self._current.name) or {}).get("properties", {}).get(key)
        piece = ("{" if self._values == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": " \
            + json.dumps(typed_value(match.group(2), schema), ensure_ascii=False)
        self._values += 1
        self._current.arguments += piece
        events.append(ToolCallArgumentsDelta(self._current.index, piece))

    def _consume(self, match: re.Match[str]) -> None:
        self._call_text += match.group(0)
        self._pending = self._pending[match.end():]

    def _close_call(self, events: list[Event]) -> None:
        call = self._current
        assert call is not None
        piece = "{}" if self._values == 0 else "}"
        call.arguments += piece
        call.complete = True
        events.append(ToolCallArgumentsDelta(call.index, piece))
        events.append(ToolCallEnd(call.index, call))
        self._current, self._in_call, self._call_text = None, False, ""

    def _give_up_unless_coming(self, events: list[Event]) -> None:
        """Wait while the pending text can still become the call's next piece; otherwise
        the text was never a call (before its name) or the call is broken (after it)."""
        rest = self._pending.lstrip(_SPACE)
        if self._current is None and self.fmt.name == "glm45":
            rest = rest[_GLM_NAME_SO_FAR.match(rest).end():]  # the name, still growing
        coming = len(self._pending) < _MAX_PENDING and (
            not rest or any(rest.startswith(o) or o.startswith(rest) for o in self._openings))
        if coming:
            return
        if self._current is None:
            events.append(ContentDelta(self._call_text))
            self._in_call, self._call_text = False, ""
            return
        # A call whose framing broke: it ends here, incomplete; the rest is content.
        self._current, self._in_call, self._call_text = None, False, ""
