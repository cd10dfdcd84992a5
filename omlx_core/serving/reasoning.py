"""Reasoning, API-neutral: which way a model thinks, what a request asks of its thinking,
and how the output processor splits a reply into thinking, content and tool calls.

A model thinks in one of two ways, read from its chat template like its tool-call
format (and overridable per model, ``reasoning_format``):

- ``think_tags``: ``<think>…</think>`` before the answer (Qwen3, DeepSeek-R1 distills,
  GLM-4.5); the chat template may open the block in the prompt;
- ``harmony``: gpt-oss's channels, ``analysis`` the thinking, ``final`` the answer
  (:mod:`omlx_core.grammar.harmony`);
- ``none``: the reply is content (and tool calls).

Engines keep speaking tokens: :class:`ReplySplitter` reads the text the output
processor releases, and the tokens of the thinking are counted from where each
token's text starts (``reasoning_tokens``). Parsing changes which field text goes in,
never which tokens are generated; only a thinking budget (``budget_tokens``) or a
constraint on the answer puts a grammar on the request (:func:`reply_grammar`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from omlx_core.grammar.compiler import DEFAULT_MAX_WHITESPACE, GrammarSpec
from omlx_core.grammar.tool_call_formats import ToolCallFormat, tool_call_format_named
from omlx_core.grammar.tool_events import ContentDelta, Event, ReasoningDelta, ToolCall
from omlx_core.serving.tools import PreparedTools

__all__ = ["EFFORTS", "REASONING_FORMATS", "ReasoningRequest", "ReplySplitter", "Split",
           "ThinkTagSplitter", "detect_reasoning_format", "plan_reply", "reasoning_tokens",
           "reply_formats", "reply_grammar"]

REASONING_FORMATS = ("think_tags", "harmony", "none")
#: the reasoning efforts a request may ask for (``reasoning_effort``, ``reasoning.effort``)
EFFORTS = ("low", "medium", "high")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SPACE = " \t\n\r"


def reply_formats(model_entry: Any, chat_template: str | None) -> tuple[str, ToolCallFormat | None]:
    """How a model thinks and writes tool calls: its ``[models.<id>]`` ``reasoning_format``
    and ``tool_call_format`` when set, else read from its chat template (``None``: the
    tools' own detection)."""
    reasoning = model_entry.get("reasoning_format") if model_entry is not None else None
    tools = model_entry.get("tool_call_format") if model_entry is not None else None
    if reasoning in (None, "", "auto"):
        reasoning = detect_reasoning_format(chat_template)
    return reasoning, (tool_call_format_named(tools) if tools not in (None, "", "auto") else None)


def detect_reasoning_format(chat_template: str | None) -> str:
    """How the model ``chat_template`` teaches thinks: ``harmony`` (its channels),
    ``think_tags`` (it renders ``<think>``) or ``none``."""
    if not chat_template:
        return "none"
    if "<|channel|>" in chat_template:
        return "harmony"
    if THINK_OPEN in chat_template or THINK_CLOSE in chat_template:
        return "think_tags"
    return "none"


@dataclass(frozen=True)
class ReasoningRequest:
    """What a request asks of the model's thinking; a model that does not reason ignores
    all of it."""

    #: ``low``, ``medium`` or ``high``: passed to chat templates that read ``reasoning_effort``
    effort: str | None = None
    #: ``False``: asks templates that read ``enable_thinking`` to turn thinking off;
    #: ``None``: the model's default
    enabled: bool | None = None
    #: the most tokens the thinking may take before the model must close it and answer
    budget_tokens: int | None = None
    #: the request field the budget came from, for error messages
    budget_param: str = "thinking.budget_tokens"

    def template_kwargs(self, chat_template: str | None) -> dict[str, Any]:
        """The chat-template arguments this request sets, for templates that read them."""
        kwargs: dict[str, Any] = {}
        template = chat_template or ""
        if self.effort is not None and "reasoning_effort" in template:
            kwargs["reasoning_effort"] = self.effort
        if self.enabled is not None and "enable_thinking" in template:
            kwargs["enable_thinking"] = self.enabled
        return kwargs


def thinking_mode(prompt_tail: str) -> str:
    """Where a ``<think>`` model's output starts, from the end of its prompt: ``open``
    (the template opened the block), ``off`` (it closed it: thinking disabled) or
    ``optional`` (the model decides)."""
    tail = prompt_tail.rstrip(_SPACE)
    if tail.endswith(THINK_OPEN):
        return "open"
    if tail.endswith(THINK_CLOSE):
        return "off"
    return "optional"


@dataclass
class Split:
    """What a piece of output adds to each field of the reply."""

    reasoning: str = ""
    content: str = ""
    tool_events: tuple[Event, ...] = ()

    def __add__(self, other: "Split") -> "Split":
        return Split(self.reasoning + other.reasoning, self.content + other.content,
                     self.tool_events + other.tool_events)


class ThinkTagSplitter:
    """Splits text fed as it streams at ``<think>`` and ``</think>``.

    ``inside``: the prompt opened the block, so the output starts in it; otherwise a
    block counts only at the very start of the output (after whitespace). The tags and
    the whitespace just inside them, and after the closing tag, are layout: they reach
    neither field. ``spans`` holds the character ranges of the thinking, tags included.
    """

    def __init__(self, *, inside: bool) -> None:
        self.spans: list[tuple[int, int]] = []
        self._state = "thinking" if inside else "start"
        self._span_start = 0
        self._offset = 0  # characters fed before _pending
        self._pending = ""
        self._trim = True  # drop the whitespace that opens the current field

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending:
            before = (self._state, len(self._pending))
            if self._state == "start":
                self._scan_start()
            elif self._state == "thinking":
                self._scan_thinking(events)
            else:
                self._emit_content(self._pending, events)
                self._take(len(self._pending))
            if (self._state, len(self._pending)) == before:
                break
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._state == "thinking":
            self._emit_reasoning(self._pending.rstrip(_SPACE), events)
            self._take(len(self._pending))
            self.spans.append((self._span_start, self._offset))
            self._state = "content"
        elif self._pending:
            self._state, self._trim = "content", False
            self._emit_content(self._pending, events)
            self._take(len(self._pending))
        return events

    def open_span(self) -> tuple[int, int] | None:
        """The thinking still going on, as a span up to what was fed."""
        if self._state == "thinking":
            return (self._span_start, self._offset + len(self._pending))
        return None

    def _take(self, count: int) -> None:
        self._offset += count
        self._pending = self._pending[count:]

    def _scan_start(self) -> None:
        stripped = self._pending.lstrip(_SPACE)
        if stripped.startswith(THINK_OPEN):
            self._span_start = self._offset + len(self._pending) - len(stripped)
            self._take(len(self._pending) - len(stripped) + len(THINK_OPEN))
            self._state, self._trim = "thinking", True
        elif not stripped or THINK_OPEN.startswith(stripped):
            return  # still deciding
        else:
            self._state, self._trim = "content", False

    def _scan_thinking(self, events: list[Event]) -> None:
        pending = self._pending
        found = pending.find(THINK_CLOSE)
        if found >= 0:
            self._emit_reasoning(pending[:found].rstrip(_SPACE), events)
            self._take(found + len(THINK_CLOSE))
            self.spans.append((self._span_start, self._offset))
            self._state, self._trim = "content", True
            return
        hold = next((size for size in range(min(len(THINK_CLOSE) - 1, len(pending)), 0, -1)
                     if THINK_CLOSE.startswith(pending[-size:])), 0)
        body = pending[:len(pending) - hold]
        ready = body.rstrip(_SPACE)  # whitespace before </think> is layout
        self._emit_reasoning(ready, events)
        self._take(len(ready))

    def _emit_reasoning(self, text: str, events: list[Event]) -> None:
        if self._trim:
            text = text.lstrip(_SPACE)
        if text:
            self._trim = False
            events.append(ReasoningDelta(text))

    def _emit_content(self, text: str, events: list[Event]) -> None:
        if self._trim:
            text = text.lstrip(_SPACE)
        if text:
            self._trim = False
            events.append(ContentDelta(text))


class ReplySplitter:
    """One request's reply, fed the text the output processor releases: its thinking
    (``thinking``: a :class:`ThinkTagSplitter` or a
    :class:`~omlx_core.grammar.harmony.HarmonyParser`), its content and its tool calls
    (``tools``: a streaming parser of the model's tool-call format; harmony's parser
    finds the calls itself)."""

    def __init__(self, *, thinking: Any = None, tools: Any = None) -> None:
        self.thinking = thinking
        self.tools = tools

    def feed(self, text: str) -> Split:
        if self.thinking is None:
            return self._after_thinking([ContentDelta(text)] if text else [], final=False)
        return self._after_thinking(self.thinking.feed(text), final=False)

    def finish(self) -> Split:
        events = self.thinking.finish() if self.thinking is not None else []
        return self._after_thinking(events, final=True)

    def _after_thinking(self, events: list[Event], *, final: bool) -> Split:
        reasoning, content, tool_events = [], [], []
        for event in events:
            if isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ContentDelta) and self.tools is not None:
                tool_events += self.tools.feed(event.text)
            elif isinstance(event, ContentDelta):
                content.append(event.text)
            else:
                tool_events.append(event)
        if final and self.tools is not None:
            tool_events += self.tools.finish()
        content += [e.text for e in tool_events if isinstance(e, ContentDelta)]
        return Split("".join(reasoning), "".join(content),
                     tuple(e for e in tool_events if not isinstance(e, ContentDelta)))

    @property
    def calls(self) -> list[ToolCall]:
        """The complete tool calls seen so far."""
        parser = self.tools if self.tools is not None else self.thinking
        return [call for call in getattr(parser, "calls", ()) if call.complete]

    def reasoning_spans(self) -> list[tuple[int, int]]:
        """The character ranges of the text fed that were thinking."""
        if self.thinking is None:
            return []
        ongoing = self.thinking.open_span()
        return list(self.thinking.spans) + ([ongoing] if ongoing is not None else [])


