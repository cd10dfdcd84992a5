"""``setup.sh`` builds its virtualenv with a Python omlx-core can run on: ``$PYTHON`` when
set, or the newest suitable one on the PATH (``scripts/find_python.sh``), and where there is
none it stops with one line naming what to install, before it installs anything.

Each case runs the script with a PATH of our own making: fake interpreters that answer
the version query as an old Python would, a name that does not run (as a pyenv shim of an
unselected version), and this test's own interpreter under newer names."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIND = ROOT / "scripts" / "find_python.sh"
BASH = shutil.which("bash")


def fake_python(folder: Path, name: str, version: str) -> Path:
    """An interpreter that reports ``version`` (and runs nothing else)."""
    path = folder / name
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def broken(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\necho 'pyenv: command not found' >&2\nexit 127\n")
    path.chmod(0o755)
    return path


def real(folder: Path, name: str) -> Path:
    path = folder / name
    path.symlink_to(sys.executable)
    return path


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH with only the tools the scripts use besides interpreters."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("bash", "sort", "head", "dirname"):
        (folder / tool).symlink_to(shutil.which(tool))
    return folder


def find(bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(FIND)], capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bin_dir), **env})


def test_the_newest_suitable_python_on_the_path_is_picked(bin_dir: Path) -> None:
    fake_python(bin_dir, "python3", "3.10")
    broken(bin_dir, "python3.13")
    picked = real(bin_dir, "python3.12")
    real(bin_dir, "python3.11")
    done = find(bin_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(picked)


def test_a_plain_python3_that_is_new_enough_is_taken(bin_dir: Path) -> None:
    broken(bin_dir, "python3.13")
    picked = real(bin_dir, "python3")
    done = find(bin_dir)
    assert (done.returncode, done.stdout.strip()) == (0, str(picked)), done.stderr


def test_without_one_it_says_in_one_line_what_to_install(bin_dir: Path) -> None:
    fake_python(bin_dir, "python3", "3.10")
    broken(bin_dir, "python3.12")
    done = find(bin_dir)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no Python 3.11 or newer" in lines[0] and "apt-get install python3.11" in lines[0]


def test_python_set_is_used_or_refused_with_its_version(bin_dir: Path) -> None:
    chosen = real(bin_dir, "python-of-choice")
    done = find(bin_dir, PYTHON=str(chosen))
    assert (done.returncode, done.stdout.strip()) == (0, str(chosen)), done.stderr
    old = fake_python(bin_dir, "python-old", "3.10")
    real(bin_dir, "python3.12")  # not taken: $PYTHON decides
    done = find(bin_dir, PYTHON=str(old))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "is Python 3.10" in done.stderr
    assert "needs 3.11 or newer" in done.stderr


def test_setup_sh_stops_before_installing_anything(bin_dir: Path, tmp_path: Path) -> None:
    fake_python(bin_dir, "python3", "3.10")
    venv = tmp_path / "venv"
    done = subprocess.run([BASH, str(ROOT / "setup.sh"), "serve"], capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": str(bin_dir), "OMLX_VENV": str(venv),
                               "HOME": os.environ.get("HOME", str(tmp_path))})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "apt-get install python3.11" in done.stderr
    assert not venv.exists()


def test_setup_sh_refuses_a_virtualenv_made_with_an_old_python(bin_dir: Path,
                                                               tmp_path: Path) -> None:
    real(bin_dir, "python3.12")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_python(venv / "bin", "python", "3.10")
    done = subprocess.run([BASH, str(ROOT / "setup.sh"), "test"], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(bin_dir), "OMLX_VENV": str(venv)})
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "older than 3.11" in done.stderr and f"rm -rf {venv}" in done.stderr


def _answers(port: int) -> bool:
    import http.client

    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/v1/models")
        return connection.getresponse().status == 200
    except OSError:
        return False


@pytest.mark.slow
def test_setup_sh_serve_installs_nothing_twice_and_serves_the_default_model(
        default_model_dir, tmp_path: Path) -> None:
    """README's first command, run again as a newcomer would after `./setup.sh test`: the
    installs are skipped (the stamp that run wrote for this pyproject.toml and setup.sh)
    and the embedded default model answers a chat through the OpenAI SDK."""
    from openai import OpenAI

    from omlx_core.testing.waiting import free_port, wait_for

    venv = Path(sys.prefix)
    stamp = (venv / ".omlx-setup").read_text().split() if (venv / ".omlx-setup").is_file() else []
    files = subprocess.run("cat pyproject.toml setup.sh | cksum", shell=True, cwd=ROOT,
                           capture_output=True, text=True, timeout=60).stdout.split()[0]
    # Installing again here would rewrite the editable install under the running suite.
    assert stamp[:1] == [files] and "grammar" in stamp, (
        f"{venv} was not installed by ./setup.sh for this pyproject.toml and setup.sh: run "
        "./setup.sh test once")
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [BASH, str(ROOT / "setup.sh"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "OMLX_VENV": str(venv)})
    try:
        assert wait_for(lambda: _answers(port) or process.poll() is not None, timeout=300), \
            log.read_text()
        assert process.poll() is None, log.read_text()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                        timeout=120)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    output = log.read_text()
    assert "is installed in" in output and "== installing omlx-core" not in output, output
