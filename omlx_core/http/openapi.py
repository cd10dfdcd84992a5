"""The OpenAPI 3.1 document served at ``/openapi.json``, built from the same request
schemas the server validates against."""

from __future__ import annotations

from typing import Any, Sequence

from omlx_core import __version__
from omlx_core.http import schemas

_ERROR_STATUSES = {
    "400": "invalid request: the message names the parameter (model_not_supported: the "
           "model is not served for this task; the message names those that are; a grammar "
           "over a cap names the cap and its grammar.* setting)",
    "401": "missing or invalid API key",
    "404": "unknown model",
    "413": "request_too_large (body over server.max_body), prefill_memory_exceeded (the "
           "prompt can never fit in memory; the body has estimated_bytes, limit_bytes, "
           "binding_ceiling, binding_rank (a distributed group's rank whose ceiling binds) "
           "and advice) or load_never_fits (the model cannot be loaded even "
           "with every unpinned model unloaded; the body has model, model_bytes, limit_bytes, "
           "binding_ceiling, pinned_models and advice)",
    "415": "the body is not declared as JSON (Content-Type: application/json, required on "
           "every POST so that a web page of another site cannot post here)",
    "421": "host_not_allowed: the Host header names a host this server does not answer for "
           "(loopback names, the bound address and server.allowed_hosts are answered)",
    "503": "memory is short now; retry after Retry-After seconds. code: admission_queue_full "
           "(no room in the admission queue), admission_queue_timeout (waited "
           "memory.queue_timeout_s without room), forward_memory_short (a prefill chunk did "
           "not fit next to the running requests), forward_over_limit (memory passed the "
           "limit after a forward), "
           "load_memory_short (busy or pinned models held the room the model needs for "
           "server.model_load_wait_s) or load_queue_timeout (the model did not finish "
           "loading within server.model_load_wait_s); "
           "the body has stage, cause, reason and advice. grammar_compile_busy: the grammar "
           "compile queue is full, or this client has its share of it (grammar.*). aborted: "
           "the server is shutting down",
    "500": "engine_error (an engine failure before the first token), model_load_failed (the "
           "model's files are missing or corrupt, or its architecture is unsupported; the "
           "message names the model and the cause), model_not_estimable (no plugin estimates "
           "the model's memory, so the guard never lets it run; no Retry-After: a retry "
           "cannot help) or internal_error (a server bug)",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


_ADMIN_ONLY = ("403: admin_key_required: the route changes the server for every client and "
               "needs a key of server.admin_keys (an API key is not enough)")


def _errors(error_ref: str, protected: bool) -> dict[str, Any]:
    return {status: {"description": text, "content": _json({"$ref": error_ref})}
            for status, text in _ERROR_STATUSES.items() if protected or status != "401"}


def _refusals(error_ref: str, *statuses: str) -> dict[str, Any]:
    return {status: {"description": _ERROR_STATUSES[status], "content": _json({"$ref": error_ref})}
            for status in statuses}


def _generation(summary: str, request_ref: str, error_ref: str, stream_text: str,
                protected: bool) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json({"$ref": request_ref})},
        "responses": {
            "200": {"description": "the completion, or with stream: true " + stream_text,
                    "content": {**_json({"type": "object"}),
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(error_ref, protected),
        },
    }}


def _encode(summary: str, request_ref: str, error_ref: str, protected: bool) -> dict[str, Any]:
    """A route that answers one JSON document (embeddings, rerank)."""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json({"$ref": request_ref})},
        "responses": {"200": {"description": summary, "content": _json({"type": "object"})},
                      **_errors(error_ref, protected)},
    }}


def _get(summary: str, content: dict[str, Any], error_ref: str, protected: bool,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary,
                                 "responses": {"200": {"description": summary, "content": content},
                                               **_refusals(error_ref, "421")}}
    if protected:
        operation["responses"]["401"] = {"description": _ERROR_STATUSES["401"],
                                         "content": _json({"$ref": error_ref})}
    else:
        operation["security"] = []
    operation.update(extra or {})
    return {"get": operation}


