"""Starts ``omlx-core serve --distributed`` as a group of ranks on loopback, the way
``mlx.launch`` would (``MLX_RANK`` and a ring ``MLX_HOSTFILE`` per process), so tests
can hold each rank's process (and kill one)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RankGroup:
    """``size`` ranks serving ``model_dir``; rank 0 answers HTTP on :attr:`port`."""

    def __init__(self, tmp_path: Path, model_dir: Path, size: int = 2, *, mode: str = "tensor",
                 extra: list[str] | None = None, ready_timeout_s: float = 300,
                 distributed: bool = True, rank_extra: dict[int, list[str]] | None = None) -> None:
        self.tmp_path = tmp_path
        self.size = size
        self.port = free_port()
        self.hostfile = tmp_path / "hosts.json"
        self.hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(size)]))
        self.logs = [tmp_path / f"rank{rank}.log" for rank in range(size)]
        command = [sys.executable, "-m", "omlx_core", "serve", "--model", str(model_dir),
                   "--port", str(self.port), "--tier", "cpu-small", *(extra or [])]
        if distributed:
            command += ["--distributed", mode]
        self.processes = []
        for rank in range(size):
            env = dict(os.environ)
            if distributed:
                env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(self.hostfile))
            with open(self.logs[rank], "w") as log:
                self.processes.append(subprocess.Popen(command + (rank_extra or {}).get(rank, []), env=env, stdout=log,
                                                       stderr=subprocess.STDOUT))
        self._wait_ready(ready_timeout_s)

    @classmethod
    def single(cls, tmp_path: Path, model_dir: Path) -> "RankGroup":
        """The plain batched engine serving ``model_dir`` in one process."""
        return cls(tmp_path, model_dir, 1, distributed=False)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ready = f"ready: http://127.0.0.1:{self.port}"
        while time.monotonic() < deadline:
            if ready in self.logs[0].read_text(errors="replace"):
                return
            if any(p.poll() is not None for p in self.processes):
                break
            time.sleep(0.2)
        self.close()
        raise AssertionError("the group did not come up:\n" + self.output())

    def output(self) -> str:
        return "\n".join(f"--- rank {rank} ---\n{log.read_text(errors='replace')[-6000:]}"
                         for rank, log in enumerate(self.logs))

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict]:
        request = urllib.request.Request(self.url(path), json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stream(self, path: str, body: dict[str, Any], timeout: float = 120):
        """The parsed ``data:`` events of a streamed request, as they come."""
        request = urllib.request.Request(self.url(path), json.dumps({**body, "stream": True}).encode(),
                                         {"Content-Type": "application/json"})
        response = urllib.request.urlopen(request, timeout=timeout)
        return response, _events(response)

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url("/health"), timeout=30) as response:
            return json.loads(response.read())

    def stop(self, timeout_s: float = 120) -> list[int | None]:
        """SIGTERM rank 0 (the followers stop with it); every rank's exit status."""
        if self.processes[0].poll() is None:
            self.processes[0].send_signal(signal.SIGTERM)
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.close()
        return codes

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def _events(response):
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
