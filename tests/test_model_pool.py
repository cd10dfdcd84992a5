"""The model pool on tiny random models: real engines created and closed through the
bootstrap, memory read from a scripted reading (the pool's own bookkeeping plus a fixed
base), so that which model fits, which is evicted and which waits is exact. The same
decisions on real models and real memory are in ``test_model_pool_real.py``."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from omlx_core.bootstrap import close_engine, create_engine, load_setup
from omlx_core.config.keep_alive import parse_keep_alive
from omlx_core.memory.admission import AdmissionQueue
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, Rejection, RequestRejected
from omlx_core.models.errors import ModelError
from omlx_core.models.registry import resolve_model
from omlx_core.pool import AVAILABLE, FAILED, RESIDENT, ModelLoadFailed, ModelPool
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model
from omlx_core.testing.waiting import wait_for

MIB = 1024**2
BASE = 100 * MIB
IDS = ("tiny-a", "tiny-b", "tiny-c")


@dataclass
class _Usage:
    pool: "ScriptedMemory"

    def resident(self) -> int:
        return self.pool.in_use()


class ScriptedMemory:
    """The guard as the pool reads it: a hard limit, and memory in use that is a fixed
    base plus the weights of every loaded model (the working set the pool plans on top
    is what its requests use, and none runs while the pool decides here)."""

    backend = "cpu"

    def __init__(self, hard_bytes: int):
        self.hard_bytes = hard_bytes
        self.pool: ModelPool | None = None
        self.usage = _Usage(self)
        self.polls = 0
        #: the real ledger the pool claims its loads in (no request runs here)
        self.admission = AdmissionQueue(64, 30.0, 1.0)

    def in_use(self) -> int:
        records = self.pool.records() if self.pool is not None else []
        return BASE + sum(r.weights_bytes or 0 for r in records if r.engine is not None)

    @property
    def snapshot(self) -> LimitSnapshot:
        in_use = self.in_use()
        # Read now, so the ledger adds no earlier load or unload to its baseline.
        snapshot = LimitSnapshot(hard_bytes=self.hard_bytes,
                                 breakdown=CeilingBreakdown(custom=self.hard_bytes, tier="custom"),
                                 in_use_bytes=in_use, baseline_bytes=in_use,
                                 baseline_read_at=time.monotonic())
        self.admission.update(snapshot)
        return snapshot

    def fresh_snapshot(self) -> LimitSnapshot:
        self.polls += 1
        return self.snapshot


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool-models")
    return {model_id: cached_model(family, 0, cache_dir=root)
            for model_id, family in zip(IDS, ("llama", "qwen3", "llama"))}


def _context(tmp_path: Path, model_dirs: dict[str, Path], extra: str = "") -> ServerContext:
    config = tmp_path / "omlx.toml"
    tables = "".join(f'\n[models.{model_id}]\npath = "{path}"\n'
                     for model_id, path in model_dirs.items())
    config.write_text(f'[server]\nmodels = []\nkeep_alive = "-1"\nmodel_load_wait_s = 30.0\n'
                      f'{extra}\n{tables}')
    setup = load_setup("cpu-small", [config])
    for model_id in list(setup.config.models):
        if model_id not in model_dirs:
            del setup.config.models[model_id]
    return ServerContext(config=setup.config, plugins=setup.plugins)


def make_pool(context: ServerContext, memory: ScriptedMemory | None,
              create: Any = None) -> ModelPool:
    plugins = context.plugins

    def advice(rejection: Any) -> list[str]:
        return [str(a) for a in plugins.hook.on_rejection(rejection=rejection) if a]

    pool = ModelPool(context.config,
                     create=create or (lambda model_id: create_engine(context, model_id,
                                                                      progress=False)),
                     close=lambda model_id: close_engine(context, model_id),
                     resolve=lambda model_id: resolve_model(context.config.models[model_id],
                                                            progress=False),
                     guard=lambda: memory, estimate_peak=plugins.hook.estimate_peak,
                     advice=advice)
    if memory is not None:
        memory.pool = pool
    context.pool = pool
    return pool


@pytest.fixture
def context(tmp_path: Path, model_dirs: dict[str, Path]) -> Iterator[ServerContext]:
    context = _context(tmp_path, model_dirs)
    yield context
    if context.pool is not None:
        context.pool.close()
    for model_id in list(context.engines):
        close_engine(context, model_id)


def plans(context: ServerContext) -> dict[str, tuple[int, int]]:
    """(weights, planned bytes) of each model, from a pool without limit (headers only)."""
    probe = make_pool(context, None)
    probe.plan_local()
    return {r.id: (r.weights_bytes, r.planned_bytes) for r in probe.records()}


def room_for_two(context: ServerContext) -> ScriptedMemory:
    sizes = plans(context)
    weights = [w for w, _ in sizes.values()]
    planned = [p for _, p in sizes.values()]
    # Any one model loads next to any other; a third never fits next to two.
    assert min(planned) + 2 * min(weights) > max(planned) + max(weights)
    return ScriptedMemory(BASE + max(weights) + max(planned))


def use(pool: ModelPool, model_id: str) -> None:
    pool.acquire(model_id).release()


# -- planning, eviction, waiting -----------------------------------------------------------


def test_the_plan_reads_weights_from_the_headers_and_adds_the_working_set(context):
    pool = make_pool(context, None)
    record = pool.load("tiny-a")
    weights = sum(p.stat().st_size for p in Path(context.config.models["tiny-a"].get("path"))
                  .glob("*.safetensors"))
    # The header's tensor bytes are the file less its (small) JSON header.
    assert weights - 64 * 1024 < record.weights_bytes <= weights
    assert record.planned_bytes > record.weights_bytes
    assert record.state == RESIDENT and "tiny-a" in context.engines


def test_a_cold_model_evicts_the_least_recently_used_idle_one(context):
    memory = room_for_two(context)
    pool = make_pool(context, memory)
    use(pool, "tiny-a")
    use(pool, "tiny-b")
    use(pool, "tiny-a")  # b is now the least recently used
    use(pool, "tiny-c")
    states = {r.id: r.state for r in pool.records()}
    assert states == {"tiny-a": RESIDENT, "tiny-b": AVAILABLE, "tiny-c": RESIDENT}
    assert pool.counters.unloads == {"evicted": 1}
    assert set(context.engines) == {"tiny-a", "tiny-c"}
    assert memory.in_use() <= memory.hard_bytes


def test_pinned_and_busy_models_are_never_evicted_the_load_waits_then_503(context):
    memory = room_for_two(context)
    pool = make_pool(context, memory)
    pool.wait_s = 0.5
    use(pool, "tiny-a")
    pool.pin("tiny-a")
    lease = pool.acquire("tiny-b")  # a request running on b (a stream mid-way)
    with pytest.raises(RequestRejected) as refused:
        pool.acquire("tiny-c")
    error = refused.value
    assert error.stage == "load" and error.rejection.cause == "memory_short" and error.retryable
    assert error.retry_after_s is not None and "tiny-c" in str(error)
    assert {r.id for r in pool.records() if r.state == RESIDENT} == {"tiny-a", "tiny-b"}
    assert lease.engine is context.engines["tiny-b"]  # the running request kept its engine
    # Once b's request ends, c's load evicts b (a stays: pinned).
    pool.wait_s = 30.0
    done = threading.Event()
    threading.Thread(target=lambda: (use(pool, "tiny-c"), done.set()), daemon=True).start()
    assert wait_for(lambda: pool.record("tiny-c").waiters == 1 or done.is_set(), timeout=30)
    assert pool.record("tiny-b").state == RESIDENT
    lease.release()
    assert done.wait(60)
    assert {r.id for r in pool.records() if r.state == RESIDENT} == {"tiny-a", "tiny-c"}


def test_a_model_that_can_never_fit_is_refused_at_once_with_advice(context):
    sizes = {model_id: planned for model_id, (_, planned) in plans(context).items()}
    weights_a = plans(context)["tiny-a"][0]
    # a loads alone; b never fits next to a's weights, and a is pinned.
    assert weights_a + sizes["tiny-b"] > sizes["tiny-a"]
    memory = ScriptedMemory(BASE + sizes["tiny-a"])
    pool = make_pool(context, memory)
    use(pool, "tiny-a")
    pool.pin("tiny-a")
    with pytest.raises(RequestRejected) as refused:
        pool.acquire("tiny-b")
    error = refused.value
    assert error.stage == "load" and error.rejection.cause == "never_fits"
    assert not error.retryable and error.retry_after_s is None
    assert error.rejection.estimated_bytes == sizes["tiny-b"]
    assert error.rejection.pinned_models == ("tiny-a",)
    assert error.rejection.binding == "custom"
    advice = " ".join(error.advice)
    assert "unpin" in advice.lower() and "tiny-a" in advice and "quantized" in advice
    assert pool.counters.loads == 1 and "tiny-b" not in context.engines


def test_concurrent_first_requests_share_one_load(context):
    pool = make_pool(context, None)
    start = threading.Barrier(6)
    engines: list[Any] = []

    def first_request() -> None:
        start.wait(60)
        lease = pool.acquire("tiny-b")
        engines.append(lease.engine)
        lease.release()

    threads = [threading.Thread(target=first_request) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(engines) == 6 and len({id(e) for e in engines}) == 1
    assert pool.counters.loads == 1


def test_a_corrupt_model_fails_every_waiter_clearly_and_leaves_the_pool_as_it_was(
        context, tmp_path, model_dirs):
    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["tiny-c"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated mid-header
    from omlx_core.config import ModelEntry, Sourced

    context.config.models["broken"] = ModelEntry("broken", {"path": Sourced(str(broken), "test")})
    pool = make_pool(context, None)
    use(pool, "tiny-a")
    errors: list[Exception] = []
    start = threading.Barrier(4)

    def first_request() -> None:
        start.wait(60)
        try:
            pool.acquire("broken")
        except ModelLoadFailed as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_request) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 4
    message = str(errors[0])
    assert "'broken'" in message and "model.safetensors" in message and "corrupt" in message
    assert pool.counters.load_failures == 1
    # Within the back-off the error is answered again without another attempt.
    with pytest.raises(ModelLoadFailed):
        pool.acquire("broken")
    assert pool.counters.load_failures == 1
    assert pool.describe(pool.record("broken"))["state"] == FAILED
    assert set(context.engines) == {"tiny-a"} and pool.resident() == ["tiny-a"]
    use(pool, "tiny-a")


def test_a_missing_model_directory_fails_with_its_path(context, tmp_path):
    from omlx_core.config import ModelEntry, Sourced

    gone = tmp_path / "gone"
    context.config.models["gone"] = ModelEntry("gone", {"path": Sourced(str(gone), "test")})
    pool = make_pool(context, None)
    with pytest.raises(ModelLoadFailed, match=r"model 'gone' failed to load: .*does not exist"):
        pool.acquire("gone")


# -- keep_alive and pinning ----------------------------------------------------------------


def test_keep_alive_zero_unloads_as_soon_as_idle_and_minus_one_keeps(context):
    pool = make_pool(context, None)
    pool.start()
    lease = pool.acquire("tiny-a", keep_alive=0)
    assert pool.record("tiny-a").state == RESIDENT  # in use: never unloaded under a request
    lease.release()
    assert wait_for(lambda: pool.record("tiny-a").state == AVAILABLE, timeout=30)
    assert pool.counters.unloads == {"keep_alive": 1} and "tiny-a" not in context.engines
    pool.acquire("tiny-b", keep_alive="-1").release()
    pool.acquire("tiny-c", keep_alive="1s").release()
    assert wait_for(lambda: pool.record("tiny-c").state == AVAILABLE, timeout=30)
    assert pool.record("tiny-b").state == RESIDENT


def test_a_pinned_model_outlives_its_keep_alive(context):
    pool = make_pool(context, None)
    pool.start()
    pool.pin("tiny-a")
    pool.acquire("tiny-a", keep_alive=0).release()
    pool.acquire("tiny-b", keep_alive=0).release()
    assert wait_for(lambda: pool.record("tiny-b").state == AVAILABLE, timeout=30)
    assert pool.record("tiny-a").state == RESIDENT
    pool.pin("tiny-a", False)
    assert wait_for(lambda: pool.record("tiny-a").state == AVAILABLE, timeout=30)


@pytest.mark.parametrize("value, expected", [
    ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), (-1, None), ("-1", None), (0, 0.0),
    ("0", 0.0), (2.5, 2.5), ("250ms", 0.25)])
def test_keep_alive_forms(value, expected):
    assert parse_keep_alive(value) == expected


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", True, [1], float("nan")])
def test_bad_keep_alive_is_refused_naming_the_forms(value):
    with pytest.raises(ValueError, match="duration"):
        parse_keep_alive(value)


# -- over HTTP -------------------------------------------------------------------------------


def _http(url: str, method: str, path: str, body: Any = None,
          key: str | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None
                                     else None, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"{}"), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}"), dict(error.headers)


@pytest.fixture
def served(context: ServerContext) -> Iterator[str]:
    from omlx_core.http.app import build_frontend
    from omlx_core.http.serve import HTTPServer

    make_pool(context, None).start()
    frontend = build_frontend(context, admin_keys=["sekrit"])
    with HTTPServer(context, port=0, frontend=frontend) as server:
        yield server.url


def test_admin_routes_need_a_key_and_steer_the_pool(served, context):
    status, body, _ = _http(served, "POST", "/admin/models/tiny-a/load")
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    assert context.pool.record("tiny-a").state == AVAILABLE
    status, body, _ = _http(served, "POST", "/admin/models/tiny-a/load", key="sekrit")
    assert status == 200 and body["state"] == RESIDENT and body["changed"]
    status, body, _ = _http(served, "POST", "/admin/models/tiny-a/pin", key="sekrit")
    assert status == 200 and body["pinned"] is True
    status, body, _ = _http(served, "GET", "/v1/models", key="sekrit")
    listed = {m["id"]: m for m in body["data"]}
    assert body["object"] == "list" and set(listed) == set(IDS)
    assert listed["tiny-a"]["state"] == RESIDENT and listed["tiny-a"]["pinned"]
    assert listed["tiny-b"]["state"] == AVAILABLE and listed["tiny-b"]["resident_bytes"] == 0
    status, body, _ = _http(served, "POST", "/admin/models/tiny-a/unload", key="sekrit")
    assert status == 200 and body["state"] == AVAILABLE and "tiny-a" not in context.engines
    status, body, _ = _http(served, "POST", "/admin/models/nope/load", key="sekrit")
    assert status == 404 and "tiny-a" in body["error"]["message"]
    status, body, _ = _http(served, "POST", "/admin/models/tiny-a/explode", key="sekrit")
    assert status == 404 and body["error"]["code"] == "unknown_action"


def test_unloading_a_model_whose_requests_do_not_end_is_a_409_naming_them(served, context):
    status, _, _ = _http(served, "POST", "/admin/models/tiny-a/load", key="sekrit")
    assert status == 200
    context.pool.wait_s = 0.5  # how long an unload waits for the model's requests to end
    lease = context.pool.acquire("tiny-a")  # a request running on it
    try:
        status, body, _ = _http(served, "POST", "/admin/models/tiny-a/unload", key="sekrit")
    finally:
        lease.release()
    assert status == 409, body
    error = body["error"]
    assert error["code"] == "model_busy" and "tiny-a" in error["message"]
    assert "still runs 1 request(s)" in error["message"] and "retry" in error["message"]
    assert context.pool.record("tiny-a").state == RESIDENT  # not left half-drained
    status, body, _ = _http(served, "POST", "/admin/models/tiny-a/unload", key="sekrit")
    assert status == 200 and body["state"] == AVAILABLE


def test_a_chat_loads_its_model_and_a_bad_keep_alive_is_a_400_naming_it(served, context):
    chat = {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, body, _ = _http(served, "POST", "/v1/chat/completions",
                            {**chat, "keep_alive": "soon"}, key="sekrit")
    assert status == 400 and body["error"]["param"] == "keep_alive"
    assert context.pool.record("tiny-b").state == AVAILABLE  # refused before any load
    status, body, _ = _http(served, "POST", "/v1/chat/completions",
                            {**chat, "keep_alive": "-1"}, key="sekrit")
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    record = context.pool.record("tiny-b")
    assert record.state == RESIDENT and record.keep_alive_s is None
    status, health, _ = _http(served, "GET", "/health", key="sekrit")
    assert status == 200 and health["pool"]["models"]["tiny-b"]["state"] == RESIDENT
    request = urllib.request.Request(served + "/metrics",
                                     headers={"Authorization": "Bearer sekrit"})
    with urllib.request.urlopen(request, timeout=60) as response:
        metrics = response.read().decode()
    assert "omlx_model_loads_total 1.0" in metrics and "omlx_models_resident 1.0" in metrics
    assert "omlx_model_load_seconds_count 1.0" in metrics


def test_an_engine_loaded_on_demand_gets_the_enforcers_limits(tmp_path, model_dirs):
    """Through the real bootstrap and memory guard: the pool's settle barrier waits for
    a poll after the load, and every poll publishes to every engine in the context."""
    from omlx_core.bootstrap import start_engines, stop_engines

    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny-a"]\n\n[models.tiny-a]\npath = "{model_dirs["tiny-a"]}"\n'
                      f'\n[models.tiny-b]\npath = "{model_dirs["tiny-b"]}"\n')
    context = start_engines(load_setup("cpu-small", [config]), progress=False)
    try:
        pool = context.pool
        assert pool.record("tiny-a").pinned and not pool.record("tiny-b").pinned
        assert pool.record("tiny-b").planned_bytes > 0  # planned at start, from the headers
        lease = pool.acquire("tiny-b")
        try:
            receiver = context.plugins.hook.resolve_scheduler(engine=lease.engine)
            assert receiver.state.limits is not None
            assert receiver.state.limits.sequence >= 1
        finally:
            lease.release()
        assert pool.unload("tiny-b") and "tiny-b" not in context.engines
    finally:
        stop_engines(context)


def test_an_unloaded_engine_and_its_mlx_buffers_are_freed(context):
    import gc
    import weakref

    import mlx.core as mx

    pool = make_pool(context, None)
    gc.collect()
    # What the process held before (other tests' arrays too): the unload must return to it.
    held_before = mx.get_active_memory()
    lease = pool.acquire("tiny-a")
    engine = weakref.ref(lease.engine)
    lease.release()
    del lease
    assert pool.unload("tiny-a")
    gc.collect()
    assert engine() is None and "tiny-a" not in context.engines
    assert pool.counters.unloads == {"admin": 1}
    assert mx.get_active_memory() - held_before < pool.record("tiny-a").weights_bytes // 100


def test_omlx_core_ps_prints_the_running_servers_pool(served, context, capsys):
    from urllib.parse import urlparse

    from omlx_core.cli import main

    context.pool.load("tiny-a")
    port = str(urlparse(served).port)
    assert main(["ps", "--port", port]) == 1  # keys are configured and none was sent
    assert "401" in capsys.readouterr().err
    assert main(["ps", "--port", port, "--api-key", "sekrit"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "STATE", "SIZE"]
    assert [line.split()[:2] for line in lines[1:]] == [["tiny-a", "resident"]]
    assert main(["ps", "--port", port, "--api-key", "sekrit", "--all"]) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed == {"tiny-a": RESIDENT, "tiny-b": AVAILABLE, "tiny-c": AVAILABLE}


# -- a stream that waits for its model's load --------------------------------------------------


class HeldLoads:
    """Model loads that wait for the test before the engine is built (then build the real
    one, or fail as a load does)."""

    def __init__(self, context: ServerContext):
        self.context = context
        self.release = threading.Event()
        self.failure: Exception | None = None

    def create(self, model_id: str) -> Any:
        assert self.release.wait(120), "the test never released the load"
        if self.failure is not None:
            raise self.failure
        return create_engine(self.context, model_id, progress=False)


@pytest.fixture
def held(tmp_path: Path, model_dirs: dict[str, Path]) -> Iterator[tuple[str, HeldLoads, Any]]:
    """A server (keep-alive every 0.2 s) whose model loads wait for the test."""
    from omlx_core.http.app import build_frontend
    from omlx_core.http.serve import HTTPServer

    context = _context(tmp_path, model_dirs, "stream_keepalive_s = 0.2")
    loads = HeldLoads(context)
    make_pool(context, None, create=loads.create).start()
    frontend = build_frontend(context, api_keys=[])
    try:
        with HTTPServer(context, port=0, frontend=frontend) as server:
            yield server.url, loads, frontend
    finally:
        loads.release.set()
        context.pool.close()
        for model_id in list(context.engines):
            close_engine(context, model_id)


def _send_stream(url: str, model_id: str, max_tokens: int = 4) -> Any:
    """A streamed chat sent; its answer not read yet."""
    import http.client
    from urllib.parse import urlparse

    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
    connection.request("POST", "/v1/chat/completions", json.dumps({
        "model": model_id, "stream": True, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}]}), {"Content-Type": "application/json"})
    return connection


def _open_stream(url: str, model_id: str, max_tokens: int = 4) -> Any:
    connection = _send_stream(url, model_id, max_tokens)
    return connection, connection.getresponse()


def _nothing_sent(connection: Any, loads: HeldLoads, model_id: str) -> bool:
    """Whether the server has sent no byte while the load of ``model_id`` is held (and
    the request waits for it) for five keep-alive intervals."""
    import select

    record = loads.context.pool.record(model_id)
    assert wait_for(lambda: record.state == "loading" and record.waiters == 1)
    readable, _, _ = select.select([connection.sock], [], [], 1.0)
    return not readable


def test_a_stream_waiting_for_its_models_load_starts_once_the_model_is_loaded(held):
    url, loads, _ = held
    connection = _send_stream(url, "tiny-b")
    with contextlib.closing(connection):
        # Not a byte while the load is held: a refusal could still come as a status.
        assert _nothing_sent(connection, loads, "tiny-b")
        loads.release.set()
        response = connection.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type").startswith("text/event-stream")
        body = response.read().decode()
    events = [json.loads(line[6:]) for line in body.splitlines()
              if line.startswith("data: {")]
    assert events and all("error" not in event for event in events), body
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert body.rstrip().endswith("data: [DONE]")


def test_a_load_that_fails_while_a_stream_waits_is_its_status_naming_the_model(held):
    url, loads, frontend = held
    connection = _send_stream(url, "tiny-b")
    with contextlib.closing(connection):
        assert _nothing_sent(connection, loads, "tiny-b")
        loads.failure = ModelError("unsupported architecture 'mystery'")
        loads.release.set()
        response = connection.getresponse()
        assert response.status == 500
        error = json.loads(response.read())["error"]
    assert error["code"] == "model_load_failed"
    assert "tiny-b" in error["message"] and "mystery" in error["message"]
    assert loads.context.pool.record("tiny-b").state == FAILED
    assert len(frontend.pipeline.in_flight) == 0


def test_unloading_a_model_that_is_loading_is_a_409_naming_it(held):
    url, loads, _ = held
    connection = _send_stream(url, "tiny-b")
    with contextlib.closing(connection):
        assert _nothing_sent(connection, loads, "tiny-b")
        assert loads.context.pool.record("tiny-b").state == "loading"
        status, body, _ = _http(url, "POST", "/admin/models/tiny-b/unload")
        loads.release.set()
        connection.getresponse().read()
    assert status == 409, body
    error = body["error"]
    assert error["code"] == "model_busy" and error["type"] == "invalid_request_error"
    assert "tiny-b" in error["message"] and "is loading" in error["message"]


def test_an_unexpected_load_failure_keeps_its_text_in_the_log(held, caplog):
    url, loads, _ = held
    connection = _send_stream(url, "tiny-b")
    with contextlib.closing(connection):
        assert _nothing_sent(connection, loads, "tiny-b")
        loads.failure = RuntimeError("secret detail at /home/someone/models/x")
        loads.release.set()
        error = json.loads(connection.getresponse().read())["error"]
    assert error["code"] == "model_load_failed" and "RuntimeError" in error["message"]
    assert "secret detail" not in error["message"] and "/home" not in error["message"]
    assert "secret detail at /home/someone/models/x" in caplog.text


class RefuseTinyB:
    """A preflight that finds every request for tiny-b too large (a ceiling it can never fit)."""

    @hookimpl
    def preflight(self, request: Any) -> None:
        if request.model_id == "tiny-b":
            raise RequestRejected(Rejection(
                estimated_bytes=1 << 40, limit_bytes=1 << 30, breakdown=None,
                request_id=request.request_id, model_id=request.model_id,
                prompt_tokens=request.prompt_tokens, stage="preflight"))


def test_a_stream_whose_load_outlasts_the_keepalive_still_gets_its_413_as_the_status(held):
    from omlx_core.memory.guard import MemoryGuard

    url, loads, _ = held
    refuse = RefuseTinyB()
    context = loads.context
    context.plugins.register(refuse, "refuse-tiny-b")
    context.memory_guard = MemoryGuard(context.plugins, context.config)
    try:
        connection = _send_stream(url, "tiny-b")
        with contextlib.closing(connection):
            assert _nothing_sent(connection, loads, "tiny-b")
            loads.release.set()
            response = connection.getresponse()
            assert response.status == 413, response.read()
            assert json.loads(response.read())["error"]["code"] == "prefill_memory_exceeded"
    finally:
        context.memory_guard = None
        context.plugins.unregister(refuse)


def test_a_model_load_refused_at_once_is_still_an_http_status_on_a_stream(held):
    url, loads, _ = held
    connection, response = _open_stream(url, "no-such-model")
    with contextlib.closing(connection):
        assert response.status == 404
        assert "tiny-a" in json.loads(response.read())["error"]["message"]


def test_a_client_that_leaves_while_its_model_loads_leaves_nothing_running(held):
    url, loads, frontend = held
    connection = _send_stream(url, "tiny-b", max_tokens=100_000)
    assert _nothing_sent(connection, loads, "tiny-b")
    connection.close()
    loads.release.set()
    record = loads.context.pool.record("tiny-b")
    # The request started once the load ended (it took a lease: last_used moved past
    # the load), then was closed at once: the lease is back and nothing is in flight.
    assert wait_for(lambda: record.state == RESIDENT and record.loaded_at is not None
                    and record.last_used > record.loaded_at and record.users == 0
                    and len(frontend.pipeline.in_flight) == 0, timeout=120)
