"""The example third-party engine installs from its own directory into a fresh
virtualenv next to omlx-core, is discovered, and serves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
from pathlib import Path

import pytest

from omlx_core.testing import cached_model
from omlx_core.testing.waiting import free_port, wait_for_output

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "sequential-engine"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A new virtualenv that sees this environment's packages (omlx-core and its
    dependencies) the way a second site directory would, plus the example installed by pip."""
    venv = tmp_path_factory.mktemp("venv")
    # No pip of its own: the outer environment's pip, seen through the site directory below,
    # installs into this interpreter's prefix.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    python = venv / "bin" / "python"
    fresh_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=300).stdout.strip()
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    # addsitedir (not a bare path) so the outer environment's own .pth files, such as an
    # editable omlx-core install, take effect too.
    Path(fresh_site, "omlx_outer_env.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in outer) + "\n")
    # Build from a copy: a build leaves egg-info behind, which would make the example
    # discoverable from the source tree.
    source = tmp_path_factory.mktemp("example") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source)
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", str(source)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return venv


def omlx(venv, *args, **kwargs):
    env = {**os.environ, "OMLX_NO_BLAS_REEXEC": "1"}
    return subprocess.run([str(venv / "bin" / "python"), "-m", "omlx_core", *args],
                          capture_output=True, text=True, env=env, timeout=300, **kwargs)


def test_example_is_listed_by_omlx_core_plugins(fresh_venv):
    result = omlx(fresh_venv, "plugins", "--json", "--tier", "cpu-small")
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    sequential = plugins["sequential"]
    assert sequential["source"] == "distribution omlx-sequential-engine"
    assert sequential["version"] == "0.1.0"
    assert sequential["hooks"] == ["register_engines"]
    assert sequential["engines"] == {"sequential": "guarded"}
    assert plugins["batched"]["source"] == "built-in"


def test_example_is_not_visible_without_the_install():
    result = subprocess.run([sys.executable, "-m", "omlx_core", "plugins", "--json", "--tier",
                             "cpu-small"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMLX_NO_BLAS_REEXEC": "1"})
    assert "sequential" not in {p["name"] for p in json.loads(result.stdout)}


def test_example_engine_serves_a_model(fresh_venv, tmp_path):
    model_dir = cached_model("llama")
    port = free_port()
    config = tmp_path / "tiny.toml"
    config.write_text(f"""
[server]
port = {port}
models = ["tiny"]

[models.tiny]
path = "{model_dir}"
engine = "sequential"
""")
    env = {**os.environ, "OMLX_NO_BLAS_REEXEC": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            [str(fresh_venv / "bin" / "python"), "-m", "omlx_core", "serve", "--tier", "cpu-small",
             "--config", str(config)], stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        started = wait_for_output(server, log, f"omlx-core ready: http://127.0.0.1:{port}",
                                  timeout=120)
        assert "starting engine 'sequential' for model 'tiny'" in started, started
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                        timeout=120)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
            temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
        assert "tiny" in [m.id for m in client.models.list().data]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert server.returncode == 0, log.read_text(errors="replace")
