"""The OpenAI-compatible endpoints: chat completions, completions and models."""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping

import falcon

from omlx_core.config.keep_alive import parse_keep_alive

from omlx_core.engine import ImagePart, SamplingParams
from omlx_core.grammar import GrammarSpec
from omlx_core.http.body import read_request
from omlx_core.http.errors import api_error, bad_request, openai_error_body
from omlx_core.http.images import openai_image
from omlx_core.http.schemas import CHAT_COMPLETION_REQUEST, COMPLETION_REQUEST
from omlx_core.http.sse import KEEPALIVE, Responder, frame
from omlx_core.grammar.tool_events import ToolCallArgumentsDelta, ToolCallStart
from omlx_core.serving import Generation, Job, ToolRequest
from omlx_core.serving.reasoning import ReasoningRequest
from omlx_core.serving.output import LogprobEntry

DONE = b"data: [DONE]\n\n"
FINISH_REASONS = {"stop": "stop", "length": "length"}


def _get(body: Mapping[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def grammar_of(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    """The grammar an OpenAI ``response_format`` asks for (``None`` for plain text)."""
    if not response_format or response_format["type"] == "text":
        return None
    if response_format["type"] == "json_object":
        return GrammarSpec.any_json(field="response_format")
    if response_format["type"] == "regex":
        return GrammarSpec.regex(response_format.get("regex", ""), field="response_format.regex")
    if response_format["type"] == "grammar":
        return GrammarSpec.ebnf(response_format.get("grammar", ""), field="response_format.grammar")
    spec = response_format.get("json_schema")
    if spec is None:
        raise bad_request("response_format of type json_schema needs a json_schema object "
                          "with a name and a schema", "response_format.json_schema")
    return GrammarSpec.json_schema(spec.get("schema", True),
                                   strict=bool(spec.get("strict") or False),
                                   field="response_format.json_schema.schema")


def sampling_from(body: Mapping[str, Any], max_tokens: int | None,
                  logprobs: int | None) -> SamplingParams:
    """Sampling parameters shared by chat and text completions (already schema-checked)."""
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(
        temperature=float(_get(body, "temperature", 1.0)),
        top_p=float(_get(body, "top_p", 1.0)),
        top_k=int(_get(body, "top_k", 0)),
        min_p=float(_get(body, "min_p", 0.0)),
        seed=int(body["seed"]) if body.get("seed") is not None else None,
        max_tokens=max_tokens,
        stop=stops,
        repetition_penalty=float(_get(body, "repetition_penalty", 1.0)),
        presence_penalty=float(_get(body, "presence_penalty", 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", 0.0)),
        logit_bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()},
        logprobs=logprobs,
        grammar=grammar_of(body.get("response_format")),
    )


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return stream, bool((options or {}).get("include_usage"))


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _content(content: Any, index: int, images: list[ImagePart]) -> Any:
    """Text, or a list of text and image parts when the message has images."""
    if isinstance(content, str) or not any(part["type"] == "image_url" for part in content):
        for position, part in enumerate(content if not isinstance(content, str) else ()):
            if not isinstance(part.get("text"), str):
                param = f"messages[{index}].content[{position}].text"
                raise bad_request(f"{param} is missing: a text part needs its text", param)
        return _message_text(content)
    parts: list[dict[str, Any]] = []
    for position, part in enumerate(content):
        param = f"messages[{index}].content[{position}]"
        if part["type"] == "image_url":
            images.append(openai_image(part, param, len(images)))
            parts.append({"type": "image", "image": images[-1]})
        elif not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.text is missing: a text part needs its text", f"{param}.text")
        else:
            parts.append({"type": "text", "text": part["text"]})
    return parts


def _chat_message(message: Mapping[str, Any], index: int, images: list[ImagePart]) -> dict[str, Any]:
    role = "system" if message["role"] == "developer" else message["role"]
    content = message.get("content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise bad_request(f"messages[{index}].content is missing; only an assistant message "
                          "with tool_calls may leave it out", f"messages[{index}].content")
    result: dict[str, Any] = {"role": role,
                              "content": None if content is None else _content(content, index, images)}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            result[key] = message[key]
    thinking = message.get("reasoning_content") or message.get("reasoning")
    if role == "assistant" and thinking:
        result["reasoning_content"] = thinking
    return result


def chat_job(body: Mapping[str, Any]) -> Job:
    images: list[ImagePart] = []
    messages = [_chat_message(m, i, images) for i, m in enumerate(body["messages"])]
    given = body.get("max_completion_tokens")
    param = "max_completion_tokens"
    if given is None:
        given, param = body.get("max_tokens"), "max_tokens"
    logprobs = None
    if body.get("logprobs"):
        logprobs = int(_get(body, "top_logprobs", 0))
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = sampling_from(body, int(given) if given is not None else None, logprobs)
    tools = None
    if body.get("tools"):
        tools = ToolRequest(body["tools"], body.get("tool_choice") or "auto",
                            body.get("parallel_tool_calls") is not False)
    return Job(body["model"], sampling, messages=messages, prompt_param="messages",
               max_tokens_param=param, id_prefix="chatcmpl-", tools=tools,
               reasoning=_reasoning(body, given, param),
               template_kwargs=dict(body.get("chat_template_kwargs") or {}),
               keep_alive=_keep_alive(body), cache_salt=body.get("cache_salt"))


def _reasoning(body: Mapping[str, Any], max_tokens: int | None, max_param: str) -> ReasoningRequest:
    budget = body.get("thinking_token_budget")
    if budget is not None and max_tokens is not None and budget > max_tokens:
        raise bad_request(f"thinking_token_budget ({budget}) must be at most {max_param} "
                          f"({max_tokens}): thinking counts toward it", "thinking_token_budget")
    return ReasoningRequest(effort=body.get("reasoning_effort"), budget_tokens=budget,
                            budget_param="thinking_token_budget")


def completion_job(body: Mapping[str, Any]) -> Job:
    prompt = body["prompt"]
    text, token_ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif all(isinstance(p, str) for p in prompt):
        text = prompt[0]
    else:
        token_ids = [int(t) for t in prompt]
    given = body.get("max_tokens")
    logprobs = body.get("logprobs")
    sampling = sampling_from(body, int(given) if given is not None else None,
                             int(logprobs) if logprobs is not None else None)
    return Job(body["model"], sampling, text=text, token_ids=token_ids, prompt_param="prompt",
               id_prefix="cmpl-", keep_alive=_keep_alive(body), cache_salt=body.get("cache_salt"))


def _keep_alive(body: Mapping[str, Any]) -> Any:
    """The request's ``keep_alive`` (an omlx-core extension in Ollama's forms), checked."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        parse_keep_alive(value)
    except ValueError as exc:
        raise bad_request(f"keep_alive: {exc}", "keep_alive", "invalid_keep_alive") from None
    return value


def usage_of(generation: Generation) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": generation.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": generation.reasoning_tokens},
    }
    speculative = generation.speculative_usage()
    if speculative is not None:
        # OpenAI's names for predicted tokens the model kept or threw away, and the
        # engine's own summary beside them.
        drafted, accepted = generation.draft_tokens, generation.accepted_draft_tokens
        usage["completion_tokens_details"].update(accepted_prediction_tokens=accepted,
                                                  rejected_prediction_tokens=drafted - accepted)
        usage["speculative"] = speculative
    return usage


def _finish_reason(generation: Generation) -> str:
    if generation.tool_calls:
        return "tool_calls"
    return FINISH_REASONS[generation.finish_reason]


def _tool_call_delta(event: Any) -> dict[str, Any] | None:
    """One tool-call event as an element of OpenAI's ``delta.tool_calls``."""
    if isinstance(event, ToolCallStart):
        return {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
    if isinstance(event, ToolCallArgumentsDelta) and event.text:
        return {"index": event.index, "function": {"arguments": event.text}}
    return None


def error_frames(error: Exception) -> list[bytes]:
    """An error after the first byte, in-band: the error object as an event, then [DONE]."""
    rendered = api_error(error)
    return [frame(openai_error_body(rendered.status_code, rendered.message, rendered.code,
                                    rendered.param, rendered.extra)), DONE]


class _Logprobs:
    """Turns the pipeline's logprob entries into the two OpenAI shapes (chat and legacy
    completions)."""

    def __init__(self) -> None:
        self._offset = 0

    def chat(self, logprobs: tuple[LogprobEntry, ...]) -> dict[str, Any]:
        return {"content": [self._chat_entry(lp) for lp in logprobs], "refusal": None}

    def _chat_entry(self, lp: LogprobEntry) -> dict[str, Any]:
        entry = self._token(lp)
        entry["top_logprobs"] = [self._token(t) for t in lp.top]
        return entry

    @staticmethod
    def _token(lp: LogprobEntry) -> dict[str, Any]:
        return {"token": _text_of(lp), "logprob": lp.logprob, "bytes": list(lp.bytes)}

    def completion(self, logprobs: tuple[LogprobEntry, ...]) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in logprobs:
            text = _text_of(lp)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_text_of(t): t.logprob for t in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


def _text_of(lp: LogprobEntry) -> str:
    return lp.bytes.decode("utf-8", errors="replace")


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged


class _Completions:
    """What chat completions and text completions share: run, stream or collect."""

    schema: Mapping[str, Any] = {}

    def __init__(self, responder: Responder, max_body: int):
        self.responder = responder
        self.max_body = max_body

    def job(self, body: Mapping[str, Any]) -> Job:
        raise NotImplementedError

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_request(req, self.max_body, self.schema)
        job = self.job(body)
        stream, include_usage = _stream_flags(body)
        self.responder.serve(req, resp, job, stream=stream, collect=self.collect,
                             frames=lambda generation: self.frames(generation, include_usage),
                             error_frames=error_frames)

    def collect(self, generation: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def frames(self, generation: Generation, include_usage: bool) -> Iterator[bytes]:
        raise NotImplementedError

    def _head(self, generation: Generation, object_name: str) -> dict[str, Any]:
        return {"id": generation.request_id, "object": object_name, "created": generation.created,
                "model": generation.model_id, "system_fingerprint": None}

    def _ended_in_error(self, generation: Generation) -> bool:
        return generation.finish_reason not in FINISH_REASONS

    def _raise_generation_error(self, generation: Generation) -> None:
        raise api_error(generation.failure or RuntimeError("generation failed"))


class ChatCompletions(_Completions):
    schema = CHAT_COMPLETION_REQUEST

    def job(self, body: Mapping[str, Any]) -> Job:
        return chat_job(body)

    def collect(self, generation: Generation) -> dict[str, Any]:
        wants_logprobs = generation.sampling.logprobs is not None
        logprobs = _Logprobs() if wants_logprobs else None
        text, thinking, entries = [], [], []
        for delta in generation.deltas():
            text.append(delta.text)
            thinking.append(delta.reasoning)
            if logprobs is not None and delta.logprobs:
                entries.extend(logprobs.chat(delta.logprobs)["content"])
        if self._ended_in_error(generation):
            self._raise_generation_error(generation)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text), "refusal": None}
        if any(thinking):
            message["reasoning_content"] = "".join(thinking)
        calls = generation.tool_calls
        if calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls]
        return {**self._head(generation, "chat.completion"), "choices": [{
            "index": 0, "message": message,
            "logprobs": {"content": entries, "refusal": None} if wants_logprobs else None,
            "finish_reason": _finish_reason(generation),
        }], "usage": usage_of(generation)}

    def frames(self, generation: Generation, include_usage: bool) -> Iterator[bytes]:
        head = self._head(generation, "chat.completion.chunk")
        usage_field = {"usage": None} if include_usage else {}
        logprobs = _Logprobs() if generation.sampling.logprobs is not None else None

        def chunk(delta: dict[str, Any], finish: str | None = None,
                  token_logprobs: Any = None) -> bytes:
            return frame({**head, "choices": [{"index": 0, "delta": delta,
                                               "logprobs": token_logprobs,
                                               "finish_reason": finish}], **usage_field})

        yield chunk({"role": "assistant", "content": ""})
        for delta in generation.deltas():
            if delta.keepalive:
                yield KEEPALIVE
                continue
            entries = logprobs.chat(delta.logprobs) if logprobs and delta.logprobs else None
            if delta.reasoning:
                yield chunk({"reasoning_content": delta.reasoning})
            if delta.text or entries:
                yield chunk({"content": delta.text}, token_logprobs=entries)
            calls = [_tool_call_delta(event) for event in delta.tool_events]
            if any(calls):
                yield chunk({"tool_calls": [c for c in calls if c]})
        if self._ended_in_error(generation):
            yield from self.responder.stream_error(generation, error_frames)
            return
        yield chunk({}, _finish_reason(generation))
        if include_usage:
            yield frame({**head, "choices": [], "usage": usage_of(generation)})
        yield DONE


class TextCompletions(_Completions):
    schema = COMPLETION_REQUEST

    def job(self, body: Mapping[str, Any]) -> Job:
        return completion_job(body)

    def collect(self, generation: Generation) -> dict[str, Any]:
        logprobs = _Logprobs() if generation.sampling.logprobs is not None else None
        text, parts = [], []
        for delta in generation.deltas():
            text.append(delta.text)
            if logprobs is not None and delta.logprobs:
                parts.append(logprobs.completion(delta.logprobs))
        if self._ended_in_error(generation):
            self._raise_generation_error(generation)
        return {**self._head(generation, "text_completion"), "choices": [{
            "index": 0, "text": "".join(text),
            "logprobs": _merge_completion_logprobs(parts) if logprobs is not None else None,
            "finish_reason": FINISH_REASONS[generation.finish_reason],
        }], "usage": usage_of(generation)}

    def frames(self, generation: Generation, include_usage: bool) -> Iterator[bytes]:
        head = self._head(generation, "text_completion")
        usage_field = {"usage": None} if include_usage else {}
        logprobs = _Logprobs() if generation.sampling.logprobs is not None else None

        def chunk(text: str, finish: str | None = None, token_logprobs: Any = None) -> bytes:
            return frame({**head, "choices": [{"index": 0, "text": text,
                                               "logprobs": token_logprobs,
                                               "finish_reason": finish}], **usage_field})

        for delta in generation.deltas():
            if delta.keepalive:
                yield KEEPALIVE
                continue
            entries = logprobs.completion(delta.logprobs) if logprobs and delta.logprobs else None
            yield chunk(delta.text, token_logprobs=entries)
        if self._ended_in_error(generation):
            yield from self.responder.stream_error(generation, error_frames)
            return
        yield chunk("", FINISH_REASONS[generation.finish_reason])
        if include_usage:
            yield frame({**head, "choices": [], "usage": usage_of(generation)})
        yield DONE


class Models:
    """``GET /v1/models``: every available model, in OpenAI's list shape, each with the
    pool's view of it (state, bytes, pinned, last used, engine, context length)."""

    def __init__(self, responder: Responder):
        self.pipeline = responder.pipeline
        self.started = int(time.time())

    def _entry(self, model_id: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": model_id, "object": "model", "created": self.started,
                                 "owned_by": "omlx-core"}
        pool = self.pipeline.context.pool
        record = pool.record(model_id) if pool is not None else None
        if record is not None:
            entry.update(pool.describe(record))
        elif model_id in self.pipeline.context.engines:
            entry["state"] = "resident"
        return entry

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"object": "list",
                      "data": [self._entry(m) for m in self.pipeline.available()]}

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        if model_id not in self.pipeline.available():
            self.pipeline.engine(model_id)  # the 404 naming the available models
        resp.media = self._entry(model_id)
