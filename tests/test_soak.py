"""A short soak (issue 24, item 2): ``omlx-core serve --memory-ceiling 0.9GiB`` on the
default model takes 100 s of mixed traffic on loopback (chats, completions, tools and
JSON, Anthropic, Responses, cancels, oversized prompts and bodies that must be 413, bad
bodies that must be 400, slow senders and readers), and every verdict of
:mod:`benchmarks.soak` must hold: no 5xx, no truncated 200, every refusal a fresh
server's, RSS under the ceiling at every sample (VmRSS 50 times a second, and VmHWM),
the quiet server's footprint less the caches it gives back on demand within 2 % of where
it was after the warm-up, no growth in open files or threads. ``python -m benchmarks.soak`` runs the long one (30 minutes)."""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakResult, render, soak

pytestmark = pytest.mark.slow

TRAFFIC_S = 100
WARM_UP_S = 40


@pytest.fixture(scope="module")
def short_soak(default_model_dir, tmp_path_factory) -> tuple[SoakResult, str]:
    # A fresh SSD-cache directory: the run does not depend on what earlier runs left.
    ssd_dir = tmp_path_factory.mktemp("ssd")
    result = soak(TRAFFIC_S, "0.9GiB", warm_up=WARM_UP_S,
                  server_args=["--set", f"plugin.ssd_cache.dir={ssd_dir}"])
    report = render(result, [f"{TRAFFIC_S} s of traffic, warm-up {WARM_UP_S} s"])
    print(report)
    return result, report


def test_a_short_soak_keeps_every_promise_on_answers_files_and_threads(short_soak) -> None:
    result, report = short_soak
    kinds = {outcome.kind for outcome in result.outcomes}
    assert {"chat", "oversized prompt", "bad body"} <= kinds, report
    assert result.replayed > 0, report
    failed = [check for check, ok in result.verdicts().items() if not ok]
    assert not failed, report
