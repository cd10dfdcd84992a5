"""Rank 0 judges admission and the forward gate against the tightest rank: the
arithmetic of :func:`judged_limits` on hand-built readings, fed to the real admission
ledger and forward gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omlx_core.http.errors import rejection_error
from omlx_core.memory.admission import AdmissionQueue
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.gate import PrefillChunk, PrefillStep
from omlx_core.memory.types import (
    CeilingBreakdown,
    LimitSnapshot,
    PeakEstimate,
    PreflightRequest,
    RequestRejected,
)
from omlx_core.memory.usage import MemoryUsage
from omlx_core.pluginmanager import PluginManager
from omlx_core.plugins import advice as advice_plugin
from omlx_core.plugins import distributed as distributed_plugin
from omlx_core.plugins.distributed.rank_memory import (
    BOARDS,
    RankMemory,
    RankMemoryBoard,
    _decode,
    _encode,
    judged_limits,
)

MIB = 1 << 20
MARGIN = 64 * MIB
WATERMARK = 0.95


def rank0(hard: int = 1000 * MIB, in_use: int = 300 * MIB, baseline: int = 200 * MIB) -> LimitSnapshot:
    return LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(static=hard),
                         in_use_bytes=in_use, baseline_bytes=baseline, margin_bytes=MARGIN)


def other(rank: int, hard: int | None, in_use: int, baseline: int) -> RankMemory:
    # A pinned ceiling under a roomier static one, on a 4 GiB machine.
    ceilings = CeilingBreakdown(static=3000 * MIB, custom=hard, tier="custom", total_ram=4096 * MIB)
    return RankMemory(rank=rank, hard_bytes=hard, baseline_bytes=baseline, in_use_bytes=in_use,
                      breakdown=ceilings, margin_bytes=MARGIN, admit_watermark=WATERMARK)


def ledger() -> AdmissionQueue:
    return AdmissionQueue(4, 0.0, WATERMARK, margin_bytes=MARGIN)


def advise(error: RequestRejected) -> RequestRejected:
    """``error`` with the built-in advice ladder's advice (as the guard adds it)."""
    plugins = PluginManager()
    plugins.register(advice_plugin, "advice")
    return error.with_advice([a for a in plugins.hook.on_rejection(rejection=error.rejection) if a])


def rank_1_binds(error: RequestRejected) -> tuple[dict, str]:
    """The refusal's error body, after checking that its structured parts name rank 1's
    pinned ceiling, not rank 0's static one; and its advice."""
    body = rejection_error(error).extra
    assert body["binding_ceiling"] == "custom" and body["binding_rank"] == 1, body
    assert body["ceilings"] == {"static": 3000 * MIB, "custom": 600 * MIB}, body
    [advice] = body["advice"]
    assert advice.startswith("Rank 1's pinned ceiling (600.00 MiB, memory.custom_ceiling) binds")
    assert "static ceiling" not in advice and "1000.00 MiB" not in advice, advice
    assert "rank 1's other ceilings allow up to 2.93 GiB" in advice, advice
    assert "over more than 2 ranks" in advice, advice
    return body, advice


def test_the_tightest_rank_sets_the_forward_limit_and_the_admission_budget() -> None:
    own = rank0()
    readings = [other(0, 5000 * MIB, 0, 0),  # rank 0's gathered row: its fresh snapshot counts
                other(1, 600 * MIB, 400 * MIB, 300 * MIB),
                other(2, None, 900 * MIB, 900 * MIB)]  # no limit there
    judged = judged_limits(own, WATERMARK, readings, 3)
    # Forward: rank 1 has 600 - 400 - 64 = 136 MiB of room, rank 0 636 MiB: rank 0's
    # use (300) + margin (64) + the tightest room (136).
    assert judged.hard_bytes == 500 * MIB
    # Admission: rank 1's budget 0.95 × 600 - 300 - 64 = 206 MiB, rank 0's 686 MiB.
    assert ledger().budget_bytes(judged) == 206 * MIB
    assert ledger().budget_bytes(own) == 686 * MIB
    assert judged.margin_bytes == MARGIN and judged.in_use_bytes == own.in_use_bytes
    assert "on rank 1 of 3, whose custom ceiling (600.00 MiB" in judged.breakdown.elsewhere
    assert "binds admission and the forward gate" in judged.breakdown.elsewhere


def test_rank_0_judges_by_its_own_limits_when_it_is_the_tightest() -> None:
    own = rank0(hard=600 * MIB, in_use=500 * MIB)
    assert judged_limits(own, WATERMARK, [other(1, 4000 * MIB, 500 * MIB, 200 * MIB)], 2) is None
    assert judged_limits(own, WATERMARK, [], 1) is None


