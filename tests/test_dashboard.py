"""The dashboard's data side and JSON endpoints without a browser: the ring buffer keeps
15 minutes, the recorder's samples carry the enforcer's limits and the engines' rates,
refusals are kept (100) and found by request id, the endpoints are documented and keyed;
``omlx-core top`` prints the same data in a terminal."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Iterator

import falcon.testing
import pytest

from omlx_core.bootstrap import stop_engines
from omlx_core.dashboard import DashboardRecorder, History, Sample
from omlx_core.dashboard.history import columns
from omlx_core.dashboard.recorder import REFUSALS_KEPT
from omlx_core.engine import SamplingParams
from omlx_core.http import build_frontend
from omlx_core.memory.types import CeilingBreakdown, Rejection, RequestRejected
from omlx_core.serving import Job
from omlx_core.server_context import ServerContext
from omlx_core.testing.waiting import wait_for

from conftest import start_tiny_context

DASHBOARD_JSON = ("/dashboard/api/history", "/dashboard/api/requests",
                  "/dashboard/api/refusals", "/dashboard/api/models")

#: the Host a client on loopback sends (falcon's test client sends its own site's)
LOCAL = {"Host": "localhost"}


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerContext]:
    context = start_tiny_context(tmp_path_factory)
    yield context
    stop_engines(context)


def rejection(request_id: str, stage: str = "preflight") -> RequestRejected:
    return RequestRejected(Rejection(
        estimated_bytes=3 << 30, limit_bytes=1 << 30, request_id=request_id, model_id="tiny",
        breakdown=CeilingBreakdown(static=8 << 30, custom=1 << 30), prompt_tokens=9000,
        stage=stage), advice=["raise memory.custom_ceiling"])


def test_the_history_keeps_only_its_window() -> None:
    history = History(window_s=10, interval_s=1)
    for t in range(100):
        history.append(Sample(t=float(t), ceilings={"static": 5}))
    kept = history.samples()
    assert [s.t for s in kept] == [float(t) for t in range(90, 100)]
    assert [s.t for s in history.samples(since=97.0)] == [98.0, 99.0]
    table = columns(kept)
    assert table["t"] == [s.t for s in kept]
    assert table["ceiling_static"] == [5] * 10 and table["ceiling_custom"] == [None] * 10


def test_the_history_gives_back_every_field_of_a_sample() -> None:
    history = History(window_s=10, interval_s=1)
    full = Sample(t=5.5, in_use_bytes=3 << 40, reclaimable_bytes=7, reserved_bytes=0,
                  hard_limit_bytes=(1 << 50) + 1, ceilings={"static": 9, "custom": 1 << 33},
                  binding="custom", prefill_tokens_per_s=0.25, decode_tokens_per_s=12.0,
                  ttft_p50_s=0.1, ttft_p95_s=0.3, queue_depth=2, running=3, preempted=1,
                  prefix_hit_rate=0.0, ssd_hit_rate=1.0)
    bare = Sample(t=6.0)
    odd = Sample(t=7.0, binding="rank-2")
    for sample in (full, bare, odd):
        history.append(sample)
    assert history.samples() == [full, bare, odd] and history.latest() == odd
    kept = history.samples()[0]
    assert isinstance(kept.in_use_bytes, int) and isinstance(kept.queue_depth, int)
    assert isinstance(kept.decode_tokens_per_s, float) and kept.reserved_bytes == 0


def test_recording_a_sample_keeps_no_object_of_its_own() -> None:
    """The samples are rows of one array made up front: a poll made during a model load
    leaves nothing among the load's objects that would keep an allocator arena after
    the unload. Kept as objects, 500 samples held over 200 kB."""
    history = History(window_s=1000, interval_s=1)
    history.append(Sample(t=0.0, binding="static"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for t in range(1, 501):
            history.append(Sample(t=float(t), in_use_bytes=(1 << 33) + t,
                                  ceilings={"static": (1 << 34) + t}, binding="static",
                                  ttft_p50_s=t / 7))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(history) == 501 and history.latest().in_use_bytes == (1 << 33) + 500
    assert grown < 4096, grown


def test_a_sample_carries_the_enforcer_snapshot_and_the_engines_rates(context) -> None:
    recorder = DashboardRecorder(context)
    enforcer = context.memory_guard.enforcer
    snapshot = enforcer.poll_once()
    first = recorder.record(snapshot)
    assert first.hard_limit_bytes == snapshot.hard_bytes
    assert first.ceilings == snapshot.breakdown.ceilings()
    assert first.binding == snapshot.breakdown.binding
    assert first.in_use_bytes == snapshot.in_use_bytes
    assert first.decode_tokens_per_s is None  # nothing to measure a rate against yet

    from omlx_core.serving import ServingPipeline

    pipeline = ServingPipeline(context, recorder)
    generation = pipeline.start(Job("tiny", SamplingParams(max_tokens=8, temperature=0.0),
                                    text="hello there"))
    text = "".join(delta.text for delta in generation.deltas())
    generation.close()
    assert generation.completion_tokens >= 1, text
    second = recorder.record(enforcer.poll_once())
    assert second.decode_tokens_per_s is not None and second.decode_tokens_per_s > 0
    assert second.prefill_tokens_per_s is not None and second.prefill_tokens_per_s > 0
    assert second.ttft_p50_s is not None and second.ttft_p95_s >= second.ttft_p50_s
    assert [s.t for s in recorder.history.samples()] == [first.t, second.t]


def test_at_each_poll_the_enforcer_records_a_sample(context) -> None:
    recorder = DashboardRecorder(context)
    recorder.start()
    try:
        assert wait_for(lambda: len(recorder.history) >= 2, 30)
    finally:
        recorder.close()
    assert recorder.record not in context.memory_guard.enforcer.listeners


def test_the_last_refusals_are_kept_newest_first_and_found_by_request_id(context) -> None:
    recorder = DashboardRecorder(context)
    for n in range(REFUSALS_KEPT + 20):
        recorder.rejected("tiny", rejection(f"chatcmpl-{n:04d}", "admission" if n % 2 else "preflight"))
    kept = recorder.refusals()
    assert len(kept) == REFUSALS_KEPT and kept[0].request_id == f"chatcmpl-{REFUSALS_KEPT + 19:04d}"
    found = recorder.refusals("CMPL-0118")
    assert [r.request_id for r in found] == ["chatcmpl-0118"]
    assert found[0].status == 413 and found[0].binding_ceiling == "custom"
    assert found[0].advice == ("raise memory.custom_ceiling",)
    assert recorder.refusals("chatcmpl-0119")[0].status == 503


def test_the_json_endpoints_are_documented_and_need_a_key_when_keys_are_set(context) -> None:
    frontend = build_frontend(context, api_keys=["k1"], admin_keys=["a1"])
    try:
        client = falcon.testing.TestClient(frontend.app, headers=LOCAL)
        document = client.simulate_get("/openapi.json").json
        for path in DASHBOARD_JSON:
            assert "get" in document["paths"][path] and "401" in document["paths"][path]["get"]["responses"]
            assert client.simulate_get(path).status_code == 401
            assert client.simulate_get(path, headers={"x-api-key": "k1"}).status_code == 200
        assert "delete" in document["paths"]["/dashboard/api/requests/{request_id}"]
        page = client.simulate_get("/dashboard")
        assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
        assert client.simulate_get("/dashboard/assets/vendor/uPlot.iife.min.js").status_code == 200
        assert client.simulate_get("/dashboard/assets/../api/models").status_code == 404
        # Cancelling another client's request is an admin action.
        refused = client.simulate_delete("/dashboard/api/requests/nope", headers={"x-api-key": "k1"})
        assert refused.status_code == 403 and refused.json["error"]["code"] == "admin_key_required"
        missing = client.simulate_delete("/dashboard/api/requests/nope", headers={"x-api-key": "a1"})
        assert missing.status_code == 404 and missing.json["error"]["code"] == "request_not_found"
        bad = client.simulate_get("/dashboard/api/history", params={"since": "yesterday"},
                                  headers={"x-api-key": "k1"})
        assert bad.status_code == 400 and bad.json["error"]["param"] == "since"
    finally:
        frontend.shutdown()


def test_the_models_panel_names_engine_weights_context_and_caches(context) -> None:
    frontend = build_frontend(context, api_keys=[])
    try:
        body = falcon.testing.TestClient(frontend.app, headers=LOCAL).simulate_get("/dashboard/api/models").json
    finally:
        frontend.shutdown()
    assert body["pool"] is True
    models = {m["model"]: m for m in body["models"]}
    # Every model the pool lists, resident or not (the default model is available too).
    assert set(models) == {r.id for r in context.pool.records()}
    model = models["tiny"]
    engine = context.engines["tiny"]
    assert model["state"] == "resident" and model["pinned"] is True
    assert model["engine"] == "batched" and model["source"] == engine.model.source
    assert model["max_context"] == engine.limits().context_length
    assert model["context_length"] == engine.model.config["max_position_embeddings"]
    files = sum(f.stat().st_size for f in Path(engine.model.path).glob("*.safetensors"))
    # The safetensors headers' tensor bytes: the files less their (small) JSON headers.
    assert files - 64 * 1024 < model["weights_bytes"] <= files
    assert model["weights_bytes"] == context.pool.record("tiny").weights_bytes
    assert model["prefix_cache"]["enabled"] is True
    others = [m for m in models.values() if m["model"] != "tiny"]
    assert all(m["state"] == "available" and m["resident_bytes"] == 0 and m["prefix_cache"] is None
               for m in others)


def test_the_models_panel_without_a_pool_lists_the_engines(context) -> None:
    """A hand-built context (an embedder's) has engines and no pool: each engine is
    listed resident, with the keys the pool's rows have, and no action applies."""
    bare = ServerContext(config=context.config, plugins=context.plugins,
                         engines=dict(context.engines))
    frontend = build_frontend(bare, api_keys=[])
    try:
        client = falcon.testing.TestClient(frontend.app, headers=LOCAL)
        body = client.simulate_get("/dashboard/api/models").json
        refused = client.simulate_post("/admin/models/tiny/load", json={})
    finally:
        frontend.shutdown()
    assert body["pool"] is False
    (model,) = body["models"]
    with_pool = models_of(context)["tiny"]
    assert set(model) == set(with_pool)
    assert model["state"] == "resident" and model["weights_bytes"] == with_pool["weights_bytes"]
    assert model["max_context"] == with_pool["max_context"]
    assert refused.status_code == 400 and refused.json["error"]["code"] == "no_pool"


def models_of(context: ServerContext) -> dict:
    from omlx_core.dashboard.views import models

    return {m["model"]: m for m in models(context)}


def test_the_uplot_dist_and_its_licence_ship_with_the_package() -> None:
    from importlib import resources

    vendor = resources.files("omlx_core.dashboard").joinpath("assets", "vendor")
    assert "MIT License" in vendor.joinpath("LICENSE.uPlot").read_text()
    assert "uplot@1.6.32" in vendor.joinpath("README.md").read_text()
    assert "uPlot" in vendor.joinpath("uPlot.iife.min.js").read_text()


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerContext]:
    """The tiny model with one batch slot, so a second request waits in the engine."""
    from omlx_core.bootstrap import load_setup, start_engines
    from omlx_core.testing import cached_model

    model_dir = cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))
    config = tmp_path_factory.mktemp("config") / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n')
    context = start_engines(load_setup("cpu-small", [config], [
        ("plugin.batched.max_batch_size", "1", "test")]), progress=False)
    yield context
    stop_engines(context)


