"""Optional API keys: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``.

Keys come from ``server.api_keys`` (or ``OMLX_SERVER_API_KEYS``, comma-separated). Each
presented key is compared with every configured key in constant time, and no key is
ever logged. ``/health`` and ``/openapi.json`` stay open for load balancers and tools,
and so does the dashboard page (not its data), which asks for a key.
"""

from __future__ import annotations

import hmac
from typing import Sequence

import falcon

from omlx_core.http.errors import AuthenticationError

PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/dashboard"})
#: the dashboard page's scripts and styles: they hold no data, and the page must load
#: to ask for a key
PUBLIC_PREFIXES = ("/dashboard/assets/",)
REALM = "omlx-core"


def _wire_bytes(header_value: str) -> bytes:
    # WSGI hands header values over as latin-1 code points; this restores the bytes sent.
    return header_value.encode("latin-1", errors="replace")


class APIKeyAuth:
    """Falcon middleware that refuses requests without a configured key (when keys are set)."""

    def __init__(self, keys: Sequence[str]):
        self._keys = [key.encode("utf-8") for key in keys if key]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self._keys or req.path in PUBLIC_PATHS or req.path.startswith(PUBLIC_PREFIXES):
            return
        presented = self._presented(req)
        if not presented:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>' or "
                                      "'x-api-key: <key>'", "missing_api_key", REALM)
        if not any([self._accepted(_wire_bytes(value)) for value in presented]):
            raise AuthenticationError("invalid API key: it matches none of server.api_keys",
                                      "invalid_api_key", REALM)

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

    def _accepted(self, presented: bytes) -> bool:
        matched = False
        for key in self._keys:  # every key, so the time taken does not tell which one matched
            matched |= hmac.compare_digest(presented, key)
        return matched
