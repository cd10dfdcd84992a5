"""The OpenAI Responses API (``POST /v1/responses``: text output, function tools and a
reasoning model's reasoning items) and Anthropic's ``POST /v1/messages/count_tokens``.

Responses are not stored: every request carries its whole conversation in ``input``
(``previous_response_id`` is refused with a 400 that says so). The same preflight,
admission and typed errors as every route apply: a request that can never fit is a 413
before any byte, an error after the first byte is an in-band ``error`` event.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator, Mapping

import falcon

from omlx_core.engine import SamplingParams
from omlx_core.http.anthropic_api import messages_of, reasoning_of, tools_of
from omlx_core.http.body import read_request
from omlx_core.http.errors import api_error, bad_request
from omlx_core.http.schemas import COUNT_TOKENS_REQUEST, RESPONSES_REQUEST
from omlx_core.http.sse import KEEPALIVE, Responder, frame
from omlx_core.grammar.tool_events import ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from omlx_core.serving import Generation, Job, ToolRequest
from omlx_core.serving.reasoning import ReasoningRequest


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def responses_job(body: Mapping[str, Any]) -> Job:
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        thinking: list[str] = []  # a reasoning item's text, for the assistant turn after it
        for index, item in enumerate(items):
            if item.get("type") == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                thinking += [parts] if isinstance(parts, str) else [part["text"] for part in parts]
                continue
            turn = _input_item(item, index)
            if thinking and turn and turn[0]["role"] == "assistant":
                turn[0]["reasoning_content"] = "\n".join(thinking)
                thinking = []
            messages += turn
    given = body.get("max_output_tokens")
    sampling = SamplingParams(
        temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
        top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
        max_tokens=int(given) if given is not None else None)
    tools = None
    if body.get("tools"):
        # Responses tools are flat ({"type": "function", "name", "parameters"}); the
        # pipeline takes chat-completions' nested form.
        tools = ToolRequest([{"type": tool.get("type"), "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}}
            if tool.get("type") == "function" else tool for tool in body["tools"]],
            _choice(body.get("tool_choice")), body.get("parallel_tool_calls") is not False)
    effort = (body.get("reasoning") or {}).get("effort")
    return Job(body["model"], sampling, messages=messages, prompt_param="input",
               max_tokens_param="max_output_tokens", id_prefix="resp_", tools=tools,
               reasoning=ReasoningRequest(effort=effort),
               template_kwargs=dict(body.get("chat_template_kwargs") or {}))


def _choice(choice: Any) -> Any:
    """A Responses tool_choice ({"type": "function", "name"}) in chat-completions' form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice or "auto"


