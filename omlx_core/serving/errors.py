"""What can go wrong with a request before its first byte, as the serving pipeline
raises it (generation in :mod:`.pipeline`, embeddings and rerank in :mod:`.encode`); the
HTTP front end maps each to its status once (:mod:`omlx_core.http.errors`)."""

from __future__ import annotations


class InvalidRequest(Exception):
    """The request cannot be served as sent (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class UnknownModel(InvalidRequest):
    """No engine serves the requested model (HTTP 404)."""

    def __init__(self, model_id: str, served: list[str]):
        super().__init__(f"model {model_id!r} is not served here; served models: "
                         f"{', '.join(sorted(served)) or 'none'} (GET /v1/models lists them)",
                         "model", "model_not_found")


class EngineFailed(Exception):
    """The engine failed (HTTP 500 before the first byte, an in-band error after it)."""


class RequestAborted(Exception):
    """The request was aborted (client gone, server shutting down) before it finished."""


__all__ = ["EngineFailed", "InvalidRequest", "RequestAborted", "UnknownModel"]