def test_requests_now_shows_the_stage_of_each_request_and_cancel_aborts_one(one_slot) -> None:
    from omlx_core.dashboard.views import cancel, requests_now
    from omlx_core.serving import ServingPipeline

    context = one_slot
    pipeline = ServingPipeline(context)
    greedy = SamplingParams(max_tokens=3000, temperature=0.0)
    first = pipeline.start(Job("tiny", greedy, text="one two three"))
    second_started: list = []
    import threading

    waiter = threading.Thread(target=lambda: second_started.append(
        pipeline.start(Job("tiny", greedy, text="four five six"))))
    waiter.start()

    def stages() -> dict[str, dict]:
        return {row["request_id"]: row for row in requests_now(context)}

    assert wait_for(lambda: len(stages()) == 2 and {r["stage"] for r in stages().values()}
                    == {"decoding", "queued"}, 60), stages()
    rows = stages()
    running = rows[first.request_id]
    assert running["model"] == "tiny" and running["completion_tokens"] >= 1
    assert running["prompt_tokens"] > 0 and running["max_tokens"] == 3000
    assert "tok/s" in running["detail"] and running["age_s"] > 0
    (queued,) = [r for r in rows.values() if r["stage"] == "queued"]
    assert queued["queue"] == "engine" and queued["queue_position"] == 1
    assert "#1 in line" in queued["detail"]

    assert cancel(context, first.request_id) == "tiny"
    for _ in first.deltas():
        pass
    first.close()
    assert first.finish_reason == "error"  # aborted: its client would get an in-band error
    waiter.join(60)
    (second,) = second_started
    second.close()
    with pytest.raises(KeyError):
        cancel(context, "no-such-request")
    assert wait_for(lambda: not requests_now(context), 30)


