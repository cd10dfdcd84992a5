"""The tool-call formats models are trained on, and which one a chat template teaches.

Each :class:`ToolCallFormat` says how one family of models writes its calls; the
JSON-framed ones are constrained and parsed in :mod:`omlx_core.grammar.toolcalls`, the
others in their own modules (``xml_toolcalls``, ``pythonic_toolcalls``, ``harmony``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "FORMATS",
    "GLM45",
    "HARMONY",
    "HERMES",
    "LLAMA3",
    "MISTRAL",
    "PYTHONIC",
    "QWEN3_CODER",
    "ToolCallFormat",
    "detect_tool_call_format",
    "tool_call_format_named",
]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of models writes a tool call."""

    name: str
    #: text (or special token) that opens the calls; "" when a call opens with its JSON
    open: str
    #: text (or special token) that closes the calls; "" when the JSON's end closes it
    close: str
    #: the key holding the arguments object in the call JSON
    arguments_key: str
    #: between two calls inside one open/close pair ("" when each call has its own pair)
    separator: str = ""
    #: opens a list of calls inside open/close (mistral's JSON array)
    list_open: str = ""
    list_close: str = ""
    #: text a model may put before the calls that is not content
    ignorable_prefixes: tuple[str, ...] = ()
    #: how a call is written: ``json`` (the fields above describe it), ``xml``,
    #: ``pythonic`` or ``harmony`` (their own modules describe them)
    family: str = "json"
    #: whether one turn may hold several calls
    parallel: bool = True


HERMES = ToolCallFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", arguments_key="arguments")
LLAMA3 = ToolCallFormat("llama3", open="", close="", arguments_key="parameters", separator="; ",
                        ignorable_prefixes=("<|python_tag|>",))
MISTRAL = ToolCallFormat("mistral", open="[TOOL_CALLS]", close="", arguments_key="arguments",
                         separator=", ", list_open="[", list_close="]")
QWEN3_CODER = ToolCallFormat("qwen3_coder", open="<tool_call>", close="</tool_call>", arguments_key="",
                             separator="\n", family="xml")
GLM45 = ToolCallFormat("glm45", open="<tool_call>", close="</tool_call>", arguments_key="",
                       separator="\n", family="xml")
PYTHONIC = ToolCallFormat("pythonic", open="[", close="]", arguments_key="", separator=", ",
                          family="pythonic")
# A harmony call ends the model's turn (<|call|> is a stop token): one call per turn.
HARMONY = ToolCallFormat("harmony", open="<|channel|>", close="<|call|>", arguments_key="",
                         family="harmony", parallel=False)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    HERMES, LLAMA3, MISTRAL, QWEN3_CODER, GLM45, PYTHONIC, HARMONY)}

# Template fragments that identify a format, checked in order: Mistral's marker is
# unambiguous; harmony addresses calls to=functions.NAME; Qwen3-Coder's <function=...>
# and GLM's <arg_key> sit inside <tool_call>, so they come before hermes; pythonic
# templates show the call list (func_name1(params_name1=...)); Llama 3.1+ templates
# render tool calls as {"name": ..., "parameters": ...} and mention <|python_tag|> or
# the ipython role.
_TEMPLATE_SIGNS: tuple[tuple[ToolCallFormat, re.Pattern[str]], ...] = (
    (MISTRAL, re.compile(r"\[TOOL_CALLS\]")),
    (HARMONY, re.compile(r"to=functions\.|<\|channel\|>")),
    (QWEN3_CODER, re.compile(r"<function=|<parameter=")),
    (GLM45, re.compile(r"<arg_key>")),
    (HERMES, re.compile(r"<tool_call>")),
    (PYTHONIC, re.compile(r"func_name\d*\(|\[func_name")),
    (LLAMA3, re.compile(r"<\|python_tag\|>|ipython|\"parameters\"\s*:|'parameters'\s*:|\.parameters\b")),
)


def detect_tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The tool-call format ``chat_template`` teaches its model; hermes when it shows none
    (the most widely trained format, and what templates without tool support get)."""
    for fmt, sign in _TEMPLATE_SIGNS:
        if chat_template and sign.search(chat_template):
            return fmt
    return HERMES


def tool_call_format_named(name: str) -> ToolCallFormat:
    """The format called ``name`` (a model's ``tool_call_format`` setting); ``ValueError``
    naming the known ones otherwise."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; use one of {', '.join(FORMATS)}")
    return FORMATS[name]