def test_different_ranks_may_bind_admission_and_the_forward_gate() -> None:
    own = rank0()
    # Rank 1: little idle room (its baseline), plenty free now; rank 2 the reverse.
    readings = [other(1, 700 * MIB, 100 * MIB, 500 * MIB), other(2, 2000 * MIB, 1800 * MIB, 200 * MIB)]
    judged = judged_limits(own, WATERMARK, readings, 3)
    assert judged.hard_bytes == own.in_use_bytes + MARGIN + (2000 - 1800) * MIB - MARGIN
    assert ledger().budget_bytes(judged) == int(700 * MIB * WATERMARK) - 500 * MIB - MARGIN
    # Each stage's refusals name the rank that binds it, and that rank's ceilings.
    admission, forward = judged.breakdown_at("admission"), judged.breakdown_at("forward")
    assert "on rank 1 of 3" in admission.elsewhere and "binds admission" in admission.elsewhere
    assert (admission.rank, admission.custom) == (1, 700 * MIB)
    assert "on rank 2 of 3" in forward.elsewhere and "binds the forward gate" in forward.elsewhere
    assert (forward.rank, forward.custom) == (2, 2000 * MIB)


def test_where_only_another_rank_binds_the_forward_gate_admission_stays_rank_0s() -> None:
    own = rank0()
    judged = judged_limits(own, WATERMARK, [other(1, 2000 * MIB, 1800 * MIB, 200 * MIB)], 2)
    assert judged.breakdown == own.breakdown  # rank 0's own static ceiling binds admission
    assert judged.binding_at("admission") == "static"
    assert judged.breakdown_at("forward").rank == 1
    assert judged.binding_at("forward") == "custom"
    # The forward gate's refusal names rank 1's ceiling (136 MiB of room there).
    refused = forward_gate().check_prefill(step(140, judged))["r"]
    body = rejection_error(refused).extra
    assert (body["binding_ceiling"], body["binding_rank"]) == ("custom", 1), body
    assert body["advice"][0].startswith("Rank 1's pinned ceiling (1.95 GiB"), body["advice"]


def test_admission_refuses_next_to_a_running_request_naming_the_tight_rank() -> None:
    judged = judged_limits(rank0(), WATERMARK, [other(1, 600 * MIB, 400 * MIB, 300 * MIB)], 2)
    queue = ledger()
    queue.update(judged)
    running = queue.admit("a", 150 * MIB)
    with pytest.raises(RequestRejected) as refused:
        queue.admit("b", 100 * MIB)  # 250 MiB > rank 1's 206 MiB (rank 0 alone: 686)
    assert refused.value.stage == "admission"
    assert "on rank 1 of 2, whose custom ceiling (600.00 MiB" in str(refused.value)
    _, advice = rank_1_binds(advise(refused.value))
    # How far rank 1's ceiling must rise is its budget's business, not in these figures.
    assert "raise it (a larger serve --memory-ceiling on rank 1)" in advice, advice
    running.release()
    assert queue.admit("b", 100 * MIB) is not None  # alone it runs
    # Model loads and unloads still count on top of the baseline.
    queue.claim("load")
    queue.end_claim("load", 50 * MIB)
    assert queue.budget_bytes(judged) == 156 * MIB


def forward_gate() -> PrefillForwardGate:
    """A forward gate reading 300 MiB in use on rank 0, its estimate 1 MiB a token."""
    usage = MemoryUsage(read_active=lambda: 300 * MIB, read_footprint=lambda: 0)
    plugins = PluginManager()
    plugins.register(advice_plugin, "advice")
    return PrefillForwardGate(lambda q: PeakEstimate(transient_bytes=q.new_tokens * MIB,
                                                     kv_bytes_per_token=0),
                              usage, MARGIN, lambda r: plugins.hook.on_rejection(rejection=r))


def step(tokens: int, limits: LimitSnapshot) -> PrefillStep:
    return PrefillStep(model_id="m", chunks=(PrefillChunk("r", tokens, 0, tokens),),
                       decoding=0, chunk_size=512, limits=limits)