def test_the_admission_queue_lists_its_waiting_requests_in_order() -> None:
    import threading

    from omlx_core.memory.admission import AdmissionQueue
    from omlx_core.memory.types import LimitSnapshot

    queue = AdmissionQueue(queue_size=4, timeout_s=60, admit_watermark=1.0)
    queue.update(LimitSnapshot(hard_bytes=1000, breakdown=CeilingBreakdown(custom=1000)))
    running = queue.admit("a", 800, model_id="m", prompt_tokens=3)
    granted: list = []
    waiters = [threading.Thread(target=lambda rid=rid: granted.append(
        queue.admit(rid, 700, model_id="m", prompt_tokens=5))) for rid in ("b", "c")]
    waiters[0].start()
    assert wait_for(lambda: queue.waiting == 1)
    waiters[1].start()
    assert wait_for(lambda: queue.waiting == 2)
    waiting = queue.waiting_requests()
    assert [(w.request_id, w.model_id, w.prompt_tokens, w.reserve_bytes) for w in waiting] == [
        ("b", "m", 5, 700), ("c", "m", 5, 700)]
    assert all(w.waited_s >= 0 for w in waiting)
    running.release()
    assert wait_for(lambda: len(granted) == 1)
    assert [w.request_id for w in queue.waiting_requests()] == ["c"]
    granted[0].release()
    for waiter in waiters:
        waiter.join(10)
    assert queue.waiting_requests() == []