def reasoning_tokens(token_starts: Sequence[int], spans: Sequence[tuple[int, int]]) -> int:
    """How many tokens start inside ``spans`` (sorted character ranges of the text)."""
    count = 0
    for start, end in spans:
        count += bisect.bisect_left(token_starts, end) - bisect.bisect_left(token_starts, start)
    return count


def marker_of(text: str, tokenize: Callable[[str], Sequence[int]]) -> Any:
    """``text`` as a :class:`~omlx_core.grammar.reasoning.Marker` of the model's vocabulary."""
    from omlx_core.grammar.reasoning import Marker

    ids = list(tokenize(text))
    return Marker(text, ids[0] if len(ids) == 1 else None, max(1, len(ids)))


def reply_grammar(*, reasoning_format: str, mode: str, request: ReasoningRequest | None,
                  answer: GrammarSpec | None, tools: Any, tool_format: ToolCallFormat | None,
                  tokenize: Callable[[str], Sequence[int]],
                  special_tokens: Collection[str]) -> GrammarSpec | None:
    """The grammar a reply needs: the answer constrained (``answer``: a response format
    or the tools' grammar) after free thinking, the thinking capped at the request's
    budget. ``tools``: ``(functions, tool_choice mode)`` for a harmony reply, whose calls
    are messages of its own. ``None`` when nothing is constrained."""
    budget = request.budget_tokens if request is not None else None
    if reasoning_format == "think_tags":
        from omlx_core.grammar.reasoning import ThinkTags, with_thinking

        thinking = ThinkTags(marker_of(THINK_OPEN, tokenize), marker_of(THINK_CLOSE, tokenize),
                             mode, budget)  # type: ignore[arg-type]
        return with_thinking(answer, thinking)
    if reasoning_format == "harmony" and (budget is not None or answer is not None or tools):
        from omlx_core.grammar.harmony import ANALYSIS_HEADER, harmony_format
        from omlx_core.grammar.reasoning import answer_format

        functions, tool_mode = tools or ([], "none")
        if tool_format is not None and tool_format.family != "harmony" and functions:
            return answer  # a mismatched override: the tools' own grammar, unthinking
        analysis = None if budget is None else budget - len(tokenize(ANALYSIS_HEADER)) - 1
        tag = {"type": "structural_tag", "format": harmony_format(
            functions, tool_mode, special_tokens=special_tokens, analysis_tokens=analysis,
            max_whitespace=DEFAULT_MAX_WHITESPACE,
            answer=answer_format(answer) if answer is not None and not functions else None)}
        return GrammarSpec.structural_tag(tag, field=answer.field if answer is not None else "tools")
    return answer


