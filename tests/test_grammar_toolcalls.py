"""Tool calls: the format read from the chat template, grammars that make every call
valid for its function, and the streaming parser that turns output back into calls."""

from __future__ import annotations

import importlib.util
import json

import pytest

from omlx_core.grammar import GrammarError
from omlx_core.grammar.function_tools import normalize_tools
from omlx_core.grammar.tool_call_formats import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolCallFormat,
    detect_tool_call_format,
)
from omlx_core.grammar.tool_events import ContentDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from omlx_core.grammar.toolcalls import (
    ToolCallParser,
    parse_tool_calls,
    tool_call_grammar,
    tool_call_structural_tag,
)
from omlx_core.testing import CHAT_TEMPLATE, special_token_id
from omlx_core.testing.tokenizer import ENDOFTEXT, IM_END, IM_START

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="xgrammar is not installed (./setup.sh installs it)")

EOS = special_token_id(IM_END)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

# Fragments of real templates, in the syntax each family's template uses.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n\\nYou may call one or more functions."
    "<tools>{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}</tools>\\n\\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
    "<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>"
    "{%- endif %}"
)
LLAMA31_TEMPLATE = (
    "{%- if tools_in_user_message and not tools is none %}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.' }}{%- endif %}"
    "{%- if message.role == \"assistant\" and message.tool_calls %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{%- elif message.role == \"tool\" or message.role == \"ipython\" %}{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}"
    "{%- endif %}{%- if builtin_tools is defined %}{{- \"<|python_tag|>\" }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- if message['role'] == 'user' %}{%- if tools is not none and (message == user_messages[-1]) %}"
    "{{- '[AVAILABLE_TOOLS] [' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{{- tool_call.function | tojson }}{%- endfor %}{{- ']' + eos_token }}"
)


@pytest.mark.parametrize("template, expected", [
    (QWEN25_TEMPLATE, HERMES),
    (LLAMA31_TEMPLATE, LLAMA3),
    (MISTRAL_TEMPLATE, MISTRAL),
    (CHAT_TEMPLATE, HERMES),  # ChatML without tools: the widely trained default
    (None, HERMES),
])
def test_format_is_read_from_the_chat_template(template, expected):
    assert detect_tool_call_format(template) is expected


def test_default_model_template_falls_back_to_hermes():
    from omlx_core.models.default import DefaultModelUnavailable, default_gguf_path
    from omlx_core.models.gguf import read_gguf

    try:
        path = default_gguf_path()
    except DefaultModelUnavailable as exc:
        pytest.skip(str(exc))
    _, metadata = read_gguf(path)
    template = metadata["tokenizer.chat_template"]
    assert "<|im_start|>" in template  # SmolLM2's ChatML, which shows no tool format
    assert detect_tool_call_format(template) is HERMES


