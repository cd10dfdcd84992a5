"""Errors a client can act on, and how each API spells them.

Every error the front end answers is a falcon ``HTTPError``: falcon sets its status and
headers (``Retry-After``, ``WWW-Authenticate``, ``Allow``) and :func:`serialize_error`,
the app's error serializer, writes the body: an OpenAI error object, or on
``/v1/messages`` an Anthropic one. Each of our own errors is an :class:`APIError` and
an instance of falcon's class for its status (``HTTPServiceUnavailable`` for a 503, ...),
and carries a message that says what is wrong and how to fix it, a machine-readable
code, the parameter at fault and extra fields.

A responder may also let a typed error of the serving pipeline through;
:func:`api_error` is the one mapping from those to an :class:`APIError`, used before the
first byte (by :func:`handle_error`, the app's one error handler) and after it (in-band
stream errors). Only a genuine bug is none of these: the handler logs it and answers a
JSON 500.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Mapping

import falcon

from omlx_core.grammar import GrammarBusy, GrammarError
from omlx_core.memory.types import RequestRejected
from omlx_core.pool import ModelLoadFailed, PoolError
from omlx_core.redaction import redact_paths
from omlx_core.serving import EngineFailed, InvalidRequest, RequestAborted, UnknownModel

log = logging.getLogger(__name__)

ANTHROPIC_PATH_PREFIX = "/v1/messages"

_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
    413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error",
    503: "overloaded_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error",
    503: "overloaded_error",
}

#: the typed errors of the serving pipeline a responder lets through
SERVING_ERRORS = (InvalidRequest, RequestRejected, GrammarError, GrammarBusy, RequestAborted,
                  EngineFailed, ModelLoadFailed, PoolError)


# -- the errors -----------------------------------------------------------------------------


class APIError(falcon.HTTPError):
    """An HTTP error with a message that says what is wrong and how to fix it.

    Takes falcon's ``HTTPError`` arguments (the message is the ``description``), and
    ``code`` is the machine-readable string both APIs' bodies carry. ``param`` names the
    request field at fault; ``extra`` fields are added to the error object as they are
    (e.g. the byte counts of a memory rejection). The message a client reads names no
    absolute path of this machine (:func:`~omlx_core.redaction.redact_paths`).
    """

    def __init__(self, status: int | str, *, title: str | None = None,
                 description: str | None = None, headers: Any = None,
                 code: str | None = None, param: str | None = None,
                 extra: Mapping[str, Any] | None = None, **kwargs: Any):
        if description is not None:
            description = redact_paths(description)
        super().__init__(status, title=title, description=description, headers=headers,
                         code=code, **kwargs)  # type: ignore[arg-type]
        self.param = param
        self.extra = dict(extra or {})

    @property
    def message(self) -> str:
        return self.description or self.title

    def __str__(self) -> str:
        return self.message


class BadRequestError(falcon.HTTPBadRequest, APIError):
    """400: the request cannot be served as sent; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(description=message, param=param, code=code)


class AuthenticationError(falcon.HTTPUnauthorized, APIError):
    """401 with a bearer challenge: the API key is missing or wrong."""

    def __init__(self, message: str, code: str, realm: str):
        super().__init__(description=message, code=code, challenges=[f'Bearer realm="{realm}"'])


class ForbiddenError(falcon.HTTPForbidden, APIError):
    """403: the key is valid but does not allow this (an API key on an admin route)."""

    def __init__(self, message: str, code: str):
        super().__init__(description=message, code=code)


class MisdirectedRequestError(APIError):
    """421: the request names a host this server does not answer for (DNS rebinding)."""

    def __init__(self, message: str, code: str = "host_not_allowed"):
        super().__init__(falcon.HTTP_421, description=message, code=code)


class NotFoundError(falcon.HTTPNotFound, APIError):
    """404: no such model (``param`` = ``model``) or route."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(description=message, code=code, param=param)


class ContentTooLargeError(falcon.HTTPContentTooLarge, APIError):
    """413: the body is over ``server.max_body``, or the request can never fit in memory."""

    def __init__(self, message: str, code: str, extra: Mapping[str, Any] | None = None):
        super().__init__(description=message, code=code, extra=extra)


class UnsupportedMediaTypeError(falcon.HTTPUnsupportedMediaType, APIError):
    """415: the body is not JSON."""

    def __init__(self, message: str, code: str = "unsupported_media_type"):
        super().__init__(description=message, code=code)


class OverloadedError(falcon.HTTPServiceUnavailable, APIError):
    """503: the server cannot run the request now; with ``retry_after`` (seconds) when
    the same request can succeed later."""

    def __init__(self, message: str, code: str, retry_after: int | None = None,
                 extra: Mapping[str, Any] | None = None):
        super().__init__(description=message, code=code, retry_after=retry_after, extra=extra)


class ConflictError(falcon.HTTPConflict, APIError):
    """409: an operator's request conflicts with what the server is doing (a model loading)."""

    def __init__(self, message: str, code: str):
        super().__init__(description=message, code=code)


class ServerError(falcon.HTTPInternalServerError, APIError):
    """500: an engine failure, a model the server cannot serve safely, or a bug."""

    def __init__(self, message: str, code: str, extra: Mapping[str, Any] | None = None):
        super().__init__(description=message, code=code, extra=extra)


def bad_request(message: str, param: str | None = None,
                code: str = "invalid_request") -> BadRequestError:
    return BadRequestError(message, param, code)


# -- from serving errors to HTTP errors -----------------------------------------------------


