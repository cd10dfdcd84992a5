"""The Anthropic Messages endpoint: ``POST /v1/messages``, streaming events and not,
with tools (``tool_use`` blocks out, ``tool_result`` blocks in) and a reasoning model's
thinking (``thinking`` blocks out, streamed as ``thinking_delta``; a previous turn's
thinking blocks in; ``thinking.budget_tokens`` caps it)."""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

import falcon

from omlx_core.engine import ImagePart, SamplingParams
from omlx_core.http.body import read_request
from omlx_core.http.errors import anthropic_error_body, api_error, bad_request
from omlx_core.http.images import anthropic_image
from omlx_core.http.schemas import MESSAGES_REQUEST
from omlx_core.http.sse import Responder, frame
from omlx_core.grammar.tool_events import ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from omlx_core.serving import Generation, Job, ToolRequest
from omlx_core.serving.reasoning import ReasoningRequest


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if block["type"] == "text")


def _with_images(content: list[Mapping[str, Any]], index: int,
                 images: list[ImagePart]) -> list[dict[str, Any]]:
    """Text and image blocks as chat content parts (image blocks as ImageParts)."""
    parts: list[dict[str, Any]] = []
    for position, block in enumerate(content):
        if block["type"] == "image":
            images.append(anthropic_image(block, f"messages[{index}].content[{position}]", len(images)))
            parts.append({"type": "image", "image": images[-1]})
        elif block["type"] == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
    return parts


def _chat_messages(message: Mapping[str, Any], index: int, images: list[ImagePart]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become ``tool`` messages,
    tool uses the assistant's ``tool_calls``, image blocks image parts."""
    content = message["content"]
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if any(b["type"] == "image" for b in content):
        if any(b["type"] in ("tool_use", "tool_result") for b in content):
            raise bad_request(f"messages[{index}]: send images in a message of their own, not "
                              "next to tool_use or tool_result blocks", f"messages[{index}].content")
        return [{"role": message["role"], "content": _with_images(content, index, images)}]
    out: list[dict[str, Any]] = []
    results = [b for b in content if b["type"] == "tool_result"]
    for block in results:
        out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                    "content": _text(block.get("content") or "")})
    uses = [b for b in content if b["type"] == "tool_use"]
    text = _text(content)
    # A previous turn's thinking comes back for templates that render it; redacted
    # thinking (another server's, encrypted) cannot be read and is left out.
    thinking = "".join(b.get("thinking", "") for b in content if b["type"] == "thinking")
    if uses:
        out.append({"role": "assistant", "content": text or None, "tool_calls": [
            {"id": b.get("id", ""), "type": "function",
             "function": {"name": b.get("name", ""), "arguments": json.dumps(b.get("input") or {})}}
            for b in uses]})
    elif text or not results:
        out.append({"role": message["role"], "content": text})
    if thinking and message["role"] == "assistant" and out and out[-1]["role"] == "assistant":
        out[-1]["reasoning_content"] = thinking
    return out


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages (or count_tokens) request, the system prompt first."""
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"])})
    images: list[ImagePart] = []
    return messages + [m for index, message in enumerate(body["messages"])
                       for m in _chat_messages(message, index, images)]


def tools_of(body: Mapping[str, Any]) -> ToolRequest | None:
    if not body.get("tools"):
        return None
    choice = body.get("tool_choice") or {"type": "auto"}
    return ToolRequest(body["tools"], choice, not choice.get("disable_parallel_tool_use", False))


def reasoning_of(body: Mapping[str, Any]) -> ReasoningRequest:
    """What ``thinking`` asks: thinking on (``enabled``, with its budget), off
    (``disabled``) or the model's choice (``adaptive``, or no ``thinking``)."""
    thinking = body.get("thinking") or {}
    kind = thinking.get("type")
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if budget is not None and "max_tokens" in body and budget > body["max_tokens"]:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be at most max_tokens "
                          f"({body['max_tokens']}): thinking counts toward max_tokens",
                          "thinking.budget_tokens")
    return ReasoningRequest(enabled={"enabled": True, "disabled": False}.get(kind),
                            budget_tokens=budget, budget_param="thinking.budget_tokens")


def messages_job(body: Mapping[str, Any]) -> Job:
    messages = messages_of(body)
    sampling = SamplingParams(
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        top_k=int(body.get("top_k", 0)),
        max_tokens=int(body["max_tokens"]),
        stop=tuple(body.get("stop_sequences") or ()),
    )
    # Anthropic clients treat max_tokens as a cap and often send more than a small
    # model's context holds; it is shortened to fit rather than refused.
    return Job(body["model"], sampling, messages=messages, prompt_param="messages",
               max_tokens_param="max_tokens", max_tokens_is_cap=True, id_prefix="msg_",
               tools=tools_of(body), reasoning=reasoning_of(body),
               cache_salt=body.get("cache_salt"))


def _stop_reason(generation: Generation) -> str:
    if generation.tool_calls:
        return "tool_use"
    if generation.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if generation.finish_reason == "length" else "end_turn"