def _admin(error_ref: str, protected: bool, model_schema: dict[str, Any]) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {"description": "the model as GET /v1/models lists it, after the action",
                "content": _json({"type": "object"})},
        "404": {"description": "no such model or action", "content": _json({"$ref": error_ref})},
        "409": {"description": "model_busy: the model is loading, or its requests did not end "
                               "within server.model_load_wait_s",
                "content": _json({"$ref": error_ref})},
        **_refusals(error_ref, "413", "415", "421", "503", "500"),
    }
    if protected:
        responses["401"] = {"description": _ERROR_STATUSES["401"],
                            "content": _json({"$ref": error_ref})}
        responses["403"] = {"description": _ADMIN_ONLY, "content": _json({"$ref": error_ref})}
    return {"post": {
        "summary": "load, unload, pin or unpin a model (an unload waits for its requests "
                   "to end; a pinned model is never unloaded to make room or when idle)",
        "parameters": [
            {"name": "model_id", "in": "path", "required": True, "schema": model_schema},
            {"name": "action", "in": "path", "required": True,
             "schema": {"enum": ["load", "unload", "pin", "unpin"]}},
        ],
        # Nothing is read from it, but a POST must declare JSON (415 otherwise).
        "requestBody": {"required": False, "content": _json({"type": "object"})},
        "responses": responses,
    }}
