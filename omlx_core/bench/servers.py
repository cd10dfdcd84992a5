"""The servers a benchmark compares, each run as its own subprocess on a loopback port.

Both get the same optimized BLAS preloaded (the ``mlx-cpu`` wheel's reference BLAS would
make either one ~80x slower) and the same batch and prefill-chunk settings where the
server has them; :func:`blas_of` reads a running server's memory map to prove which
BLAS it really uses.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

OMLX = "omlx"
MLX_LM = "mlx_lm"


@dataclass(frozen=True)
class ServerSettings:
    """What omlx-core runs with (its effective configuration) and what mlx_lm.server is
    given alike."""

    tier: str
    max_batch_size: int
    prefill_step_size: int
    http_threads: int
    #: ``--set KEY=VALUE`` overrides given to omlx-core; none for what a user gets
    overrides: tuple[str, ...] = ()
    #: whether ``--tier`` is passed (otherwise omlx-core picks the tier, as ``serve`` does)
    tier_given: bool = False

    @classmethod
    def of_config(cls, config: Any) -> "ServerSettings":
        """What ``omlx-core serve`` runs with by default under ``config`` (the effective
        configuration), no override and the tier left to the server."""
        return cls(tier=str(config["memory.tier"]),
                   max_batch_size=int(config["plugin.batched.max_batch_size"]),
                   prefill_step_size=int(config["plugin.batched.prefill_step_size"]),
                   http_threads=0)


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server and which model id its requests name."""

    name: str
    label: str
    argv: list[str]
    model_id: str
    #: settings this server has no equivalent for, said in the report
    lacks: tuple[str, ...] = ()
    #: environment variables set for this server only (a benchmark prints them)
    env: tuple[tuple[str, str], ...] = ()

    def typed(self) -> list[str]:
        """``omlx-core serve ...`` as a user types it: the bench's address and port left
        out (its free port is the bench's, not a setting)."""
        shown = list(self.argv[self.argv.index("serve"):])
        for flag in ("--host", "--port"):
            if flag in shown:
                at = shown.index(flag)
                del shown[at:at + 2]
        return ["omlx-core", *shown]

    def command(self) -> str:
        """The command as a reader can run it: its environment first, ``python`` for this
        interpreter, ``~`` for the home directory and ``$TMPDIR`` for the temporary one (a
        committed report shows no machine's paths)."""
        home, temp = str(Path.home()), tempfile.gettempdir()

        def shown(arg: str) -> str:
            if arg == sys.executable:
                return "python"
            if arg.startswith(temp + os.sep):
                return "$TMPDIR" + arg[len(temp):]
            if arg.startswith(home + os.sep):
                return "~" + arg[len(home):]
            return arg

        return " ".join([*(f"{k}={shown(v)}" for k, v in self.env), *map(shown, self.argv)])


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def fresh_cache_root() -> Path:
    """A new, empty omlx-core cache root (for ``OMLX_CACHE_DIR``) whose ``models/`` and
    ``cpu-kernels/`` are the user's (what ``setup.sh`` left there): a server started on it
    converts no model and builds no kernels again, and its SSD cache starts empty, as on a
    first start, whatever earlier runs left in the user's cache."""
    from omlx_core.models.default import model_cache_dir

    root = Path(tempfile.mkdtemp(prefix="omlx-bench-cache-"))
    for name in ("models", "cpu-kernels"):
        kept = model_cache_dir() / name
        if kept.is_dir():
            (root / name).symlink_to(kept, target_is_directory=True)
    return root


def omlx_spec(model_dir: Path | None, port: int, settings: ServerSettings,
              model_id: str | None = None, cache_root: Path | None = None) -> ServerSpec:
    """``omlx-core serve`` as the README starts it (``./setup.sh serve``: no flag, so the
    tier it picks, its default log level, 127.0.0.1): only the port, the model (only when
    one is named) and the overrides the benchmark was given are added; with
    ``cache_root``, that directory as ``OMLX_CACHE_DIR``."""
    argv = [sys.executable, "-m", "omlx_core", "serve", "--port", str(port)]
    if settings.tier_given:
        argv += ["--tier", settings.tier]
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
    for override in settings.overrides:
        argv += ["--set", override]
    served = model_id or (Path(model_dir).resolve().name if model_dir is not None else "")
    env = (("OMLX_CACHE_DIR", str(cache_root)),) if cache_root is not None else ()
    return ServerSpec(OMLX, f"omlx-core serve (tier {settings.tier})", argv, model_id=served, env=env)