@pytest.mark.parametrize("tools, field, words", [
    ([], "tools", "non-empty array"),
    ([{"type": "function", "function": {"parameters": ADD}}], "tools[0].function.name", "1-64 letters"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name", "1-64 letters"),
    ([TOOLS[1], TOOLS[1]], "tools[1].function.name", "defined twice"),
    ([TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[1].function.parameters", 'type "object"'),
    ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tools[0].function.parameters", "object"),
    ([{"type": "retrieval"}], "tools[0].type", "unsupported tool type"),
    ([{"name": "f", "input_schema": {"type": "string"}}], "tools[0].input_schema", 'type "object"'),
])
def test_bad_tools_are_refused_naming_the_field(tools, field, words):
    with pytest.raises(GrammarError) as caught:
        normalize_tools(tools)
    assert caught.value.field == field and words in caught.value.message


def test_anthropic_style_tools_are_accepted():
    (tool,) = normalize_tools([{"name": "add", "description": "Adds", "input_schema": ADD}])
    assert (tool.name, tool.description, tool.parameters) == ("add", "Adds", ADD)


@pytest.mark.parametrize("choice, field", [
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ({"type": "tool", "name": "nope"}, "tool_choice.name"),
    ("sometimes", "tool_choice"),
])
def test_bad_tool_choice_is_refused_naming_the_field(choice, field):
    with pytest.raises(GrammarError) as caught:
        tool_call_structural_tag(HERMES, normalize_tools(TOOLS), choice)
    assert caught.value.field == field


def test_tool_choice_none_means_no_constraint():
    assert tool_call_grammar(HERMES, TOOLS, "none") is None
    assert tool_call_grammar(HERMES, TOOLS, {"type": "none"}) is None


# -- grammars, on a real tokenizer and a random model ---------------------------------


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    from mlx_lm import load

    return load(str(tiny_model_path("llama")))


@pytest.fixture(scope="module")
def compiler(model_and_tokenizer):
    from omlx_core.grammar import GrammarCompilerCache

    cache = GrammarCompilerCache(model_and_tokenizer[1], vocab_size=512)
    yield cache
    cache.close()


def decode(model, tokenizer, constraint, seed, max_tokens=600):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=1.0)
    prompt = tokenizer.encode("What is the weather?")
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    processor, context, generated = constraint.processor(), list(prompt), []
    for _ in range(max_tokens):
        logits = processor(mx.array(context), logits)
        token = int(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item())
        if token == EOS:
            return tokenizer.decode(generated), True
        context.append(token)
        generated.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return tokenizer.decode(generated), False


@needs_xgrammar
@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_constrained_calls_parse_and_match_their_schemas(model_and_tokenizer, compiler, fmt, choice):
    from omlx_core.grammar import GrammarConstraint

    model, tokenizer = model_and_tokenizer
    compiled = compiler.compile(tool_call_grammar(fmt, TOOLS, choice, parallel_tool_calls=False))
    for seed in range(4):
        text, ended = decode(model, tokenizer, GrammarConstraint(compiled), seed)
        assert ended, f"no stop after one call: {text!r}"
        content, calls = parse_tool_calls(fmt, text)
        assert content.strip() == "" and len(calls) == 1, text
        if isinstance(choice, dict):
            assert calls[0].name == "add"
        arguments = calls[0].arguments_json()
        import jsonschema

        jsonschema.validate(arguments, SCHEMAS[calls[0].name])


@needs_xgrammar
@pytest.mark.parametrize("fmt, call", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'),
], ids=lambda v: v.name if isinstance(v, ToolCallFormat) else "")
def test_auto_allows_text_then_a_valid_call_and_refuses_an_invalid_one(model_and_tokenizer, compiler, fmt, call):
    from omlx_core.grammar import GrammarConstraint

    tokenizer = model_and_tokenizer[1]
    compiled = compiler.compile(tool_call_grammar(fmt, TOOLS, "auto", parallel_tool_calls=False))
    good = tokenizer.encode("Let me check. " + call)
    constraint = GrammarConstraint(compiled)
    assert constraint.accept_tokens(good) == len(good) and constraint.accept(EOS)
    assert constraint.is_terminated()

    for bad_call in (call.replace("3}", '"three"}'), call.replace("get_weather", "get_wether"),
                     call.replace('"Paris"', '"Paris, France"')):  # past maxLength 8
        bad = tokenizer.encode("Let me check. " + bad_call)
        assert GrammarConstraint(compiled).accept_tokens(bad) < len(bad), bad_call

    text_only = tokenizer.encode("It is sunny.")
    constraint = GrammarConstraint(compiled)
    assert constraint.accept_tokens(text_only) == len(text_only) and constraint.accept(EOS)


@needs_xgrammar
def test_a_marker_that_is_a_special_token_is_matched_as_that_token(model_and_tokenizer, compiler):
    """<|im_start|> is a control token of the test tokenizer, like [TOOL_CALLS] in
    Mistral's: the grammar must name it as a token and may produce it only there."""
    import mlx.core as mx
    import numpy as np

    from omlx_core.grammar import GrammarConstraint, special_tokens

    tokenizer = model_and_tokenizer[1]
    fmt = ToolCallFormat("marker", open=IM_START, close="", arguments_key="arguments",
                         separator=", ", list_open="[", list_close="]")
    spec = tool_call_grammar(fmt, TOOLS, "auto", special_tokens=special_tokens(tokenizer))
    assert '"type":"token"' in spec.text
    compiled = compiler.compile(spec)
    constraint = GrammarConstraint(compiled)
    allowed = set(np.flatnonzero(np.isfinite(np.array(constraint.mask_logits(mx.zeros((1, 512)))[0]))).tolist())
    # The named control token may open a call; the other control tokens stay out of text.
    assert special_token_id(IM_START) in allowed and special_token_id(ENDOFTEXT) not in allowed
    call = tokenizer.encode('[{"name": "add", "arguments": {"a": 5}}]')
    assert constraint.accept_tokens(tokenizer.encode("Sure: ")) > 0
    assert constraint.accept(special_token_id(IM_START))
    assert constraint.accept_tokens(call) == len(call) and constraint.accept(EOS)
    wrong = tokenizer.encode('[{"name": "add", "arguments": {"a": 500}}]')
    constraint = GrammarConstraint(compiled)
    assert constraint.accept(special_token_id(IM_START))
    assert constraint.accept_tokens(wrong) < len(wrong)


# -- the streaming parser --------------------------------------------------------------

OUTPUTS = {
    "hermes": (HERMES, 'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                       '"n": [1, {"x": "}\\""}]}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
                       '{"a": 1}}\n</tool_call>\n'),
    "llama3": (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                       '{"name": "add", "parameters": {"a": 2}}'),
    "mistral": (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                         '{"name": "add", "arguments": {}}]'),
}
EXPECTED = {
    "hermes": ("I will look.\n", [("get_weather", {"city": "Paris", "n": [1, {"x": '}"'}]}), ("add", {"a": 1})]),
    "llama3": ("", [("get_weather", {"city": "Oslo"}), ("add", {"a": 2})]),
    "mistral": ("", [("get_weather", {"city": "Rome"}), ("add", {})]),
}


def replay(fmt, pieces):
    counter = iter(range(1000))
    parser = ToolCallParser(fmt, new_id=lambda: f"call_{next(counter)}")
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    return parser, events


def check_events(parser, events, expected_content, expected_calls):
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == expected_content
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(i, name) for i, (name, _) in enumerate(expected_calls)]
    assert len({s.id for s in starts}) == len(starts)
    for index, (name, arguments) in enumerate(expected_calls):
        deltas = "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == index)
        assert json.loads(deltas) == arguments
        first_delta = next(i for i, e in enumerate(events) if isinstance(e, ToolCallArgumentsDelta) and e.index == index)
        assert events.index(starts[index]) < first_delta
        (end,) = [e for e in events if isinstance(e, ToolCallEnd) and e.index == index]
        assert end.call.complete and end.call.arguments == deltas and end.call.name == name
    assert [c.name for c in parser.calls] == [name for name, _ in expected_calls]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_parser_gives_the_same_result_however_the_text_is_split(name):
    fmt, text = OUTPUTS[name]
    expected_content, expected_calls = EXPECTED[name]
    check_events(*replay(fmt, [text]), expected_content, expected_calls)
    check_events(*replay(fmt, list(text)), expected_content, expected_calls)
    for cut in range(1, len(text)):
        check_events(*replay(fmt, [text[:cut], text[cut:]]), expected_content, expected_calls)


def test_parser_holds_back_a_possible_marker_until_it_is_decided():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hello <tool") == [ContentDelta("Hello ")]
    assert parser.feed("box> is a tag") == [ContentDelta("<toolbox> is a tag")]
    assert parser.finish() == [] and parser.calls == []


def test_a_call_cut_off_by_max_tokens_is_reported_incomplete():
    parser = ToolCallParser(HERMES)
    events = parser.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    events += parser.finish()
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta]
    (call,) = parser.calls
    assert not call.complete and call.arguments == '{"a": 1'


def test_json_without_a_name_is_content():
    assert parse_tool_calls(LLAMA3, 'The set {"name" : none} is empty.') == (
        'The set {"name" : none} is empty.', [])


@needs_xgrammar
def test_strict_false_lets_undeclared_arguments_through_but_keeps_the_declared_types(model_and_tokenizer, compiler):
    from omlx_core.grammar import GrammarConstraint

    tokenizer = model_and_tokenizer[1]
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": loose, "strict": False}}]
    compiled = compiler.compile(tool_call_grammar(HERMES, tools, "required"))
    extra = tokenizer.encode('<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>')
    assert GrammarConstraint(compiled).accept_tokens(extra) == len(extra)
    wrong = tokenizer.encode('<tool_call>\n{"name": "f", "arguments": {"a": "1"}}\n</tool_call>')
    assert GrammarConstraint(compiled).accept_tokens(wrong) < len(wrong)
    strict = compiler.compile(tool_call_grammar(HERMES, [{"type": "function", "function": {
        "name": "f", "parameters": loose}}], "required"))
    assert GrammarConstraint(strict).accept_tokens(extra) < len(extra)
