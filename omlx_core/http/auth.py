"""API keys and admin keys: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``.

Keys come from ``server.api_keys`` and ``server.admin_keys`` (or ``OMLX_SERVER_API_KEYS``,
``OMLX_SERVER_ADMIN_KEYS``, comma-separated). Each presented key is compared with every
configured key in constant time, and no key is ever logged.

- ``api_keys`` guard the model routes, ``/metrics`` and the dashboard's data.
- ``admin_keys`` guard what changes the server for everyone: ``/admin/*`` (load, unload,
  pin, unpin a model) and cancelling a request (``DELETE /dashboard/api/requests/{id}``).
  An admin key is accepted wherever an API key is. With API keys set and no admin key,
  those routes are refused (403): any client holding an API key could otherwise unload
  pinned models and cancel other clients' requests.
- With no key of either kind (a server on loopback) every route is open; what protects
  it from web pages is :mod:`~omlx_core.http.browser_guard`.

``/health`` and ``/openapi.json`` stay open for load balancers and tools (``/health``
shows only its status to a caller without a key when keys are set), and so does the
dashboard page (not its data), which asks for a key. CORS preflights carry no
credentials and pass.
"""

from __future__ import annotations

import hmac
from typing import Sequence

import falcon

from omlx_core.http.browser_guard import is_preflight
from omlx_core.http.errors import AuthenticationError, ForbiddenError

PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/dashboard"})
#: the dashboard page's scripts and styles: they hold no data, and the page must load
#: to ask for a key
PUBLIC_PREFIXES = ("/dashboard/assets/",)
ADMIN_PREFIX = "/admin/"
CANCEL_PREFIX = "/dashboard/api/requests/"
REALM = "omlx-core"
#: what ``req.context.key_role`` holds: the kind of valid key presented (``None``: none)
API, ADMIN = "api", "admin"


def _wire_bytes(header_value: str) -> bytes:
    # WSGI hands header values over as latin-1 code points; this restores the bytes sent.
    return header_value.encode("latin-1", errors="replace")


def is_admin_route(req: falcon.Request) -> bool:
    """Whether ``req`` changes the server for every client (admin keys only)."""
    return req.path.startswith(ADMIN_PREFIX) or (
        req.method == "DELETE" and req.path.startswith(CANCEL_PREFIX))


class APIKeyAuth:
    """Falcon middleware that refuses requests without a key the route needs."""

    def __init__(self, keys: Sequence[str], admin_keys: Sequence[str] = ()):
        self._keys = [key.encode("utf-8") for key in keys if key]
        self._admin_keys = [key.encode("utf-8") for key in admin_keys if key]

    @property
    def enabled(self) -> bool:
        """Whether any key is configured: the routes that need one refuse requests without."""
        return bool(self._keys or self._admin_keys)

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        presented = self._presented(req)
        req.context.key_role = self._role(presented)
        if not self.enabled or is_preflight(req):
            return
        if req.path in PUBLIC_PATHS or req.path.startswith(PUBLIC_PREFIXES):
            return
        if is_admin_route(req):
            self._require_admin(req, presented)
            return
        if req.context.key_role is None:
            self._refuse(presented, "server.api_keys or server.admin_keys")

    def _require_admin(self, req: falcon.Request, presented: list[str]) -> None:
        if not self._admin_keys:
            raise ForbiddenError(
                "this route changes the server for every client and needs an admin key, but "
                "server.admin_keys is empty; set one (API keys do not open admin routes)",
                "admin_key_required")
        role = req.context.key_role
        if role == ADMIN:
            return
        if role == API:
            raise ForbiddenError("this route needs an admin key (server.admin_keys); the key "
                                 "sent is an API key", "admin_key_required")
        self._refuse(presented, "server.admin_keys")

    def _refuse(self, presented: list[str], setting: str) -> None:
        if not presented:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>' or "
                                      "'x-api-key: <key>'", "missing_api_key", REALM)
        raise AuthenticationError(f"invalid API key: it matches none of {setting}",
                                  "invalid_api_key", REALM)

    def _role(self, presented: list[str]) -> str | None:
        wire = [_wire_bytes(value) for value in presented]
        # Every key is compared, so the time taken does not tell which one matched.
        admin = any([self._matches(value, self._admin_keys) for value in wire])
        api = any([self._matches(value, self._keys) for value in wire])
        return ADMIN if admin else API if api else None

    def _presented(self, req: falcon.Request) -> list[str]:
        values = []
        authorization = req.get_header("Authorization")
        if authorization:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                values.append(token.strip())
        api_key = req.get_header("X-API-Key")
        if api_key and api_key.strip():
            values.append(api_key.strip())
        return values

    @staticmethod
    def _matches(presented: bytes, keys: list[bytes]) -> bool:
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(presented, key)
        return matched
