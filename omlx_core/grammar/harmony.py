"""OpenAI's harmony format (gpt-oss): the reply is a series of messages on channels.

After the prompt's ``<|start|>assistant`` the model writes a header and a body::

    <|channel|>analysis<|message|>…thinking…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>…the answer…<|return|>

``analysis`` is the model's reasoning, ``final`` the answer, a ``commentary`` message
addressed ``to=functions.NAME`` a tool call whose body is its JSON arguments (a header
may also put the recipient before the channel). ``<|call|>`` and ``<|return|>`` end the
turn (they are the model's stop tokens), so a turn holds one call at most.

:func:`harmony_format` is the grammar (an optional analysis message with an optional
token budget, then the answer or a call constrained by the function's schema);
:class:`HarmonyParser` splits the streamed text into reasoning, content and calls.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Collection, Sequence

from omlx_core.grammar.function_tools import FunctionTool
from omlx_core.grammar.structural_tags import arguments_format, const_string, sequence_of
from omlx_core.grammar.tool_events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)

__all__ = ["ANALYSIS_HEADER", "HarmonyParser", "harmony_format"]

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
#: what opens a reasoning message (its tokens count against a thinking budget)
ANALYSIS_HEADER = f"{CHANNEL}analysis{MESSAGE}"


def _marker(text: str, special_tokens: Collection[str]) -> dict[str, Any]:
    return {"type": "token", "token": text} if text in special_tokens else const_string(text)


def harmony_format(tools: Sequence[FunctionTool], mode: str, *, special_tokens: Collection[str] = (),
                   max_whitespace: int | None = None, analysis_tokens: int | None = None,
                   answer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The structural-tag format of a harmony reply: an optional analysis message (its
    body at most ``analysis_tokens`` tokens), then a final message whose body is
    ``answer`` (free text when ``None``) or, by ``mode`` (``"none"``, ``"auto"``,
    ``"required"``, ``"forced"``), one call to one of ``tools``."""

    def marker(text: str) -> dict[str, Any]:
        return _marker(text, special_tokens)

    # The markers read as their text to xgrammar: free text must not spell them out.
    text: dict[str, Any] = {"type": "any_text", "excludes": list(_MARKERS)}
    thinking = dict(text)
    if analysis_tokens is not None:
        thinking["max_tokens"] = max(0, analysis_tokens)
    analysis = sequence_of([marker(CHANNEL), const_string("analysis"), marker(MESSAGE), thinking,
                            marker(END), marker(START), const_string("assistant")])
    final = sequence_of([marker(CHANNEL), const_string("final"), marker(MESSAGE),
                         answer or text])
    calls = [sequence_of([marker(CHANNEL), const_string(f"commentary to=functions.{tool.name} "),
                          marker(CONSTRAIN), const_string("json"), marker(MESSAGE),
                          arguments_format(tool, max_whitespace)]) for tool in tools]
    replies = ([final] if mode in ("none", "auto") else []) + (calls if mode != "none" else [])
    reply = replies[0] if len(replies) == 1 else {"type": "or", "elements": replies}
    return sequence_of([{"type": "optional", "content": analysis}, reply])


# -- reading the reply ---------------------------------------------------------------------


_ENDS = (END, CALL, RETURN, START)
_MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
#: a header longer than this without ``<|message|>`` is not one: the text is content
_MAX_HEADER = 512


