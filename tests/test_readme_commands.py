"""Every command README.md lists, run as a reader runs it: the ``omlx-core`` console
script of this environment in a subprocess, checked for its exit status and the key
lines of what it prints; and README's printed outputs checked against what the commands
print now (``scripts/readme_outputs.py --check``).

:data:`COMMANDS` names the test that runs each command of README's table; a command
added to the table without one fails :func:`test_every_readme_command_is_run_here`.
Each runs a subprocess (the commands that serve start real servers): they are slow
tests; the check that every command has one is not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from omlx_core.testing.waiting import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OMLX = Path(sys.executable).with_name("omlx-core")
#: seconds a command (or a server's start) may take before the test fails on it
COMMAND_S = 300

#: README's commands and the test in this module that runs each
COMMANDS = {
    "serve": "test_serve_answers_and_ps_and_top_read_it",
    "ps": "test_serve_answers_and_ps_and_top_read_it",
    "top": "test_serve_answers_and_ps_and_top_read_it",
    "launch": "test_launch_serves_on_two_ranks_and_stops_them_all",
    "plugins": "test_plugins",
    "config show": "test_config_show",
    "config tiers": "test_config_tiers",
    "models": "test_models_list",
    "models convert-gguf": "test_models_convert_gguf",
    "doctor": "test_doctor",
}


def readme_commands() -> list[str]:
    """The commands of README's command table: ``omlx-core`` and the words after it up to
    the first argument (``models [list]`` is ``models``)."""
    found = []
    for line in README.read_text().splitlines():
        match = re.match(r"\| `omlx-core ([^`]*)`", line)
        if match:
            words = []
            for word in match.group(1).split():
                if not re.fullmatch(r"[a-z][a-z-]*", word):
                    break
                words.append(word)
            found.append(" ".join(words))
    return found


def omlx(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(OMLX), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=COMMAND_S, **kwargs)


def test_every_readme_command_is_run_here() -> None:
    commands = readme_commands()
    assert {"serve", "launch", "doctor"} <= set(commands), commands
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, ("README's command table lists commands no test runs; add a test to "
                         "tests/test_readme_commands.py and name it in COMMANDS: "
                         + ", ".join(missing))
    assert all(callable(globals().get(name)) for name in COMMANDS.values())


@pytest.mark.slow
def test_readme_outputs_are_what_the_commands_print_now() -> None:
    result = subprocess.run([sys.executable, "scripts/readme_outputs.py", "--check"],
                            capture_output=True, text=True, cwd=ROOT, timeout=COMMAND_S)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_plugins() -> None:
    result = omlx("plugins", "--tier", "cpu-small")
    assert result.returncode == 0, result.stderr
    plugins, engines = (
        {line.split()[0]: line.split() for line in table.splitlines() if not line.startswith("#")}
        for table in result.stdout.strip().split("\n\n"))
    assert plugins["NAME"][:4] == ["NAME", "VERSION", "SOURCE", "STATUS"]
    for plugin in ("advice", "batched", "dflash", "distributed", "encoder", "estimator",
                   "memory_guard", "ssd_cache", "vlm"):
        assert plugins[plugin][2:4] == ["built-in", "loaded"], result.stdout
    assert {engine: row[-1] for engine, row in engines.items() if engine != "ENGINE"} == {
        "batched": "guarded", "dflash": "guarded", "distributed": "guarded", "encoder": "guarded",
        "vlm": "guarded"}
    listed = json.loads(omlx("plugins", "--json").stdout)
    assert {p["name"] for p in listed} >= {"batched", "memory_guard"}


@pytest.mark.slow
def test_config_show(tmp_path) -> None:
    result = omlx("config", "show", "--tier", "cpu-small")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# tier: cpu-small\n")
    assert re.search(r"^memory\.tier\s+'safe'\s+omlx_core/config/tiers/cpu-small\.toml$",
                     result.stdout, re.M), result.stdout
    shown = json.loads(omlx("config", "show", "--tier", "cpu-small", "--json").stdout)
    assert "memory.tier" in json.dumps(shown)
    # README's example of a mistyped key: exit status 2, the file, the key, the fix.
    mine = tmp_path / "mine.toml"
    mine.write_text('base = ["cpu-small"]\n\n[plugin.batched]\nmax_batch_sise = 8\n')
    result = omlx("config", "show", "--tier", str(mine))
    assert result.returncode == 2
    assert ("plugin.batched.max_batch_sise: unknown key; did you mean 'max_batch_size'?"
            in result.stderr), result.stderr


@pytest.mark.slow
def test_config_tiers() -> None:
    result = omlx("config", "tiers")
    assert result.returncode == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines()[1:] if line.strip()]
    assert set(listed) == {"cluster", "cpu-small", "cuda-80gb", "laptop-16gb",
                           "workstation-128gb"}


@pytest.mark.slow
def test_models_list(tmp_path, tiny_model_path) -> None:
    config = tmp_path / "omlx.toml"
    config.write_text(f'[models.tiny]\npath = "{tiny_model_path("llama")}"\n')
    # Bare `models` takes its configuration from the environment, `models list` from flags.
    for args, env in ((("models",), {"OMLX_CONFIG": str(config)}),
                      (("models", "list", "--config", str(config)), {})):
        result = omlx(*args, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()}
        assert rows["ID"] == ["ID", "ENGINE", "SOURCE", "SERVED"]
        assert rows["tiny"][1] == "batched" and rows["tiny"][-1] == "no"
        assert rows["smollm2-135m-instruct"][-1] == "yes"


@pytest.mark.slow
def test_models_convert_gguf(tmp_path) -> None:
    from tests.test_gguf_convert import write_tiny_gguf

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "converted"
    result = omlx("models", "convert-gguf", str(source), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == out
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    result = omlx("models", "convert-gguf", str(tmp_path / "missing.gguf"))
    assert result.returncode == 2 and "is not a file" in result.stderr


@pytest.mark.slow
def test_doctor() -> None:
    result = omlx("doctor", "--json")
    report = json.loads(result.stdout)
    failed = report["summary"]["fail"]
    assert result.returncode == (1 if failed else 0), report
    names = [check["name"] for check in report["checks"]]
    assert names[:3] == ["python", "backend", "blas"] and "ssd cache" in names
    result = omlx("doctor")
    assert result.returncode == (1 if failed else 0)
    assert result.stdout.startswith("STATUS  CHECK")
    assert re.search(rf"^{len(names)} checks: \d+ ok, \d+ warnings?, {failed} failures?$",
                     result.stdout, re.M), result.stdout


class Served:
    """A command that serves (``omlx-core serve`` or ``launch``) in a subprocess of its
    own process group, read until it says it is ready."""

    def __init__(self, *args: str, log: Path):
        self.port = free_port()
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen([str(OMLX), *args, "--port", str(self.port)],
                                            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            start_new_session=True)

    def wait_ready(self) -> None:
        from omlx_core.testing.waiting import wait_for_output

        wait_for_output(self.process, self.log, f"omlx-core ready: http://127.0.0.1:{self.port}",
                        COMMAND_S)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=COMMAND_S) as response:
            return json.loads(response.read())

    def stop(self) -> int:
        """SIGTERM, as a supervisor stops it; its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=COMMAND_S)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)


