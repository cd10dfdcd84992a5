"""The dashboard in a real browser (Debian's headless Chromium, driven by Selenium): the
page loads with no console error; under concurrent chats on the real default model its
plots fill and its request table shows each chat, whose cancel button aborts it; a 413
under a small ceiling appears in the refusals with its advice, found by request id; the
memory plot's limit line is /health's hard limit; with API keys the page asks for one
and the JSON behind it refuses requests without one."""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.http import HTTPServer, build_frontend
from omlx_core.memory.usage import footprint_bytes
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model
from omlx_core.testing.browser import BrowserMissing, console_errors, headless_chromium
from omlx_core.testing.waiting import wait_for

openai = pytest.importorskip("openai")
from selenium.webdriver.common.by import By  # noqa: E402  (after the importorskip)
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY = "tiny"
MIB = 1 << 20
#: how long a condition may take to come true on a loaded 2-core machine
PATIENCE_S = 120


# -- set-up ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        driver = headless_chromium()
    except BrowserMissing as exc:
        pytest.fail(str(exc))
    yield driver
    driver.quit()


def until(driver: Any, condition: Any, message: str = "") -> Any:
    return WebDriverWait(driver, PATIENCE_S, poll_frequency=0.1).until(condition, message)


def page_state(driver: Any, expression: str) -> Any:
    return driver.execute_script(f"return window.omlxDashboard ? ({expression}) : null")


def open_dashboard(driver: Any, server: HTTPServer) -> None:
    driver.get(server.url + "/dashboard")
    until(driver, lambda d: (page_state(d, "omlxDashboard.polls") or 0) >= 1 or
          page_state(d, "omlxDashboard.needsKey"), "the page never polled its data")


def start(tmp_path: Path, model_toml: str = "", **settings: str) -> ServerContext:
    config = tmp_path / "omlx.toml"
    config.write_text(model_toml)
    overrides = [(key.replace("__", "."), value, "test") for key, value in settings.items()]
    return start_engines(load_setup("cpu-small", [config], overrides), progress=False)


def tiny_toml(model_dir: Path) -> str:
    return f'[server]\nmodels = ["{TINY}"]\n\n[models.{TINY}]\npath = "{model_dir}"\n'


def get_json(server: HTTPServer, path: str, headers: dict[str, str] | None = None
             ) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


# -- under load, on the real default model ----------------------------------------------------


@pytest.fixture(scope="module")
def context(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerContext]:
    context = start(tmp_path_factory.mktemp("default"))
    yield context
    stop_engines(context)


def stream_chat(client: Any, content: str, max_tokens: int, ids: list[str]) -> int:
    """Stream one chat; returns the chunks received (the id goes into ``ids`` at once)."""
    chunks = 0
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if not chunks:
            ids.append(chunk.id)
        chunks += 1
    return chunks


def test_under_load_the_plots_fill_and_the_request_table_shows_each_chat(
        server: HTTPServer, browser: Any) -> None:
    open_dashboard(browser, server)
    assert page_state(browser, "omlxDashboard.needsKey") is False
    ids: list[str] = []
    questions = ["Name three rivers in Europe.", "Write a haiku about memory.",
                 "Explain what a cache is.", "List four prime numbers and why they are prime."]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        with ThreadPoolExecutor(len(questions)) as pool:
            received = list(pool.map(lambda q: stream_chat(client, q, 48, ids), questions))
    assert all(count > 1 for count in received) and len(set(ids)) == len(questions)
    until(browser, lambda d: set(ids) <= set(page_state(d, "[...omlxDashboard.seenRequests]")),
          "the request table never listed every chat")
    # The plots draw what the server measured: prefill and decode ran, a TTFT was taken.
    for plot, series in (("throughput", 1), ("throughput", 2), ("ttft", 1), ("memory", 1)):
        until(browser, lambda d: page_state(
            d, f"Math.max(0, ...omlxDashboard.plots.{plot}.data[{series}].filter(v => v !== null))"
        ) > 0, f"the {plot} plot's series {series} has no point above zero")
    assert page_state(browser, "omlxDashboard.plots.memory.data[0].length") >= 2
    models = browser.find_element(By.CSS_SELECTOR, "#models tbody").text
    assert DEFAULT_MODEL in models and "batched" in models
    assert console_errors(browser) == []


def test_the_cancel_button_aborts_a_running_chat(server: HTTPServer, context: ServerContext,
                                                 browser: Any) -> None:
    open_dashboard(browser, server)
    aborted_before = context.engines[DEFAULT_MODEL].stats()["finished"]["abort"]
    ids: list[str] = []
    outcome: dict[str, Any] = {}

    def chat() -> None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                           max_retries=0) as client:
            try:
                outcome["chunks"] = stream_chat(client, "Tell me a very long story.", 400, ids)
            except openai.APIError as exc:
                outcome["error"] = exc

    thread = threading.Thread(target=chat)
    thread.start()
    assert wait_for(lambda: bool(ids), PATIENCE_S)
    button = until(browser, lambda d: d.find_elements(
        By.CSS_SELECTOR, f'#requests tr[data-request-id="{ids[0]}"] button'))[0]
    button.click()
    thread.join(PATIENCE_S)
    assert not thread.is_alive()
    assert "error" in outcome or outcome["chunks"] < 400
    assert context.engines[DEFAULT_MODEL].stats()["finished"]["abort"] == aborted_before + 1
    assert console_errors(browser) == []


