"""Serving the app with waitress: a start/stop server for tests and ``omlx-core serve``.

Waitress runs with ``channel_request_lookahead = 1`` so its event loop keeps reading a
connection while a request on it is being served; that is how it notices a client
that hangs up mid-stream (see :mod:`omlx_core.serving.inflight`). The server is
waitress's, extended by :mod:`omlx_core.http.connection_guard` so that slow and idle
clients cannot lock others out (``server.request_timeout_s``, ``server.connection_limit``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from waitress import wasyncore

from omlx_core.config import ConfigError, Problem
from omlx_core.http.app import Frontend, build_frontend
from omlx_core.http.browser_guard import is_loopback
from omlx_core.http.connection_guard import create_server

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)

# Waitress refuses bodies over its own limit with a plain-text 413 before the app runs;
# keep it well above server.max_body so the app's JSON 413 is what clients normally see.
WAITRESS_BODY_LIMIT_FACTOR = 4
#: threads beyond the generating requests, for /health, /metrics, /v1/models and the like
SPARE_THREADS = 4


def threads_needed(context: ServerContext) -> int:
    """Waitress threads that let every request the server can hold reach the engines.

    A waitress thread serves one request for its whole life, a stream included, and a
    request waiting for memory or for a batch slot holds its thread too. So the server
    needs one per request the engines run at once, plus one per admission-queue place,
    plus a few for the short routes: fewer, and requests wait in waitress, unseen by the
    scheduler and the memory guard.
    """
    running = sum(engine.limits().max_running for engine in context.engines.values())
    return running + int(context.config["memory.queue_size"]) + SPARE_THREADS


def thread_count(context: ServerContext, requested: int | str | None = None) -> int:
    """``server.threads`` (or ``requested``), with ``"auto"`` resolved; a number below
    :func:`threads_needed` is honoured with a warning that names the number needed."""
    value = requested if requested is not None else context.config["server.threads"]
    needed = threads_needed(context)
    if value == "auto":
        return needed
    if int(value) < needed:
        log.warning("server.threads is %d, but the engines run %d requests at once and the "
                    "admission queue holds %s more: requests beyond %d wait in the HTTP server, "
                    "where neither the scheduler nor the memory guard sees them. Set "
                    "server.threads = \"auto\" (or at least %d)", int(value),
                    needed - SPARE_THREADS - int(context.config["memory.queue_size"]),
                    context.config["memory.queue_size"], int(value), needed)
    return int(value)


def check_exposure(host: str, config: Config) -> None:
    """Refuse to listen beyond loopback without a key, unless the operator said so with
    ``server.insecure_no_auth`` (``serve --insecure-no-auth``): anyone on the network could
    then run the models and unload them."""
    if is_loopback(host) or config.get("server.api_keys") or config.get("server.admin_keys"):
        return
    if config.get("server.insecure_no_auth", False):
        log.warning("serving on %s without API keys (server.insecure_no_auth): anyone who can "
                    "reach this address can use and unload the models", host or "every interface")
        return
    raise ConfigError([Problem(
        config.source("server.host"), "server.host",
        f"{host!r} is reachable from other machines, and no API key is set: anyone on the "
        "network could run and unload the models. Set server.api_keys (and "
        "server.admin_keys for /admin), bind 127.0.0.1, or pass --insecure-no-auth "
        "(server.insecure_no_auth = true) to serve without keys anyway")])


class HTTPServer:
    """A waitress server for one ServerContext, run on a background thread."""

    def __init__(self, context: ServerContext, *, host: str | None = None,
                 port: int | None = None, threads: int | None = None,
                 frontend: Frontend | None = None):
        config = context.config
        host = host if host is not None else config.get("server.host", "127.0.0.1")
        check_exposure(host, config)
        self.frontend = frontend or build_frontend(context, bound_host=host)
        port = port if port is not None else int(config.get("server.port", 8000))
        threads = thread_count(context, threads)
        self.threads = threads
        max_body = self.frontend.max_body
        self._server = create_server(
            self.frontend.app, host=host, port=port, threads=threads,
            request_timeout=float(config.get("server.request_timeout_s", 10.0)),
            connection_limit=int(config.get("server.connection_limit", 2048)),
            channel_request_lookahead=1,
            max_request_body_size=max(max_body * WAITRESS_BODY_LIMIT_FACTOR, max_body + 2**20),
            ident="omlx-core", clear_untrusted_proxy_headers=True, expose_tracebacks=False)
        self.host = str(self._server.effective_host)
        self.port = int(self._server.effective_port)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "HTTPServer":
        self._thread = threading.Thread(target=self._server.run, name="omlx-http", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, abort in-flight requests, finish the worker threads, close sockets."""
        if self._closed:
            return
        self._closed = True
        server = self._server
        stopped_listening = threading.Event()

        def stop_listening() -> None:
            wasyncore.dispatcher.close(server)
            stopped_listening.set()

        if self._thread is not None and self._thread.is_alive():
            if self._pull(stop_listening):
                stopped_listening.wait(timeout)
            else:
                stop_listening()
        aborted = self.frontend.shutdown()
        if aborted:
            log.info("aborted %d in-flight request(s) on shutdown", aborted)
        server.task_dispatcher.shutdown(timeout=timeout)

        def close_all() -> None:
            wasyncore.close_all(server.socket_map, ignore_all=True)

        if self._thread is not None and self._thread.is_alive() and self._pull(close_all):
            self._thread.join(timeout)
        else:
            # Without the loop's wake-up pipe the sockets close from here: the loop polls
            # with a timeout, finds its map empty and ends.
            close_all()
            if self._thread is not None:
                self._thread.join(timeout)

    def _pull(self, thunk: Callable[[], None]) -> bool:
        """Run ``thunk`` on the server's loop thread; ``False`` when its wake-up pipe is
        closed already (a suite run once saw EBADF there as a server closed)."""
        try:
            self._server.trigger.pull_trigger(thunk)
            return True
        except OSError as error:
            log.warning("the HTTP server's wake-up pipe is closed (%s); closing it from this "
                        "thread", error)
            return False

    def __enter__(self) -> "HTTPServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_forever(context: ServerContext, stop: threading.Event) -> None:
    """Serve until ``stop`` is set, printing one ready line with the URL; then shut down cleanly."""
    server = HTTPServer(context).start()
    models = ", ".join(context.engines) or "none"
    print(f"omlx-core ready: {server.url} (OpenAI /v1, Anthropic /v1/messages; models: {models})",
          flush=True)
    try:
        stop.wait()
    finally:
        server.close()