def test_the_speculative_engine_reports_its_lone_request(tmp_path: Path) -> None:
    from omlx_core.bootstrap import load_setup, start_engines
    from omlx_core.dashboard.views import requests_now
    from omlx_core.serving import ServingPipeline
    from omlx_core.testing import cached_model

    model_dir = cached_model("llama", 0, cache_dir=tmp_path / "models")
    config = tmp_path / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n'
                      'engine = "dflash"\n')
    context = start_engines(load_setup("cpu-small", [config]), progress=False)
    try:
        generation = ServingPipeline(context).start(
            Job("tiny", SamplingParams(max_tokens=3000, temperature=0.0), text="one two three"))
        assert wait_for(lambda: [r["stage"] for r in requests_now(context)] == ["decoding"], 60)
        (row,) = requests_now(context)
        assert row["request_id"] == generation.request_id and row["completion_tokens"] >= 1
        assert context.engines["tiny"].stats()["speculative"]["running"] == 1
        generation.close()
        assert wait_for(lambda: not requests_now(context), 30)
    finally:
        stop_engines(context)


# -- omlx-core top: the same data in a terminal ---------------------------------------------


def test_omlx_core_top_prints_memory_models_and_requests_once_and_refreshing(
        server, context, capsys) -> None:
    from omlx_core.cli import main
    from omlx_core.dashboard.top import fetch_snapshot

    port = str(server.port)
    # The recorder of this server's front end takes its first sample at the next poll.
    assert wait_for(lambda: fetch_snapshot(server.url)["latest"] is not None, 30)
    assert main(["top", "--port", port, "--once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"omlx-core top  {server.url}")
    assert lines[1].startswith("memory     in use ") and "hard limit" in lines[1]
    assert lines[3] == f"models     1 resident of {len(context.pool.records())} available"
    header = lines.index(next(line for line in lines if line.startswith("NAME")))
    assert lines[header].split()[:4] == ["NAME", "STATE", "PINNED", "ENGINE"]
    rows = {line.split()[0]: line.split() for line in lines[header + 1:] if line.strip()
            and not line.startswith("no request")}
    assert set(rows) == {r.id for r in context.pool.records()}
    assert rows["tiny"][1:4] == ["resident", "yes", "batched"]
    assert lines[-1] == "no request in flight"
    # Refreshing: -n frames, each with its header (no screen clearing when not a terminal).
    assert main(["top", "--port", port, "-n", "3", "--interval", "0.05"]) == 0
    assert capsys.readouterr().out.count("omlx-core top  ") == 3
    # --json: the dashboard endpoints' data, as the page reads it.
    assert main(["top", "--port", port, "--json"]) == 0
    frame = json.loads(capsys.readouterr().out)
    assert {m["model"] for m in frame["models"]} == set(rows) and frame["pool"] is True
    assert frame["latest"]["hard_limit_bytes"] > 0 and frame["requests"] == []
    assert main(["top", "--port", port, "--interval", "0"]) == 2
    assert "--interval" in capsys.readouterr().err


def test_omlx_core_top_needs_the_key_when_the_server_has_keys(context, capsys) -> None:
    from omlx_core.cli import main
    from omlx_core.http.serve import HTTPServer

    frontend = build_frontend(context, api_keys=["top-key"])
    with HTTPServer(context, port=0, frontend=frontend) as server:
        port = str(server.port)
        assert main(["top", "--port", port, "--once"]) == 1
        err = capsys.readouterr().err
        assert "401" in err and "--api-key" in err
        assert main(["top", "--port", port, "--once", "--api-key", "top-key"]) == 0
        assert "tiny" in capsys.readouterr().out
