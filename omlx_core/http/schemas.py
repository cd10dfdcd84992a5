"""The JSON Schemas of the request bodies: validated on every request and published in
``/openapi.json``. Parameters of the OpenAI and Anthropic APIs that omlx-core does not
implement and that would change the answer (tools, response formats, several choices)
are refused with a 400 that names them; others (``user``, ``metadata``, ``store``...) are
accepted and ignored."""

from __future__ import annotations

from typing import Any

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 512
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or ``null``: null means "use the default", as many clients send it."""
    kinds = schema["type"]
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    return {**schema, "type": [*kinds, "null"]}


def _unsupported(what: str) -> dict[str, Any]:
    return {"not": {}, "description": f"not supported: {what}", "x-error": f"not supported: {what}"}


MODEL = {"type": "string", "minLength": 1, "maxLength": 256,
         "description": "id of a served model, as listed by GET /v1/models"}

TEXT_PART = {
    "type": "object",
    "description": "a text content part",
    "required": ["type", "text"],
    "properties": {
        "type": {"const": "text", "x-error": "only text content parts are supported"},
        "text": {"type": "string"},
    },
}

CONTENT_PART = {
    "type": "object",
    "description": "a text or image_url content part (images: a vision model only; data URLs, "
                   "or local files where the operator allows a directory; remote URLs are not fetched)",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "image_url"],
                 "x-error": "content parts must be text or image_url"},
        "text": {"type": "string"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {
                "url": {"type": "string", "minLength": 1},
                "detail": {"enum": ["auto", "low", "high"]},
            },
        },
    },
}

#: vLLM's name: requests with different salts never share prefix-cache entries
CACHE_SALT = {"type": "string", "minLength": 1, "maxLength": 256,
              "description": "keeps this request's prefix-cache entries apart from those of "
                             "requests without this salt (cached_tokens then tells nothing of "
                             "other clients' prompts); use a long random secret per client"}

_SAMPLING = {
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2,
                              "description": "0 is greedy decoding; default 1"}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": 0, "maximum": INT32_MAX,
                        "description": "omlx-core extension; 0 disables it"}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1,
                        "description": "omlx-core extension; 0 disables it"}),
    "seed": _nullable({"type": "integer", "minimum": 0, "maximum": INT64_MAX}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 10,
                                     "description": "omlx-core extension; 1 disables it"}),
    "logit_bias": _nullable({
        "type": "object",
        "description": "token id (as a string) to a bias added to its logit",
        "propertyNames": {"type": "string", "pattern": "^[0-9]{1,9}$",
                          "x-error": "logit_bias keys must be token ids, e.g. \"1234\""},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "maxProperties": 1024,
    }),
    "stop": {
        "anyOf": [
            {"type": "null"},
            {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH},
            {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
             "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}},
        ],
        "description": "text that ends the completion; it is not included in the output",
    },
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({
        "type": "object",
        "properties": {"include_usage": _nullable({"type": "boolean"})},
    }),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": 1,
                    "x-error": "only n=1 is supported; send one request per choice"}),
    "user": {"type": "string"},
    "cache_salt": _nullable(CACHE_SALT),
}

TOOL_CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}

CHAT_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"],
                 "x-error": "role must be system, developer, user, assistant or tool"},
        "content": {"anyOf": [
            {"type": "null"},
            {"type": "string"},
            {"type": "array", "items": CONTENT_PART},
        ]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": TOOL_CALL},
        "tool_call_id": {"type": "string"},
        "reasoning_content": _nullable({"type": "string", "description": (
            "an assistant message's thinking, as a reasoning model's reply gave it; passed "
            "to chat templates that render past thinking")}),
        "reasoning": _nullable({"type": "string", "description": "the same as reasoning_content"}),
    },
}

REASONING_EFFORT = {"enum": ["low", "medium", "high", None],
                    "description": "how long a reasoning model thinks, for chat templates that "
                                   "read reasoning_effort (gpt-oss); models that do not reason "
                                   "ignore it",
                    "x-error": "reasoning_effort must be 'low', 'medium' or 'high'"}

#: chat-template arguments the server sets itself
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "tokenize",
                            "return_dict", "return_tensors", "continue_final_message",
                            "chat_template", "images", "tokenizer")

CHAT_TEMPLATE_KWARGS = _nullable({
    "type": "object", "maxProperties": 32,
    "description": "extra arguments for the model's chat template, e.g. {\"enable_thinking\": false} "
                   "(omlx-core extension, as vLLM's); "
                   + ", ".join(RESERVED_TEMPLATE_KWARGS) + " are the server's own",
    "propertyNames": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$",
                      "not": {"enum": list(RESERVED_TEMPLATE_KWARGS)},
                      "x-error": "chat_template_kwargs keys must be template variable names, not "
                                 "one the server sets (" + ", ".join(RESERVED_TEMPLATE_KWARGS) + ")"},
    "x-error": "chat_template_kwargs must be an object of template variables, e.g. "
               "{\"enable_thinking\": false}",
})

CHAT_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": MODEL,
        "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX}),
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX}),
        **_SAMPLING,
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                                   "description": "needs logprobs: true"}),
        "response_format": _nullable({
            "type": "object", "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema", "regex", "grammar"],
                         "description": "regex and grammar are omlx-core extensions",
                         "x-error": "response_format.type must be text, json_object, "
                                    "json_schema, regex or grammar"},
                "regex": {"type": "string", "minLength": 1,
                          "description": "with type regex: the pattern the whole output matches"},
                "grammar": {"type": "string", "minLength": 1,
                            "description": "with type grammar: a GBNF/EBNF grammar (llama.cpp "
                                           "syntax) whose root rule the output derives"},
                "json_schema": {
                    "type": "object", "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1, "maxLength": 64},
                        "description": {"type": "string"},
                        "schema": {"type": ["object", "boolean"]},
                        "strict": _nullable({"type": "boolean"}),
                    },
                },
            },
        }),
        "tools": _nullable({"type": "array", "minItems": 1, "maxItems": 128,
                            "items": {"type": "object"}}),
        "tool_choice": {"anyOf": [{"type": "null"}, {"enum": ["auto", "none", "required"]},
                                  {"type": "object"}]},
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "reasoning_effort": REASONING_EFFORT,
        "thinking_token_budget": _nullable({
            "type": "integer", "minimum": 1, "maximum": INT32_MAX,
            "description": "the most tokens a reasoning model's thinking may take before it must "
                           "answer; at most max_tokens (omlx-core extension, vLLM's name)",
            "x-error": "thinking_token_budget must be an integer from 1 to max_tokens"}),
        "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
        "functions": _unsupported("function calling"),
        "function_call": _unsupported("function calling"),
        "audio": _unsupported("audio output"),
        "prediction": _unsupported("predicted outputs"),
    },
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": MODEL,
        "prompt": {"anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"},
             "x-error": "give exactly one prompt string; send one request per prompt"},
            {"type": "array", "minItems": 1,
             "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
             "description": "token ids"},
        ]},
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX}),
        **_SAMPLING,
        "logprobs": _nullable({"type": "integer", "minimum": 0,
                               "maximum": MAX_COMPLETION_LOGPROBS}),
        "echo": {"anyOf": [{"type": "null"}, {"const": False}],
                 "x-error": "echo is not supported"},
        "suffix": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 0}],
                   "x-error": "suffix (insertion) is not supported"},
        "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": 1,
                              "x-error": "only best_of=1 is supported"}),
    },
}

ANTHROPIC_TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"const": "text", "x-error": "only text content blocks are supported"},
        "text": {"type": "string"},
    },
}

ANTHROPIC_CONTENT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"],
                 "x-error": "content blocks must be text, image, tool_use, tool_result, thinking "
                            "or redacted_thinking"},
        "text": {"type": "string"},
        "thinking": {"type": "string"},
        "signature": {"type": "string"},
        "data": {"type": "string"},
        "source": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"type": "string"},
                "media_type": {"type": "string"},
                "data": {"type": "string"},
                "url": {"type": "string"},
            },
        },
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"},
                              {"type": "array", "items": ANTHROPIC_TEXT_BLOCK}]},
        "is_error": {"type": "boolean"},
    },
}

MESSAGES_REQUEST = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": MODEL,
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": INT32_MAX},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["user", "assistant"]},
                "content": {"anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": ANTHROPIC_CONTENT_BLOCK},
                ]},
            },
        }},
        "system": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": ANTHROPIC_TEXT_BLOCK},
        ]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
        "stop_sequences": {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                           "items": {"type": "string", "minLength": 1,
                                     "maxLength": MAX_STOP_LENGTH}},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
        "cache_salt": _nullable(CACHE_SALT),
        "tools": {"type": "array", "minItems": 1, "maxItems": 128, "items": {"type": "object"}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]},
            "name": {"type": "string"},
            "disable_parallel_tool_use": {"type": "boolean"}}},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "adaptive", "disabled"],
                     "x-error": "thinking.type must be 'enabled', 'adaptive' or 'disabled'"},
            "budget_tokens": {"type": "integer", "minimum": 1, "maximum": INT32_MAX,
                              "description": "with type enabled: the most tokens the thinking may "
                                             "take; at most max_tokens",
                              "x-error": "thinking.budget_tokens must be an integer from 1 to max_tokens"},
            "display": {"enum": ["summarized", "omitted"],
                        "x-error": "thinking.display must be 'summarized' or 'omitted'"}},
            "description": "a reasoning model's thinking comes back as thinking blocks; models "
                           "that do not reason ignore this"},
    },
}

COUNT_TOKENS_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": MODEL,
        "messages": MESSAGES_REQUEST["properties"]["messages"],
        "system": MESSAGES_REQUEST["properties"]["system"],
        "tools": MESSAGES_REQUEST["properties"]["tools"],
        "tool_choice": MESSAGES_REQUEST["properties"]["tool_choice"],
        "thinking": MESSAGES_REQUEST["properties"]["thinking"],
    },
}

RESPONSES_INPUT_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"enum": ["input_text", "output_text", "text", "reasoning_text"],
                 "x-error": "only text content parts (input_text, output_text, reasoning_text) "
                            "are supported"},
        "text": {"type": "string"},
    },
}

RESPONSES_REASONING_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["summary_text", "reasoning_text"]}, "text": {"type": "string"}},
}

RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": MODEL,
        "input": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "properties": {
                    "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"],
                             "x-error": "input items must be messages, function_call, "
                                        "function_call_output or reasoning items"},
                    "summary": {"type": "array", "items": RESPONSES_REASONING_TEXT},
                    "encrypted_content": _nullable({"type": "string"}),
                    "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": {"anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": RESPONSES_INPUT_TEXT},
                    ]},
                    "id": {"type": "string"},
                    "status": _nullable({"type": "string"}),
                    "call_id": {"type": "string"},
                    "name": {"type": "string"},
                    "arguments": {"type": "string"},
                    "output": {"type": "string"},
                },
            }},
        ]},
        "instructions": _nullable({"type": "string"}),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX}),
        "temperature": _SAMPLING["temperature"],
        "top_p": _SAMPLING["top_p"],
        "stream": _SAMPLING["stream"],
        "store": _nullable({"type": "boolean"}),
        "metadata": _nullable({"type": "object"}),
        "user": {"type": "string"},
        "truncation": {"enum": ["disabled", None],
                       "x-error": "only truncation 'disabled' is supported"},
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "previous_response_id": {
            "type": "null", "x-error": "previous_response_id is not supported: responses are not "
                                       "stored; send the whole conversation in input"},
        "tools": {"type": "array", "minItems": 1, "maxItems": 128, "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"type": "null"}, {"enum": ["auto", "none", "required"]},
                                  {"type": "object"}]},
        "text": {"type": "object", "properties": {"format": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"const": "text",
                                    "x-error": "only text output is supported on /v1/responses"}},
        }}},
        "reasoning": _nullable({"type": "object", "properties": {
            "effort": {**REASONING_EFFORT,
                       "x-error": "reasoning.effort must be 'low', 'medium' or 'high'"},
            "summary": {"enum": ["auto", "concise", "detailed", None],
                        "description": "accepted; the reasoning item carries the whole thinking"},
            "generate_summary": {"enum": ["auto", "concise", "detailed", None]}},
            "description": "a reasoning model's thinking comes back as a reasoning item; models "
                           "that do not reason ignore this"}),
        "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
    },
}

#: inputs one embedding or rerank request may carry (OpenAI's limit for embeddings)
MAX_ENCODE_INPUTS = 2048
#: token ids one token-array input may carry
MAX_INPUT_TOKEN_IDS = 65536

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
_ENCODE_TRUNCATION = {
    "truncate": _nullable({"type": "boolean", "description": "cut inputs over the model's "
                           "longest to fit instead of refusing them with 400 (omlx-core "
                           "extension)"}),
    "truncate_prompt_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX,
                                         "description": "cut every input to at most this many "
                                                        "tokens (vLLM's parameter)"}),
    "keep_alive": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 32},
                             {"type": "number"}],
                   "description": "how long the model stays resident once idle (Ollama's form)"},
    "user": {"type": "string"},
}

EMBEDDINGS_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": MODEL,
        "input": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": MAX_ENCODE_INPUTS,
             "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "maxItems": MAX_INPUT_TOKEN_IDS,
             "items": _TOKEN_ID, "description": "one input's token ids"},
            {"type": "array", "minItems": 1, "maxItems": MAX_ENCODE_INPUTS,
             "items": {"type": "array", "minItems": 1, "maxItems": MAX_INPUT_TOKEN_IDS,
                       "items": _TOKEN_ID}, "description": "several inputs' token ids"},
        ], "description": "a string, an array of strings, an array of token ids, or an array "
                          f"of such arrays; at most {MAX_ENCODE_INPUTS} inputs, none empty. "
                          "Token ids are encoded as given (include the model's special tokens)",
            "x-error": "input must be a non-empty string, an array of 1 to "
                       f"{MAX_ENCODE_INPUTS} non-empty strings, an array of token ids "
                       f"(integers >= 0) or an array of 1 to {MAX_ENCODE_INPUTS} non-empty "
                       "arrays of token ids"},
        "encoding_format": _nullable({"enum": ["float", "base64"], "type": "string",
                                      "x-error": "encoding_format must be float or base64"}),
        "dimensions": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX,
                                 "description": "shorten each vector to this many values and "
                                                "normalise it again (models with Matryoshka "
                                                "training only)"}),
        "input_type": _nullable({"enum": ["query", "document"], "type": "string",
                                 "description": "query (default) puts the model's instruction, "
                                                "if it has one, before each input; document "
                                                "does not (omlx-core extension)"}),
        **_ENCODE_TRUNCATION,
    },
}

RERANK_DOCUMENT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "object", "required": ["text"],
     "properties": {"text": {"type": "string", "minLength": 1}}},
], "x-error": "each document must be a non-empty string or an object with a non-empty text"}

RERANK_REQUEST = {
    "type": "object",
    "required": ["query", "documents"],
    "properties": {
        "model": {**MODEL, "description": "a model served for reranking, or for embeddings "
                                          "(scored by cosine similarity); default: the first "
                                          "reranker, else the first embedding model"},
        "query": {"type": "string", "minLength": 1},
        "documents": {"type": "array", "minItems": 1, "maxItems": MAX_ENCODE_INPUTS,
                      "items": RERANK_DOCUMENT},
        "top_n": _nullable({"type": "integer", "minimum": 1, "maximum": INT32_MAX,
                            "description": "return only the n most relevant documents"}),
        "return_documents": _nullable({"type": "boolean"}),
        **_ENCODE_TRUNCATION,
    },
}

ERROR_RESPONSE = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
            "estimated_bytes": {"type": "integer"},
            "limit_bytes": {"type": ["integer", "null"]},
            "binding_ceiling": {"type": ["string", "null"]},
            "binding_rank": {"type": ["integer", "null"]},
            "advice": {"type": "array", "items": {"type": "string"}},
        },
    }},
}

ANTHROPIC_ERROR_RESPONSE = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}