@pytest.mark.slow
def test_serve_answers_and_ps_and_top_read_it(tmp_path, tiny_model_path) -> None:
    served = Served("serve", "--tier", "cpu-small", "--model", str(tiny_model_path("llama")),
                    "--set", "plugin.ssd_cache.dir=", log=tmp_path / "serve.log")
    try:
        served.wait_ready()
        answer = served.post("/v1/completions", {"model": "llama-seed0", "prompt": "hi",
                                                 "max_tokens": 3})
        assert answer["usage"]["completion_tokens"] == 3
        ps = omlx("ps", "--port", str(served.port))
        assert ps.returncode == 0, ps.stderr
        header, *rows = ps.stdout.splitlines()
        assert header.split()[:2] == ["NAME", "STATE"]
        assert [row.split()[:2] for row in rows] == [["llama-seed0", "resident"]]
        top = omlx("top", "--port", str(served.port), "--once")
        assert top.returncode == 0, top.stderr
        assert "llama-seed0" in top.stdout and "memory" in top.stdout.lower()
        frame = json.loads(omlx("top", "--port", str(served.port), "--json").stdout)
        assert "llama-seed0" in [m["model"] for m in frame["models"]]
        assert served.stop() == 0
    finally:
        served.close()
    # With no server there, ps and top say so and exit 1.
    for command in ("ps", "top"):
        result = omlx(command, "--port", str(served.port), *(["--once"] if command == "top" else []))
        assert result.returncode == 1 and "omlx-core serve" in result.stderr, result.stderr


@pytest.mark.slow
def test_launch_serves_on_two_ranks_and_stops_them_all(tmp_path, tiny_model_path) -> None:
    served = Served("launch", "-n", "2", "--", "--tier", "cpu-small",
                    "--model", str(tiny_model_path("llama")), "--set", "plugin.ssd_cache.dir=",
                    log=tmp_path / "launch.log")
    try:
        served.wait_ready()
        answer = served.post("/v1/completions", {"model": "llama-seed0", "prompt": "hi",
                                                 "max_tokens": 3})
        assert answer["usage"]["completion_tokens"] == 3
        log = served.log.read_text()
        assert "mlx.launch -n 2 -- " in log and "serve --distributed tensor" in log
        assert served.stop() == 0, served.log.read_text()[-3000:]
        # Every rank stopped with it: nothing of its process group is left.
        with pytest.raises(ProcessLookupError):
            os.killpg(served.process.pid, 0)
    finally:
        served.close()
