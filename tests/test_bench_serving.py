"""`omlx-core bench --quick` against our own server on a tiny model: keeps the serving
benchmark's request mix, timing and report from rotting (mlx_lm.server is left out); and
the parts that make it fair: no logit_bias, decode rates apart from end-to-end ones,
medians of per-round ratios with their range, drafts from the usage, the
weight-streaming bound from the model's own weights."""

from __future__ import annotations

import math
import re

import pytest

from omlx_core.bench.bound import Bound, measure_bound, model_weights
from omlx_core.bench.client import StreamRecord, chat_body
from omlx_core.bench.phases import Drafts, Observations, batch_decode_rate
from omlx_core.bench.prompts import OPEN_ENDED, repeated_share
from omlx_core.bench.report import MLX_LM, OMLX, Metric, ServerRun, compare, render
from omlx_core.bench.servers import ServerSpec
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


def test_decode_rates_run_from_the_first_token_to_the_last():
    one = StreamRecord(started=10.0, chunk_times=[11.0, 11.5, 12.0, 13.0], completion_tokens=5,
                       finished=13.5)
    assert one.decode_rate == 2.0  # 4 tokens after the first, over 2 s
    assert one.end_to_end_rate == 5 / 3.5
    assert math.isnan(StreamRecord(started=0.0, chunk_times=[1.0], completion_tokens=1).decode_rate)
    other = StreamRecord(started=10.0, chunk_times=[12.0, 14.0], completion_tokens=3)
    assert batch_decode_rate([one, other]) == (4 + 2) / 3.0  # from 11.0 to 14.0


def test_a_comparison_sends_no_logit_bias():
    assert "logit_bias" not in chat_body("m", [{"role": "user", "content": "hi"}], 8)
    biased = chat_body("m", [{"role": "user", "content": "hi"}], 8, banned_token_ids=[2])
    assert biased["logit_bias"] == {"2": -100.0}


def test_the_prompt_set_holds_both_kinds_alike_and_repetition_is_measured():
    kinds = [p.kind for p in OPEN_ENDED]
    assert len(OPEN_ENDED) >= 16 and len({p.text for p in OPEN_ENDED}) == len(OPEN_ENDED)
    for n in (2, 8, 16):
        assert kinds[:n].count("question") == kinds[:n].count("story")
    assert repeated_share("a b c d e f g h") == 0.0
    assert repeated_share("a b c d a b c d a b c d") == pytest.approx(5 / 9)


def _spec(name: str) -> ServerSpec:
    return ServerSpec(name, name, ["serve"], "m")


def test_the_ratio_is_the_median_of_per_round_ratios_with_their_range():
    ours, theirs = ServerRun(_spec(OMLX)), ServerRun(_spec(MLX_LM))
    ours.rounds = [{"k": 10.0}, {"k": 12.0}, {"k": 30.0}]
    theirs.rounds = [{"k": 10.0}, {"k": 6.0}, {"k": 20.0}]
    metric = Metric("k", "a rate", True, target=1.2)
    assert compare(metric, ours, theirs) == (12.0, 10.0, [1.0, 2.0, 1.5])
    # Only METRICS rows are rendered: a row of a known key shows median, ratio and range.
    ours.rounds = [{"tps_16": 10.0}, {"tps_16": 12.0}, {"tps_16": 30.0}]
    theirs.rounds = [{"tps_16": 10.0}, {"tps_16": 6.0}, {"tps_16": 20.0}]
    report = render({OMLX: ours, MLX_LM: theirs}, ["- header"])
    row = next(line for line in report.splitlines()
               if line.startswith("| open-ended, 16 streams: tokens/s end to end |"))
    assert row.rstrip(" |").split(" | ")[2:7] == ["12.0", "10.0", "1.50", "1.00-2.00",
                                                 ">= 1.35x met"], row


def test_drafts_come_from_the_usage_and_answers_are_compared_round_by_round():
    drafts = Drafts()
    drafts.add(StreamRecord(started=0.0, completion_tokens=10, draft_tokens=6,
                            accepted_draft_tokens=4))
    drafts.add(StreamRecord(started=0.0, completion_tokens=7))
    assert (drafts.completion, drafts.drafted, drafts.accepted, drafts.unreported) == (17, 6, 4, 1)
    ours, theirs = ServerRun(_spec(OMLX)), ServerRun(_spec(MLX_LM))
    ours.observations = Observations(answers={(0, "1 stream", "p"): "same",
                                              (1, "1 stream", "p"): "differs"},
                                     drafts={"1 stream": drafts})
    theirs.observations = Observations(answers={(0, "1 stream", "p"): "same",
                                                (1, "1 stream", "p"): "other"})
    report = render({OMLX: ours, MLX_LM: theirs}, [])
    assert "- omlx: 1 stream 1/2" in report
    assert "- omlx: 1 stream: 17 tokens, 6 drafted, 4 accepted" in report


def test_the_bound_reads_every_weight_of_the_model():
    model_dir = cached_model("llama")
    weights = model_weights(model_dir)
    on_disk = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert weights.dtype == "F32" and weights.hidden_size > 0
    # the files hold the tensors and their JSON headers
    assert on_disk - 100_000 < weights.bytes <= on_disk


def test_the_bound_is_the_faster_way_to_multiply_on_this_machine():
    from omlx_core.bench.servers import preload_env
    from omlx_core.models.packed_linear import packed_bits

    weights = model_weights(cached_model("llama"))
    bound = Bound(weights, {"blas": {1: 0.040, 16: 0.060}, "packed": {1: 0.020, 16: 0.070}})
    described = bound.describe()  # the faster way counts, at each row count
    assert "in 20.0 ms (mlx's matmul (the BLAS) 40.0 ms, omlx-core's packed kernel 20.0 ms" in described
    assert "in 60.0 ms (mlx's matmul (the BLAS) 60.0 ms, omlx-core's packed kernel 70.0 ms" in described
    again = bound.faster(Bound(weights, {"blas": {1: 0.030, 16: 0.065}}))
    assert again.ways == {"blas": {1: 0.030, 16: 0.060}, "packed": {1: 0.020, 16: 0.070}}
    assert again.timed == 2 and again.describe().startswith("the fastest of 2 timings of ")
    measured = measure_bound(cached_model("llama"), [1, 4], preload_env())
    assert set(measured.ways) == ({"blas", "packed"} if packed_bits() else {"blas"})
    assert all(set(rows) == {1, 4} for rows in measured.ways.values())


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
        # (a loaded machine hands the client several chunks at once), and so may a share
        # of the weight-streaming bound (a tiny model's matmul is far faster than serving).
        assert ours != "-", f"{metric.label}: {ours}\n{report}"
        positive = metric.higher_is_better and metric.unit
        assert float(ours) > 0 if positive else float(ours) >= 0, metric.label
        assert theirs == "-"
    assert "BLAS mapped in the server process" in report
    assert "first request after ready:" in report and "weight-streaming bound" in report
    # The twin without speculation was started with the one override, and drafted nothing.
    assert "--set plugin.batched.speculation=false`" in report
    twin = next(line for line in report.splitlines()
                if line.startswith("- omlx-core serve") and "speculation off:" in line)
    assert "drafted" not in twin.replace("none drafted", ""), twin
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
