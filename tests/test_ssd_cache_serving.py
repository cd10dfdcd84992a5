"""The SSD cache behind real engines and a real server: restarts, hybrid models, kill -9."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import openai
import pytest

from omlx_core.bench.servers import ServerProcess, ServerSpec
from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.models.registry import spec_for_path
from omlx_core.pluginmanager import build_plugin_manager
from omlx_core.plugins import ssd_cache
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.testing.scrape import metric_value
from omlx_core.testing.served import ServedEngine
from omlx_core.testing.waiting import free_port, wait_for
from omlx_core.testing import engine_io

PREFILL_STEP = 16
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class Served(ServedEngine):
    """An engine started the way ``serve`` starts it, with this module's small blocks and
    prefill steps."""

    def __init__(self, path: Path, ssd_dir: Path | str, **overrides: object) -> None:
        super().__init__(path, ssd_dir, **{"plugin.batched.prefill_step_size": PREFILL_STEP,
                                           "plugin.batched.block_size": BLOCK, **overrides})
        self._ids = 0

    def run(self, prompt: list[int], request_id: str | None = None):
        self._ids += 1
        handle = self.engine.submit(GenerationRequest(request_id or f"r{self._ids}", prompt, GREEDY))
        tokens, last = [], None
        for output in engine_io.collect(handle):
            tokens += output.token_ids
            last = output
        return tokens, last


def prompt_for(engine: BatchedEngine, words: int) -> list[int]:
    return engine.tokenize(" ".join(f"word{(i * 7 + 3) % 23}" for i in range(words)))


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next", "gpt_oss"])
def test_restarted_engine_resumes_from_blocks_on_disk(tiny_model_path, tmp_path, family):
    path = tiny_model_path(family)
    cold = Served(path, "", **{"plugin.batched.prefix_cache_budget": 0})
    first = Served(path, tmp_path)
    prompt = prompt_for(first.engine, 40)
    target = len(prompt) - 1  # all but the last prompt token are prefilled
    try:
        expected, _ = cold.run(prompt)
        tokens, _ = first.run(prompt)
        assert tokens == expected
        assert first.store.flush(10)
        stats = first.store.stats()
        assert stats["saves_persisted"] == stats["saves"] > 0 and stats["errors"] == 0
    finally:
        first.stop()
        cold.stop()

    second = Served(path, tmp_path)  # a new process's view: empty memory, same directory
    try:
        tokens, last = second.run(prompt)
        # To the token: for llama the block the first answer continued into is on disk
        # with its tokens, and its first ones are reused; for models with layers that
        # cannot be cut, the partial block where the first prefill ended is on disk
        # with its boundary state.
        resume_at = target
        assert last.usage.cached_tokens == resume_at > 0
        # Prefill started at the boundary: only the rest of the prompt was computed.
        assert second.engine.stats()["prompt_tokens_prefilled"] == target - resume_at
        assert tokens == expected
        assert second.store.stats()["loads"] == -(-resume_at // BLOCK)
    finally:
        second.stop()


def test_boundary_snapshots_are_staged_per_request_and_cleaned_after(tiny_model_path, tmp_path):
    served = Served(tiny_model_path("qwen3_next"), tmp_path)
    try:
        prompt = prompt_for(served.engine, 40)
        served.run(prompt, request_id="snap-req")
        store = served.store
        assert store.flush(10)
        stats = store.stats()
        assert stats["snapshots_persisted"] == stats["snapshots"] > 0
        # Every staged state was adopted by its block, then the request's directory went;
        # the other states are the partial blocks where the prompt (less its last token,
        # and whole) and the completion ended, each offered with its state.
        boundaries = list(store.blocks_dir.glob("*.boundary.safetensors"))
        assert len(boundaries) == stats["snapshots"] + 3
        assert not store.request_dir("snap-req").exists()

        # An aborted prefill leaves nothing staged either.
        long_prompt = prompt_for(served.engine, 200)
        handle = served.engine.submit(GenerationRequest("aborted-req", long_prompt, GREEDY))
        assert wait_for(lambda: store.stats()["snapshots"] > stats["snapshots"], 30)
        handle.close()
        assert wait_for(lambda: served.engine.stats()["finished"]["abort"] == 1, 30)
        assert store.flush(10)
        assert not store.request_dir("aborted-req").exists()
        assert list(store.snapshots_dir.iterdir()) == []
    finally:
        served.stop()


def test_another_model_never_reads_these_blocks(tiny_model_path, tmp_path):
    first = Served(tiny_model_path("llama", seed=0), tmp_path)
    prompt = prompt_for(first.engine, 40)
    try:
        first.run(prompt)
        assert first.store.flush(10)
    finally:
        first.stop()
    other = Served(tiny_model_path("llama", seed=1), tmp_path)  # same shapes, other weights
    try:
        _, last = other.run(prompt)
        assert last.usage.cached_tokens == 0
        assert other.store.stats()["loads"] == 0
    finally:
        other.stop()


# -- a real server killed with SIGKILL in the middle of a write -----------------------------------

# Runs `omlx-core serve` with the block writer patched: it writes three blocks normally,
# then half of the fourth file, signals, and hangs until killed.
_HANGING_SERVER = textwrap.dedent("""
    import os, sys, time
    from omlx_core.plugins.ssd_cache import writer

    real = writer.write_payload
    written = []

    def write_then_hang(payload, path):
        if len(written) < 3:
            written.append(path)
            return real(payload, path)
        real(payload, path)
        data = open(path, "rb").read()
        with open(path, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
        open(os.environ["HANG_MARKER"], "w").close()
        time.sleep(3600)

    writer.write_payload = write_then_hang
    from omlx_core.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _serve_argv(port: int, ssd_dir: Path, python_prefix: list[str]) -> list[str]:
    return python_prefix + ["--log-level", "WARNING", "serve", "--tier", "cpu-small",
                            "--port", str(port), "--set", f"plugin.ssd_cache.dir={ssd_dir}"]


def _ask(port: int, text: str):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                           timeout=300)
    return client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16,
                                          temperature=0, messages=[{"role": "user", "content": text}])