def test_the_forward_gate_refuses_what_only_rank_0_has_room_for() -> None:
    judged = judged_limits(rank0(), WATERMARK, [other(1, 600 * MIB, 400 * MIB, 300 * MIB)], 2)
    gate = forward_gate()
    assert gate.check_prefill(step(130, judged)) == {}  # 130 MiB ≤ rank 1's 136 MiB
    refused = gate.check_prefill(step(140, judged))["r"]
    assert refused.stage == "forward"
    assert "on rank 1 of 2, whose custom ceiling (600.00 MiB" in str(refused)
    _, advice = rank_1_binds(refused)
    # Rank 1 has 400 MiB in use and needs 140 + 64 MiB more: 604 MiB, + 10 % (rounded up).
    assert "to at least 768.00 MiB (serve --memory-ceiling 768MiB on rank 1)" in advice, advice
    assert gate.check_prefill(step(140, rank0())) == {}  # rank 0 alone has room for it


def test_preflight_refuses_what_can_never_fit_on_rank_1_naming_its_ceiling() -> None:
    board = RankMemoryBoard(SimpleNamespace(leader=True, size=2), "tensor", 2, WATERMARK)
    board.ranks = [other(0, 5000 * MIB, 0, 0), other(1, 600 * MIB, 300 * MIB, 300 * MIB)]
    BOARDS["m"] = board
    try:
        request = PreflightRequest(request_id="r", model_id="m", prompt_tokens=100,
                                   cached_tokens=0, chunk_size=512, estimated_bytes=400 * MIB,
                                   limits=rank0(), margin_bytes=MARGIN)
        with pytest.raises(RequestRejected) as refused:
            distributed_plugin.preflight(request)
    finally:
        BOARDS.pop("m", None)
    assert refused.value.stage == "preflight" and not refused.value.retryable
    assert "(on rank 1 of 2, whose custom ceiling binds there)" in str(refused.value)
    body, advice = rank_1_binds(advise(refused.value))
    assert body["limit_bytes"] == 600 * MIB and body["base_bytes"] == 300 * MIB
    # 300 MiB idle + 400 MiB + 64 MiB margin = 764 MiB there, + 10 % (rounded up).
    assert "to at least 1.00 GiB (serve --memory-ceiling 1GiB on rank 1)" in advice, advice


def test_a_ranks_ceilings_cross_the_gather() -> None:
    ceilings = CeilingBreakdown(static=30 << 30, dynamic=28 << 30, device=24 << 30,
                                custom=None, tier="aggressive", total_ram=32 << 30,
                                reclaimable=9 << 30, device_kind="metal")
    snapshot = LimitSnapshot(hard_bytes=24 << 30, breakdown=ceilings, in_use_bytes=5 << 30,
                             baseline_bytes=4 << 30, margin_bytes=MARGIN)
    row = _encode(snapshot, 0.9)
    import numpy as np

    reading = _decode(1, [float(v) for v in np.asarray(row, dtype=np.float32)])  # as sent
    assert reading.breakdown == ceilings and reading.binding == "device"
    assert (reading.hard_bytes, reading.in_use_bytes, reading.baseline_bytes,
            reading.margin_bytes) == (24 << 30, 5 << 30, 4 << 30, MARGIN)
    assert reading.admit_watermark == pytest.approx(0.9)
    assert len(_encode(None, 0.9)) == len(row)  # every rank sends rows of one length
    assert _decode(2, _encode(None, 0.9)).hard_bytes is None


def test_a_follower_sends_the_baseline_of_a_poll_no_request_ran_through() -> None:
    """A follower's ledger never holds a request, so its guard reads every poll as idle:
    the board keeps the baseline of the last poll read while nothing ran there (between
    two observations that saw nothing running and no sequence started)."""
    activity = {"started": 0, "running": False}
    board = RankMemoryBoard(SimpleNamespace(leader=False), "tensor", 2, WATERMARK,
                            activity=lambda: (activity["started"], activity["running"]))

    def observed(baseline: int) -> int:
        board.observe(rank0(baseline=baseline))
        return board.own.baseline_bytes

    assert observed(200 * MIB) == 200 * MIB  # the first reading, at start
    assert observed(205 * MIB) == 205 * MIB  # read while nothing ran
    activity.update(started=1, running=True)
    assert observed(260 * MIB) == 205 * MIB  # the running request's KV and transients
    activity.update(running=False)
    assert observed(240 * MIB) == 205 * MIB  # read while it still ran
    assert observed(210 * MIB) == 210 * MIB  # idle since the last observation
    activity.update(started=2)  # one started and ended between two observations
    assert observed(250 * MIB) == 210 * MIB
    assert observed(212 * MIB) == 212 * MIB
    # Rank 0's own guard reads its baseline only while its ledger is idle: passed on.
    leader = RankMemoryBoard(SimpleNamespace(leader=True), "tensor", 2, WATERMARK,
                             activity=lambda: (3, True))
    leader.observe(rank0(baseline=260 * MIB))
    assert leader.own.baseline_bytes == 260 * MIB