def plan_reply(engine: Any, prompt_tokens: Sequence[int], *, reasoning_format: str,
               request: ReasoningRequest | None, tools: PreparedTools | None,
               answer: GrammarSpec | None) -> tuple[ReplySplitter | None, GrammarSpec | None]:
    """How a chat reply is split into thinking, content and calls (``None``: not at
    all), and the grammar it is generated under: ``answer`` (a response format or the
    tools' grammar) after the thinking, the thinking capped at the request's budget.
    Raises :class:`~omlx_core.grammar.GrammarError` for a grammar that cannot be built."""
    tool_parser = tools.parser() if tools is not None else None
    thinking: Any = None
    mode = "off"
    if reasoning_format == "harmony" or (tools is not None and tools.fmt.family == "harmony"):
        from omlx_core.grammar.harmony import HarmonyParser

        thinking = HarmonyParser(reasoning=reasoning_format == "harmony")
        if tools is not None and tools.fmt.family == "harmony":
            tool_parser = None  # harmony's calls are messages: its parser reads them
    elif reasoning_format == "think_tags":
        mode = thinking_mode(prompt_tail(engine, prompt_tokens))
        thinking = ThinkTagSplitter(inside=mode == "open")
    grammar = answer
    if reasoning_format != "none":
        grammar = reply_grammar(
            reasoning_format=reasoning_format, mode=mode, request=request, answer=answer,
            tools=(tools.functions, tools.mode) if tools is not None and tools.mode != "none" else None,
            tool_format=tools.fmt if tools is not None else None,
            tokenize=engine.tokenize, special_tokens=engine.special_tokens())
    if thinking is None and tool_parser is None:
        return None, grammar
    return ReplySplitter(thinking=thinking, tools=tool_parser), grammar


def prompt_tail(engine: Any, prompt_tokens: Sequence[int], count: int = 16) -> str:
    """The text of the prompt's last ``count`` tokens (where the chat template leaves the
    model: inside a thinking block, after one, or at a fresh turn)."""
    detokenizer = engine.detokenizer()
    for token in prompt_tokens[-count:]:
        detokenizer.add_token(int(token))
    detokenizer.finalize()
    return detokenizer.last_segment
