"""Crash safety of the SSD tier under load (issue 24, item 3): a real ``omlx-core serve``
with the SSD cache on is SIGKILLed while concurrent long prompts keep its block writer
busy (no patched writer: the kill lands wherever the writes are), then restarted on the
same directory. The restarted server cleans the interrupted writes' temp files, serves
only whole blocks (every answer equals a server's without any SSD cache, which
recomputes the prefill, token for token, with no load error counted) and hits resume
(prompts sent before the kill are served partly from disk)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from omlx_core.bench.servers import ServerProcess, ServerSpec
from omlx_core.testing.scrape import metric_value
from omlx_core.testing.waiting import free_port, wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPTS = 6
#: block files on disk before the kill: the writer is well into its work, not done
BLOCKS_BEFORE_KILL = 6


def prompt(index: int) -> str:
    colours = ("red", "green", "blue", "amber", "white", "black")
    return f"Report {index}. Summarize these notes. " + " ".join(
        f"Note {i}: the {colours[(i + index) % 6]} lamp in room {i * (index + 2)} was checked "
        f"by inspector {index}." for i in range(36))


def serve(port: int, ssd_dir: Path | str) -> ServerProcess:
    argv = [sys.executable, "-m", "omlx_core", "--log-level", "INFO", "serve", "--tier",
            "cpu-small", "--host", "127.0.0.1", "--port", str(port),
            "--set", f"plugin.ssd_cache.dir={ssd_dir}"]
    return ServerProcess(ServerSpec("omlx", "omlx-core serve", argv, model_id=""), port)


def ask(port: int, text: str):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                           timeout=600)
    return client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, logprobs=True,
                                          messages=[{"role": "user", "content": text}])


def tokens_of(answer) -> list[str]:
    return [entry.token for entry in answer.choices[0].logprobs.content]


def test_a_server_killed_under_write_load_restarts_serving_only_whole_blocks(
        default_model_dir, tmp_path) -> None:
    ssd_dir = tmp_path / "ssd"
    port = free_port()
    with serve(port, ssd_dir) as server:
        threads = [threading.Thread(target=lambda i=i: _ignore_drop(port, prompt(i)), daemon=True)
                   for i in range(PROMPTS)]
        for thread in threads:
            thread.start()

        def blocks() -> list[Path]:
            return list(ssd_dir.glob("*/blocks/*.safetensors"))

        assert wait_for(lambda: len(blocks()) >= BLOCKS_BEFORE_KILL, 600), server.log_tail()
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait(30)
        for thread in threads:
            thread.join(60)
    on_disk_after_kill = len(blocks())

    port = free_port()
    with serve(port, ssd_dir) as server:
        assert list(ssd_dir.glob("*/blocks/*.tmp")) == [], "orphaned temp files were not cleaned"
        assert list(ssd_dir.glob("*/snapshots/*")) == [], "orphaned staged snapshots remain"
        assert metric_value(port, "omlx_engine_prefix_cache_lower_blocks") >= 1
        again = [ask(port, prompt(i)) for i in range(PROMPTS)]
        assert metric_value(port, "omlx_engine_prefix_cache_lower_errors") == 0, server.log_tail()
    hits = [a.usage.prompt_tokens_details.cached_tokens for a in again]
    assert sum(hits) > 0, f"no prompt was served from disk after the restart ({hits})"

    port = free_port()
    with serve(port, ""):  # no SSD cache: every prefill recomputed
        reference = [ask(port, prompt(i)) for i in range(PROMPTS)]
    for index, (served, recomputed) in enumerate(zip(again, reference)):
        assert tokens_of(served) == tokens_of(recomputed), (
            f"prompt {index} ({hits[index]} tokens from disk, {on_disk_after_kill} blocks on "
            f"disk after the kill) answers otherwise than a recomputed prefill")


def _ignore_drop(port: int, text: str) -> None:
    try:
        ask(port, text)
    except openai.APIConnectionError:
        pass  # the server was killed under this request: that is the test
