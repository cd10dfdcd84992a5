"""What a tool-call parser reports as generated text streams in: content, reasoning, and
each call's start, argument text and end, with the finished :class:`ToolCall`.

Every format's parser (JSON-framed, XML, pythonic, harmony) reports these same events,
so the HTTP layers stream them without knowing the format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ContentDelta",
    "Event",
    "ReasoningDelta",
    "ToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "new_call_id",
]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's thinking (harmony's analysis channel, a ``<think>`` block)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: "ToolCall"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str = ""
    #: the arguments as JSON text (OpenAI's ``function.arguments``)
    arguments: str = ""
    complete: bool = False

    def arguments_json(self) -> Any:
        """The arguments parsed (``{}`` for none)."""
        return json.loads(self.arguments) if self.arguments.strip() else {}


Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
