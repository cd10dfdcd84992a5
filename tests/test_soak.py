"""A short soak (issue 24, item 2): ``omlx-core serve --memory-ceiling 0.9GiB`` on the
default model takes about two minutes of mixed traffic on loopback (chats, completions,
tools and JSON, Anthropic, Responses, cancels, oversized prompts and bodies that must be
413, bad bodies that must be 400, slow senders and readers), and every verdict of
:mod:`omlx_core.bench.soak` must hold: no 5xx, no truncated 200, every refusal a fresh
server's, RSS under the ceiling at every sample, no drift, no growth in open files or
threads. ``python -m omlx_core.bench.soak`` runs the long one (30 minutes)."""

from __future__ import annotations

import pytest

from omlx_core.bench.soak import render, soak

pytestmark = pytest.mark.slow

TRAFFIC_S = 100
WARM_UP_S = 40


def test_a_short_soak_keeps_every_promise(default_model_dir) -> None:
    result = soak(TRAFFIC_S, "0.9GiB", warm_up=WARM_UP_S)
    report = render(result, [f"{TRAFFIC_S} s of traffic, warm-up {WARM_UP_S} s"])
    print(report)
    kinds = {outcome.kind for outcome in result.outcomes}
    assert {"chat", "oversized prompt", "bad body"} <= kinds, report
    assert result.replayed > 0, report
    failed = [check for check, ok in result.verdicts().items() if not ok]
    assert not failed, report