def _dashboard_paths(error: str, protected: bool) -> dict[str, Any]:
    """The page at /dashboard and the JSON it draws (the same data for scripts)."""
    def query(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
        return {"parameters": [{"name": name, "in": "query", "required": False,
                                "schema": schema, "description": text}]}

    one = _get("", _json({"type": "object"}), error, protected)["get"]
    one["responses"].pop("200")
    one["responses"].update({
        "200": {"description": "the request was aborted; its client gets an in-band error",
                "content": _json({"type": "object"})},
        "404": {"description": "no request with that id is in flight",
                "content": _json({"$ref": error})},
        "409": {"description": "the request waits for memory and has not reached its engine",
                "content": _json({"$ref": error})}})
    if protected:
        one["responses"]["403"] = {"description": _ADMIN_ONLY, "content": _json({"$ref": error})}
    one.update(summary="cancel a request in flight (dashboard)", parameters=[
        {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}])
    return {
        "/dashboard": _get("the operator's dashboard (an HTML page; it asks for an API key "
                           "when the server has them)",
                           {"text/html": {"schema": {"type": "string"}}}, error, False),
        "/dashboard/api/history": _get(
            "the last 15 minutes, one sample per memory enforcer poll, as columns: memory in "
            "use, reclaimable, reserved, hard limit, each ceiling, binding ceiling, prefill "
            "and decode tok/s, TTFT p50/p95, queued/running/preempted, prefix-cache and "
            "SSD-tier hit rates", _json({"type": "object"}), error, protected,
            {**query("since", {"type": "number"}, "unix time of the last sample you have: "
                                                   "only later ones are sent"),
             "responses": {**_get("", {}, error, protected)["get"]["responses"],
                           "200": {"description": "the history",
                                   "content": _json({"type": "object"})},
                           "400": {"description": "since is not a number",
                                   "content": _json({"$ref": error})}}}),
        "/dashboard/api/requests": _get(
            "requests in flight: model, stage (queued with position, prefilling n/m with ETA, "
            "decoding with tok/s, preempted), tokens, age", _json({"type": "object"}), error,
            protected),
        "/dashboard/api/requests/{request_id}": {"delete": one},
        "/dashboard/api/refusals": _get(
            "the last 100 requests the memory guard refused: status, stage, binding ceiling, "
            "estimated vs limit bytes, advice", _json({"type": "object"}), error, protected,
            query("request_id", {"type": "string"}, "only refusals whose request id contains "
                                                     "this")),
        "/dashboard/api/models": _get(
            "every available model with its pool state (available, loading, resident, "
            "unloading, failed), engine, pinned, weights/planned/measured/resident bytes, "
            "context length, last use, keep-alive expiry, requests in flight and waiting "
            "for the load, the last load error, and for a resident model its engine's "
            "context, running/queued requests and cache counters; pool says whether "
            "POST /admin/models/{model_id}/{action} can change them",
            _json({"type": "object"}), error, protected),
    }


def openapi_document(model_ids: Sequence[str], api_keys: bool) -> dict[str, Any]:
    """The document; ``api_keys`` says whether the /v1 routes and /metrics need a key."""
    error = "#/components/schemas/Error"
    anthropic_error = "#/components/schemas/AnthropicError"
    # The served ids, so generated clients and fuzzers pick a real one; the server itself
    # answers any other string with 404 model_not_found.
    model_schema = {**schemas.MODEL, "enum": list(model_ids)} if model_ids else schemas.MODEL
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "omlx-core", "version": __version__,
                 "description": "OpenAI- and Anthropic-compatible LLM serving on MLX. A request "
                                "that can never fit in memory is refused with 413 before any "
                                "byte of a stream; errors after the first byte arrive in-band."},
        "paths": {
            "/v1/chat/completions": _generation(
                "OpenAI chat completion", "#/components/schemas/ChatCompletionRequest", error,
                "server-sent chat.completion.chunk events ending with data: [DONE]", api_keys),
            "/v1/completions": _generation(
                "OpenAI text completion", "#/components/schemas/CompletionRequest", error,
                "server-sent text_completion events ending with data: [DONE]", api_keys),
            "/v1/messages": _generation(
                "Anthropic Messages", "#/components/schemas/MessagesRequest", anthropic_error,
                "Anthropic message events ending with message_stop (or event: error)", api_keys),
            "/v1/messages/count_tokens": _generation(
                "Anthropic token count of a Messages request",
                "#/components/schemas/CountTokensRequest", anthropic_error,
                "not streamed", api_keys),
            "/v1/responses": _generation(
                "OpenAI Responses (text output; nothing is stored)",
                "#/components/schemas/ResponsesRequest", error,
                "server-sent response.* events ending with response.completed", api_keys),
            "/v1/embeddings": _encode(
                "OpenAI embeddings: a vector per input (float, or base64 little-endian "
                "float32), from a model served for task embed",
                "#/components/schemas/EmbeddingsRequest", error, api_keys),
            "/v1/rerank": _encode(
                "rerank documents against a query (Cohere/Jina shape): results sorted by "
                "relevance_score, each with its index; scoring says how (cross_encoder, "
                "yes_no_logits, or cosine for an embedding model)",
                "#/components/schemas/RerankRequest", error, api_keys),
            "/rerank": _encode("the same as POST /v1/rerank",
                               "#/components/schemas/RerankRequest", error, api_keys),
            "/v1/models": _get("available models with their pool state (resident, loading, "
                               "available, failed), bytes, pinned, last use, engine and "
                               "context length", _json({"type": "object"}), error, api_keys),
            "/admin/models/{model_id}/{action}": _admin(error, api_keys, model_schema),
            "/v1/models/{model_id}": _get(
                "one served model", _json({"type": "object"}), error, api_keys, {
                    "parameters": [{"name": "model_id", "in": "path", "required": True,
                                    "schema": model_schema}],
                }),
            "/health": _get("liveness, engine counters, memory and the model pool", _json({"type": "object"}), error,
                            False),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}},
                             error, api_keys),
            "/openapi.json": _get("this document", _json({"type": "object"}), error, False),
            **_dashboard_paths(error, api_keys),
        },
        "components": {"schemas": {
            "ChatCompletionRequest": {**schemas.CHAT_COMPLETION_REQUEST, "properties": {
                **schemas.CHAT_COMPLETION_REQUEST["properties"], "model": model_schema}},
            "CompletionRequest": {**schemas.COMPLETION_REQUEST, "properties": {
                **schemas.COMPLETION_REQUEST["properties"], "model": model_schema}},
            "MessagesRequest": {**schemas.MESSAGES_REQUEST, "properties": {
                **schemas.MESSAGES_REQUEST["properties"], "model": model_schema}},
            "CountTokensRequest": {**schemas.COUNT_TOKENS_REQUEST, "properties": {
                **schemas.COUNT_TOKENS_REQUEST["properties"], "model": model_schema}},
            "ResponsesRequest": {**schemas.RESPONSES_REQUEST, "properties": {
                **schemas.RESPONSES_REQUEST["properties"], "model": model_schema}},
            "EmbeddingsRequest": {**schemas.EMBEDDINGS_REQUEST, "properties": {
                **schemas.EMBEDDINGS_REQUEST["properties"], "model": model_schema}},
            "RerankRequest": {**schemas.RERANK_REQUEST, "properties": {
                **schemas.RERANK_REQUEST["properties"], "model": model_schema}},
            "Error": schemas.ERROR_RESPONSE,
            "AnthropicError": schemas.ANTHROPIC_ERROR_RESPONSE,
        }},
    }
    if api_keys:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        document["security"] = [{"bearer": []}, {"apiKey": []}]
    return document
