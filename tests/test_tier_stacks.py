"""A tier's [plugins] table is the plugin stack: it decides what `omlx-core plugins`
lists as loaded and what the server loads, and a disabled plugin's settings tables are
ignored rather than errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.types import PeakEstimate
from omlx_core.testing import cached_model


def tier_file(tmp_path: Path, body: str, model_dir: Path | None = None) -> Path:
    path = tmp_path / "mine.toml"
    models = (f'\n[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n'
              if model_dir else "")
    path.write_text(body + models)
    return path


def plugins_listed(tier: Path) -> dict[str, str]:
    result = subprocess.run([sys.executable, "-m", "omlx_core", "plugins", "--json", "--tier",
                             str(tier)], capture_output=True, text=True, timeout=120,
                            env={"OMLX_NO_BLAS_REEXEC": "1", "PATH": "/usr/bin:/bin"})
    return {p["name"]: p["status"] for p in json.loads(result.stdout)}


def test_a_tier_that_disables_the_ssd_cache_loads_the_server_without_it(tmp_path) -> None:
    model_dir = cached_model("llama", 0, cache_dir=tmp_path / "models")
    # Every tier inherits [plugin.ssd_cache] from base.toml: the disabled plugin's table is ignored.
    tier = tier_file(tmp_path, 'base = ["workstation-128gb"]\n[plugins]\ndisabled = ["ssd_cache"]\n',
                     model_dir)
    assert plugins_listed(tier)["ssd_cache"] == "disabled"
    setup = load_setup(str(tier))
    assert "ssd_cache" not in setup.config.plugin_values
    context = start_engines(setup, progress=False)
    try:
        assert context.engines["tiny"].prefix_cache._lower is None
    finally:
        stop_engines(context)
    # The shipped tier itself loads it and puts the SSD tier behind the prefix cache.
    assert plugins_listed(Path("workstation-128gb"))["ssd_cache"] == "loaded"
    context = start_engines(load_setup(str(tier_file(tmp_path, 'base = ["workstation-128gb"]\n',
                                                     model_dir))), progress=False)
    try:
        assert context.engines["tiny"].prefix_cache._lower is not None
    finally:
        stop_engines(context)


class FlatEstimate:
    """A stand-in estimator: 1 KiB per token, whatever the model."""

    def __init__(self):
        self.asked = 0

    @hookimpl
    def estimate_peak(self, query):
        self.asked += 1
        return PeakEstimate(transient_bytes=1024, kv_bytes_per_token=1024,
                            kv_bytes=query.new_tokens * 1024)


def test_a_tier_can_swap_the_estimator(tmp_path) -> None:
    model_dir = cached_model("llama", 0, cache_dir=tmp_path / "models")
    tier = tier_file(tmp_path, 'base = ["cpu-small"]\n[plugins]\ndisabled = ["estimator"]\n',
                     model_dir)
    assert plugins_listed(tier)["estimator"] == "disabled"
    setup = load_setup(str(tier))
    flat = FlatEstimate()
    setup.plugins.register(flat, "flat-estimator")
    context = start_engines(setup, progress=False)
    try:
        guard, engine = context.memory_guard, context.engines["tiny"]
        assert guard.estimate(guard.peak_query(engine, [1] * 100)).total == 100 * 1024 + 1024
        assert flat.asked >= 2  # the start-up check and this one: the built-in never answered
    finally:
        stop_engines(context)
