"""The tool-call formats of today's models (harmony, Qwen3-Coder XML, GLM-4.5, pythonic):
read from the chat template, parsed back from what the template itself renders for a
past call, parsed the same however the stream is chunked, and, constrained by the
grammar, never producing arguments that fail their schema, even from a model that
knows nothing (a property test over generated schemas)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omlx_core.grammar.function_tools import normalize_tools
from omlx_core.grammar.tool_call_formats import (
    GLM45,
    HARMONY,
    HERMES,
    PYTHONIC,
    QWEN3_CODER,
    detect_tool_call_format,
    tool_call_format_named,
)
from omlx_core.grammar.tool_events import ContentDelta, ToolCallArgumentsDelta
from omlx_core.grammar.toolcalls import parse_tool_calls, tool_call_parser
from omlx_core.grammar.xml_toolcalls import typed_value
from omlx_core.testing.chat_formats import CHAT_FORMATS, cached_format_model

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="xgrammar is not installed (./setup.sh installs it)")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "hot": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}}]
FUNCTIONS = normalize_tools(TOOLS)
ARGUMENTS = {"city": "São \"Paulo\"", "days": 3, "hot": False, "tags": ["a", "b c"]}
NEW_FORMATS = {"qwen3_coder": QWEN3_CODER, "glm45": GLM45, "pythonic": PYTHONIC, "harmony": HARMONY}


@pytest.mark.parametrize("name, fmt", [*NEW_FORMATS.items(), ("qwen3", HERMES), ("r1", HERMES)])
def test_the_format_is_read_from_the_test_templates(name, fmt):
    assert detect_tool_call_format(CHAT_FORMATS[name].chat_template) is fmt


def test_a_format_is_named_in_config_and_an_unknown_name_says_which_exist():
    assert tool_call_format_named("glm45") is GLM45
    with pytest.raises(ValueError, match="qwen3_coder"):
        tool_call_format_named("qwen4")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from mlx_lm import load

    root = tmp_path_factory.mktemp("formats")
    return {name: load(str(cached_format_model(name, cache_dir=root)))[1] for name in NEW_FORMATS}


def rendered_call(tokenizer, name: str) -> str:
    """What the model's own template writes for a past call (the reply after the user turn)."""
    ask = [{"role": "user", "content": "Weather?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": ARGUMENTS}}]}
    before = tokenizer.apply_chat_template(ask, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(ask + [call], tools=TOOLS, tokenize=False)
    reply = whole[len(before):] if whole.startswith(before) else whole[whole.index("Weather?") + 8:]
    for end in ("<|im_end|>", "<|call|>"):
        reply = reply.split(end)[0]
    if name == "harmony":  # the generation prompt ends at <|start|>assistant
        reply = reply[reply.index("<|channel|>"):]
    return reply.replace("<think></think>", "")  # GLM's empty thinking: the reasoning splitter's


@pytest.mark.parametrize("name", NEW_FORMATS)
def test_a_call_the_template_renders_is_parsed_back(tokenizers, name):
    text = rendered_call(tokenizers[name], name)
    content, calls = parse_tool_calls(NEW_FORMATS[name], text, FUNCTIONS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGUMENTS)], text
    assert content.strip() == ""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 400), max_size=10))
@pytest.mark.parametrize("name", NEW_FORMATS)
def test_streamed_pieces_add_up_to_the_same_calls_however_the_text_is_chunked(tokenizers, name, cuts):
    call_text = rendered_call(tokenizers[name], name)
    text = "Let me check. " + call_text if name != "harmony" else call_text
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)]) if b > a]
    parser = tool_call_parser(NEW_FORMATS[name], FUNCTIONS)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    [call] = [c for c in parser.calls if c.complete]
    assert json.loads(call.arguments) == ARGUMENTS
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta)) == call.arguments
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content.strip() == ("" if name == "harmony" else "Let me check.")
    assert content == parse_tool_calls(NEW_FORMATS[name], text, FUNCTIONS)[0]


@pytest.mark.parametrize("fmt, text", [
    (QWEN3_CODER, "I use <tool_call> tags <b>here</b> in prose."),
    (GLM45, "<tool_call>oops <b>not xml</b>"),
    (PYTHONIC, "A list: [get_weather is a function, not a call] and [1, 2]."),
])
def test_text_that_only_looks_like_a_call_is_content(fmt, text):
    content, calls = parse_tool_calls(fmt, text, FUNCTIONS)
    assert calls == [] and content == text


def test_pythonic_arguments_are_literals_never_evaluated():
    content, calls = parse_tool_calls(PYTHONIC, '[get_weather(city=__import__("os").getcwd())]', FUNCTIONS)
    assert calls == [] and "__import__" in content
    _, calls = parse_tool_calls(PYTHONIC, '[get_weather(city="a\\/b", days=-2, hot=True, tags=None)]',
                                FUNCTIONS)
    assert json.loads(calls[0].arguments) == {"city": "a/b", "days": -2, "hot": True, "tags": None}


