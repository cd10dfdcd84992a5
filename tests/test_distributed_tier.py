"""The shipped ``cluster`` tier is a different plugin stack: it requires the distributed
plugin and leaves out what that does not support yet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omlx_core.bootstrap import load_setup
from omlx_core.pluginmanager import PluginError


def _listed(tier: str) -> dict[str, str]:
    result = subprocess.run([sys.executable, "-m", "omlx_core", "plugins", "--json", "--tier", tier],
                            capture_output=True, text=True, timeout=120,
                            env={"OMLX_NO_BLAS_REEXEC": "1", "PATH": "/usr/bin:/bin"})
    return {p["name"]: p["status"] for p in json.loads(result.stdout)}


def test_the_cluster_tier_loads_another_stack_than_a_single_machine_tier() -> None:
    cluster, single = _listed("cluster"), _listed("cpu-small")
    for name in ("ssd_cache", "dflash", "vlm"):
        assert cluster[name] == "disabled" and single[name] == "loaded", name
    for name in ("distributed", "batched", "estimator", "memory_guard"):
        assert cluster[name] == "loaded", name
    setup = load_setup("cluster")
    assert "distributed" in setup.config["plugins.required"]
    assert setup.config["plugin.batched.prefix_cache_budget"] == 0
    assert setup.config["plugin.distributed.mode"] == "tensor"


def test_the_cluster_tier_refuses_to_start_without_the_distributed_plugin() -> None:
    setup = load_setup("cluster", overrides=[("plugins.disabled", "distributed,ssd_cache,dflash,vlm",
                                              "test")])
    with pytest.raises(PluginError, match="distributed"):
        setup.plugins.require(sorted(setup.config["plugins.required"]))


@pytest.mark.parametrize("tier", ["cpu-small", "workstation-128gb", "cluster"])
def test_distributed_brings_the_cluster_tiers_stack_on_any_tier(tier) -> None:
    """`serve --distributed` without `--tier cluster` used to start with an SSD cache per
    rank (two lost its directory lock) and a prefix cache: now it serves with the
    cluster tier's stack, the tier's own choices kept."""
    from omlx_core.cli import distributed_stack

    overrides = [("plugins.disabled", "dflash", "test")]
    setup = load_setup(tier, overrides=overrides + distributed_stack(tier, [], overrides))
    loaded = {i.name for i in setup.plugins.list() if i.enabled and not i.error}
    assert {"distributed", "batched", "estimator", "memory_guard"} <= loaded
    assert not loaded & {"ssd_cache", "dflash", "vlm"}
    assert {"distributed", "batched", "estimator", "memory_guard"} <= set(
        setup.config["plugins.required"])
    assert setup.config["plugin.batched.prefix_cache_budget"] == 0
    assert "cluster tier" in setup.config.source("plugins.disabled")
