"""Chat templates and tokenizers that teach the tiny random models how reasoning models
think and call tools, one per format, written for the tests from each format's
published description (no model's template file is copied).

Every format model shares one tokenizer: the test BPE (:mod:`.tokenizer`) with the
marker tokens of every format added after the trained vocabulary, so the 512 trained
ids stay what they are. The thinking and tool-call markers are added tokens that read
as text (as ``<think>`` is in Qwen3's vocabulary); harmony's and GLM's framing tokens
are special tokens, as they are in those vocabularies. A format differs only in its
chat template and the tokens that end a turn.

- ``qwen3``: ChatML, thinking in ``<think>…</think>`` that the model opens itself
  (``enable_thinking=false`` renders an empty block), hermes tool calls;
- ``r1``: ChatML whose generation prompt opens ``<think>``, as DeepSeek-R1's does;
- ``qwen3_coder``: ChatML, thinking tags, Qwen3-Coder's XML calls
  (``<tool_call><function=NAME><parameter=KEY>value</parameter>…``);
- ``glm45``: GLM-4.5's ``[gMASK]<sop><|user|>…<|assistant|>`` turns, thinking tags,
  ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>…</tool_call>``;
- ``harmony``: gpt-oss's channels (``analysis``, ``commentary``, ``final``), tool calls
  addressed ``to=functions.NAME``, ``reasoning_effort`` in the system message;
- ``pythonic``: ChatML with Llama-4's pythonic call list ``[f(a=1), g(b="x")]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_core.testing.tokenizer import IM_END, ENDOFTEXT, VOCAB_SIZE, build_tokenizer

#: added after the trained vocabulary, in this order (ids 512, 513, ...)
TEXT_MARKERS: tuple[str, ...] = (
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)
SPECIAL_MARKERS: tuple[str, ...] = (
    "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|constrain|>", "<|return|>",
    "<|call|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
)
#: the logits width of a format model: the trained vocabulary, the markers, padding
FORMAT_VOCAB_SIZE = 544

_SYSTEM_FIRST = "{%- set system = messages[0].content if messages[0].role == 'system' else '' -%}"
_LAST_CALL = "{%- set ns = namespace(call='') -%}"

_HERMES_TOOLS = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
)


def _chatml(tools_block: str, call: str, *, open_thinking: bool = False, thinking: bool = True) -> str:
    """A ChatML template: ``tools_block`` in the system turn, each past call rendered by
    ``call`` (with ``call`` bound to ``message.tool_calls[i].function``); with
    ``thinking``, thinking in ``<think>`` tags from ``reasoning_content``, and a generation
    prompt that opens it (``open_thinking``) or closes it empty when the caller says
    ``enable_thinking=false``."""
    generation = ("{{- '<|im_start|>assistant\\n<think>\\n' }}" if open_thinking else
                  "{{- '<|im_start|>assistant\\n' }}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    if not thinking:
        generation = "{{- '<|im_start|>assistant\\n' }}"
    past_thinking = ("{%- if message.reasoning_content %}"
                     "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
                     if thinking else "")
    return (
        _SYSTEM_FIRST +
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
        + tools_block + "{{- '<|im_end|>\\n' }}"
        "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        + past_thinking + "{{- message.content or '' }}"
        "{%- for tool_call in message.tool_calls or [] %}{%- set call = tool_call.function %}"
        + call + "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}" + generation + "{%- endif %}"
    )


QWEN3_TEMPLATE = _chatml(
    _HERMES_TOOLS,
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) "
    "+ '}\\n</tool_call>' }}")

R1_TEMPLATE = _chatml(_HERMES_TOOLS,
                      "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' "
                      "+ (call.arguments | tojson) + '}\\n</tool_call>' }}", open_thinking=True)

QWEN3_CODER_TEMPLATE = _chatml(
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{%- set f = tool.function %}"
    "{{- '\\n<function>\\n<name>' + f.name + '</name>\\n<description>' + (f.description or '') "
    "+ '</description>\\n<parameters>' }}"
    "{%- for key, value in (f.parameters.properties or {}).items() %}"
    "{{- '\\n<parameter>\\n<name>' + key + '</name>\\n<type>' + (value.type or 'any') + '</type>\\n</parameter>' }}"
    "{%- endfor %}{{- '\\n</parameters>\\n</function>' }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n</function>\\n</tool_call>' }}",
    "{{- '\\n<tool_call>\\n<function=' + call.name + '>\\n' }}"
    "{%- for key, value in call.arguments.items() %}"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}")

GLM45_TEMPLATE = (
    _SYSTEM_FIRST +
    "{{- '[gMASK]<sop>' }}"
    "{%- if tools %}{{- '<|system|>\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, output the function name and arguments within the "
    "following XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n"
    "<arg_value>{arg-value-1}</arg_value>\\n...\\n</tool_call>' }}"
    "{%- elif system %}{{- '<|system|>\\n' + system }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|user|>\\n' + message.content }}"
    "{%- elif message.role == 'system' and not loop.first %}{{- '<|system|>\\n' + message.content }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|assistant|>\\n<think>' + (message.reasoning_content or '') + '</think>\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set call = tool_call.function %}"
    "{{- '\\n<tool_call>' + call.name + '\\n' }}"
    "{%- for key, value in call.arguments.items() %}"
    "{{- '<arg_key>' + key + '</arg_key>\\n<arg_value>' + (value if value is string else value | tojson) "
    "+ '</arg_value>\\n' }}{%- endfor %}{{- '</tool_call>' }}{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|observation|>\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n<think></think>' }}{%- endif %}"
    "{%- endif %}"
)

HARMONY_TEMPLATE = (
    _SYSTEM_FIRST + _LAST_CALL +
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\n\\nReasoning: ' "
    "+ (reasoning_effort or 'medium') + '\\n\\n# Valid channels: analysis, commentary, final. "
    "Channel must be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- if system or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if system %}{{- '# Instructions\\n\\n' + system }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}{{- '\\n// ' + (tool.function.description or '') + '\\ntype ' + tool.function.name "
    "+ ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\\n' }}{%- endfor %}"
    "{{- '\\n} // namespace functions' }}{%- endif %}{{- '<|end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if message.reasoning_content %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' }}{%- endif %}"
    "{%- if message.content %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set ns.call = tool_call.function.name %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + ns.call + ' <|constrain|>json<|message|>' "
    "+ (tool_call.function.arguments | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + ns.call + ' to=assistant<|channel|>commentary<|message|>' + message.content "
    "+ '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

PYTHONIC_TEMPLATE = _chatml(
    "{{- 'Here is a list of functions in JSON format that you can invoke:\\n[' }}"
    "{%- for tool in tools %}{{ (tool | tojson) + (', ' if not loop.last else '') }}{%- endfor %}"
    "{{- ']\\n\\nIf you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\\n"
    "You SHOULD NOT include any other text in the response if you call a function.' }}",
    "{{- ('[' if loop.first else ', ') + call.name + '(' }}"
    "{%- for key, value in call.arguments.items() %}"
    "{{- key + '=' + ('True' if value is true else 'False' if value is false else 'None' if value is none "
    "else value | tojson) + (', ' if not loop.last else '') }}{%- endfor %}"
    "{{- ')' + (']' if loop.last else '') }}",
    thinking=False)


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the tokens that end a turn of a model taught by it."""

    name: str
    chat_template: str
    eos_tokens: tuple[str, ...]


