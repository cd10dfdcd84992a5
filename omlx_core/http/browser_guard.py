"""What a web page in the operator's browser can make this server do: nothing it was not
let do.

A server on loopback with no API keys is reachable by every page the user visits, two
ways:

- **cross-site requests.** A page may send a POST to ``http://127.0.0.1:8000`` without
  asking: an HTML form (``application/x-www-form-urlencoded``, ``multipart/form-data``,
  ``text/plain``) or a ``fetch`` with one of those types. It cannot read the answer, but
  the request runs (a chat that costs minutes of compute, a model unloaded). Every POST
  must therefore say ``Content-Type: application/json`` (:class:`JSONBodiesOnly`: 415
  otherwise, a missing header included): a page can only send that after a CORS
  preflight, which this server refuses unless ``server.cors_origins`` lets its origin in.
- **DNS rebinding.** A page's own domain is made to resolve to 127.0.0.1; its scripts
  are then same-origin with the server and read every answer. Their requests still carry
  the page's host name, so a server that answers only the names it is reached by
  (:class:`HostAllowlist`: loopback names, the address it is bound to,
  ``server.allowed_hosts``) answers them with 421.

Browser apps the operator trusts (Open WebUI and the like) are let in by origin:
``server.cors_origins`` turns on :class:`CORS` (falcon's middleware: preflights answered
with the route's methods, the origin echoed, ``Vary: Origin``).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable

import falcon

from omlx_core.http.errors import MisdirectedRequestError, UnsupportedMediaTypeError

#: names every loopback client may use
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
#: methods whose body the server reads
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface."""
    return host.strip().strip("[]") in ("", "0.0.0.0", "::")


def is_preflight(req: falcon.Request) -> bool:
    """A browser's CORS preflight: it carries no credentials and asks only what is allowed."""
    return req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method") is not None


def host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port, lower case."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    name, colon, port = value.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostAllowlist:
    """Falcon middleware: 421 for a ``Host`` this server is not reached by.

    Allowed: loopback names and addresses, the bound address (every address of this
    machine when bound to all interfaces: any IP literal, the machine's own names), and
    ``extra`` (``server.allowed_hosts``; ``"*"`` turns the check off).
    """

    def __init__(self, bound_host: str, extra: Iterable[str] = ()):
        names = {host_name(h) for h in extra if h.strip()}
        self.any_host = "*" in names
        self.bound_any = is_wildcard(bound_host)
        names.discard("*")
        names.add(host_name(bound_host))
        if self.bound_any:
            for name in (socket.gethostname(), socket.getfqdn()):
                names.add(name.lower())
        self.names = frozenset(n for n in names if n)

    def allows(self, host: str) -> bool:
        if self.any_host or host in self.names or is_loopback(host):
            return True
        # A rebinding page's requests carry its own domain name, never an IP literal.
        return self.bound_any and _ip(host) is not None

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        header = req.get_header("Host")
        if header is None:  # HTTP/1.0 without a Host: not a browser
            return
        host = host_name(header)
        if not self.allows(host):
            raise MisdirectedRequestError(
                f"this server does not answer for the host {host[:100]!r} (a web page whose "
                "name resolves here is refused: DNS rebinding); reach it by a loopback name or "
                "the address it is bound to, or add the name to server.allowed_hosts")


class JSONBodiesOnly:
    """Falcon middleware: 415 for a POST, PUT or PATCH that does not declare a JSON body."""

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.method not in BODY_METHODS:
            return
        media_type = (req.content_type or "").split(";", 1)[0].strip().lower()
        if media_type == "application/json" or (media_type.startswith("application/")
                                                and media_type.endswith("+json")):
            return
        sent = f"Content-Type {media_type!r}" if media_type else "no Content-Type"
        raise UnsupportedMediaTypeError(
            f"the request has {sent}; send the body as JSON with Content-Type: "
            "application/json (other types are refused so that a web page cannot post "
            "to this server without its consent)")


class CORS(falcon.CORSMiddleware):
    """Falcon's CORS middleware for ``server.cors_origins``, answers varying by origin."""

    def __init__(self, origins: Iterable[str]):
        listed = [o.strip().rstrip("/") for o in origins if o.strip()]
        super().__init__(allow_origins="*" if "*" in listed else listed,
                         expose_headers=["Retry-After", "WWW-Authenticate"])

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         req_succeeded: bool) -> None:
        super().process_response(req, resp, resource, req_succeeded)
        if self.allow_origins != "*":
            resp.append_header("Vary", "Origin")


__all__ = ["CORS", "HostAllowlist", "JSONBodiesOnly", "LOOPBACK_NAMES", "host_name",
           "is_loopback", "is_preflight", "is_wildcard"]