def _usage(generation: Generation) -> dict[str, Any]:
    usage = {"input_tokens": generation.prompt_tokens,
             "output_tokens": generation.completion_tokens,
             "cache_read_input_tokens": generation.cached_tokens, "cache_creation_input_tokens": 0}
    speculative = generation.speculative_usage()
    if speculative is not None:
        usage["speculative"] = speculative  # an extension: Anthropic's usage has no such field
    return usage


def error_frames(error: Exception) -> list[bytes]:
    """An error after the first byte, in-band: Anthropic's ``error`` event."""
    rendered = api_error(error)
    return [frame(anthropic_error_body(rendered.status_code, rendered.message, rendered.code,
                                       rendered.extra), event="error")]


def _event(kind: str, **fields: Any) -> bytes:
    return frame({"type": kind, **fields}, event=kind)


class Messages:
    def __init__(self, responder: Responder, max_body: int):
        self.responder = responder
        self.max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_request(req, self.max_body, MESSAGES_REQUEST)
        stream = bool(body.get("stream"))
        show_thinking = (body.get("thinking") or {}).get("display") != "omitted"
        self.responder.serve(req, resp, messages_job(body), stream=stream,
                             collect=lambda generation: self.collect(generation, show_thinking),
                             frames=lambda generation: self.events(generation, show_thinking),
                             error_frames=error_frames)

    def _message(self, generation: Generation, content: list, stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": generation.request_id, "type": "message", "role": "assistant",
                "model": generation.model_id, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def collect(self, generation: Generation, show_thinking: bool = True) -> dict[str, Any]:
        text, thinking = [], []
        for delta in generation.deltas():
            text.append(delta.text)
            thinking.append(delta.reasoning)
        if generation.finish_reason not in ("stop", "length"):
            raise api_error(generation.failure or RuntimeError("generation failed"))
        content: list[dict[str, Any]] = []
        if any(thinking):
            content.append(_thinking_block("".join(thinking) if show_thinking else ""))
        if any(text) or not (generation.tool_calls or content):
            content.append({"type": "text", "text": "".join(text)})
        content += [{"type": "tool_use", "id": call.id, "name": call.name,
                     "input": call.arguments_json()} for call in generation.tool_calls]
        return self._message(generation, content, _stop_reason(generation),
                             generation.stop_sequence, _usage(generation))

    def events(self, generation: Generation, show_thinking: bool = True) -> Iterator[bytes]:
        start_usage = {**_usage(generation), "output_tokens": 0}
        yield _event("message_start", message=self._message(generation, [], None, None, start_usage))
        blocks = _Blocks()
        for delta in generation.deltas():
            if delta.keepalive:
                yield _event("ping")
                continue
            if delta.reasoning:
                yield from blocks.open("thinking", _thinking_block(""))
                if show_thinking:
                    yield _event("content_block_delta", index=blocks.index,
                                 delta={"type": "thinking_delta", "thinking": delta.reasoning})
            if delta.text:
                yield from blocks.open("text", {"type": "text", "text": ""})
                yield _event("content_block_delta", index=blocks.index,
                             delta={"type": "text_delta", "text": delta.text})
            for event in delta.tool_events:
                if isinstance(event, ToolCallStart):
                    yield from blocks.open(f"tool_use:{event.index}", {
                        "type": "tool_use", "id": event.id, "name": event.name, "input": {}})
                elif isinstance(event, ToolCallArgumentsDelta) and event.text \
                        and blocks.kind == f"tool_use:{event.index}":
                    yield _event("content_block_delta", index=blocks.index,
                                 delta={"type": "input_json_delta", "partial_json": event.text})
                elif isinstance(event, ToolCallEnd) and blocks.kind == f"tool_use:{event.index}":
                    yield from blocks.close()
        if generation.finish_reason not in ("stop", "length"):
            yield from self.responder.stream_error(generation, error_frames)
            return
        if blocks.index < 0:  # nothing was said: one empty text block, as a reply always has
            yield from blocks.open("text", {"type": "text", "text": ""})
        yield from blocks.close()
        final_usage: dict[str, Any] = {"output_tokens": generation.completion_tokens}
        speculative = generation.speculative_usage()
        if speculative is not None:
            final_usage["speculative"] = speculative
        yield _event("message_delta",
                     delta={"stop_reason": _stop_reason(generation),
                            "stop_sequence": generation.stop_sequence},
                     usage=final_usage)
        yield _event("message_stop")


def _thinking_block(text: str) -> dict[str, Any]:
    # The signature proves to Anthropic's servers that they wrote the thinking; a local
    # model's has nothing to prove, and thinking sent back is accepted unsigned.
    return {"type": "thinking", "thinking": text, "signature": ""}


class _Blocks:
    """The content blocks of a streamed message: which one is open, and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def open(self, kind: str, block: dict[str, Any]) -> Iterator[bytes]:
        """Open a block of ``kind`` unless it is the one open (closing the open one)."""
        if self.kind == kind:
            return
        yield from self.close()
        self.index += 1
        self.kind = kind
        yield _event("content_block_start", index=self.index, content_block=block)
        if self.index == 0:
            yield _event("ping")  # where Anthropic's own stream sends its first

    def close(self) -> Iterator[bytes]:
        if self.kind is not None:
            yield _event("content_block_stop", index=self.index)
            self.kind = None