# -- a small ceiling: refusals and the limit line --------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def ceiling_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[ServerContext, HTTPServer]]:
    ceiling = max(512 * MIB, footprint_bytes() + 256 * MIB)
    context = start(tmp_path_factory.mktemp("ceiling"), tiny_toml(tiny_dir),
                    memory__tier="custom", memory__custom_ceiling=str(ceiling),
                    engine__max_context="2000000")
    with HTTPServer(context, port=0) as server:
        yield context, server
    stop_engines(context)


def oversized_prompt(context: ServerContext) -> list[int]:
    """Token ids whose estimated prefill peak is over the hard limit by the guard's math."""
    guard, engine = context.memory_guard, context.engines[TINY]
    assert wait_for(lambda: guard.snapshot is not None)
    tokens = 4096
    while tokens < 2_000_000:
        prompt = [(7 * i) % 200 + 10 for i in range(tokens)]
        estimate = guard.estimate(guard.peak_query(engine, prompt))
        if estimate is not None and estimate.total > guard.snapshot.hard_bytes:
            return prompt
        tokens *= 2
    pytest.fail("no prompt within 2M tokens is estimated over the ceiling")


def test_a_413_appears_in_the_refusals_with_its_advice_found_by_request_id(
        ceiling_server: tuple[ServerContext, HTTPServer], browser: Any) -> None:
    context, server = ceiling_server
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=TINY, prompt=oversized_prompt(context), max_tokens=4)
    assert refused.value.status_code == 413
    error = refused.value.body if "request_id" in refused.value.body else refused.value.body["error"]
    request_id, advice = error["request_id"], error["advice"]
    assert request_id and advice and error["binding_ceiling"] == "custom"

    open_dashboard(browser, server)
    search = browser.find_element(By.ID, "refusal-search")
    search.send_keys(request_id[-12:])
    row = until(browser, lambda d: (rows := d.find_elements(
        By.CSS_SELECTOR, "#refusals tbody tr[data-request-id]")) and len(rows) == 1 and
        rows[0].get_attribute("data-request-id") == request_id and rows[0],
        "the refusal never appeared alone under a search for its id")
    text = row.text
    assert "413" in text and "preflight" in text and "custom" in text
    assert advice[0] in text
    search.clear()
    search.send_keys("no-such-request")
    until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR,
                                                 "#refusals tbody tr[data-request-id]"))
    assert console_errors(browser) == []


def test_the_memory_plot_limit_line_is_the_health_hard_limit(
        ceiling_server: tuple[ServerContext, HTTPServer], browser: Any) -> None:
    context, server = ceiling_server
    open_dashboard(browser, server)
    status, health = get_json(server, "/health")
    assert status == 200
    hard_limit = health["memory"]["hard_limit_bytes"]
    assert health["memory"]["binding_ceiling"] == "custom"
    labels = page_state(browser, "omlxDashboard.plots.memory.series.map(s => s.label)")
    limit_series = labels.index("hard limit")
    until(browser, lambda d: page_state(
        d, f"omlxDashboard.plots.memory.data[{limit_series}].at(-1)") == hard_limit,
        "the limit line never reached /health's hard limit")
    assert "custom ceiling (binding)" in labels, labels
    custom = labels.index("custom ceiling (binding)")
    assert page_state(browser, f"omlxDashboard.plots.memory.data[{custom}].at(-1)") == hard_limit
    assert console_errors(browser) == []


# -- API keys ---------------------------------------------------------------------------------


def test_with_api_keys_the_page_asks_for_one_and_the_json_refuses_without_it(
        tiny_dir: Path, tmp_path: Path, browser: Any) -> None:
    key = "dashboard-secret-key"
    context = start(tmp_path, tiny_toml(tiny_dir))
    try:
        with HTTPServer(context, port=0, frontend=build_frontend(context, api_keys=[key])) as server:
            for path in ("/dashboard/api/history", "/dashboard/api/requests",
                         "/dashboard/api/refusals", "/dashboard/api/models"):
                status, body = get_json(server, path)
                assert status == 401 and body["error"]["code"] == "missing_api_key", path
                assert get_json(server, path, {"Authorization": f"Bearer {key}"})[0] == 200
            browser.delete_all_cookies()
            browser.get(server.url + "/dashboard")
            browser.execute_script("sessionStorage.clear()")
            browser.refresh()
            form = until(browser, lambda d: (f := d.find_element(By.ID, "key-form")).is_displayed()
                         and f, "the page never asked for a key")
            assert not browser.find_element(By.ID, "main").is_displayed()
            form.find_element(By.ID, "key-input").send_keys("wrong-key")
            form.find_element(By.CSS_SELECTOR, "button").click()
            until(browser, lambda d: "matches none" in d.find_element(By.ID, "key-error").text)
            form.find_element(By.ID, "key-input").send_keys(key)
            form.find_element(By.CSS_SELECTOR, "button").click()
            until(browser, lambda d: (page_state(d, "omlxDashboard.polls") or 0) >= 2,
                  "the page never polled with the key")
            assert browser.find_element(By.ID, "main").is_displayed()
            requested = browser.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)")
            assert requested and not any(key in url for url in requested)
            assert key not in browser.current_url
    finally:
        stop_engines(context)
