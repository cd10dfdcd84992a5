"""The Anthropic Messages endpoint: ``POST /v1/messages``, streaming events and not."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import falcon

from omlx_core.engine import SamplingParams
from omlx_core.http.body import read_request
from omlx_core.http.errors import anthropic_error_body, api_error
from omlx_core.http.schemas import MESSAGES_REQUEST
from omlx_core.http.sse import Responder, frame
from omlx_core.serving import Generation, Job


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(block["text"] for block in content)


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages (or count_tokens) request, the system prompt first."""
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"])})
    return messages + [{"role": m["role"], "content": _text(m["content"])}
                       for m in body["messages"]]


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
               max_tokens_param="max_tokens", max_tokens_is_cap=True, id_prefix="msg_")


def _stop_reason(generation: Generation) -> str:
    if generation.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if generation.finish_reason == "length" else "end_turn"


def _usage(generation: Generation) -> dict[str, Any]:
    return {"input_tokens": generation.prompt_tokens, "output_tokens": generation.completion_tokens,
            "cache_read_input_tokens": generation.cached_tokens, "cache_creation_input_tokens": 0}


def error_frames(error: Exception) -> list[bytes]:
    """An error after the first byte, in-band: Anthropic's ``error`` event."""
    rendered = api_error(error)
    return [frame(anthropic_error_body(rendered.status, rendered.message, rendered.code,
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
        generation = self.responder.start(messages_job(body), req, stream=stream)
        self.responder.respond(resp, generation, stream=stream,
                               collect=self.collect, frames=lambda: self.events(generation),
                               error_frames=error_frames)

    def _message(self, generation: Generation, content: list, stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": generation.request_id, "type": "message", "role": "assistant",
                "model": generation.model_id, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def collect(self, generation: Generation) -> dict[str, Any]:
        text = "".join(delta.text for delta in generation.deltas())
        if generation.finish_reason not in ("stop", "length"):
            raise api_error(generation.failure or RuntimeError("generation failed"))
        return self._message(generation, [{"type": "text", "text": text}], _stop_reason(generation),
                             generation.stop_sequence, _usage(generation))

    def events(self, generation: Generation) -> Iterator[bytes]:
        start_usage = {**_usage(generation), "output_tokens": 0}
        yield _event("message_start", message=self._message(generation, [], None, None, start_usage))
        yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield _event("ping")
        for delta in generation.deltas():
            if delta.keepalive:
                yield _event("ping")
            elif delta.text:
                yield _event("content_block_delta", index=0,
                             delta={"type": "text_delta", "text": delta.text})
        if generation.finish_reason not in ("stop", "length"):
            yield from self.responder.stream_error(generation, error_frames)
            return
        yield _event("content_block_stop", index=0)
        yield _event("message_delta",
                     delta={"stop_reason": _stop_reason(generation),
                            "stop_sequence": generation.stop_sequence},
                     usage={"output_tokens": generation.completion_tokens})
        yield _event("message_stop")
