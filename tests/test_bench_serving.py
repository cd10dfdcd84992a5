"""`omlx-core bench --quick` against our own server on a tiny model: keeps the serving
benchmark's request mix, timing and report from rotting (mlx_lm.server is left out)."""

from __future__ import annotations

import math
import re

import pytest

from omlx_core.bench.client import StreamRecord
from omlx_core.bench.serving import METRICS, main, percentile
from omlx_core.testing import cached_model


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert math.isnan(percentile([], 95))


def test_stream_record_gaps_and_ttft():
    record = StreamRecord(started=10.0, chunk_times=[10.5, 10.75, 11.5])
    assert record.ttft == 0.5
    assert record.gaps == [0.25, 0.75]
    with pytest.raises(RuntimeError, match="no text"):
        StreamRecord(started=1.0).ttft


@pytest.mark.slow  # a real server and a bench run
def test_quick_bench_against_our_server_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.md"
    model_dir = cached_model("llama")

    assert main(["--quick", "--only", "omlx", "--model", str(model_dir), "--out", str(out)]) == 0

    report = out.read_text()
    assert report in capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in report.splitlines() if line.startswith("| ") and " | " in line}
    for metric in METRICS:
        ours, theirs = rows[metric.label][2], rows[metric.label][3]
        # Measured (a number, not "-"). A rate is above zero; a time may round to 0.000 s
        # (a loaded machine hands the client several chunks at once).
        assert ours != "-", f"{metric.label}: {ours}\n{report}"
        assert float(ours) > 0 if metric.higher_is_better else float(ours) >= 0, metric.label
        assert theirs == "-"
    assert "BLAS mapped in the server process" in report
    # The prefix phase really reused the shared system prompt: the repeat and the new
    # question reuse far more than the cold request (which shares only what earlier
    # requests' chat-template opening had in common with it).
    note = next(line for line in report.splitlines() if line.startswith("- shared prefix"))
    counts = {name: (int(total), int(cached)) for name, total, cached in re.findall(
        r"(cold|hit|new question|edit|follow-up) (\d+) prompt tokens \((\d+) cached\)", note)}
    assert set(counts) == {"cold", "hit", "new question", "edit", "follow-up"}, note
    cold_cached = counts["cold"][1]
    for name in ("hit", "new question", "edit", "follow-up"):
        assert counts[name][1] > cold_cached + 0.3 * counts[name][0], (name, note)