@pytest.mark.parametrize("raw, schema, value", [
    ("\n Paris \n", {"type": "string"}, "Paris"),
    ("3", {"type": "string"}, "3"),
    ("3", {"type": "integer"}, 3),
    ("true", {"type": "boolean"}, True),
    ("null", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("x", {"enum": ["x", 1]}, "x"),
    ("7", {"type": ["string", "integer"]}, 7),
    ("not json", None, "not json"),
    # A listed string with whitespace of its own, which the grammar lets the model pad
    # (hypothesis found enum [" "] read back as ""):
    (" ", {"enum": [" "]}, " "),
    ("\n \n", {"enum": [" "]}, " "),
    (" a", {"enum": [" a", "b"]}, " a"),
    ("\n a\n", {"const": " a"}, " a"),
    (" ", {"enum": [" ", 1]}, " "),
    ("\n b \n", {"enum": [" a", "b"]}, "b"),
])
def test_xml_parameters_are_typed_by_their_schema(raw, schema, value):
    assert typed_value(raw, schema) == value


# -- constrained calls satisfy their schema -------------------------------------------------


def leaves() -> st.SearchStrategy[dict]:
    def integer(bounds):
        low, high = sorted(bounds)
        return {"type": "integer", "minimum": low, "maximum": high}

    def string(bounds):
        low, high = sorted(bounds)
        return {"type": "string", "minLength": low, "maxLength": high}

    words = st.text(alphabet=st.sampled_from(list("ab z\"<>é")), min_size=1, max_size=4)
    return st.one_of(
        st.just({"type": "boolean"}),
        st.tuples(st.integers(-100, 100), st.integers(-100, 100)).map(integer),
        st.tuples(st.integers(0, 5), st.integers(1, 6)).map(string),
        st.tuples(st.integers(0, 5), st.integers(1, 6)).map(string),
        st.lists(words, min_size=1, max_size=3, unique=True).map(lambda values: {"enum": values}),
        st.lists(st.integers(-9, 9), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
    )


def values() -> st.SearchStrategy[dict]:
    def array(args):
        items, (low, high) = args
        low, high = sorted((low, high))
        return {"type": "array", "items": items, "minItems": low, "maxItems": high}

    return st.one_of(leaves(), leaves(), st.tuples(leaves(), st.tuples(st.integers(0, 2), st.integers(0, 2)))
                     .map(array))


names = st.from_regex(r"[a-z][a-z_]{0,5}", fullmatch=True)
parameters = st.dictionaries(names, values(), min_size=0, max_size=3).flatmap(
    lambda properties: st.lists(st.booleans(), min_size=len(properties), max_size=len(properties)).map(
        lambda flags: {"type": "object", "properties": properties, "additionalProperties": False,
                       "required": [k for k, flag in zip(properties, flags) if flag]}))

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def format_models(tmp_path_factory):
    from mlx_lm import load

    root = tmp_path_factory.mktemp("format-models")
    return {name: load(str(cached_format_model(name, cache_dir=root))) for name in NEW_FORMATS}


def constrained_calls(model, tokenizer, spec, *, temperature: float, seed: int) -> tuple[str, bool]:
    """Decode from a user turn under ``spec``; (the text, whether it ended before
    ``MAX_TOKENS``)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from omlx_core.grammar import GrammarConstraint, compiler_for
    from omlx_core.testing.chat_formats import FORMAT_VOCAB_SIZE

    constraint = GrammarConstraint(compiler_for(tokenizer, vocab_size=FORMAT_VOCAB_SIZE).compile(spec))
    sampler = make_sampler(temp=temperature)
    mx.random.seed(seed)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Call it."}],
                                           add_generation_prompt=True)
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    processor = constraint.processor()
    context, generated = list(prompt), []
    for _ in range(MAX_TOKENS):
        logits = processor(mx.array(context), logits)
        token = int(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item())
        if token in constraint.stop_token_ids:
            return tokenizer.decode(generated), True
        context.append(token)
        generated.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return tokenizer.decode(generated), False


@pytest.mark.slow
@needs_xgrammar
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=parameters, seed=st.integers(0, 2**16), parallel=st.booleans())
@pytest.mark.parametrize("name", NEW_FORMATS)
def test_constrained_calls_in_each_format_satisfy_their_schema(format_models, name, schema, seed, parallel):
    import jsonschema

    from omlx_core.grammar import special_tokens
    from omlx_core.grammar.toolcalls import tool_call_grammar

    model, tokenizer = format_models[name]
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}},
             {"type": "function", "function": {"name": "g_2", "parameters": {
                 "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["n"], "additionalProperties": False}}}]
    fmt = NEW_FORMATS[name]
    spec = tool_call_grammar(fmt, tools, "required", parallel_tool_calls=parallel,
                             special_tokens=special_tokens(tokenizer))
    if fmt is HARMONY:  # with its analysis capped: a model that knows nothing never leaves it
        from omlx_core.grammar import GrammarSpec
        from omlx_core.grammar.harmony import harmony_format

        spec = GrammarSpec.structural_tag({"type": "structural_tag", "format": harmony_format(
            normalize_tools(tools), "required", special_tokens=special_tokens(tokenizer),
            max_whitespace=16, analysis_tokens=12)})
    schemas = {"f": schema, "g_2": tools[1]["function"]["parameters"]}
    for temperature in (0.0, 1.0):
        text, ended = constrained_calls(model, tokenizer, spec, temperature=temperature, seed=seed)
        _, calls = parse_tool_calls(fmt, text, normalize_tools(tools))
        # A model that knows nothing may list calls until max_tokens: the calls it
        # finished are checked all the same.
        assert calls, f"no complete call in {text!r}"
        assert parallel or (len(calls) == 1 and ended)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
