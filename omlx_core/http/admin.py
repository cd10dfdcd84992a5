"""``POST /admin/models/{model_id}/{action}``: load, unload, pin or unpin a model at run
time. The API keys apply like on every other route (``/health`` and ``/openapi.json``
are the only open ones), so with keys configured a request without one is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import falcon

from omlx_core.http.errors import NotFoundError, bad_request

if TYPE_CHECKING:
    from omlx_core.server_context import ServerContext

ACTIONS = ("load", "unload", "pin", "unpin")


class AdminModels:
    def __init__(self, context: ServerContext):
        self.context = context

    def on_post(self, req: falcon.Request, resp: falcon.Response, model_id: str,
                action: str) -> None:
        pool = self.context.pool
        if action not in ACTIONS:
            raise NotFoundError(f"no admin action {action!r}; use one of {', '.join(ACTIONS)} "
                                f"(POST /admin/models/{{id}}/load)", "unknown_action", "action")
        if pool is None:
            raise bad_request("this server was started without a model pool; models cannot "
                              "be loaded or unloaded at run time", "model", "no_pool")
        if pool.record(model_id) is None:
            known = ", ".join(sorted(r.id for r in pool.records())) or "none"
            raise NotFoundError(f"model {model_id!r} is not available here; available models: "
                                f"{known} (GET /v1/models lists them)", "model_not_found", "model")
        changed = True
        if action == "load":
            pool.load(model_id)
        elif action == "unload":
            changed = pool.unload(model_id)
        else:
            pool.pin(model_id, action == "pin")
        record = pool.record(model_id)
        resp.media = {"id": model_id, "action": action, "changed": changed,
                      **pool.describe(record)}
