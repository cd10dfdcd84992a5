"""Reasoning, below the HTTP layer: the format read from the chat template, the streaming
split of a reply into thinking, content and tool calls (however the text is chunked),
the thinking's token count, and the grammars that constrain the answer, not the
thinking, and close the thinking at its budget."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omlx_core.grammar.harmony import HarmonyParser
from omlx_core.grammar.tool_call_formats import HARMONY, HERMES
from omlx_core.grammar.tool_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from omlx_core.grammar.toolcalls import tool_call_parser
from omlx_core.serving.reasoning import (
    ReasoningRequest,
    ReplySplitter,
    ThinkTagSplitter,
    detect_reasoning_format,
    reasoning_tokens,
    thinking_mode,
)
from omlx_core.testing import CHAT_TEMPLATE
from omlx_core.testing.chat_formats import CHAT_FORMATS

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="xgrammar is not installed (./setup.sh installs it)")


@pytest.mark.parametrize("name, expected", [
    ("qwen3", "think_tags"), ("r1", "think_tags"), ("qwen3_coder", "think_tags"),
    ("glm45", "think_tags"), ("harmony", "harmony"), ("pythonic", "none")])
def test_the_reasoning_format_is_read_from_the_chat_template(name, expected):
    assert detect_reasoning_format(CHAT_FORMATS[name].chat_template) == expected


def test_a_template_without_thinking_reasons_not():
    assert detect_reasoning_format(CHAT_TEMPLATE) == "none"
    assert detect_reasoning_format(None) == "none"


@pytest.mark.parametrize("tail, mode", [
    ("<|im_start|>assistant\n<think>\n", "open"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "off"),
    ("<|assistant|>\n<think></think>", "off"),
    ("<|im_start|>assistant\n", "optional"),
])
def test_where_the_thinking_starts_is_read_from_the_end_of_the_prompt(tail, mode):
    assert thinking_mode(tail) == mode


def test_template_arguments_reach_only_templates_that_read_them():
    request = ReasoningRequest(effort="high", enabled=False)
    assert request.template_kwargs(CHAT_FORMATS["harmony"].chat_template) == {"reasoning_effort": "high"}
    assert request.template_kwargs(CHAT_FORMATS["qwen3"].chat_template) == {"enable_thinking": False}
    assert request.template_kwargs(CHAT_TEMPLATE) == {}


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def split_all(splitter: ReplySplitter, pieces: list[str]):
    total = None
    for piece in pieces:
        part = splitter.feed(piece)
        total = part if total is None else total + part
    end = splitter.finish()
    return end if total is None else total + end


THOUGHT = "<think>\nThe user wants the weather. </thing> is not a tag.\n</think>\n\nIt is sunny."


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
def test_think_tags_split_the_same_however_the_text_is_chunked(cuts):
    splitter = ReplySplitter(thinking=ThinkTagSplitter(inside=False))
    split = split_all(splitter, chunked(THOUGHT, cuts))
    assert split.reasoning == "The user wants the weather. </thing> is not a tag."
    assert split.content == "It is sunny."
    (start, end), = splitter.reasoning_spans()
    assert THOUGHT[start:end] == THOUGHT[:THOUGHT.index("</think>") + len("</think>")]


def test_a_prompt_that_opened_the_thinking_starts_the_reply_inside_it():
    splitter = ReplySplitter(thinking=ThinkTagSplitter(inside=True))
    split = split_all(splitter, ["still thinking", " about it"])
    assert (split.reasoning, split.content) == ("still thinking about it", "")
    assert splitter.reasoning_spans() == [(0, len("still thinking about it"))]


def test_think_tags_count_only_at_the_start_of_the_reply():
    splitter = ReplySplitter(thinking=ThinkTagSplitter(inside=False))
    split = split_all(splitter, ["Hello <think>not thinking</think>"])
    assert (split.reasoning, split.content) == ("", "Hello <think>not thinking</think>")
    assert splitter.reasoning_spans() == []


def test_tool_calls_after_the_thinking_are_calls_and_inside_it_are_thinking():
    text = ('<think>maybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call></think>\n\n'
            '<tool_call>\n{"name": "g", "arguments": {"a": 1}}\n</tool_call>')
    splitter = ReplySplitter(thinking=ThinkTagSplitter(inside=False), tools=tool_call_parser(HERMES))
    split = split_all(splitter, [text[i:i + 7] for i in range(0, len(text), 7)])
    assert split.reasoning.startswith("maybe <tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in splitter.calls] == [("g", {"a": 1})]
    assert split.content == ""


HARMONY_REPLY = ('<|channel|>analysis<|message|>Need weather; call the tool.<|end|>'
                 '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                 '<|message|>{"city": "Paris"}')


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 300), max_size=12))
def test_harmony_splits_analysis_and_a_call_however_the_text_is_chunked(cuts):
    parser = HarmonyParser()
    splitter = ReplySplitter(thinking=parser)
    split = split_all(splitter, chunked(HARMONY_REPLY, cuts))
    assert split.reasoning == "Need weather; call the tool."
    assert split.content == ""
    [call] = splitter.calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    starts = [e for e in split.tool_events if isinstance(e, ToolCallStart)]
    assert [e.name for e in starts] == ["get_weather"]
    assert "".join(e.text for e in split.tool_events if isinstance(e, ToolCallArgumentsDelta)) \
        == call.arguments
    (start, end), = splitter.reasoning_spans()
    assert HARMONY_REPLY[start:end].endswith("<|end|>") and start == 0


def test_harmony_final_channel_is_content_and_analysis_is_content_for_a_model_served_unthinking():
    reply = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    split = split_all(ReplySplitter(thinking=HarmonyParser()), [reply])
    assert (split.reasoning, split.content) == ("hmm", "Hi!")
    split = split_all(ReplySplitter(thinking=HarmonyParser(reasoning=False)), [reply])
    assert (split.reasoning, split.content) == ("", "hmmHi!")


def test_text_that_is_not_harmony_is_content():
    split = split_all(ReplySplitter(thinking=HarmonyParser()), ["plain words, no channels " * 30])
    assert split.content == "plain words, no channels " * 30 and split.reasoning == ""


def test_a_harmony_call_cut_off_by_max_tokens_is_not_a_call():
    parser = tool_call_parser(HARMONY)
    events = parser.feed('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ') \
        + parser.finish()
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert [c.complete for c in parser.calls] == [False]


def test_reasoning_tokens_are_the_tokens_whose_text_starts_in_the_thinking():
    # Tokens start at these offsets of "<think>ab</think>cd": "<think>", "a", "b", "</think>", "c", "d".
    starts = [0, 7, 8, 9, 17, 18]
    assert reasoning_tokens(starts, [(0, 17)]) == 4
    assert reasoning_tokens(starts, []) == 0
    assert reasoning_tokens(starts, [(0, 7), (8, 9)]) == 2


def test_every_event_kind_reaches_its_field():
    splitter = ReplySplitter(thinking=HarmonyParser())
    split = split_all(splitter, [HARMONY_REPLY])
    kinds = {type(e) for e in split.tool_events}
    assert kinds == {ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd}
    assert not any(isinstance(e, (ContentDelta, ReasoningDelta)) for e in split.tool_events)


# -- grammars ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def r1_tokenizer(tiny_model_path, tmp_path_factory):
    from mlx_lm import load

    from omlx_core.testing.chat_formats import cached_format_model

    return load(str(cached_format_model("r1", cache_dir=tmp_path_factory.mktemp("formats"))))


@needs_xgrammar
@pytest.mark.parametrize("mode", ["open", "optional"])
def test_a_thinking_budget_lets_only_the_closing_tag_through_once_spent(r1_tokenizer, mode):
    import numpy as np

    from omlx_core.grammar import GrammarCompilerCache, GrammarConstraint
    from omlx_core.grammar.reasoning import Marker, ThinkTags, with_thinking
    from omlx_core.testing.chat_formats import FORMAT_VOCAB_SIZE, marker_id

    _, tokenizer = r1_tokenizer
    think = ThinkTags(Marker("<think>", marker_id("<think>")), Marker("</think>", marker_id("</think>")),
                      mode, budget=6)
    constraint = GrammarConstraint(GrammarCompilerCache(tokenizer, vocab_size=FORMAT_VOCAB_SIZE)
                                   .compile(with_thinking(None, think)))
    words = tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)

    def allowed() -> list[int]:  # what an engine's mask lets through next
        mask = constraint.fill_bitmask()
        return list(range(FORMAT_VOCAB_SIZE)) if mask is None else \
            np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()

    if mode == "optional":
        assert marker_id("<think>") in allowed() and constraint.accept(marker_id("<think>"))
    spent = 0
    for token in words:
        if token not in allowed():
            break
        assert constraint.accept(token)
        spent += 1
    assert spent == 6 - (2 if mode == "optional" else 1)
    assert allowed() == [marker_id("</think>")]
    assert constraint.accept(marker_id("</think>"))
    assert words[0] in allowed()  # the answer is free


@needs_xgrammar
def test_without_a_budget_or_a_constraint_a_thinking_reply_needs_no_grammar():
    from omlx_core.grammar import GrammarSpec
    from omlx_core.grammar.reasoning import Marker, ThinkTags, with_thinking

    think = ThinkTags(Marker("<think>", 512), Marker("</think>", 513), "open")
    assert with_thinking(None, think) is None
    schema = GrammarSpec.json_schema({"type": "object"})
    assert with_thinking(schema, ThinkTags(Marker("<think>"), Marker("</think>"), "off")) is schema
    composed = with_thinking(schema, think)
    assert composed.kind == "structural_tag" and composed.field == schema.field


def test_the_config_choices_are_the_formats_that_exist():
    from omlx_core.config.schema import MODEL_SETTINGS
    from omlx_core.grammar.tool_call_formats import FORMATS
    from omlx_core.serving.reasoning import REASONING_FORMATS

    settings = {s.key: s for s in MODEL_SETTINGS}
    assert set(settings["tool_call_format"].choices) == {"auto", *FORMATS}
    assert set(settings["reasoning_format"].choices) == {"auto", *REASONING_FORMATS}
