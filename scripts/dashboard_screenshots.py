"""Screenshots of the dashboard under load, for the README (``docs/dashboard*.png``).

    .venv/bin/python scripts/dashboard_screenshots.py

Serves the real default model on loopback under a 1 GiB custom ceiling, with two tiny
random-weight models available in the pool beside it, runs several concurrent
streaming chats through the openai SDK (some repeating a prompt, so the prefix cache
has hits), sends one prompt that can never fit (a 413 for the refusals table), presses
the models panel's Load button of one tiny model (the other stays available), and
photographs the page in headless Chromium while the chats run.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time
from pathlib import Path

import openai

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.http import HTTPServer
from omlx_core.platform.blas import ensure_optimized_blas
from omlx_core.testing import cached_model
from omlx_core.testing.browser import headless_chromium
from omlx_core.testing.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
#: available in the pool beside the default model: the first is loaded from the page
POOL_MODELS = {"tiny-llama-random": "llama", "tiny-qwen3-random": "qwen3"}
QUESTIONS = ["Name three rivers in Europe and where they flow.",
             "Write a short poem about memory and forgetting.",
             "Explain what a prefix cache is to a new programmer.",
             "List five prime numbers and explain why each is prime.",
             "Describe the water cycle in a few sentences.",
             "What makes a good error message? Give examples."]


def chat_forever(url: str, stop: threading.Event, offset: int) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        for question in itertools.islice(itertools.cycle(QUESTIONS), offset, None):
            if stop.is_set():
                return
            try:
                for _ in client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": question}],
                        max_tokens=96, temperature=0.7, stream=True):
                    if stop.is_set():
                        break
            except openai.APIError:
                time.sleep(0.5)


def refuse_one(url: str) -> None:
    """A prompt of most of the context: its prefill can never fit in 1 GiB."""
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        try:
            client.completions.create(model=MODEL, prompt="word " * 7000, max_tokens=8)
        except openai.APIStatusError as exc:
            print(f"refused as expected: {exc.status_code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--load-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    ensure_optimized_blas()
    scratch = tempfile.TemporaryDirectory(prefix="omlx-screenshots-")
    pool_toml = Path(scratch.name) / "pool.toml"
    pool_toml.write_text("".join(
        f'[models.{name}]\npath = "{cached_model(family, cache_dir=Path(scratch.name))}"\n\n'
        for name, family in POOL_MODELS.items()))
    setup = load_setup("cpu-small", [pool_toml], [("memory.tier", "custom", "script"),
                                                  ("memory.custom_ceiling", "1GiB", "script")])
    context = start_engines(setup, progress=True)
    stop = threading.Event()
    try:
        with HTTPServer(context, port=0) as server:
            browser = headless_chromium(1500, 1200)
            try:
                browser.get(server.url + "/dashboard")
                threads = [threading.Thread(target=chat_forever, args=(server.url, stop, i))
                           for i in range(args.streams)]
                for thread in threads:
                    thread.start()
                time.sleep(args.load_s / 2)
                refuse_one(server.url)
                loaded = next(iter(POOL_MODELS))
                browser.find_element(
                    "css selector", f'#models tr[data-model="{loaded}"] button[data-action="load"]'
                ).click()
                time.sleep(args.load_s / 2)
                wait_for(lambda: context.pool.record(loaded).state == "resident", 60)
                wait_for(lambda: browser.execute_script(
                    "return document.querySelectorAll('#requests tbody tr[data-request-id]').length"
                ) >= 2, 30)
                args.out.mkdir(parents=True, exist_ok=True)
                browser.execute_script("window.scrollTo(0, 0)")  # the click scrolled down
                browser.save_screenshot(str(args.out / "dashboard.png"))
                height = browser.execute_script("return document.body.scrollHeight")
                browser.set_window_size(1500, height + 300)
                browser.save_screenshot(str(args.out / "dashboard-full.png"))
                print(f"wrote {args.out / 'dashboard.png'} and {args.out / 'dashboard-full.png'}")
            finally:
                stop.set()
                browser.quit()
            for thread in threads:
                thread.join(60)
    finally:
        stop_engines(context)
        scratch.cleanup()


if __name__ == "__main__":
    main()
