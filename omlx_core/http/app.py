"""The Falcon WSGI app: routes, middleware and error handlers around a ServerContext."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import falcon

from omlx_core.http.admin import AdminModels
from omlx_core.dashboard import DashboardRecorder, ServingEventsFanOut
from omlx_core.grammar.compile_queue import compile_client
from omlx_core.http.anthropic_api import Messages
from omlx_core.http.auth import APIKeyAuth
from omlx_core.http.browser_guard import CORS, HostAllowlist, JSONBodiesOnly
from omlx_core.http.dashboard import add_dashboard_routes
from omlx_core.http.embeddings_api import Embeddings, Rerank
from omlx_core.http.errors import install_error_handlers
from omlx_core.http.metrics import CONTENT_TYPE, Metrics, flatten_stats
from omlx_core.http.openai_api import ChatCompletions, Models, TextCompletions
from omlx_core.http.refusal_pacing import RefusalPacing
from omlx_core.http.openapi import openapi_document
from omlx_core.http.responses_api import CountTokens, Responses
from omlx_core.http.sse import Responder
from omlx_core.serving import ServingPipeline
from omlx_core.settings import parse_size

if TYPE_CHECKING:
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)

_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class CompileClient:
    """Falcon middleware: who the grammar compile queue takes this request to be from (its
    fair share): the API key it presented on a server with keys (checked by then), else
    its address. A key is never kept, only its digest."""

    def __init__(self, keys_set: bool):
        self.keys_set = keys_set

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        client = f"address {req.remote_addr}"
        if self.keys_set and getattr(req.context, "key_role", None) is not None:
            presented = req.get_header("Authorization") or req.get_header("X-API-Key") or ""
            client = "key " + hashlib.sha256(presented.encode("latin-1", "replace")).hexdigest()[:16]
        req.context.compile_client = compile_client.set(client)

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        token = getattr(req.context, "compile_client", None)
        if token is not None:
            compile_client.reset(token)


class RequestCounter:
    """Counts every answered request by route template (never the raw path) and status."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        route = req.uri_template or "unmatched"
        method = req.method if req.method in _METHODS else "OTHER"
        self.metrics.requests.labels(route, method, str(resp.status_code)).inc()


def _plain(value: Any) -> bool:
    """A scalar, or a list of rows of scalars (e.g. every rank's memory reading): what
    ``/health`` shows of an engine's stats."""
    if isinstance(value, list):
        return all(isinstance(row, dict) and all(map(_plain_scalar, row.values()))
                   for row in value)
    return _plain_scalar(value)


def _plain_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


class Health:
    """Liveness for anyone; with keys configured, the engines, memory and pool only for a
    caller that sends one (they name models, their errors and the machine's memory)."""

    def __init__(self, context: ServerContext, pipeline: ServingPipeline, keys_set: bool = False):
        self.context = context
        self.in_flight = pipeline.in_flight
        self.keys_set = keys_set

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        serving = bool(self.context.engines) or bool(
            self.context.pool is not None and self.context.pool.records())
        resp.status = 200 if serving else 503
        status = "ok" if serving else "no models loaded"
        if self.keys_set and getattr(req.context, "key_role", None) is None:
            resp.media = {"status": status}
            return
        engines = {}
        for model_id, engine in list(self.context.engines.items()):
            try:
                stats = flatten_stats(engine.stats() or {})
            except Exception as exc:
                log.error("the stats of model %r failed", model_id, exc_info=exc)
                stats = {"error": f"{type(exc).__name__} (the server log has the details)"}
            engines[model_id] = {str(k): v for k, v in stats.items() if _plain(v)}
        resp.media = {"status": status,
                      "models": list(self.context.engines), "in_flight": len(self.in_flight),
                      "engines": engines, "memory": self._memory(), "pool": self._pool()}

    def _pool(self) -> dict[str, Any] | None:
        """Each available model's state in the pool, and the bytes resident ones hold."""
        pool = self.context.pool
        if pool is None:
            return None
        return {"resident_bytes": pool.resident_bytes(),
                "models": {record.id: pool.describe(record) for record in pool.records()}}

    def _memory(self) -> dict[str, Any] | None:
        """The guard's latest reading: what is in use, what of it the server would give
        back on demand, and the room a new request has with every cache emptied."""
        guard = self.context.memory_guard
        snapshot = guard.snapshot if guard is not None else None
        if guard is None or snapshot is None:
            return None
        return {"hard_limit_bytes": snapshot.hard_bytes,
                "binding_ceiling": snapshot.breakdown.binding,
                "in_use_bytes": snapshot.in_use_bytes,
                "reclaimable_bytes": snapshot.reclaimable_bytes,
                "baseline_bytes": snapshot.baseline_bytes,
                "headroom_bytes": snapshot.headroom_bytes,
                "admission_waiting": guard.waiting,
                "preempted_now": guard.admission.suspended,
                "preempted_total": guard.preempted_total(),
                "admission_reserved_bytes": guard.admission.reserved_bytes,
                "reclaimed_bytes_total": guard.reclaimed_bytes_total}


