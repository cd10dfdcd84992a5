"""The dashboard's data side and JSON endpoints without a browser: the ring buffer keeps
15 minutes, the recorder's samples carry the enforcer's limits and the engines' rates,
refusals are kept (100) and found by request id, the endpoints are documented and keyed."""

from __future__ import annotations

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
    frontend = build_frontend(context, api_keys=["k1"])
    try:
        client = falcon.testing.TestClient(frontend.app)
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
        missing = client.simulate_delete("/dashboard/api/requests/nope", headers={"x-api-key": "k1"})
        assert missing.status_code == 404 and missing.json["error"]["code"] == "request_not_found"
        bad = client.simulate_get("/dashboard/api/history", params={"since": "yesterday"},
                                  headers={"x-api-key": "k1"})
        assert bad.status_code == 400 and bad.json["error"]["param"] == "since"
    finally:
        frontend.shutdown()


def test_the_models_panel_names_engine_weights_context_and_caches(context) -> None:
    frontend = build_frontend(context, api_keys=[])
    try:
        body = falcon.testing.TestClient(frontend.app).simulate_get("/dashboard/api/models").json
    finally:
        frontend.shutdown()
    (model,) = body["models"]
    engine = context.engines["tiny"]
    assert model["model"] == "tiny" and model["engine"] == "batched"
    assert model["context_length"] == engine.limits().context_length
    assert model["weights_bytes"] == sum(f.stat().st_size for f in Path(engine.model.path).glob("*.safetensors"))
    assert model["prefix_cache"]["enabled"] is True


def test_the_uplot_dist_and_its_licence_ship_with_the_package() -> None:
    from importlib import resources

    vendor = resources.files("omlx_core.dashboard").joinpath("assets", "vendor")
    assert "MIT License" in vendor.joinpath("LICENSE.uPlot").read_text()
    assert "uplot@1.6.32" in vendor.joinpath("README.md").read_text()
    assert "uPlot" in vendor.joinpath("uPlot.iife.min.js").read_text()