def rejection_code(stage: str, cause: str) -> str:
    """The code of a memory refusal: where it happened and why (``memory.types.STAGES``
    and ``CAUSES``), e.g. ``admission_queue_timeout``. A preflight refusal (the request
    can never fit here) keeps the name OpenAI-style clients know: ``prefill_memory_exceeded``."""
    if cause == "no_estimate":
        return "model_not_estimable"
    return "prefill_memory_exceeded" if stage == "preflight" else f"{stage}_{cause}"


def rejection_error(error: RequestRejected) -> APIError:
    """A memory refusal: 413 when the request can never fit here (preflight), else 503
    with ``Retry-After`` (memory is short now; the same request can succeed later)."""
    rejection = error.rejection
    breakdown = rejection.breakdown
    extra: dict[str, Any] = {
        "stage": rejection.stage, "cause": rejection.cause,
        "estimated_bytes": rejection.estimated_bytes, "limit_bytes": rejection.limit_bytes,
        "base_bytes": rejection.base_bytes, "binding_ceiling": rejection.binding,
        # a distributed group's rank whose ceiling binds (null: this server's own)
        "binding_rank": rejection.binding_rank,
        "ceilings": breakdown.ceilings() if breakdown is not None else {},
        "prompt_tokens": rejection.prompt_tokens, "advice": list(error.advice),
        "request_id": rejection.request_id,
    }
    if rejection.stage == "load":
        extra.update(model=rejection.model_id, model_bytes=rejection.estimated_bytes,
                     pinned_models=list(rejection.pinned_models))
    code = rejection_code(rejection.stage, rejection.cause)
    if rejection.cause == "no_estimate":
        # The server cannot judge this model's memory: its fault, and no retry helps.
        return ServerError(str(error), code, extra)
    if not error.retryable:
        return ContentTooLargeError(str(error), code, extra)
    retry_after = max(1, int(round(error.retry_after_s or 1.0)))
    return OverloadedError(str(error), code, retry_after,
                           {**extra, "reason": rejection.summary(), "retry_after_s": retry_after})


def api_error(error: Exception) -> APIError:
    """The HTTP rendering of a serving error (or any other exception: a 500 naming it)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestRejected):
        return rejection_error(error)
    if isinstance(error, UnknownModel):
        return NotFoundError(error.message, error.code, error.param)
    if isinstance(error, InvalidRequest):
        return BadRequestError(error.message, error.param, error.code)
    if isinstance(error, GrammarError):
        return BadRequestError(str(error), error.field, "invalid_grammar")
    if isinstance(error, GrammarBusy):
        retry_after = max(1, math.ceil(error.retry_after_s))
        return OverloadedError(str(error), "grammar_compile_busy", retry_after,
                               {"retry_after_s": retry_after})
    if isinstance(error, RequestAborted):
        return OverloadedError(str(error), "aborted")
    if isinstance(error, EngineFailed):
        return ServerError(str(error), "engine_error")
    if isinstance(error, ModelLoadFailed):
        return ServerError(str(error), "model_load_failed")
    if isinstance(error, PoolError):
        return ConflictError(str(error), "model_busy")
    log.error("an unexpected error reached a client", exc_info=error)
    return ServerError(f"internal error ({type(error).__name__}); the server log has the "
                       "details", "internal_error")


def falcon_error(req: falcon.Request, error: falcon.HTTPError) -> APIError:
    """One of falcon's own errors (no route, a method not allowed, a malformed header)
    with a message and code like ours; falcon has already set its headers."""
    status = error.status_code
    message = error.title or falcon.code_to_http_status(status)
    if error.description:
        message = f"{message}: {error.description}"
    if status == 404:
        message = (f"no route {req.method} {req.path}; see /openapi.json for the endpoints "
                   "this server offers")
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
    return APIError(status, description=message, code=code)


# -- the two body shapes --------------------------------------------------------------------


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
    """``error`` in the shape of the API that ``path`` belongs to."""
    if is_anthropic_path(path):
        return anthropic_error_body(error.status_code, error.message, error.code, error.extra)
    return openai_error_body(error.status_code, error.message, error.code, error.param,
                             error.extra)


# -- wiring into the app --------------------------------------------------------------------


def serialize_error(req: falcon.Request, resp: falcon.Response, error: falcon.HTTPError) -> None:
    """The app's error serializer: the body of every error answer, as JSON whatever the
    client's ``Accept`` says (falcon's default sends none when JSON is not accepted)."""
    rendered = error if isinstance(error, APIError) else falcon_error(req, error)
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(error_body(req.path, rendered))


def handle_error(req: falcon.Request, resp: falcon.Response, error: Exception,
                 params: dict) -> None:
    """The app's one error handler, for every exception that is not already an HTTP
    error (those falcon answers itself, through :func:`serialize_error`): a serving
    error becomes its HTTP error; anything else is a bug, logged, and a 500 that keeps
    its details in the log."""
    if isinstance(error, SERVING_ERRORS):
        raise api_error(error)
    if isinstance(error, RecursionError):
        # Only what a client sent nests deep enough for this (JSON in a JSON string).
        log.warning("a request to %s %s nested too deep to handle", req.method, req.path,
                    exc_info=error)
        raise BadRequestError("the request nests values deeper than this server handles; "
                              "send flatter JSON", code="nested_too_deep")
    log.error("bug while serving %s %s", req.method, req.path, exc_info=error)
    raise ServerError(f"internal error ({type(error).__name__}); the server log has the "
                      "traceback", "internal_error")


def install_error_handlers(app: falcon.App) -> None:
    app.add_error_handler(Exception, handle_error)
    app.set_error_serializer(serialize_error)