class HarmonyParser:
    """Splits a harmony reply, fed as it streams, into reasoning (``analysis``), content
    (``final``, and ``commentary`` not addressed to a function) and tool calls.

    With ``reasoning=False`` the analysis channel is content too (a model served as not
    reasoning). ``spans`` holds the character ranges of the fed text that were
    reasoning messages, header and end marker included, for counting their tokens. The
    parser interface of :class:`~omlx_core.grammar.toolcalls.ToolCallParser`.
    """

    def __init__(self, *, reasoning: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        self.reasoning = reasoning
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self.spans: list[tuple[int, int]] = []
        self._pending = ""
        self._offset = 0  # characters fed before _pending
        self._state = "header"  # header, body, or raw (not harmony after all: all content)
        self._header_start = 0
        self._kind = ""  # the body's: reasoning, content, call
        self._call: ToolCall | None = None

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending:
            before = (self._state, len(self._pending))
            if self._state == "header":
                self._scan_header(events)
            elif self._state == "body":
                self._scan_body(events)
            else:
                self._emit("content", self._pending, events)
                self._take(len(self._pending))
            if (self._state, len(self._pending)) == before:
                break
        return events

    def finish(self) -> list[Event]:
        """Flush at the end of the output: the stop token that ended it (``<|return|>``,
        ``<|call|>``) never reaches the text, so the last message ends here."""
        events: list[Event] = []
        if self._state == "body":
            self._emit(self._kind, self._pending, events)
            self._take(len(self._pending))
            self._end_message(events)
        elif self._pending.strip() and self._pending.strip() not in (START, f"{START}assistant"):
            events.append(ContentDelta(self._pending))
            self._take(len(self._pending))
        self._pending = ""
        return events

    def _take(self, count: int) -> None:
        self._offset += count
        self._pending = self._pending[count:]

    def _scan_header(self, events: list[Event]) -> None:
        found = self._pending.find(MESSAGE)
        if found < 0:
            if len(self._pending) > _MAX_HEADER or any(end in self._pending for end in (END, CALL, RETURN)):
                self._state = "raw"
            return
        header = self._pending[:found]
        self._take(found + len(MESSAGE))
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else ""
        if recipient and recipient.group(1).startswith("functions."):
            self._kind = "call"
            self._call = ToolCall(index=len(self.calls), id=self.new_id(),
                                  name=recipient.group(1)[len("functions."):])
            self.calls.append(self._call)
            events.append(ToolCallStart(self._call.index, self._call.id, self._call.name))
        elif name == "analysis" and self.reasoning:
            self._kind = "reasoning"
        else:
            self._kind = "content"
        self._state = "body"

    def _scan_body(self, events: list[Event]) -> None:
        pending = self._pending
        ends = [(i, end) for end in _ENDS if (i := pending.find(end)) >= 0]
        if ends:
            at, end = min(ends)
            self._emit(self._kind, pending[:at], events)
            # <|start|> without <|end|> first: the message ended all the same.
            self._take(at + (0 if end == START else len(end)))
            self._end_message(events)
            return
        hold = _partial_marker(pending)
        self._emit(self._kind, pending[:len(pending) - hold], events)
        self._take(len(pending) - hold)

    def _emit(self, kind: str, text: str, events: list[Event]) -> None:
        if not text:
            return
        if kind == "reasoning":
            events.append(ReasoningDelta(text))
        elif kind == "call" and self._call is not None:
            self._call.arguments += text
            events.append(ToolCallArgumentsDelta(self._call.index, text))
        else:
            events.append(ContentDelta(text))

    def _end_message(self, events: list[Event]) -> None:
        if self._kind == "reasoning":
            self.spans.append((self._header_start, self._offset))
        elif self._kind == "call" and self._call is not None:
            try:
                json.loads(self._call.arguments)
            except ValueError:
                pass  # cut off (max_tokens) or broken: stays incomplete
            else:
                self._call.complete = True
                events.append(ToolCallEnd(self._call.index, self._call))
            self._call = None
        self._state, self._kind, self._header_start = "header", "", self._offset

    def open_span(self) -> tuple[int, int] | None:
        """The reasoning message still being written, as a span up to what was fed."""
        if self._state == "body" and self._kind == "reasoning":
            return (self._header_start, self._offset + len(self._pending))
        return None


def _partial_marker(text: str) -> int:
    """How many characters at the end of ``text`` could begin a marker."""
    start = text.rfind("<", max(0, len(text) - max(map(len, _MARKERS))))
    if start < 0:
        return 0
    tail = text[start:]
    return len(tail) if any(marker.startswith(tail) for marker in _MARKERS) else 0