CHAT_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    ChatFormat("qwen3", QWEN3_TEMPLATE, (IM_END,)),
    ChatFormat("r1", R1_TEMPLATE, (IM_END,)),
    ChatFormat("qwen3_coder", QWEN3_CODER_TEMPLATE, (IM_END,)),
    ChatFormat("glm45", GLM45_TEMPLATE, (ENDOFTEXT, "<|user|>", "<|observation|>")),
    ChatFormat("harmony", HARMONY_TEMPLATE, ("<|return|>", "<|call|>")),
    ChatFormat("pythonic", PYTHONIC_TEMPLATE, (IM_END,)),
)}


def format_tokenizer_json() -> str:
    """The test tokenizer with every format's markers added after its vocabulary."""
    from tokenizers import AddedToken, Tokenizer

    from omlx_core.testing.tokenizer import trained_tokenizer_json

    tokenizer = Tokenizer.from_str(trained_tokenizer_json())
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_MARKERS])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_MARKERS])
    if tokenizer.get_vocab_size() > FORMAT_VOCAB_SIZE:
        raise RuntimeError(f"the format tokenizer has {tokenizer.get_vocab_size()} tokens, more than "
                           f"FORMAT_VOCAB_SIZE ({FORMAT_VOCAB_SIZE}); raise it")
    return tokenizer.to_str()


def marker_id(token: str) -> int:
    """The id of a marker token in the format tokenizer."""
    markers = TEXT_MARKERS + SPECIAL_MARKERS
    return VOCAB_SIZE + markers.index(token)


def build_format_tokenizer(out_dir: Path, chat_format: ChatFormat) -> None:
    """Write the format tokenizer and ``chat_format``'s template and end tokens."""
    build_tokenizer(out_dir)
    out_dir = Path(out_dir)
    (out_dir / "tokenizer.json").write_text(format_tokenizer_json(), encoding="utf-8")
    config_path = out_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(chat_template=chat_format.chat_template, eos_token=chat_format.eos_tokens[0],
                  additional_special_tokens=sorted({*config["additional_special_tokens"],
                                                    *SPECIAL_MARKERS}))
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def eos_ids(chat_format: ChatFormat) -> list[int]:
    from omlx_core.testing.tokenizer import SPECIAL_TOKENS

    return [SPECIAL_TOKENS.index(t) if t in SPECIAL_TOKENS else marker_id(t)
            for t in chat_format.eos_tokens]


def build_format_model(name: str, out_dir: Path, *, family: str = "qwen3", seed: int = 0) -> Path:
    """A tiny random ``family`` model taught chat format ``name`` (see :data:`CHAT_FORMATS`)."""
    from omlx_core.testing.models import build_model

    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; known: {', '.join(CHAT_FORMATS)}")
    chat_format = CHAT_FORMATS[name]
    out_dir = build_model(family, out_dir, seed=seed, overrides={"vocab_size": FORMAT_VOCAB_SIZE})
    config_path = Path(out_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos_ids(chat_format)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    build_format_tokenizer(out_dir, chat_format)
    return out_dir


def cached_format_model(name: str, seed: int = 0, *, family: str = "qwen3",
                        cache_dir: Path | None = None) -> Path:
    """Path of :func:`build_format_model`'s model, built once per process."""
    from omlx_core.testing.models import cached_build

    return cached_build(f"{family}-{name}", lambda directory: build_format_model(
        name, directory, family=family, seed=seed), seed, cache_dir)


__all__ = ["CHAT_FORMATS", "ChatFormat", "FORMAT_VOCAB_SIZE", "SPECIAL_MARKERS", "TEXT_MARKERS",
           "build_format_model", "build_format_tokenizer", "cached_format_model", "format_tokenizer_json",
           "marker_id"]
