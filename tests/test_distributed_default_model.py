"""The real default model (SmolLM2-135M: 9 attention heads, 3 KV heads) tensor-parallel
over 3 ranks on loopback, through the openai SDK; and started by mlx.launch itself, with
default settings, on this box's two cores (three ranks take seconds per step there: a
slow group, not a dead one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed_group import RankGroup, free_port


@pytest.mark.slow
def test_three_ranks_serve_the_default_model_through_the_openai_sdk(tmp_path, default_model_dir) -> None:
    import openai

    group = RankGroup(tmp_path, default_model_dir, 3)
    try:
        client = openai.OpenAI(base_url=group.url("/v1"), api_key="unused")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                               temperature=0)
        assert reply.usage.completion_tokens > 0 and reply.choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(
                               model=model, messages=messages, max_tokens=12, temperature=0,
                               stream=True) if chunk.choices)
        assert streamed == reply.choices[0].message.content
        engine = group.health()["engines"][model]
        assert (engine["distributed_ranks"], engine["distributed_mode"]) == (3, "tensor")
        assert group.stop() == [0, 0, 0], group.output()
    finally:
        group.close()


@pytest.mark.slow
def test_two_ranks_are_refused_for_the_default_model_with_what_would_work(tmp_path, default_model_dir) -> None:
    with pytest.raises(AssertionError) as failed:
        RankGroup(tmp_path, default_model_dir, 2, ready_timeout_s=300)
    assert "9 attention heads, 3 KV heads do not divide by 2 ranks: use 3 ranks" in str(failed.value)


@pytest.mark.slow
def test_mlx_launch_three_ranks_answer_a_40_token_chat_with_default_settings(tmp_path,
                                                                          default_model_dir) -> None:
    """``mlx.launch -n 3 --backend ring -- omlx-core serve --distributed tensor --tier
    cluster``: a step's collectives wait for ranks that share two cores, for seconds;
    liveness is their heartbeats, so the group answers instead of declaring itself dead
    at its first request."""
    import openai

    port = free_port()
    launcher = Path(sys.executable).with_name("mlx.launch")
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(launcher), "-n", "3", "--backend", "ring", "--", sys.executable, "-m",
             "omlx_core", "serve", "--distributed", "tensor", "--tier", "cluster", "--port",
             str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = f"ready: http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while (ready not in log_path.read_text(errors="replace") and process.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.5)
        assert ready in log_path.read_text(errors="replace"), \
            log_path.read_text(errors="replace")[-4000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=1200, max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=40, temperature=0,
            messages=[{"role": "user", "content": "Tell me a short story about a cat."}])
        output = log_path.read_text(errors="replace")
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0, output
        assert "group is dead" not in output and process.poll() is None, output[-4000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
