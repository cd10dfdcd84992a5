"""The real default model (SmolLM2-135M: 9 attention heads, 3 KV heads) tensor-parallel
over 3 ranks on loopback, started by mlx.launch itself with default settings and asked
through the openai SDK, on this box's two cores (three ranks take seconds per step there: a
slow group, not a dead one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks.ceiling import child_pids
from distributed_group import RankGroup, free_port
from omlx_core.testing.waiting import wait_for_output


@pytest.mark.slow
def test_two_ranks_are_refused_for_the_default_model_with_what_would_work(tmp_path, default_model_dir) -> None:
    with pytest.raises(AssertionError) as failed:
        RankGroup(tmp_path, default_model_dir, 2, ready_timeout_s=300)
    assert "9 attention heads, 3 KV heads do not divide by 2 ranks: use 3 ranks" in str(failed.value)


@pytest.mark.slow
def test_mlx_launch_three_ranks_serve_the_default_model_through_the_openai_sdk(tmp_path,
                                                                         default_model_dir) -> None:
    """``mlx.launch -n 3 --backend ring -- omlx-core serve --distributed tensor --tier
    cluster``, with default settings: a 24-token chat, the same chat streamed (its first
    tokens, the same text), ``/health`` naming the split, and every rank gone after
    SIGTERM. A step's collectives wait for ranks that share two cores, for seconds;
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
        wait_for_output(process, log_path, f"ready: http://127.0.0.1:{port}", timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=1200, max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Tell me a short story about a cat."}]
        reply = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                               messages=messages)
        output = log_path.read_text(errors="replace")
        text = reply.choices[0].message.content
        assert text and reply.usage.completion_tokens > 0, output
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(
                               model=model, messages=messages, max_tokens=8, temperature=0,
                               stream=True) if chunk.choices)
        assert streamed and text.startswith(streamed), (streamed, text)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as response:
            engine = json.loads(response.read())["engines"][model]
        assert (engine["distributed_ranks"], engine["distributed_mode"]) == (3, "tensor")
        output = log_path.read_text(errors="replace")
        assert "group is dead" not in output and process.poll() is None, output[-4000:]
        # SIGTERM to rank 0 alone: the followers stop with it, and mlx.launch names any
        # rank that exits otherwise than with status 0.
        os.kill(_rank_pid(process.pid, 0), signal.SIGTERM)
        assert process.wait(timeout=120) == 0
        output = log_path.read_text(errors="replace")
        assert "exited with code" not in output and "was killed" not in output, output[-4000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)


def _rank_pid(launcher: int, rank: int) -> int:
    """The process ``mlx.launch`` (pid ``launcher``) started as ``rank``: among its
    descendants, the server itself (``-m omlx_core``, not the shell that started it)
    whose environment names that rank."""
    pending = child_pids(launcher)
    while pending:
        pid = pending.pop()
        pending += child_pids(pid)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # it ended meanwhile
        if f"MLX_RANK={rank}".encode() in environ and b"omlx_core" in argv:
            return pid
    raise AssertionError(f"mlx.launch (pid {launcher}) has no rank {rank} process")
