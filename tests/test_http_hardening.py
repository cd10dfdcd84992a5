"""A localhost server no web page can drive, on a real waitress server over loopback with
a real HTTP client (``http.client``): cross-site posts and rebinding hosts are refused,
CORS is off unless an origin is let in (then its preflight answers right), admin routes
need an admin key, ``/health`` shows only its status without a key, a server reachable
from other machines needs keys, and client errors name no path of this machine."""

from __future__ import annotations

import http.client
import json
import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.config import ConfigError, Sourced
from omlx_core.http import HTTPServer, build_frontend
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def start_context(tmp_path: Path, model_dir: Path, extra: str = "", **settings: str
                  ) -> ServerContext:
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["{MODEL}"]\n\n[models.{MODEL}]\npath = "{model_dir}"\n'
                      + extra)
    overrides = [(key.replace("__", "."), value, "test") for key, value in settings.items()]
    return start_engines(load_setup("cpu-small", [config], overrides), progress=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def context(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerContext]:
    # A second model whose directory is missing: its load error names a path.
    missing = tmp_path_factory.mktemp("gone") / "no-such-model"
    context = start_context(tmp_path_factory.mktemp("config"), tiny_dir,
                            f'\n[models.broken]\npath = "{missing}"\n')
    yield context
    stop_engines(context)


def call(server: HTTPServer, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        got = {k.lower(): v for k, v in response.getheaders()}
        if got.get("content-type", "").startswith("application/json") and data:
            return response.status, got, json.loads(data)
        return response.status, got, data
    finally:
        connection.close()


JSON = {"Content-Type": "application/json"}


@contextlib.contextmanager
def setting(context: ServerContext, key: str, value: Any) -> Iterator[None]:
    """``key`` set to ``value`` for the servers built meanwhile."""
    values = context.config.values
    before = values[key]
    values[key] = Sourced(value, "test")
    try:
        yield
    finally:
        values[key] = before


def test_a_post_must_declare_json_so_a_web_form_cannot_send_one(context, server) -> None:
    chat = json.dumps(CHAT).encode()
    # What a cross-site page can send without a preflight: a form, text, or no type.
    for headers in ({}, {"Content-Type": "text/plain"},
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"}):
        status, _, body = call(server, "POST", "/v1/chat/completions", chat, headers)
        assert status == 415, (headers, body)
        assert body["error"]["code"] == "unsupported_media_type"
        assert "application/json" in body["error"]["message"]
    # An HTML form that unloads or unpins a model: refused, the model stays.
    for action in ("unload", "unpin"):
        status, _, _ = call(server, "POST", f"/admin/models/{MODEL}/{action}", b"x=1",
                            {"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 415
        status, _, _ = call(server, "POST", f"/admin/models/{MODEL}/{action}")
        assert status == 415
    pool = context.pool
    assert pool.describe(pool.record(MODEL))["state"] == "resident"
    assert pool.describe(pool.record(MODEL))["pinned"] is True
    # A client that says JSON is served.
    assert call(server, "POST", "/v1/chat/completions", chat, JSON)[0] == 200
    assert call(server, "POST", f"/admin/models/{MODEL}/pin", None, JSON)[0] == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000",
                                  "localhost.attacker.example", "10.1.2.3"])
def test_a_rebinding_host_is_421(server, host) -> None:
    for method, path, body, headers in (("GET", "/v1/models", None, {}),
                                        ("GET", "/health", None, {}),
                                        ("POST", "/v1/chat/completions",
                                         json.dumps(CHAT).encode(), JSON)):
        status, _, answer = call(server, method, path, body, {**headers, "Host": host})
        assert status == 421, (host, path, answer)
        assert answer["error"]["code"] == "host_not_allowed"
        assert "server.allowed_hosts" in answer["error"]["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1234",
                                  "[::1]:8000"])
def test_loopback_hosts_are_answered(server, host) -> None:
    assert call(server, "GET", "/v1/models", headers={"Host": host})[0] == 200


def test_allowed_hosts_adds_names(context) -> None:
    with setting(context, "server.allowed_hosts", ["gpu-box.lan"]), \
            HTTPServer(context, port=0) as server:
        assert call(server, "GET", "/v1/models", headers={"Host": "gpu-box.lan:8000"})[0] == 200
        assert call(server, "GET", "/v1/models", headers={"Host": "other.lan"})[0] == 421


PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_is_off_by_default(server) -> None:
    status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in headers
    status, headers, _ = call(server, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                              {**JSON, "Origin": "http://localhost:3000"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_cors_origins_let_a_browser_app_in_with_a_correct_preflight(context) -> None:
    with setting(context, "server.cors_origins", ["http://localhost:3000"]):
        frontend = build_frontend(context, api_keys=["app-key"])
        with HTTPServer(context, port=0, frontend=frontend) as server:
            # The preflight carries no key and passes; it lists the route's methods.
            status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
            assert status == 200
            assert headers["access-control-allow-origin"] == "http://localhost:3000"
            assert "POST" in headers["access-control-allow-methods"]
            assert headers["access-control-allow-headers"] == "authorization, content-type"
            assert "Origin" in headers["vary"]
            # The request itself needs the key, and its answer (a refusal too) is readable.
            origin = {**JSON, "Origin": "http://localhost:3000"}
            status, headers, body = call(server, "POST", "/v1/chat/completions",
                                         json.dumps(CHAT).encode(), origin)
            assert status == 401 and headers["access-control-allow-origin"] == "http://localhost:3000"
            status, headers, body = call(server, "POST", "/v1/chat/completions",
                                         json.dumps(CHAT).encode(),
                                         {**origin, "Authorization": "Bearer app-key"})
            assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
            # Another origin is told nothing.
            status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions",
                                      headers={**PREFLIGHT, "Origin": "http://attacker.example"})
            assert "access-control-allow-origin" not in headers


def test_admin_routes_need_an_admin_key(context) -> None:
    frontend = build_frontend(context, api_keys=["user-key"], admin_keys=["admin-key"])
    user, admin = {"Authorization": "Bearer user-key"}, {"x-api-key": "admin-key"}
    with HTTPServer(context, port=0, frontend=frontend) as server:
        path = f"/admin/models/{MODEL}/unpin"
        status, _, body = call(server, "POST", path, None, {**JSON, **user})
        assert status == 403 and body["error"]["code"] == "admin_key_required"
        assert call(server, "POST", path, None, JSON)[0] == 401
        status, _, body = call(server, "POST", path, None, {**JSON, **admin})
        assert status == 200 and body["pinned"] is False
        assert call(server, "POST", f"/admin/models/{MODEL}/pin", None, {**JSON, **admin})[0] == 200
        # Cancelling a request is an admin action too; reading the dashboard is not.
        status, _, body = call(server, "DELETE", "/dashboard/api/requests/req-none", None, user)
        assert status == 403
        assert call(server, "DELETE", "/dashboard/api/requests/req-none", None, admin)[0] == 404
        assert call(server, "GET", "/dashboard/api/requests", None, user)[0] == 200
        # An admin key is an API key as well.
        assert call(server, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                    {**JSON, **admin})[0] == 200
    # API keys without admin keys: nobody may use the admin routes.
    frontend = build_frontend(context, api_keys=["user-key"])
    with HTTPServer(context, port=0, frontend=frontend) as server:
        status, _, body = call(server, "POST", f"/admin/models/{MODEL}/unload", None,
                               {**JSON, **user})
        assert status == 403 and "server.admin_keys" in body["error"]["message"]
    assert context.pool.describe(context.pool.record(MODEL))["state"] == "resident"


def test_health_shows_only_its_status_without_a_key_when_keys_are_set(context) -> None:
    frontend = build_frontend(context, api_keys=["user-key"])
    with HTTPServer(context, port=0, frontend=frontend) as server:
        status, _, body = call(server, "GET", "/health")
        assert status == 200 and body == {"status": "ok"}
        status, _, body = call(server, "GET", "/health", headers={"x-api-key": "wrong"})
        assert body == {"status": "ok"}
        status, _, body = call(server, "GET", "/health", headers={"x-api-key": "user-key"})
        assert status == 200 and {"models", "engines", "memory", "pool"} <= set(body)


def test_client_errors_name_no_path_of_this_machine(context, server, tmp_path_factory) -> None:
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           json.dumps({**CHAT, "model": "broken"}).encode(), JSON)
    assert status == 500 and body["error"]["code"] == "model_load_failed"
    message = body["error"]["message"]
    assert "no-such-model" in message and str(tmp_path_factory.getbasetemp()) not in message
    assert "/tmp" not in message and "…/no-such-model" in message
    for path in ("/health", "/v1/models", "/dashboard/api/models"):
        text = call(server, "GET", path)[2]
        assert str(tmp_path_factory.getbasetemp()) not in json.dumps(text), path


def test_a_server_whose_wake_up_pipe_is_gone_still_closes(context) -> None:
    """A suite run once saw the loop's wake-up pipe closed (EBADF) as a server closed:
    the close then raised and left the loop thread running. It closes from the calling
    thread instead, and the loop ends."""
    import os

    server = HTTPServer(context, port=0).start()
    assert call(server, "GET", "/v1/models")[0] == 200
    trigger = server._server.trigger
    os.close(trigger.trigger)
    trigger._fds = [fd for fd in trigger._fds if fd != trigger.trigger]
    server.close()
    assert not server._thread.is_alive()


def test_a_server_other_machines_reach_needs_keys(context) -> None:
    with pytest.raises(ConfigError, match="--insecure-no-auth"):
        HTTPServer(context, host="0.0.0.0", port=0)
    with setting(context, "server.api_keys", ["k"]), \
            HTTPServer(context, host="0.0.0.0", port=0) as server:
        assert call(server, "GET", "/v1/models", headers={"x-api-key": "k"})[0] == 200
    with setting(context, "server.insecure_no_auth", True), \
            HTTPServer(context, host="0.0.0.0", port=0) as server:
        # Bound to every interface: any address of this machine is a host it answers.
        assert call(server, "GET", "/v1/models", headers={"Host": "10.1.2.3:8000"})[0] == 200
        assert call(server, "GET", "/v1/models", headers={"Host": "attacker.example"})[0] == 421


def test_serve_on_all_interfaces_without_keys_refuses_at_start() -> None:
    done = subprocess.run([sys.executable, "-m", "omlx_core", "serve", "--host", "0.0.0.0",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "no API key is set" in done.stderr and "--insecure-no-auth" in done.stderr


# -- the prefix cache tells no client of another's prompts -------------------------------------


def cached_tokens(server: HTTPServer, prompt: list[int], salt: str | None = None) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, _, answer = call(server, "POST", "/v1/completions", json.dumps(body).encode(), JSON)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_cache_salt_keeps_a_clients_prefix_cache_entries_apart(server) -> None:
    prompt = [(11 * i) % 250 + 3 for i in range(300)]  # several blocks of the prefix cache
    assert cached_tokens(server, prompt) == 0
    assert cached_tokens(server, prompt) > 0  # the unsalted entries serve unsalted requests
    # Another client, salted: it cannot tell that someone sent this prompt before.
    assert cached_tokens(server, prompt, "client-b-3f9a1c") == 0
    assert cached_tokens(server, prompt, "client-b-3f9a1c") > 0  # its own entries serve it
    assert cached_tokens(server, prompt, "client-c-77d0e2") == 0
    # And an unsalted client learns nothing of the salted ones' prompts either.
    other = [(13 * i) % 250 + 4 for i in range(300)]  # no token in common at the start
    assert cached_tokens(server, other, "client-b-3f9a1c") == 0
    assert cached_tokens(server, other) == 0


# -- what a client nests ------------------------------------------------------------------------

DEEP = "[" * 50_000 + "]" * 50_000


def test_tool_call_arguments_nested_50000_deep_are_a_4xx_not_a_500(server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    for body in ({"model": MODEL, "messages": history, "max_tokens": 2, "tools": [tool]},
                 {"model": MODEL, "messages": history, "max_tokens": 2}):
        status, _, answer = call(server, "POST", "/v1/chat/completions",
                                 json.dumps(body).encode(), JSON)
        assert 400 <= status < 500, answer
        assert "traceback" not in json.dumps(answer).lower()
    assert call(server, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(), JSON)[0] == 200


# -- the grammar flood ------------------------------------------------------------------------


def _words(count: int, length: int = 40) -> list[str]:
    import random
    import string

    rng = random.Random(count)
    return ["".join(rng.choices(string.ascii_letters, k=length)) for _ in range(count)]


def test_flood_grammars_are_refused_at_once_naming_the_cap(server) -> None:
    flood = {"type": "object", "properties": {"pick": {"enum": _words(60_000)}}}
    wide = {"type": "object", "properties": {"pick": {"enum": _words(600, 8)}}}
    for schema, setting in ((flood, "grammar.max_grammar_bytes"), (wide, "grammar.max_alternatives")):
        body = {**CHAT, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": schema}}}
        status, _, answer = call(server, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                                 JSON)
        assert status == 400 and setting in answer["error"]["message"], answer
        assert answer["error"]["param"] == "response_format.json_schema.schema"
        # A tool whose parameters are the same: its grammar is capped the same way.
        tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
        status, _, answer = call(server, "POST", "/v1/chat/completions",
                                 json.dumps({**CHAT, "tools": [tool]}).encode(), JSON)
        assert status == 400 and setting in answer["error"]["message"], answer
    # Grammars within the caps are served.
    small = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {**CHAT, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": small}}}
    assert call(server, "POST", "/v1/chat/completions", json.dumps(body).encode(), JSON)[0] == 200


def test_refusals_of_large_bodies_are_paced_so_a_refused_flood_cannot_take_the_cpu() -> None:
    import falcon
    import falcon.testing

    from omlx_core.http.errors import bad_request, install_error_handlers
    from omlx_core.http.refusal_pacing import MAX_DELAY_S, RefusalPacing

    waits: list[float] = []

    class Route:
        def on_post(self, req, resp):
            req.bounded_stream.read()
            if req.get_param("refuse"):
                raise bad_request("the grammar is over a cap (grammar.max_grammar_bytes)")
            resp.media = {"ok": True}

    app = falcon.App(middleware=[RefusalPacing(sleep=waits.append)])
    install_error_handlers(app)
    app.add_route("/x", Route())
    client = falcon.testing.TestClient(app)
    mib = b"x" * (1024 * 1024)
    assert client.simulate_post("/x", params={"refuse": 1}, body=mib).status_code == 400
    assert waits == [1.0]  # a MiB refused: answered at a MiB a second
    assert client.simulate_post("/x", params={"refuse": 1}, body=mib * 20).status_code == 400
    assert waits[-1] == MAX_DELAY_S
    assert client.simulate_post("/x", body=mib).status_code == 200  # served: at once
    assert client.simulate_post("/x", params={"refuse": 1}, body=b"x" * 1000).status_code == 400
    assert len(waits) == 2  # small refusals: at once
