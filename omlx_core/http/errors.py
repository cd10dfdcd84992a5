"""Errors a client can act on, and how each API spells them.

A responder raises :class:`APIError` (or a falcon ``HTTPError``), or lets a typed error
of the serving pipeline through; :func:`api_error` is the one mapping from those to an
HTTP status, code and fields, used before the first byte (the handlers here) and after
it (in-band stream errors). The handlers render an OpenAI error object, or on
``/v1/messages`` an Anthropic one. Only a genuine bug reaches the catch-all, which logs
it and answers a JSON 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import falcon

from omlx_core.grammar import GrammarError
from omlx_core.memory.types import RequestRejected
from omlx_core.serving import EngineFailed, InvalidRequest, RequestAborted, UnknownModel

log = logging.getLogger(__name__)

ANTHROPIC_PATH_PREFIX = "/v1/messages"

_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 503: "overloaded_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
}


class APIError(Exception):
    """An HTTP error with a message that says what is wrong and how to fix it.

    ``extra`` fields are added to the error object as they are (e.g. the byte counts of
    a memory rejection); ``headers`` are sent with the response (``Retry-After``).
    """

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, extra: Mapping[str, Any] | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def rejection_error(error: RequestRejected) -> APIError:
    """A memory refusal: 413 when the request can never fit here (preflight), else 503
    with ``Retry-After`` (memory is short now; the same request can succeed later)."""
    rejection = error.rejection
    breakdown = rejection.breakdown
    extra: dict[str, Any] = {
        "stage": rejection.stage, "cause": rejection.cause,
        "estimated_bytes": rejection.estimated_bytes, "limit_bytes": rejection.limit_bytes,
        "base_bytes": rejection.base_bytes, "binding_ceiling": rejection.binding,
        "ceilings": breakdown.ceilings() if breakdown is not None else {},
        "prompt_tokens": rejection.prompt_tokens, "advice": list(error.advice),
        "request_id": rejection.request_id,
    }
    if rejection.stage == "preflight":
        return APIError(413, str(error), code="prefill_memory_exceeded", extra=extra)
    retry_after = max(1, int(round(error.retry_after_s or 1.0)))
    code = "admission_queue_full" if rejection.stage == "admission" else "memory_pressure"
    return APIError(503, str(error), code=code, headers={"Retry-After": str(retry_after)},
                    extra={**extra, "reason": rejection.summary(), "retry_after_s": retry_after})


def api_error(error: Exception) -> APIError:
    """The HTTP rendering of a serving error (or any other exception: a 500)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestRejected):
        return rejection_error(error)
    if isinstance(error, UnknownModel):
        return APIError(404, error.message, code=error.code, param=error.param)
    if isinstance(error, InvalidRequest):
        return APIError(400, error.message, code=error.code, param=error.param)
    if isinstance(error, GrammarError):
        return APIError(400, str(error), code="invalid_grammar", param=error.field)
    if isinstance(error, RequestAborted):
        return APIError(503, str(error), code="aborted")
    if isinstance(error, EngineFailed):
        return APIError(500, str(error), code="engine_error")
    return APIError(500, f"internal error ({type(error).__name__}: {error})", code="internal_error")


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def openai_error_body(status: int, message: str, code: str | None = None,
                      param: str | None = None, extra: Mapping[str, Any] | None = None) -> dict:
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code,
                      **(extra or {})}}


def anthropic_error_body(status: int, message: str, code: str | None = None,
                         extra: Mapping[str, Any] | None = None) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": kind, "message": message}
    if code:
        error["code"] = code
    return {"type": "error", "error": {**error, **(extra or {})}}


def error_body(path: str, error: APIError) -> dict:
    if is_anthropic_path(path):
        return anthropic_error_body(error.status, error.message, error.code, error.extra)
    return openai_error_body(error.status, error.message, error.code, error.param, error.extra)


def _send(req: falcon.Request, resp: falcon.Response, error: APIError) -> None:
    resp.status = error.status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(error_body(req.path, error))
    for name, value in error.headers.items():
        resp.set_header(name, value)


def handle_api_error(req: falcon.Request, resp: falcon.Response, error: APIError,
                     params: dict) -> None:
    _send(req, resp, error)


def handle_falcon_error(req: falcon.Request, resp: falcon.Response, error: falcon.HTTPError,
                        params: dict) -> None:
    status = error.status_code
    message = error.title or falcon.code_to_http_status(status)
    if error.description:
        message = f"{message}: {error.description}"
    if status == 404:
        message = (f"no route {req.method} {req.path}; see /openapi.json for the endpoints "
                   "this server offers")
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
    _send(req, resp, APIError(status, message, code=code, headers=dict(error.headers or {})))


def handle_unexpected_error(req: falcon.Request, resp: falcon.Response, error: Exception,
                            params: dict) -> None:
    log.error("bug while serving %s %s", req.method, req.path, exc_info=error)
    _send(req, resp, APIError(500, f"internal error ({type(error).__name__}); the server log "
                                   "has the traceback", code="internal_error"))


def handle_serving_error(req: falcon.Request, resp: falcon.Response, error: Exception,
                         params: dict) -> None:
    _send(req, resp, api_error(error))


def install_error_handlers(app: falcon.App) -> None:
    app.add_error_handler(Exception, handle_unexpected_error)
    app.add_error_handler(falcon.HTTPError, handle_falcon_error)
    app.add_error_handler(APIError, handle_api_error)
    app.add_error_handler((InvalidRequest, RequestRejected, EngineFailed, RequestAborted,
                           GrammarError), handle_serving_error)