class MetricsResource:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE
        resp.data = self.metrics.render()


class OpenAPIResource:
    def __init__(self, document: dict[str, Any]):
        self.body = json.dumps(document, indent=1)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.text = self.body


@dataclass
class Frontend:
    """The app and the state a server needs to shut it down cleanly."""

    app: falcon.App
    pipeline: ServingPipeline
    metrics: Metrics
    max_body: int
    dashboard: DashboardRecorder | None = None

    def shutdown(self) -> int:
        """Abort every in-flight request (their streams end with an in-band error)."""
        if self.dashboard is not None:
            self.dashboard.close()
        return self.pipeline.close()


def build_frontend(context: ServerContext, *, api_keys: Sequence[str] | None = None,
                   admin_keys: Sequence[str] | None = None, max_body: int | None = None,
                   bound_host: str | None = None) -> Frontend:
    """The app with its state; ``api_keys``, ``admin_keys``, ``max_body`` and the address
    the server is bound to (``bound_host``: the hosts it answers for) default to the
    configuration."""
    config = context.config
    keys = list(config.get("server.api_keys", []) or []) if api_keys is None else list(api_keys)
    admins = (list(config.get("server.admin_keys", []) or []) if admin_keys is None
              else list(admin_keys))
    host = str(config.get("server.host", "127.0.0.1")) if bound_host is None else bound_host
    body_limit = parse_size(config.get("server.max_body", "8MiB")) if max_body is None else max_body
    holder: dict[str, ServingPipeline] = {}
    metrics = Metrics(context, lambda: len(holder["pipeline"].in_flight))
    dashboard = DashboardRecorder(context)
    pipeline = holder["pipeline"] = ServingPipeline(context, ServingEventsFanOut(metrics, dashboard))
    responder = Responder(pipeline, metrics)
    auth = APIKeyAuth(keys, admins)
    # The host is checked first: a rebinding page learns nothing else. CORS answers are
    # added to every response, refusals included, so a trusted browser app can read them.
    middleware: list[Any] = [RequestCounter(metrics), RefusalPacing(),
                             HostAllowlist(host, config.get("server.allowed_hosts", []) or [])]
    origins = list(config.get("server.cors_origins", []) or [])
    if origins:
        middleware.append(CORS(origins))
    middleware += [JSONBodiesOnly(), auth, CompileClient(auth.enabled)]
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    install_error_handlers(app)
    models = Models(responder)
    app.add_route("/v1/chat/completions", ChatCompletions(responder, body_limit))
    app.add_route("/v1/completions", TextCompletions(responder, body_limit))
    app.add_route("/v1/messages", Messages(responder, body_limit))
    app.add_route("/v1/messages/count_tokens", CountTokens(responder, body_limit))
    app.add_route("/v1/responses", Responses(responder, body_limit))
    app.add_route("/v1/embeddings", Embeddings(pipeline, body_limit))
    rerank = Rerank(pipeline, body_limit)
    app.add_route("/v1/rerank", rerank)
    app.add_route("/rerank", rerank)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    app.add_route("/admin/models/{model_id}/{action}", AdminModels(context))
    app.add_route("/health", Health(context, pipeline, auth.enabled))
    app.add_route("/metrics", MetricsResource(metrics))
    app.add_route("/openapi.json", OpenAPIResource(openapi_document(list(context.engines),
                                                                    auth.enabled)))
    add_dashboard_routes(app, context, dashboard)
    dashboard.start()
    return Frontend(app, pipeline, metrics, body_limit, dashboard)


def create_app(context: ServerContext) -> falcon.App:
    """The WSGI app serving ``context``'s engines (settings from ``context.config``)."""
    return build_frontend(context).app
