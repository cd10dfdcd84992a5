"""Rank 0 judges admission and the forward gate against the tightest rank: the
arithmetic of :func:`judged_limits` on hand-built readings, fed to the real admission
ledger and forward gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omlx_core.memory.admission import AdmissionQueue
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.gate import PrefillChunk, PrefillStep
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, PeakEstimate, RequestRejected
from omlx_core.memory.usage import MemoryUsage
from omlx_core.plugins.distributed.rank_memory import RankMemory, RankMemoryBoard, judged_limits

MIB = 1 << 20
MARGIN = 64 * MIB
WATERMARK = 0.95


def rank0(hard: int = 1000 * MIB, in_use: int = 300 * MIB, baseline: int = 200 * MIB) -> LimitSnapshot:
    return LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(static=hard),
                         in_use_bytes=in_use, baseline_bytes=baseline, margin_bytes=MARGIN)


def other(rank: int, hard: int | None, in_use: int, baseline: int) -> RankMemory:
    return RankMemory(rank=rank, hard_bytes=hard, baseline_bytes=baseline, in_use_bytes=in_use,
                      binding="custom", margin_bytes=MARGIN, admit_watermark=WATERMARK)


def ledger() -> AdmissionQueue:
    return AdmissionQueue(4, 0.0, WATERMARK, margin_bytes=MARGIN)


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
    where = judged.breakdown.elsewhere
    assert "rank 1 of 3" in where and "binds admission" in where
    assert "rank 2 of 3" in where and "binds the forward gate" in where


def test_admission_refuses_next_to_a_running_request_naming_the_tight_rank() -> None:
    judged = judged_limits(rank0(), WATERMARK, [other(1, 600 * MIB, 400 * MIB, 300 * MIB)], 2)
    queue = ledger()
    queue.update(judged)
    running = queue.admit("a", 150 * MIB)
    with pytest.raises(RequestRejected) as refused:
        queue.admit("b", 100 * MIB)  # 250 MiB > rank 1's 206 MiB (rank 0 alone: 686)
    assert refused.value.stage == "admission"
    assert "on rank 1 of 2, whose custom ceiling (600.00 MiB" in str(refused.value)
    running.release()
    assert queue.admit("b", 100 * MIB) is not None  # alone it runs
    # Model loads and unloads still count on top of the baseline.
    queue.claim("load")
    queue.end_claim("load", 50 * MIB)
    assert queue.budget_bytes(judged) == 156 * MIB


def test_the_forward_gate_refuses_what_only_rank_0_has_room_for() -> None:
    judged = judged_limits(rank0(), WATERMARK, [other(1, 600 * MIB, 400 * MIB, 300 * MIB)], 2)
    usage = MemoryUsage(read_active=lambda: 300 * MIB, read_footprint=lambda: 0)
    gate = PrefillForwardGate(lambda q: PeakEstimate(transient_bytes=q.new_tokens * MIB,
                                                     kv_bytes_per_token=0),
                              usage, MARGIN)

    def step(tokens: int, limits: LimitSnapshot) -> PrefillStep:
        return PrefillStep(model_id="m", chunks=(PrefillChunk("r", tokens, 0, tokens),),
                           decoding=0, chunk_size=512, limits=limits)

    assert gate.check_prefill(step(130, judged)) == {}  # 130 MiB ≤ rank 1's 136 MiB
    refused = gate.check_prefill(step(140, judged))["r"]
    assert refused.stage == "forward"
    assert "on rank 1 of 2, whose custom ceiling (600.00 MiB" in str(refused)
    assert gate.check_prefill(step(140, rank0())) == {}  # rank 0 alone has room for it


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
