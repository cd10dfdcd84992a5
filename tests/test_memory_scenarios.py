"""Issue 11's scenarios on the real default model and a real server started as the README
starts it (``omlx-core serve --memory-ceiling ...``), driven by the openai SDK.

Every verdict is decided before any compute and agrees with a fresh server's: a prompt
that fits with the margin completes with 200, one that does not gets 413 from preflight,
before any work; never a 503 or an in-band refusal after prefill work on an idle server, and
never a 413 that a fresh server would not give.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omlx_core.bench.prompts import text_of_tokens
from omlx_core.testing.waiting import free_port, wait_for

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")


class Server:
    """``python -m omlx_core serve --memory-ceiling CEILING`` on a loopback port."""

    def __init__(self, ceiling: str, log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omlx_core", "serve", "--memory-ceiling", ceiling,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1",
                                    api_key="unused", max_retries=0, timeout=600)
        if not wait_for(self._ready, timeout=180) or self.process.poll() is not None:
            self.stop()
            raise AssertionError(f"server did not start:\n{log_path.read_text()[-3000:]}")
        self.model = self.client.models.list().data[0].id

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            return True
        try:
            self.client.models.list()
            return True
        except openai.APIConnectionError:
            return False

    def ask(self, prompt: str) -> tuple[int, str]:
        """Status, and the answer or the error body."""
        try:
            answer = self.client.chat.completions.create(
                model=self.model, max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": prompt}])
        except openai.APIStatusError as error:
            return error.status_code, str(error.body)
        return 200, answer.choices[0].message.content or ""

    def metric(self, name: str, **labels: str) -> float:
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics").read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        self._log.close()


@pytest.fixture
def passages(default_model_dir):
    def passage(tokens: int, seed: int) -> str:
        return "Summarize these rules:\n" + text_of_tokens(default_model_dir, tokens, seed)
    return passage


def test_prompts_over_a_1gib_ceiling_get_the_verdict_a_fresh_server_gives(tmp_path, passages):
    first, other, oversized = passages(4000, 1), passages(4000, 2), passages(7000, 3)
    server = Server("1GiB", tmp_path / "server.log")
    try:
        outcomes = [server.ask(prompt) for prompt in (first, other, oversized)]
        forward_refusals = server.metric("omlx_memory_rejections_total", stage="forward")
        admission_refusals = server.metric("omlx_memory_rejections_total", stage="admission")
    finally:
        server.stop()
    # Both ~4k-token prompts fit with the margin: the second needs the first's cached
    # blocks given back, and gets them.
    assert [status for status, _ in outcomes[:2]] == [200, 200], outcomes
    status, body = outcomes[2]
    assert status == 413 and "'stage': 'preflight'" in body, outcomes[2]  # before any work
    assert "memory-ceiling" in body or "memory.custom_ceiling" in body
    assert forward_refusals == 0 and admission_refusals == 0

    fresh = Server("1GiB", tmp_path / "fresh.log")
    try:
        assert fresh.ask(oversized)[0] == 413  # a fresh server says the same
    finally:
        fresh.stop()


def test_a_long_chat_under_a_tight_ceiling_is_refused_before_any_work_or_completes(
        tmp_path, passages):
    """Issue 11's first scenario: ~3,000 words under a 0.8 GiB ceiling. It used to pass
    preflight and be refused half-way (a 503 after ~10 s of prefill), then get a 413
    on the second try; now both tries get the same verdict, decided before any work."""
    prompt = passages(4000, 4)
    server = Server("0.8GiB", tmp_path / "server.log")
    try:
        outcomes = [server.ask(prompt) for _ in range(2)]
        forward_refusals = server.metric("omlx_memory_rejections_total", stage="forward")
    finally:
        server.stop()
    statuses = [status for status, _ in outcomes]
    assert statuses in ([200, 200], [413, 413]), outcomes
    if statuses == [413, 413]:  # refused by preflight, before any work
        assert all("'stage': 'preflight'" in body for _, body in outcomes), outcomes
    assert forward_refusals == 0