@pytest.mark.slow
def test_server_killed_mid_write_restarts_serving_only_intact_blocks(default_model_dir, tmp_path):
    ssd_dir = tmp_path / "ssd"
    marker = tmp_path / "hanging"
    script = tmp_path / "hanging_server.py"
    script.write_text(_HANGING_SERVER)
    text = "Summarize the following notes. " + " ".join(
        f"Note {i}: the {['red', 'green', 'blue'][i % 3]} lamp in room {i} was checked." for i in range(40))

    port = free_port()
    os.environ["HANG_MARKER"] = str(marker)
    try:
        spec = ServerSpec("omlx", "omlx-core serve (writer hangs mid-file)",
                          _serve_argv(port, ssd_dir, [sys.executable, str(script)]), model_id="")
        with ServerProcess(spec, port) as server:
            reference = _ask(port, text)
            assert reference.usage.prompt_tokens > 5 * 64
            assert wait_for(marker.exists, 60), server.log_tail()
            os.kill(server.pid, signal.SIGKILL)
            server.process.wait(30)
    finally:
        os.environ.pop("HANG_MARKER", None)

    (model_dir,) = [d for d in ssd_dir.iterdir() if d.is_dir()]
    blocks_dir = model_dir / "blocks"
    assert len(list(blocks_dir.glob("*.tmp"))) == 1  # the write the kill interrupted
    intact = sorted(blocks_dir.glob("*.safetensors"))
    assert len(intact) == 3
    # And a torn file under its final name (a disk that lost the tail): must be skipped too.
    from omlx_core.plugins.ssd_cache.blockfile import read_metadata

    last = max(intact, key=lambda p: int(read_metadata(p)["index"]))  # the deepest block
    last.write_bytes(last.read_bytes()[:-4096])

    port = free_port()
    spec = ServerSpec("omlx", "omlx-core serve", _serve_argv(port, ssd_dir, [sys.executable, "-m", "omlx_core"]),
                      model_id="")
    with ServerProcess(spec, port):
        # The rebuilt index holds the two intact blocks: the temp file and the torn one went.
        assert metric_value(port, "omlx_engine_prefix_cache_lower_blocks") == 2
        assert list(blocks_dir.glob("*.tmp")) == []
        again = _ask(port, text)
        assert metric_value(port, "omlx_engine_prefix_cache_lower_errors") == 0
    # Only the two intact blocks at the front of the prompt were served from disk.
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * 64
    assert again.choices[0].message.content == reference.choices[0].message.content


# -- on by default ----------------------------------------------------------------------------------


def test_every_shipped_tier_keeps_the_ssd_cache_under_the_cache_root(monkeypatch, tmp_path):
    from omlx_core.config.loader import tier_names

    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path))
    for tier in tier_names():
        config = load_config(tier, plugin_settings=build_plugin_manager().settings(), env={})
        assert config["plugin.ssd_cache.dir"] == "auto", tier
        assert ssd_cache.ssd_directory(config) == tmp_path / "ssd", tier
    off = load_config("cpu-small", overrides=[("plugin.ssd_cache.dir", "", "test")],
                      plugin_settings=build_plugin_manager().settings(), env={})
    assert ssd_cache.ssd_directory(off) is None


def test_a_default_directory_another_server_holds_turns_the_tier_off_not_the_server(
        tiny_model_path, tmp_path, monkeypatch, caplog):
    from omlx_core.plugins.ssd_cache.store import DirectoryInUseError, PagedSSDStore

    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path))
    path = tiny_model_path("llama")
    spec = spec_for_path(path)
    identity = ssd_cache.model_identity(path)
    import re
    held = tmp_path / "ssd" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', spec.id)}-{identity[:16]}"
    other_server = PagedSSDStore(held, identity=identity)  # not this process's store registry
    try:
        with caplog.at_level("WARNING"):
            served = Served(path, "auto")
        try:
            assert served.store is None and served.engine.prefix_cache._lower is None
            assert "serving without the SSD cache" in caplog.text
            tokens, last = served.run(prompt_for(served.engine, 20))
            assert last.finish_reason == "length" and tokens
        finally:
            served.stop()
        # A directory the operator named is theirs to fix: the server does not start.
        config = load_config("base", overrides=[("plugin.ssd_cache.dir", str(tmp_path / "ssd"), "test")],
                             plugin_settings=build_plugin_manager().settings(), env={})
        with pytest.raises(DirectoryInUseError, match="give each server its own"):
            ssd_cache.create_store(spec, config)
    finally:
        other_server.close()


def test_doctor_shows_the_ssd_cache(tmp_path, monkeypatch):
    from omlx_core.bootstrap import load_setup
    from omlx_core.platform.doctor import run_doctor

    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path))
    setup = load_setup("cpu-small")
    check = run_doctor(benchmark=False, plugins=setup.plugins, config=setup.config).check("ssd cache")
    assert check.status == "ok" and check.data["dir"] == str(tmp_path / "ssd")
    assert "budget auto" in check.detail and "free disk" in check.detail
    off = load_setup("cpu-small", overrides=[("plugin.ssd_cache.dir", "", "test")])
    check = run_doctor(benchmark=False, plugins=off.plugins, config=off.config).check("ssd cache")
    assert check.detail.startswith("off") and check.data == {"enabled": False}
