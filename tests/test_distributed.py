"""One model served by two ranks on loopback (``mx.distributed`` ring on the CPU):
the same greedy tokens as one process, streaming, cancellation, and a rank killed
mid-stream. The tests that start a group of servers are slow."""

from __future__ import annotations

import signal
import time

import pytest

from distributed_group import RankGroup
from omlx_core.testing import cached_model

PROMPT = {"model": "llama-seed0", "prompt": "The quick brown fox", "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 4 attention heads and 2 KV heads: both divide by 2 ranks.
    return cached_model("llama", 0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def group(tmp_path_factory, model_dir):
    group = RankGroup(tmp_path_factory.mktemp("group"), model_dir, 2)
    yield group
    group.close()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, model_dir):
    """The same model served by the plain batched engine in one process."""
    group = RankGroup.single(tmp_path_factory.mktemp("single"), model_dir)
    yield group
    group.close()


def _wait_idle(group: RankGroup) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = group.health()
        engine = health["engines"]["llama-seed0"]
        if health["in_flight"] == 0 and engine["running"] == 0 and engine["prefilling"] == 0:
            return health
        time.sleep(0.1)
    raise AssertionError(f"requests still running: {health}")


@pytest.mark.slow
def test_two_ranks_give_the_greedy_tokens_of_one_process(group, one_process) -> None:
    for prompt in ("The quick brown fox", "hello world, hello", "a"):
        body = {**PROMPT, "prompt": prompt, "max_tokens": 24, "logprobs": 0}
        status, sharded = group.post("/v1/completions", body)
        assert status == 200, sharded
        status, single = one_process.post("/v1/completions", body)
        assert status == 200, single
        assert sharded["choices"][0]["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
        assert sharded["choices"][0]["text"] == single["choices"][0]["text"]
        assert sharded["usage"]["completion_tokens"] == 24
    engine = group.health()["engines"]["llama-seed0"]
    assert engine["distributed_ranks"] == 2 and engine["distributed_mode"] == "tensor"


@pytest.mark.slow
def test_concurrent_requests_batch_identically_on_both_ranks(group, one_process) -> None:
    import concurrent.futures

    bodies = [{**PROMPT, "prompt": f"story number {i}", "max_tokens": 12} for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        sharded = list(pool.map(lambda b: group.post("/v1/completions", b), bodies))
    for body, (status, result) in zip(bodies, sharded):
        assert status == 200, result
        _, single = one_process.post("/v1/completions", body)
        assert result["choices"][0]["text"] == single["choices"][0]["text"]


@pytest.mark.slow
def test_streaming_matches_the_whole_response(group) -> None:
    body = {**PROMPT, "max_tokens": 16}
    _, whole = group.post("/v1/completions", body)
    response, events = group.stream("/v1/completions", body)
    with response:
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == whole["choices"][0]["text"]


@pytest.mark.slow
def test_a_cancelled_stream_leaves_the_ranks_in_step(group) -> None:
    response, events = group.stream("/v1/completions", {**PROMPT, "max_tokens": 3000})
    first = next(events)
    assert first["choices"][0]["text"] is not None
    response.close()
    health = _wait_idle(group)
    assert health["engines"]["llama-seed0"]["finished_abort"] >= 1, health
    # Both ranks still take the same steps: the next request completes.
    status, result = group.post("/v1/completions", {**PROMPT, "max_tokens": 8})
    assert status == 200 and result["usage"]["completion_tokens"] == 8, result


@pytest.mark.slow
def test_a_request_that_cannot_fit_on_one_rank_gets_a_413_naming_it(tmp_path, model_dir) -> None:
    # Rank 1's ceiling sits below what it already holds: nothing can ever fit there,
    # while rank 0 (no ceiling of its own) would serve the request.
    group = RankGroup(tmp_path, model_dir, 2, rank_extra={1: ["--memory-ceiling", "64MiB"]})
    try:
        deadline = time.monotonic() + 60
        while True:
            status, body = group.post("/v1/completions", {**PROMPT, "max_tokens": 8})
            if status == 413 or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # rank 1's reading reaches rank 0 with the next step
        assert status == 413, body
        assert "on rank 1 of 2, whose custom ceiling binds there" in body["error"]["message"], body
        assert body["error"]["code"] == "prefill_memory_exceeded"
        # The structured parts name rank 1's ceiling too, and the advice its knob.
        error = body["error"]
        assert (error["binding_ceiling"], error["binding_rank"]) == ("custom", 1), body
        assert error["ceilings"]["custom"] == 64 << 20, body
        assert error["advice"][0].startswith("Rank 1's pinned ceiling (64.00 MiB"), body
        assert "on rank 1)" in error["advice"][0], body
    finally:
        group.close()


LONG = {**PROMPT, "prompt": " ".join(["fox"] * 1000)}  # 3000 tokens


def _readings(group: RankGroup) -> list[dict]:
    """Every rank's latest memory reading on rank 0's ``/health``, once both came."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = group.health()["engines"]["llama-seed0"].get("distributed_memory") or []
        if len(rows) == 2:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"rank 0's /health lists no reading of every rank: {group.health()}")


def _second_next_to_first(group: RankGroup) -> tuple[int, dict, int]:
    """A long request (streamed) and, once it runs, a second one: the second's answer
    and the first's per-rank reservation (rank 0's ledger)."""
    response, events = group.stream("/v1/completions", {**LONG, "max_tokens": 1000})
    with response:
        next(events)  # the first runs (about 3 s of decode left)
        reserved = group.health()["memory"]["admission_reserved_bytes"]
        status, body = group.post("/v1/completions", {**LONG, "max_tokens": 8})
        list(events)
    return status, body, reserved


@pytest.mark.slow
def test_rank_0_refuses_a_second_request_that_only_rank_1_has_no_room_for(tmp_path, model_dir) -> None:
    """End to end, rank 0's admission judges against the tightest rank. Without a ceiling
    of rank 1's, two long requests run at once. Then rank 1's ceiling is sized from what
    that group measured (rank 1's idle baseline and margin, the first request's per-rank
    reservation) so that its admission budget holds 1.5 such requests: the second one
    (in one padded decode batch the two cost twice the larger) is refused at once
    (``queue_timeout_s=0``) with a 503 naming rank 1, though rank 0 alone has room;
    alone it is served."""
    no_wait = ["--set", "memory.queue_timeout_s=0"]
    (tmp_path / "roomy").mkdir(), (tmp_path / "tight").mkdir()
    roomy = RankGroup(tmp_path / "roomy", model_dir, 2, extra=no_wait)
    try:
        rank1 = _readings(roomy)[1]
        status, body, reserved = _second_next_to_first(roomy)
        assert status == 200, body
    finally:
        roomy.close()
    assert 4 << 20 < reserved < 64 << 20, reserved  # tens of MiB: baselines drift by a few
    watermark = 0.95
    mib = int((rank1["baseline_bytes"] + rank1["margin_bytes"] + 1.5 * reserved) / watermark) >> 20
    tight = RankGroup(tmp_path / "tight", model_dir, 2, extra=no_wait, rank_extra={1: [
        "--memory-ceiling", f"{mib}MiB",
        "--set", f"memory.tiers.custom.admit_watermark={watermark}"]})
    try:
        assert _readings(tight)[1]["hard_limit_bytes"] == mib << 20
        # Rank 1's reading reaches rank 0's admission at rank 0's next memory poll after
        # a step: until then rank 0 judges by its own limits alone.
        deadline = time.monotonic() + 60
        while True:
            status, body, _ = _second_next_to_first(tight)
            if status != 200 or time.monotonic() > deadline:
                break
        assert status == 503, (body, tight.output())
        assert body["error"]["code"] == "admission_queue_timeout", body
        message = body["error"]["message"]
        assert "on rank 1 of 2, whose custom ceiling" in message, message
        assert "which binds admission" in message, message
        error = body["error"]
        assert (error["binding_ceiling"], error["binding_rank"]) == ("custom", 1), body
        assert "Rank 1's pinned ceiling" in error["advice"][-1], body
        status, body = tight.post("/v1/completions", {**LONG, "max_tokens": 8})
        assert status == 200, (body, tight.output())  # alone it fits
    finally:
        tight.close()


def test_the_estimate_is_one_ranks_share_of_the_kv_cache() -> None:
    from omlx_core.memory.types import PeakEstimate
    from omlx_core.plugins.distributed.rank_memory import per_rank_estimate

    whole = PeakEstimate(transient_bytes=1000, kv_bytes_per_token=64, kv_bytes=6400)
    half = per_rank_estimate(whole, 0.5)
    assert (half.kv_bytes, half.kv_bytes_per_token, half.transient_bytes) == (3200, 32, 1000)


@pytest.mark.slow
def test_a_refused_split_names_what_would_work(tmp_path, model_dir) -> None:
    with pytest.raises(AssertionError) as failed:
        RankGroup(tmp_path, model_dir, 3, ready_timeout_s=120)
    assert ("4 attention heads, 2 KV heads do not divide by 3 ranks: use 2 ranks, or "
            "--distributed pipeline") in str(failed.value)


@pytest.mark.slow
def test_a_killed_rank_ends_the_stream_with_an_error_and_the_group_exits(tmp_path, model_dir) -> None:
    group = RankGroup(tmp_path, model_dir, 2, extra=["--set", "plugin.distributed.exit_after_s=20"])
    try:
        response, events = group.stream("/v1/completions", {**PROMPT, "max_tokens": 4000})
        with response:
            next(events)
            group.processes[1].send_signal(signal.SIGKILL)
            rest = list(events)
        errors = [e["error"] for e in rest if "error" in e]
        assert errors, (rest[-3:], group.output())
        assert "rank 1" in errors[-1]["message"] or "peer" in errors[-1]["message"], errors
        engine = group.health()["engines"]["llama-seed0"]
        assert "rank 1" in engine["distributed_error"], (engine, group.output())
        status, refused = group.post("/v1/completions", {**PROMPT, "max_tokens": 4})
        assert status == 503, (refused, group.output())
        assert "distributed group serving this model is dead" in refused["error"]["message"]
        assert group.processes[0].wait(timeout=120) == 75, group.output()
    finally:
        group.close()


@pytest.mark.slow
def test_a_hung_rank_ends_the_stream_with_an_error_and_rank_0_exits(tmp_path, model_dir) -> None:
    """A rank stopped (SIGSTOP) mid-stream: rank 0's collective never returns, and the
    rank's heartbeats stop. The group is declared dead within the liveness timeout: the
    stream ends with an in-band error naming the rank, and rank 0 exits with 75 (not the
    GIL-free backstop's 1, which a thread frozen behind the collective would leave)."""
    group = RankGroup(tmp_path, model_dir, 2, extra=[
        "--set", "plugin.distributed.liveness_timeout_s=3",
        "--set", "plugin.distributed.exit_after_s=2"])
    try:
        response, events = group.stream("/v1/completions", {**PROMPT, "max_tokens": 4000}, timeout=300)
        with response:
            next(events)
            group.processes[1].send_signal(signal.SIGSTOP)
            rest = list(events)
        errors = [e["error"] for e in rest if "error" in e]
        code = group.processes[0].wait(timeout=120)
        log = group.logs[0].read_text(errors="replace")
        assert errors, (rest[-3:], log[-3000:])
        assert "rank 1 did not answer" in errors[-1]["message"], errors
        assert code == 75, log[-3000:]
    finally:
        group.processes[1].send_signal(signal.SIGCONT)
        group.close()


@pytest.mark.slow
def test_pipeline_split_gives_the_greedy_tokens_of_one_process(tmp_path_factory) -> None:
    model = cached_model("qwen3_next", 0, cache_dir=tmp_path_factory.mktemp("qwen3next"))
    single = RankGroup.single(tmp_path_factory.mktemp("qwen3next-single"), model)
    group = RankGroup(tmp_path_factory.mktemp("qwen3next-group"), model, 2, mode="pipeline")
    try:
        body = {**PROMPT, "model": model.name, "max_tokens": 16}
        status, sharded = group.post("/v1/completions", body)
        assert status == 200, sharded
        _, whole = single.post("/v1/completions", body)
        assert sharded["choices"][0]["text"] == whole["choices"][0]["text"]
        assert group.health()["engines"][model.name]["distributed_mode"] == "pipeline"
    finally:
        group.close()
        single.close()
