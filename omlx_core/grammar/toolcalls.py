"""Tool calls in a model's own format: the grammar that constrains the calls to the
functions' parameter schemas, and the parser that reads generated text back into
content and calls as it streams; the JSON-framed formats here, the others by their modules.

A model calls tools in the syntax its chat template taught it:

- ``hermes`` (Qwen 2.5/3, Hermes, many fine-tunes):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3`` (Llama 3.1-3.3): a bare ``{"name": "f", "parameters": {...}}``, optionally
  after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5) and ``glm45`` (GLM-4.5/4.6): XML parameters,
  ``<tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``
  and ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``
  (:mod:`omlx_core.grammar.xml_toolcalls`);
- ``pythonic`` (Llama-4 and Gemma-style prompts): ``[f(a=1), g(b="x")]``
  (:mod:`omlx_core.grammar.pythonic_toolcalls`);
- ``harmony`` (gpt-oss): a ``commentary`` message addressed ``to=functions.f`` whose body
  is the arguments (:mod:`omlx_core.grammar.harmony`, which also splits the reasoning).

The formats and their detection from a chat template are in
:mod:`omlx_core.grammar.tool_call_formats`, the checked ``tools`` and ``tool_choice`` in
:mod:`~omlx_core.grammar.function_tools`, and what every parser reports in
:mod:`~omlx_core.grammar.tool_events`. The grammar is an xgrammar structural tag
(:mod:`~omlx_core.grammar.structural_tags`): free text until the format's trigger, then
the call's fixed framing with the arguments constrained by the function's schema. This
module builds plain dicts and needs xgrammar only to compile them.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Collection, Sequence

from omlx_core.grammar.compiler import DEFAULT_MAX_WHITESPACE, GrammarSpec
from omlx_core.grammar.function_tools import FunctionTool, normalize_tools, resolve_tool_choice
from omlx_core.grammar.harmony import HarmonyParser, harmony_format
from omlx_core.grammar.pythonic_toolcalls import PythonicToolCallParser, pythonic_calls_format
from omlx_core.grammar.structural_tags import arguments_format, const_string, marker_parts, sequence_of, split_marker
from omlx_core.grammar.tool_call_formats import ToolCallFormat
from omlx_core.grammar.tool_events import (ContentDelta, Event, ToolCall, ToolCallArgumentsDelta, ToolCallEnd,
                                           ToolCallStart, new_call_id)
from omlx_core.grammar.xml_toolcalls import XmlToolCallParser, xml_calls_format

__all__ = [
    "ToolCallParser",
    "parse_tool_calls",
    "tool_call_grammar",
    "tool_call_parser",
    "tool_call_structural_tag",
]


# -- the grammar ------------------------------------------------------------------------


def _call_prefix(fmt: ToolCallFormat, tool: FunctionTool) -> str:
    return f'{{"name": {json.dumps(tool.name)}, "{fmt.arguments_key}": '


def _call_tag(fmt: ToolCallFormat, tool: FunctionTool, max_whitespace: int | None,
              special_tokens: Collection[str], *, framed: bool) -> dict[str, Any]:
    """One call as a tag; ``framed``: inside the format's own open/close markers (a
    format with a framing per call, hermes)."""
    prefix, suffix = _call_prefix(fmt, tool), "}"
    content = [arguments_format(tool, max_whitespace)]
    if not framed:
        return {"type": "tag", "begin": prefix, "content": content[0], "end": suffix}
    _, open_core, open_trail = split_marker(fmt.open)
    close_lead, close_core, _ = split_marker(fmt.close)
    if open_core in special_tokens:
        begin: Any = {"type": "token", "token": open_core}
        content.insert(0, const_string(open_trail + prefix))
    else:
        begin = fmt.open + prefix
    if close_core in special_tokens:
        end: Any = {"type": "token", "token": close_core}
        content.append(const_string(suffix + close_lead))
    else:
        end = suffix + fmt.close
    return {"type": "tag", "begin": begin, "content": sequence_of(content), "end": end}


def tool_call_structural_tag(fmt: ToolCallFormat, tools: Sequence[FunctionTool], tool_choice: Any = "auto",
                             *, parallel_tool_calls: bool = True, special_tokens: Collection[str] = (),
                             max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
                             field: str = "tool_choice") -> dict[str, Any] | None:
    """The xgrammar structural tag that makes ``fmt``'s calls valid against ``tools``'
    parameter schemas, or ``None`` when ``tool_choice`` is ``"none"`` (no constraint).

    ``auto``: text, optionally followed by calls; ``required``: one or more calls and
    nothing else; a named function: exactly that call. ``parallel_tool_calls=False``
    allows one call at most. ``special_tokens``: the tokenizer's special tokens, so
    markers that are special tokens are matched as tokens.
    """
    mode, chosen = resolve_tool_choice(tools, tool_choice, field)
    if mode == "none":
        return None
    one = not parallel_tool_calls or mode == "forced" or not fmt.parallel
    if fmt.family != "json":
        return {"type": "structural_tag",
                "format": _family_calls(fmt, chosen, mode, one, special_tokens, max_whitespace)}
    _, open_core, open_trail = split_marker(fmt.open)
    per_call_framing = not fmt.separator
    tags = [_call_tag(fmt, tool, max_whitespace, special_tokens, framed=per_call_framing and bool(fmt.open))
            for tool in chosen]

    if per_call_framing:
        # hermes: each call is a framed block; calls follow one another (a newline apart).
        if mode == "auto":
            if open_core in special_tokens:
                body: dict[str, Any] = {"type": "token_triggered_tags", "trigger_tokens": [open_core],
                                        "tags": tags, "stop_after_first": one}
            else:
                body = {"type": "triggered_tags", "triggers": [open_core or fmt.open], "tags": tags,
                        "stop_after_first": one}
        else:
            body = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                    "at_least_one": True, "stop_after_first": one}
        return {"type": "structural_tag", "format": body}

    # mistral, llama3: all calls inside one framing, separated.
    calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
             "at_least_one": True, "stop_after_first": one}
    if mode == "auto":
        if not fmt.open:
            # llama3 has no marker: each call's own beginning triggers it.
            body = {"type": "triggered_tags", "triggers": ['{"name": '], "tags": tags,
                    "stop_after_first": one}
            return {"type": "structural_tag", "format": body}
        inside = sequence_of([const_string(open_trail + fmt.list_open), calls])
        end = fmt.list_close + fmt.close
        if open_core in special_tokens:
            block = {"type": "tag", "begin": {"type": "token", "token": open_core}, "content": inside, "end": end}
            body = {"type": "token_triggered_tags", "trigger_tokens": [open_core], "tags": [block],
                    "stop_after_first": True}
        else:
            block = {"type": "tag", "begin": fmt.open, "content": inside, "end": end}
            body = {"type": "triggered_tags", "triggers": [fmt.open], "tags": [block], "stop_after_first": True}
        return {"type": "structural_tag", "format": body}
    body = sequence_of([*marker_parts(fmt.open, special_tokens), const_string(fmt.list_open), calls,
                      const_string(fmt.list_close), *marker_parts(fmt.close, special_tokens)])
    return {"type": "structural_tag", "format": body}


def _family_calls(fmt: ToolCallFormat, tools: list[FunctionTool], mode: str, one: bool,
                  special_tokens: Collection[str], max_whitespace: int | None) -> dict[str, Any]:
    """The calls of a format that is not JSON-framed, as a structural-tag format."""
    if fmt.family == "xml":
        return xml_calls_format(fmt, tools, mode, one=one, special_tokens=special_tokens,
                                max_whitespace=max_whitespace)
    if fmt.family == "pythonic":
        return pythonic_calls_format(tools, mode, one=one, max_whitespace=max_whitespace)
    if fmt.family == "harmony":
        return harmony_format(tools, mode, special_tokens=special_tokens, max_whitespace=max_whitespace)
    raise ValueError(f"tool-call format {fmt.name!r} has an unknown family {fmt.family!r}")




def tool_call_grammar(fmt: ToolCallFormat, tools: Any, tool_choice: Any = "auto", *,
                      parallel_tool_calls: bool = True, special_tokens: Collection[str] = (),
                      max_whitespace: int | None = DEFAULT_MAX_WHITESPACE) -> GrammarSpec | None:
    """A :class:`GrammarSpec` for a request's ``tools`` and ``tool_choice`` (raw request
    values, checked here), or ``None`` when no constraint applies (``"none"``)."""
    checked = normalize_tools(tools)
    tag = tool_call_structural_tag(fmt, checked, tool_choice, parallel_tool_calls=parallel_tool_calls,
                                   special_tokens=special_tokens, max_whitespace=max_whitespace)
    return None if tag is None else GrammarSpec.structural_tag(tag, field="tools")


# -- parsing generated text -------------------------------------------------------------




class _CallScanner:
    """Follows one call object (``{"name": ..., "<arguments key>": {...}}``) a character
    at a time: where it ends, its name, and the span of its arguments value."""

    def __init__(self, arguments_keys: Collection[str]) -> None:
        self.arguments_keys = arguments_keys
        self.text: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start = -1
        self.last_string: str | None = None
        self.key: str | None = None
        self.expect = "key"  # at depth 1: key, colon, value, comma
        self.value_start = -1
        self.name: str | None = None
        self.args_start = -1
        self.args_end = -1
        self.done = False

    def feed(self, char: str) -> None:
        position = len(self.text)
        self.text.append(char)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_closed(position)
            return
        if char == '"':
            self.in_string = True
            self.string_start = position
            if self.depth == 1 and self.expect == "value":
                self._value_begins(position)
            return
        if char in "{[":
            self.depth += 1
            if self.depth == 2 and self.expect == "value":
                self._value_begins(position)
            return
        if char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.expect == "in_value":
                self._value_ends(position + 1)
            elif self.depth == 0:
                if self.expect == "in_value":
                    self._value_ends(self._trimmed_end(position))
                self.done = True
            return
        if self.depth == 1:
            if char == ":" and self.expect == "colon":
                self.expect = "value"
            elif char == ",":
                if self.expect == "in_value":
                    self._value_ends(self._trimmed_end(position))
                self.expect = "key"
            elif not char.isspace() and self.expect == "value":
                self._value_begins(position)  # a number, true, false or null

    def _trimmed_end(self, position: int) -> int:
        while position > self.value_start and self.text[position - 1].isspace():
            position -= 1
        return position

    def _string_closed(self, position: int) -> None:
        raw = "".join(self.text[self.string_start:position + 1])
        if self.expect == "key":
            self.key = json.loads(raw)
            self.expect = "colon"
        elif self.expect == "in_value":
            self._value_ends(position + 1)

    def _value_begins(self, position: int) -> None:
        self.expect = "in_value"
        self.value_start = position
        if self.key in self.arguments_keys and self.args_start < 0:
            self.args_start = position

    def _value_ends(self, end: int) -> None:
        raw = "".join(self.text[self.value_start:end])
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        if self.key in self.arguments_keys and self.args_start == self.value_start:
            self.args_end = end
        self.expect = "comma"

    def arguments_so_far(self) -> str:
        if self.args_start < 0:
            return ""
        end = self.args_end if self.args_end >= 0 else len(self.text)
        return "".join(self.text[self.args_start:end])


class ToolCallParser:
    """Splits a model's output, fed as it streams, into content and tool calls in ``fmt``.

    ``feed(text)`` returns the events the new text completes: content to show, a call
    starting (once its name is known), pieces of its arguments JSON (for OpenAI
    ``delta.tool_calls[].function.arguments`` or Anthropic ``input_json_delta``), a call
    ending. Text that might be the start of a marker is held back until it is decided.
    ``finish()`` flushes at the end of the output; ``calls`` holds every call seen.
    """

    def __init__(self, fmt: ToolCallFormat, *, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._pending = ""
        self._state = "text"  # text, call, between
        self._scanner: _CallScanner | None = None
        self._current: ToolCall | None = None
        self._sent_arguments = 0
        self._arguments_keys = {fmt.arguments_key, "arguments", "parameters"}
        self._openers = self._text_openers()

    def _text_openers(self) -> tuple[str, ...]:
        if self.fmt.open:
            return (self.fmt.open.strip() or self.fmt.open,)
        return tuple(p + "{" for p in self.fmt.ignorable_prefixes) + ('{"name"',)

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending:
            before = (self._state, len(self._pending))
            if self._state == "text":
                self._scan_text(events)
            elif self._state == "call":
                self._scan_call(events)
            else:
                self._scan_between(events)
            if (self._state, len(self._pending)) == before:
                break  # waiting for more text to decide
        return events

    def finish(self) -> list[Event]:
        """Flush at the end of the output: held-back text is content; a call cut off
        (``max_tokens``) stays in ``calls`` with ``complete=False``."""
        events: list[Event] = []
        closers = [c for c in (self.fmt.list_close, self.fmt.close.strip()) if c]
        cut_closer = self._state == "between" and any(c.startswith(self._pending.strip()) for c in closers)
        if self._state == "call" and self._current is not None:
            self._emit_arguments(events)
        elif self._pending and self._state in ("text", "between") and not self._is_gap(self._pending) \
                and not cut_closer:  # the calls' closing marker, cut off by max_tokens
            events.append(ContentDelta(self._pending))
        self._pending = ""
        return events

    # text: content until an opener
    def _scan_text(self, events: list[Event]) -> None:
        pending = self._pending
        best = -1
        for opener in self._openers:
            found = pending.find(opener)
            if found >= 0 and (best < 0 or found < best):
                best = found
        if best >= 0:
            if best and not self._is_gap(pending[:best]):
                events.append(ContentDelta(pending[:best]))
            self._pending = pending[best:]
            self._enter_call_framing()
            return
        if self._is_gap(pending):
            return  # whitespace after a call: content only if text follows
        # Hold back a tail that could still grow into an opener.
        hold = 0
        for opener in self._openers:
            for size in range(min(len(opener) - 1, len(pending)), 0, -1):
                if opener.startswith(pending[-size:]):
                    hold = max(hold, size)
                    break
        if len(pending) > hold and not self._is_gap(pending[:len(pending) - hold]):
            events.append(ContentDelta(pending[:len(pending) - hold]))
            self._pending = pending[len(pending) - hold:]

    def _is_gap(self, text: str) -> bool:
        # The newline a model writes between or after its calls is layout, not content.
        return bool(self.calls) and not text.strip()

    def _enter_call_framing(self) -> None:
        pending = self._pending
        for prefix in (self.fmt.open, self.fmt.open.strip(), *self.fmt.ignorable_prefixes):
            if prefix and pending.startswith(prefix):
                pending = pending[len(prefix):]
                break
        self._pending = pending
        self._state = "between"

    # between: whitespace, list brackets and separators around call objects
    def _scan_between(self, events: list[Event]) -> None:
        original = self._pending
        pending = original.lstrip()
        fmt = self.fmt
        if not pending:
            return  # whitespace: wait to see what follows
        if pending[0] == "{":
            self._pending = pending
            self._start_call()
            return
        for token in (fmt.list_open, fmt.separator.strip()):
            if token and pending.startswith(token):
                self._pending = pending[len(token):]
                return
        closers = [c for c in (fmt.list_close, fmt.close.strip()) if c]
        for closer in closers:
            if pending.startswith(closer):
                self._pending = pending[len(closer):]
                self._state = "text"
                return
            if closer.startswith(pending):
                self._pending = pending
                return  # a closer still arriving
        # Anything else ends the calls: back to content, whitespace included.
        self._pending = original
        self._state = "text"

    def _start_call(self) -> None:
        self._scanner = _CallScanner(self._arguments_keys)
        self._current = ToolCall(index=len(self.calls), id=self.new_id())
        self._sent_arguments = 0
        self._announced = False
        self._state = "call"

    def _scan_call(self, events: list[Event]) -> None:
        scanner, call = self._scanner, self._current
        assert scanner is not None and call is not None
        consumed = 0
        for char in self._pending:
            scanner.feed(char)
            consumed += 1
            if scanner.done:
                break
        self._pending = self._pending[consumed:]
        if scanner.name is not None and not self._announced:
            call.name = scanner.name
            self.calls.append(call)
            self._announced = True
            events.append(ToolCallStart(call.index, call.id, call.name))
        if self._announced:
            self._emit_arguments(events)
        if scanner.done:
            if not self._announced:  # a JSON object without a name: it was content
                events.append(ContentDelta("".join(scanner.text)))
            else:
                call.arguments = scanner.arguments_so_far()
                call.complete = True
                events.append(ToolCallEnd(call.index, call))
            self._scanner = self._current = None
            self._state = "between"

    def _emit_arguments(self, events: list[Event]) -> None:
        scanner, call = self._scanner, self._current
        if scanner is None or call is None or not self._announced:
            return
        arguments = scanner.arguments_so_far()
        call.arguments = arguments
        if len(arguments) > self._sent_arguments:
            events.append(ToolCallArgumentsDelta(call.index, arguments[self._sent_arguments:]))
            self._sent_arguments = len(arguments)


def tool_call_parser(fmt: ToolCallFormat, tools: Sequence[FunctionTool] = ()) -> Any:
    """A streaming parser of ``fmt``'s calls (``feed``, ``finish``, ``calls``, as
    :class:`ToolCallParser`); XML and pythonic parsers read the functions' schemas to
    type the arguments. Harmony's is :class:`omlx_core.grammar.harmony.HarmonyParser`,
    which splits the reasoning too."""
    if fmt.family == "xml":
        return XmlToolCallParser(fmt, tools)
    if fmt.family == "pythonic":
        return PythonicToolCallParser(tools)
    if fmt.family == "harmony":
        return HarmonyParser(reasoning=False)
    return ToolCallParser(fmt)


def parse_tool_calls(fmt: ToolCallFormat, text: str, tools: Sequence[FunctionTool] = ()
                     ) -> tuple[str, list[ToolCall]]:
    """The content and the complete tool calls of a whole output (non-streaming)."""
    parser = tool_call_parser(fmt, tools)
    content = [e.text for e in [*parser.feed(text), *parser.finish()] if isinstance(e, ContentDelta)]
    return "".join(content), [call for call in parser.calls if call.complete]