def mlx_lm_spec(model_dir: Path, port: int, settings: ServerSettings) -> ServerSpec:
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
            "--decode-concurrency", str(settings.max_batch_size),
            "--prompt-concurrency", str(settings.max_batch_size),
            "--prefill-step-size", str(settings.prefill_step_size)]
    lacks = (
        "a memory ceiling, admission control and 413 refusals (it runs whatever arrives)",
        "a per-step prefill token budget: --prefill-step-size caps each sequence's chunk, "
        "so a step can prefill up to prompt-concurrency x step tokens",
        "a bounded HTTP worker pool (ThreadingHTTPServer, one thread per connection)",
    )
    return ServerSpec(MLX_LM, "mlx_lm.server", argv, model_id="default_model", lacks=lacks)


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pids: Sequence[int], *, window_s: float = 0.5, busy_share: float = 0.05,
               timeout_s: float = 60.0) -> bool:
    """Wait until the processes together use under ``busy_share`` of one core over a
    ``window_s`` window (what a server does after a request, such as writing cache
    blocks to disk, must not run while another server is measured); ``False`` when
    they were still busy after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = sum(cpu_seconds(pid) for pid in pids)
        time.sleep(window_s)
        if sum(cpu_seconds(pid) for pid in pids) - before < busy_share * window_s:
            return True
        if time.monotonic() > deadline:
            return False


def blas_of(pid: int) -> str:
    """The BLAS kind mapped into a running process (``openblas``, ``reference``, ...)."""
    from omlx_core.platform.blas import blas_library_in_use

    mapped = blas_library_in_use(Path(f"/proc/{pid}/maps"))
    return mapped.kind if mapped else "unknown"


def preload_env() -> dict[str, str]:
    """This environment with the optimized BLAS preloaded, when one is installed."""
    from omlx_core.platform.blas import (find_optimized_blas, preload_environment,
                                         preloaded_optimized_blas)

    if preloaded_optimized_blas(os.environ):
        return dict(os.environ)
    library = find_optimized_blas()
    if library is None:
        return dict(os.environ)
    return preload_environment(os.environ, library)


class ServerProcess:
    """A server subprocess: started, waited on until it answers, stopped; output in a log."""

    def __init__(self, spec: ServerSpec, port: int, *, ready_timeout: float = 300.0):
        self.spec = spec
        self.host = "127.0.0.1"
        self.port = port
        self.ready_timeout = ready_timeout
        self._log = tempfile.NamedTemporaryFile(prefix=f"omlx-bench-{spec.name}-", suffix=".log",
                                                delete=False)
        self.log_path = Path(self._log.name)
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "ServerProcess":
        self.process = subprocess.Popen(self.spec.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL,
                                        env=preload_env() | dict(self.spec.env))
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.spec.label} exited with status {self.process.returncode} "
                                   f"before answering; its log ({self.log_path}) ends:\n"
                                   f"{self.log_tail()}")
            try:
                connection = http.client.HTTPConnection(self.host, self.port, timeout=5)
                connection.request("GET", "/v1/models")
                status = connection.getresponse().status
                connection.close()
                if status == 200:
                    return
            except OSError:
                pass
            # A refused connect costs microseconds: a short poll keeps the wait close to
            # the start itself (0.5 s added a quarter second to each of the suite's starts).
            time.sleep(0.05)
        raise RuntimeError(f"{self.spec.label} did not answer GET /v1/models on port {self.port} "
                           f"within {self.ready_timeout:.0f} s; its log ({self.log_path}) ends:\n"
                           f"{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self, timeout: float = 30.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            self._log.close()
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
        self._log.close()
