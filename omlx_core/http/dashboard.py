"""The operator's dashboard over HTTP: the page at ``/dashboard``, its assets, and the
JSON endpoints behind it (``/dashboard/api/...``), which scripts can read too.

The page and its assets hold no data and are served without a key, so that the page
can ask for one; every JSON endpoint is behind the API keys (the page sends the key in
a header, never in a URL). Everything the page loads ships in ``omlx_core/dashboard/
assets/``: no CDN, it works offline.
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from typing import TYPE_CHECKING, Any

import falcon

from omlx_core.dashboard import DashboardRecorder
from omlx_core.dashboard.history import columns
from omlx_core.dashboard.views import NotCancellable, cancel, models, requests_now
from omlx_core.http.errors import APIError, BadRequestError, NotFoundError

if TYPE_CHECKING:
    from omlx_core.server_context import ServerContext

PAGE_PATH = "/dashboard"
ASSETS_PREFIX = "/dashboard/assets/"
_CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                  ".html": "text/html; charset=utf-8"}
# The page runs only what it ships; inline styles are uPlot's own.
_PAGE_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'")


def _assets() -> Any:
    return resources.files("omlx_core.dashboard").joinpath("assets")


class DashboardPage:
    def __init__(self) -> None:
        self.body = _assets().joinpath("index.html").read_text(encoding="utf-8")

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = _CONTENT_TYPES[".html"]
        resp.set_header("Content-Security-Policy", _PAGE_POLICY)
        resp.set_header("Cache-Control", "no-store")
        resp.text = self.body


class DashboardAsset:
    """The page's scripts and styles, by name (nothing outside the assets folder)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, bytes]] = {}
        self._collect(_assets(), "")

    def _collect(self, folder: Any, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                self._collect(entry, f"{prefix}{entry.name}/")
            elif (suffix := "." + entry.name.rpartition(".")[2]) in (".js", ".css"):
                self.files[prefix + entry.name] = (_CONTENT_TYPES[suffix], entry.read_bytes())

    def on_get(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        found = self.files.get(name)
        if found is None:
            raise NotFoundError(f"no dashboard asset {name!r}; the page loads "
                                f"{', '.join(sorted(self.files))}", "not_found")
        resp.content_type, resp.data = found
        resp.set_header("Cache-Control", "no-cache")  # an upgraded server serves its own script


def _jsonable(value: Any) -> Any:
    """Floats that JSON can carry (a rate over no time is ``None``, never ``NaN``)."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class DashboardHistory:
    def __init__(self, recorder: DashboardRecorder):
        self.recorder = recorder

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        since = req.get_param("since")
        try:
            since_t = float(since) if since is not None else None
        except ValueError:
            since_t = None
        if since is not None and (since_t is None or not math.isfinite(since_t)):
            raise BadRequestError(f"since={since!r} is not a number: give the time (unix "
                                  "seconds) of the last sample you have, or leave it out", "since")
        history = self.recorder.history
        latest = history.latest()
        resp.media = _jsonable({
            "interval_s": self.recorder.interval_s, "window_s": history.window_s,
            "latest": dataclasses.asdict(latest) if latest is not None else None,
            "columns": columns(history.samples(since_t))})


class DashboardRequests:
    def __init__(self, context: ServerContext):
        self.context = context

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"requests": requests_now(self.context)}

    def on_delete_one(self, req: falcon.Request, resp: falcon.Response, request_id: str) -> None:
        try:
            model_id = cancel(self.context, request_id)
        except KeyError:
            raise NotFoundError(f"no request {request_id!r} is in flight; GET "
                                "/dashboard/api/requests lists those that are",
                                "request_not_found", "request_id") from None
        except NotCancellable as exc:
            raise APIError(falcon.HTTP_409, description=str(exc), code="request_not_cancellable",
                           param="request_id") from None
        resp.media = {"request_id": request_id, "model": model_id, "cancelled": True}


class DashboardRefusals:
    def __init__(self, recorder: DashboardRecorder):
        self.recorder = recorder

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        request_id = req.get_param("request_id") or None
        found = self.recorder.refusals(request_id)
        resp.media = {"refusals": [dataclasses.asdict(r) for r in found],
                      "request_id": request_id}


class DashboardModels:
    def __init__(self, context: ServerContext):
        self.context = context

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        # "pool": whether POST /admin/models/{id}/{action} can load, unload and pin here
        resp.media = _jsonable({"models": models(self.context),
                                "pool": self.context.pool is not None})


def add_dashboard_routes(app: falcon.App, context: ServerContext,
                         recorder: DashboardRecorder) -> None:
    """The page, its assets and its JSON endpoints, over ``recorder``'s data."""
    app.add_route(PAGE_PATH, DashboardPage())
    app.add_route(ASSETS_PREFIX + "{name:path}", DashboardAsset())
    app.add_route("/dashboard/api/history", DashboardHistory(recorder))
    requests = DashboardRequests(context)
    app.add_route("/dashboard/api/requests", requests)
    app.add_route("/dashboard/api/requests/{request_id}", requests, suffix="one")
    app.add_route("/dashboard/api/refusals", DashboardRefusals(recorder))
    app.add_route("/dashboard/api/models", DashboardModels(context))
