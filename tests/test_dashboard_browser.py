"""The dashboard in a real browser (Debian's headless Chromium, driven by Selenium): the
page loads with no console error; under concurrent chats on the real default model its
plots fill and its request table shows each chat, whose cancel button aborts it, and an
embedding request to the shipped embedding model, which its cancel button aborts too; a 413
under a small ceiling appears in the refusals with its advice, found by request id; the
memory plot's limit line is /health's hard limit; with API keys the page asks for one
and the JSON behind it refuses requests without one. The models panel lists every model
the pool has, and its buttons load, pin, unpin and unload them through the admin
endpoints (a load that can never fit shows its 413 and advice; without the key an
action is refused)."""

from __future__ import annotations

import http.client
import json
import shutil
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
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402  (after the importorskip)
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
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
    # The page redraws its tables on every poll: an element found just before a redraw is
    # stale by the time it is read, and the condition is asked again.
    return WebDriverWait(driver, PATIENCE_S, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)
                         ).until(condition, message)


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


def test_an_embedding_request_shows_in_the_request_table_and_its_cancel_button_aborts_it(
        server: HTTPServer, browser: Any) -> None:
    open_dashboard(browser, server)
    passage = " ".join(["the server keeps a careful account of every byte it hands out"] * 18)
    outcome: dict[str, Any] = {}

    def embed() -> None:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=PATIENCE_S * 3)
        try:
            connection.request("POST", "/v1/embeddings", body=json.dumps(
                {"model": EMBEDDING_MODEL, "input": [passage] * 1024, "truncate": True}),
                headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            outcome["status"], outcome["body"] = response.status, json.loads(response.read())
        finally:
            connection.close()

    thread = threading.Thread(target=embed)
    thread.start()

    def cancel_encoding_row(driver: Any) -> str | None:
        """The embedding request's row text, once its cancel button is clicked (read and
        clicked in one try: the next redraw makes the row stale)."""
        for row in driver.find_elements(By.CSS_SELECTOR, "#requests tbody tr"):
            text = row.text
            if EMBEDDING_MODEL in text and "encoding" in text:
                row.find_element(By.CSS_SELECTOR, "button").click()
                return text
        return None

    text = until(browser, cancel_encoding_row, "the request table never showed the embedding request")
    assert "tokens (embeddings or rerank)" in text
    thread.join(PATIENCE_S)
    assert not thread.is_alive()
    assert outcome["status"] == 503 and outcome["body"]["error"]["code"] == "aborted", outcome
    models = browser.find_element(By.CSS_SELECTOR, "#models tbody").text
    assert EMBEDDING_MODEL in models and "encoder (embed)" in models
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


# -- the model pool: every available model, and its load / pin / unpin / unload buttons ------

SECOND = "tiny-b"
HUGE = "huge"
#: a vocabulary that puts the working set of one 512-token chunk in the terabytes
HUGE_VOCAB = 1 << 40


@pytest.fixture(scope="module")
def pool_toml(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three models: ``tiny`` loaded (and pinned) at start, ``tiny-b`` only available, and
    ``huge``: the tiny weights under a config whose vocabulary no memory holds, so its
    load is refused at once (413 load_never_fits) before a byte of it is read."""
    root = tmp_path_factory.mktemp("pool")
    second = cached_model("qwen3", 0, cache_dir=root)
    huge = root / HUGE
    shutil.copytree(tiny_dir, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "vocab_size": HUGE_VOCAB}))
    return (f'[server]\nmodels = ["{TINY}"]\n\n[models.{TINY}]\npath = "{tiny_dir}"\n\n'
            f'[models.{SECOND}]\npath = "{second}"\n\n[models.{HUGE}]\npath = "{huge}"\n')


def model_cell(driver: Any, model_id: str, field: str) -> str:
    found = driver.find_elements(By.CSS_SELECTOR,
                                 f'#models tr[data-model="{model_id}"] td[data-field="{field}"]')
    return found[0].text if found else ""


def model_button(driver: Any, model_id: str, action: str) -> Any:
    return driver.find_element(
        By.CSS_SELECTOR, f'#models tr[data-model="{model_id}"] button[data-action="{action}"]')


def enabled_actions(driver: Any, model_id: str) -> set[str]:
    return {action for action in ("load", "unload", "pin", "unpin")
            if model_button(driver, model_id, action).is_enabled()}


def click(driver: Any, model_id: str, action: str) -> None:
    button = until(driver, lambda d: (b := model_button(d, model_id, action)).is_enabled() and b,
                   f"the {action} button of {model_id} never became enabled")
    button.click()


def listed(server: HTTPServer, headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, body = get_json(server, "/dashboard/api/models", headers)
    assert status == 200, body
    return {m["model"]: m for m in body["models"]}


def test_the_models_panel_loads_pins_and_unloads_through_the_pool(
        pool_toml: str, tmp_path: Path, browser: Any) -> None:
    context = start(tmp_path, pool_toml)
    pool = context.pool
    try:
        with HTTPServer(context, port=0) as server:
            open_dashboard(browser, server)
            console_errors(browser)  # only what this test's page logs
            # Every available model is listed, with the pool's own description of it.
            models = listed(server)
            assert {TINY, SECOND, HUGE} <= set(models)
            for model_id in (TINY, SECOND, HUGE):
                described = pool.describe(pool.record(model_id))
                for key in ("state", "engine", "pinned", "planned_bytes", "weights_bytes",
                            "measured_bytes", "resident_bytes", "context_length",
                            "keep_alive_s", "in_flight", "waiting", "error"):
                    assert models[model_id][key] == described[key], (model_id, key)
            assert models[TINY]["state"] == "resident" and models[TINY]["pinned"]
            assert models[TINY]["max_context"] == context.engines[TINY].limits().context_length
            assert models[TINY]["prefix_cache"]["enabled"] is True
            assert models[SECOND]["state"] == "available" and models[SECOND]["resident_bytes"] == 0
            assert models[SECOND]["planned_bytes"] > models[SECOND]["weights_bytes"] > 0
            assert models[SECOND]["prefix_cache"] is None
            until(browser, lambda d: model_cell(d, SECOND, "state") == "available",
                  "the panel never listed the available model")
            assert model_cell(browser, TINY, "state") == "resident, pinned"
            assert enabled_actions(browser, TINY) == {"unload", "unpin"}
            assert enabled_actions(browser, SECOND) == {"load", "pin"}
            assert "planned" in model_cell(browser, SECOND, "bytes")

            click(browser, SECOND, "load")
            until(browser, lambda d: model_cell(d, SECOND, "state") == "resident",
                  "the loaded model never showed resident")
            assert pool.record(SECOND).state == "resident" and SECOND in context.engines
            assert listed(server)[SECOND]["state"] == "resident"
            result = f'#models tr[data-model="{SECOND}"] .action-result'
            assert browser.find_element(By.CSS_SELECTOR, result).text.startswith(
                "load: done, resident")
            assert enabled_actions(browser, SECOND) == {"unload", "pin"}
            assert "unloads in" in model_cell(browser, SECOND, "use")
            assert "resident" in model_cell(browser, SECOND, "bytes")

            click(browser, SECOND, "pin")
            until(browser, lambda d: model_cell(d, SECOND, "state") == "resident, pinned",
                  "the pinned model never showed pinned")
            assert pool.record(SECOND).pinned and listed(server)[SECOND]["pinned"] is True
            assert "pinned: stays resident" in model_cell(browser, SECOND, "use")

            click(browser, SECOND, "unpin")
            until(browser, lambda d: model_cell(d, SECOND, "state") == "resident",
                  "the unpinned model still showed pinned")
            assert not pool.record(SECOND).pinned

            click(browser, SECOND, "unload")
            until(browser, lambda d: model_cell(d, SECOND, "state") == "available",
                  "the unloaded model never showed available again")
            assert SECOND not in context.engines and pool.record(SECOND).state == "available"
            assert listed(server)[SECOND]["resident_bytes"] == 0
            assert enabled_actions(browser, SECOND) == {"load", "pin"}
            assert console_errors(browser) == []

            # A model that can never fit: the panel shows the 413 with its advice.
            click(browser, HUGE, "load")
            until(browser, lambda d: "413" in d.find_element(
                By.CSS_SELECTOR, f'#models tr[data-model="{HUGE}"] .action-result').text,
                "the refused load's 413 never showed")
            text = browser.find_element(
                By.CSS_SELECTOR, f'#models tr[data-model="{HUGE}"] .action-result').text
            error = pool.record(HUGE).error
            assert "load_never_fits" in text and str(error) in text
            assert error.advice and error.advice[0] in text
            assert pool.record(HUGE).state == "available" and HUGE not in context.engines
            until(browser, lambda d: "last load:" in model_cell(d, HUGE, "state"),
                  "the refused load never showed as the model's last load error")
            # The browser logs the refused fetch itself; nothing else.
            assert all("status of 413" in e for e in console_errors(browser))
    finally:
        stop_engines(context)


def test_with_api_keys_a_model_action_without_the_key_is_refused(
        pool_toml: str, tmp_path: Path, browser: Any) -> None:
    key = "pool-admin-key"
    context = start(tmp_path, pool_toml)
    try:
        # The page's buttons change the server for everyone: they need an admin key.
        frontend = build_frontend(context, api_keys=["reader-key"], admin_keys=[key])
        with HTTPServer(context, port=0, frontend=frontend) as server:
            browser.get(server.url + "/dashboard")
            browser.execute_script("sessionStorage.clear()")
            browser.refresh()
            form = until(browser, lambda d: (f := d.find_element(By.ID, "key-form")).is_displayed()
                         and f, "the page never asked for a key")
            form.find_element(By.ID, "key-input").send_keys(key)
            form.find_element(By.CSS_SELECTOR, "button").click()
            until(browser, lambda d: model_cell(d, SECOND, "state") == "available",
                  "the panel never listed the models with the key")
            console_errors(browser)
            # The key is gone from the tab when the button is pressed: the action is sent
            # without one, refused, and the page asks for a key again.
            browser.execute_script(
                "sessionStorage.clear(); document.querySelector("
                f"'#models tr[data-model=\"{SECOND}\"] button[data-action=\"load\"]').click()")
            until(browser, lambda d: "refused" in (page_state(
                d, f"(omlxDashboard.modelActions[{json.dumps(SECOND)}] || {{}}).text") or ""),
                "the refused action never showed its refusal")
            assert "missing API key" in page_state(
                browser, f"omlxDashboard.modelActions[{json.dumps(SECOND)}].text")
            until(browser, lambda d: d.find_element(By.ID, "key-form").is_displayed(),
                  "the page did not ask for the key again")
            assert pool_state(context, SECOND) == "available" and SECOND not in context.engines
            assert all("status of 401" in e for e in console_errors(browser))
            # With the key again, the same button loads it.
            form.find_element(By.ID, "key-input").send_keys(key)
            form.find_element(By.CSS_SELECTOR, "button").click()
            click(browser, SECOND, "load")
            until(browser, lambda d: model_cell(d, SECOND, "state") == "resident",
                  "the model never loaded with the key")
            assert listed(server, {"Authorization": f"Bearer {key}"})[SECOND]["state"] == "resident"
            requested = browser.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)")
            assert any("/admin/models/" in url for url in requested)
            assert not any(key in url for url in requested)
            assert console_errors(browser) == []
    finally:
        stop_engines(context)


def pool_state(context: ServerContext, model_id: str) -> str:
    return context.pool.record(model_id).state
