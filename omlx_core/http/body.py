"""Reading a JSON request body: media type, size limit (before and while reading), syntax."""

from __future__ import annotations

import json
from typing import Any, Mapping

import falcon

from omlx_core.http.errors import ContentTooLargeError, UnsupportedMediaTypeError, bad_request
from omlx_core.http.validation import SchemaViolation, validate
from omlx_core.settings import format_size

JSON_MEDIA_TYPES = ("application/json",)


def _too_large(max_body: int, size: str) -> ContentTooLargeError:
    return ContentTooLargeError(f"the request body is {size}, over this server's "
                                f"{format_size(max_body)} limit (server.max_body)",
                                "request_too_large")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def read_json(req: falcon.Request, max_body: int) -> dict[str, Any]:
    """The body as a JSON object, or an ``APIError`` that says what is wrong with it."""
    media_type = (req.content_type or "").split(";", 1)[0].strip().lower()
    if media_type not in JSON_MEDIA_TYPES and not media_type.endswith("+json"):
        sent = f"Content-Type {media_type!r} is" if media_type else "a body without a Content-Type is"
        raise UnsupportedMediaTypeError(f"{sent} not supported; send the body as JSON with "
                                        "Content-Type: application/json")
    length = req.content_length  # falcon answers 400 itself when the header is not a number
    if length is not None and length > max_body:
        raise _too_large(max_body, format_size(length))
    data = req.bounded_stream.read(max_body + 1)
    if len(data) > max_body:
        raise _too_large(max_body, f"over {format_size(max_body)}")
    if not data.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8 (byte {exc.start})",
                          code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}", code="invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}",
                          code="invalid_json")
    return body


def read_request(req: falcon.Request, max_body: int, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The body, checked against ``schema`` (the one published in /openapi.json)."""
    body = read_json(req, max_body)
    try:
        validate(body, schema)
    except SchemaViolation as violation:
        raise bad_request(violation.message, violation.param) from None
    return body
