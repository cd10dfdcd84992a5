"""Issue 24, item 5: the goodput mix under ``--memory-ceiling 0.9GiB`` never takes the
server's resident set over the ceiling: the peak is the kernel's high-water mark of the
server's resident set (``VmHWM``, reset after the warm-up), so no short spike between two
samples can hide, however fast the sampler runs on a loaded machine.

The server is started as the README starts it, plus the ceiling; the burst is
``benchmarks.ceiling``'s: twelve concurrent streaming chats on the default model
(200-, 800- and 1,800-token passages, two answers long enough to grow their KV past
what admission reserved). What it once went over by: 1.4 MiB (923 MiB), with mlx's
buffer cache filling the whole transient margin during long-context prefill chunks.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.ceiling import MIX, measure, reset_peak
from omlx_core.bench.client import special_token_ids
from omlx_core.bench.servers import ServerSettings
from omlx_core.config import load_config
from omlx_core.settings import parse_size

pytestmark = pytest.mark.slow

CEILING = "0.9GiB"
MIB = 2**20


@pytest.mark.timeout(1200)  # ~6 min on two loaded cores
def test_the_goodput_mix_stays_under_a_0_9_gib_ceiling_at_every_sample(default_model_dir):
    config = load_config(None)
    settings = ServerSettings.of_config(config)
    run = measure("ceiling", settings, default_model_dir, config["server.models"][0],
                  special_token_ids(default_model_dir), ["--memory-ceiling", CEILING])
    statuses = [outcome.status for outcome in run.outcomes]
    assert statuses == ["200"] * sum(count for *_, count in MIX), statuses
    # measure() resets the server's VmHWM after the warm-up; where the kernel allows that
    # (it does for this process), the peak it reports is the exact high-water mark.
    assert reset_peak(os.getpid()), "VmHWM cannot be reset here: the peak would only be sampled"
    assert run.rss_samples > 0
    ceiling = parse_size(CEILING)
    print(f"goodput mix under {CEILING}: peak RSS {(run.peak_bytes or 0) / MIB:.1f} MiB, "
          f"{run.rss_samples} samples in {run.wall_s:.1f} s, idle {(run.idle_bytes or 0) / MIB:.1f} MiB")
    assert run.peak_bytes is not None and run.peak_bytes < ceiling, (
        f"peak RSS {run.peak_bytes / MIB:.1f} MiB over the {ceiling / MIB:.1f} MiB ceiling")
