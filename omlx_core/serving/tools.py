"""Tool calls, API-neutral: what a request with tools sends to the engine, and how the
generated text is split back into content and calls.

The model's own chat template decides the tool-call format
(:func:`omlx_core.grammar.tool_call_formats.detect_tool_call_format`). A template that renders
tools itself (it mentions ``tools``) gets them and the conversation's tool calls and
results as structured messages; one that does not (the default model's ChatML) gets
them the way hermes-trained models read them: the functions in a system message, past
calls as ``<tool_call>`` text, results as ``<tool_response>`` text. Either way the
output is constrained by the grammar of the functions' parameter schemas, and
:meth:`PreparedTools.parser` parses it back as it streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from omlx_core.grammar.compiler import GrammarSpec
from omlx_core.grammar.function_tools import FunctionTool, normalize_tools, resolve_tool_choice
from omlx_core.grammar.tool_call_formats import HERMES, ToolCallFormat, detect_tool_call_format
from omlx_core.grammar.toolcalls import tool_call_grammar, tool_call_parser

#: how hermes-format models are told about their functions (Nous Research's prompt)
HERMES_TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>{tools}</tools>\nFor each function call return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


@dataclass
class ToolRequest:
    """What a request asks of tools: OpenAI-style ``tools`` (Anthropic's flat entries are
    accepted too), ``tool_choice`` and ``parallel_tool_calls``."""

    tools: list[dict[str, Any]]
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class PreparedTools:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    grammar: GrammarSpec | None
    fmt: ToolCallFormat
    #: the functions, checked, and what tool_choice makes of them
    functions: list[FunctionTool]
    mode: str

    def parser(self) -> Any:
        """A fresh streaming parser of the reply's calls."""
        return tool_call_parser(self.fmt, self.functions)


def prepare(request: ToolRequest, messages: Sequence[Mapping[str, Any]],
            chat_template: str | None, special_tokens: frozenset[str],
            fmt: ToolCallFormat | None = None) -> PreparedTools:
    """Messages, template arguments and grammar for a request with tools, in ``fmt``
    (default: the format ``chat_template`` shows); raises
    :class:`~omlx_core.grammar.GrammarError` naming a bad tool or tool_choice."""
    functions = normalize_tools(request.tools)
    mode, _ = resolve_tool_choice(functions, request.tool_choice)
    as_openai = [_openai_tool(f) for f in functions]
    if not (chat_template and "tools" in chat_template):
        fmt = HERMES
        messages = _as_hermes_text(messages, as_openai)
        template_kwargs: dict[str, Any] = {}
    else:
        fmt = fmt or detect_tool_call_format(chat_template)
        messages = [_structured(m) for m in messages]
        template_kwargs = {"tools": as_openai}
    grammar = tool_call_grammar(fmt, request.tools, request.tool_choice,
                                parallel_tool_calls=request.parallel_tool_calls,
                                special_tokens=special_tokens)
    return PreparedTools(list(messages), template_kwargs, grammar, fmt, functions, mode)


def _openai_tool(function: FunctionTool) -> dict[str, Any]:
    return {"type": "function", "function": {"name": function.name,
                                             "description": function.description,
                                             "parameters": function.parameters}}


def _arguments(value: Any) -> Any:
    """Arguments as templates expect them: a mapping (clients send OpenAI's JSON text)."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):  # not JSON, or nested past what Python parses
            return value
    return value


def _structured(message: Mapping[str, Any]) -> dict[str, Any]:
    result = dict(message)
    if result.get("tool_calls"):
        result["tool_calls"] = [{**call, "function": {
            **call["function"], "arguments": _arguments(call["function"].get("arguments"))}}
            for call in result["tool_calls"]]
    if result.get("content") is None:
        result["content"] = ""
    return result


def _as_hermes_text(messages: Sequence[Mapping[str, Any]],
                    tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as plain-text messages a template without tool support renders."""
    prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    out: list[dict[str, Any]] = []
    rest = list(messages)
    if rest and rest[0].get("role") == "system":
        prompt = f"{rest[0].get('content') or ''}\n\n{prompt}"
        rest = rest[1:]
    out.append({"role": "system", "content": prompt})
    for message in rest:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                             "arguments": _arguments(c["function"].get("arguments"))})
                + "\n</tool_call>" for c in message["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif role == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    return out

