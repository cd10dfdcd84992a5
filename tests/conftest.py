"""Test session set-up: OpenBLAS, an isolated model cache, shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from omlx_core.platform.blas import ensure_optimized_blas

import pytest

pytest_plugins = ["omlx_core.testing.pytest_fixtures"]

#: the time limit of a slow test (a real server, the real default model) without a
#: ``@pytest.mark.timeout`` of its own; the others get pyproject's ``timeout``
SLOW_TIMEOUT_S = 600


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Re-execute pytest once with OpenBLAS preloaded: the mlx-cpu wheel's reference BLAS
    # makes every forward ~30x slower. Output capture holds fd 1 and 2 by now, so release
    # them first or the re-executed run would write into the capture file.
    # Stopping and restarting the capture in the process that then runs the tests left
    # pytest's terminal writer on a closed file (a collection error crashed the report),
    # so only a process that may still re-execute does it.
    from omlx_core.platform.blas import NO_REEXEC_ENV, REEXEC_MARKER_ENV

    # One OpenBLAS thread per test process (unless set): two processes, each with servers
    # whose BLAS threads spin while they wait for work, oversubscribed two cores (two
    # default-model workloads side by side: 54-60 s with OpenBLAS's own threads, 48 s with
    # one each). Set before the re-execution, which every process inherits.
    processes = getattr(config.option, "numprocesses", None) or 0
    if processes in ("auto", "logical") or (isinstance(processes, int) and processes > 1):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    may_reexec = "1" not in (os.environ.get(REEXEC_MARKER_ENV), os.environ.get(NO_REEXEC_ENV))
    capture = config.pluginmanager.getplugin("capturemanager") if may_reexec else None
    if capture is not None:
        capture.stop_global_capturing()
    ensure_optimized_blas()
    if capture is not None:
        capture.start_global_capturing()
    # Tests convert the default model once per session into a private cache, never the user's.
    config._omlx_cache = tempfile.mkdtemp(prefix="omlx-test-cache-")
    _seed_cpu_kernels(Path(config._omlx_cache))
    os.environ["OMLX_CACHE_DIR"] = config._omlx_cache


def _seed_cpu_kernels(session_cache: Path) -> None:
    """Copy the CPU kernels ``./setup.sh`` built into the user's cache (read, never
    written) into the session's, where their build directory (keyed by the kernels'
    source, mlx, nanobind, Python and compiler) would be; without them the session's
    first model load compiles the same extension again (~10 s of g++ on two cores).
    Where none is built, the session builds its own as before."""
    from omlx_core.models import cpu_kernels

    try:
        built = cpu_kernels.build_dir()
    except cpu_kernels.KernelBuildError:  # no compiler: the session says so at first load
        return
    if any(built.glob(f"{cpu_kernels.MODULE_NAME}*")):
        shutil.copytree(built, session_cache / built.relative_to(built.parents[1]),
                        ignore=shutil.ignore_patterns(".lock", "tmp*"))


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_omlx_cache", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def default_model_dir():
    """The real default model (SmolLM2-135M-Instruct float32), converted once per session."""
    from omlx_core.models.default import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def server(context):
    """A real HTTP server (waitress, loopback, a free port) over the module's ``context``
    fixture, which each HTTP test module defines."""
    from omlx_core.http.serve import HTTPServer

    with HTTPServer(context, port=0) as server:
        yield server


def start_tiny_context(tmp_path_factory, model_id: str = "tiny"):
    """A started server context serving a tiny random llama as ``model_id``, through
    the real bootstrap (tier cpu-small)."""
    from omlx_core.bootstrap import load_setup, start_engines
    from omlx_core.testing import cached_model

    model_dir = cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))
    config = tmp_path_factory.mktemp("config") / "omlx.toml"
    config.write_text(f'[server]\nmodels = ["{model_id}"]\n\n[models.{model_id}]\n'
                      f'path = "{model_dir}"\n')
    return start_engines(load_setup("cpu-small", [config]), progress=False)


@pytest.fixture
def client(server):
    """The openai SDK against the module's ``server``."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(server):
    """The anthropic SDK against the module's ``server``."""
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client