def _input_item(item: Mapping[str, Any], index: int) -> list[dict[str, Any]]:
    kind = item.get("type", "message")
    where = f"input[{index}]"
    if kind == "function_call":
        if not item.get("name") or not item.get("call_id"):
            raise bad_request(f"{where} (a function_call) needs call_id and name", where)
        return [{"role": "assistant", "content": None, "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}]}]
    if kind == "function_call_output":
        if not item.get("call_id"):
            raise bad_request(f"{where} (a function_call_output) needs call_id", where)
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output", "")}]
    if "role" not in item or "content" not in item:
        raise bad_request(f"{where} (a message) needs role and content", where)
    return [{"role": "system" if item["role"] == "developer" else item["role"],
             "content": _text_of(item["content"])}]


def error_frames(error: Exception) -> list[bytes]:
    rendered = api_error(error)
    return [frame({"type": "error", "code": rendered.code, "message": rendered.message,
                   "param": rendered.param, **rendered.extra}, event="error")]


class Responses:
    """``POST /v1/responses``: one assistant message of text, streamed as events or not."""

    def __init__(self, responder: Responder, max_body: int):
        self.responder = responder
        self.max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_request(req, self.max_body, RESPONSES_REQUEST)
        stream = bool(body.get("stream"))
        job = responses_job(body)
        echo = {key: body.get(key) for key in ("instructions", "max_output_tokens", "temperature",
                                                "top_p", "metadata", "user", "tools",
                                                "tool_choice", "reasoning")}
        self.responder.serve(req, resp, job, stream=stream,
                             collect=lambda generation: self.collect(generation, echo),
                             frames=lambda generation: self.events(generation, echo),
                             error_frames=error_frames)

    def _response(self, generation: Generation, echo: Mapping[str, Any], status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = ({"reason": "max_output_tokens"}
                      if generation.finish_reason == "length" else None)
        return {
            "id": generation.request_id, "object": "response", "created_at": generation.created,
            "status": status, "error": None, "incomplete_details": incomplete,
            "model": generation.model_id, "output": output,
            "instructions": echo.get("instructions"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "temperature": echo.get("temperature") if echo.get("temperature") is not None else 1.0,
            "top_p": echo.get("top_p") if echo.get("top_p") is not None else 1.0,
            "metadata": echo.get("metadata") or {}, "user": echo.get("user"),
            "parallel_tool_calls": True, "tool_choice": echo.get("tool_choice") or "auto",
            "tools": echo.get("tools") or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "reasoning": {"effort": (echo.get("reasoning") or {}).get("effort"), "summary": None},
            "usage": usage,
        }

    @staticmethod
    def _usage(generation: Generation) -> dict[str, Any]:
        usage = {"input_tokens": generation.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": generation.cached_tokens},
                 "output_tokens": generation.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": generation.reasoning_tokens},
                 "total_tokens": generation.prompt_tokens + generation.completion_tokens}
        speculative = generation.speculative_usage()
        if speculative is not None:
            usage["speculative"] = speculative  # an extension, as on the other APIs
        return usage

    @staticmethod
    def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]
                if status == "completed" else []}

    def _status(self, generation: Generation) -> str:
        return "incomplete" if generation.finish_reason == "length" else "completed"

    @staticmethod
    def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def collect(self, generation: Generation, echo: Mapping[str, Any]) -> dict[str, Any]:
        text, thinking = [], []
        for delta in generation.deltas():
            text.append(delta.text)
            thinking.append(delta.reasoning)
        if generation.finish_reason not in ("stop", "length"):
            raise api_error(generation.failure or RuntimeError("generation failed"))
        output = [self._reasoning(f"rs_{uuid.uuid4().hex}", "".join(thinking), "completed")] \
            if any(thinking) else []
        if any(text) or not (generation.tool_calls or output):
            output.append(self._message(f"msg_{uuid.uuid4().hex}", "".join(text), "completed"))
        output += [_function_call(f"fc_{uuid.uuid4().hex}", call.id, call.name, call.arguments,
                                  "completed") for call in generation.tool_calls]
        return self._response(generation, echo, self._status(generation), output,
                              self._usage(generation))

    def events(self, generation: Generation, echo: Mapping[str, Any]) -> Iterator[bytes]:
        sequence = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> bytes:
            return frame({"type": kind, "sequence_number": next(sequence), **fields}, event=kind)

        yield event("response.created",
                    response=self._response(generation, echo, "in_progress", [], None))
        yield event("response.in_progress",
                    response=self._response(generation, echo, "in_progress", [], None))
        items = _OutputItems(event, self._reasoning, self._message)
        for delta in generation.deltas():
            if delta.keepalive:
                yield KEEPALIVE
                continue
            if delta.reasoning:
                yield from items.reasoning(delta.reasoning)
            if delta.text:
                yield from items.text(delta.text)
            for tool_event in delta.tool_events:
                if isinstance(tool_event, ToolCallStart):
                    yield from items.close()
                    yield from items.open_call(_function_call(
                        f"fc_{uuid.uuid4().hex}", tool_event.id, tool_event.name, "", "in_progress"),
                        tool_event.index)
                elif isinstance(tool_event, ToolCallArgumentsDelta) and tool_event.text:
                    yield from items.arguments(tool_event.index, tool_event.text)
                elif isinstance(tool_event, ToolCallEnd):
                    yield from items.end_call(tool_event.index, tool_event.call.arguments)
        if generation.finish_reason not in ("stop", "length"):
            yield from self.responder.stream_error(generation, error_frames)
            return
        if not items.output and items.open_kind is None:
            yield from items.text("")  # a response always says something, if only nothing
        yield from items.close()
        status = self._status(generation)
        yield event(f"response.{status}", response=self._response(
            generation, echo, status, items.output, self._usage(generation)))


class _OutputItems:
    """The output items of a streamed response, opened as their first piece arrives (a
    reasoning item, a message, function calls) and closed when the next begins."""

    def __init__(self, event: Any, reasoning_item: Any, message_item: Any) -> None:
        self.event = event
        self.reasoning_item = reasoning_item
        self.message_item = message_item
        self.output: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.item_id = ""
        self.parts: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its open item

    @property
    def index(self) -> int:
        return len(self.output)

    def reasoning(self, text: str) -> Iterator[bytes]:
        if self.open_kind != "reasoning":
            yield from self.close()
            self.open_kind, self.item_id, self.parts = "reasoning", f"rs_{uuid.uuid4().hex}", []
            yield self.event("response.output_item.added", output_index=self.index,
                             item=self.reasoning_item(self.item_id, "", "in_progress"))
        self.parts.append(text)
        yield self.event("response.reasoning_text.delta", item_id=self.item_id,
                         output_index=self.index, content_index=0, delta=text)

    def text(self, text: str) -> Iterator[bytes]:
        if self.open_kind != "message":
            yield from self.close()
            self.open_kind, self.item_id, self.parts = "message", f"msg_{uuid.uuid4().hex}", []
            yield self.event("response.output_item.added", output_index=self.index,
                             item=self.message_item(self.item_id, "", "in_progress"))
            yield self.event("response.content_part.added", item_id=self.item_id,
                             output_index=self.index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})
        if text:
            self.parts.append(text)
            yield self.event("response.output_text.delta", item_id=self.item_id,
                             output_index=self.index, content_index=0, delta=text, logprobs=[])

    def close(self) -> Iterator[bytes]:
        whole = "".join(self.parts)
        if self.open_kind == "reasoning":
            item = self.reasoning_item(self.item_id, whole, "completed")
            yield self.event("response.reasoning_text.done", item_id=self.item_id,
                             output_index=self.index, content_index=0, text=whole)
            yield self.event("response.output_item.done", output_index=self.index, item=item)
            self.output.append(item)
        elif self.open_kind == "message":
            item = self.message_item(self.item_id, whole, "completed")
            yield self.event("response.output_text.done", item_id=self.item_id,
                             output_index=self.index, content_index=0, text=whole, logprobs=[])
            yield self.event("response.content_part.done", item_id=self.item_id,
                             output_index=self.index, content_index=0, part=item["content"][0])
            yield self.event("response.output_item.done", output_index=self.index, item=item)
            self.output.append(item)
        self.open_kind, self.parts = None, []

    def open_call(self, item: dict[str, Any], index: int) -> Iterator[bytes]:
        self.calls[index] = item
        yield self.event("response.output_item.added", output_index=self.index, item=item)

    def arguments(self, index: int, text: str) -> Iterator[bytes]:
        item = self.calls.get(index)
        if item is not None:
            item["arguments"] += text
            yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=self.index, delta=text)

    def end_call(self, index: int, arguments: str) -> Iterator[bytes]:
        item = self.calls.pop(index, None)
        if item is not None:
            item.update(arguments=arguments, status="completed")
            yield self.event("response.function_call_arguments.done", item_id=item["id"],
                             output_index=self.index, arguments=item["arguments"])
            yield self.event("response.output_item.done", output_index=self.index, item=item)
            self.output.append(item)


def _function_call(item_id: str, call_id: str, name: str, arguments: str,
                   status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class CountTokens:
    """``POST /v1/messages/count_tokens``: the prompt tokens of a Messages request."""

    def __init__(self, responder: Responder, max_body: int):
        self.pipeline = responder.pipeline
        self.max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_request(req, self.max_body, COUNT_TOKENS_REQUEST)
        job = Job(body["model"], SamplingParams(), messages=messages_of(body),
                  tools=tools_of(body), reasoning=reasoning_of(body))
        resp.media = {"input_tokens": self.pipeline.count_tokens(job)}

