"""How the prefill planner cuts a prompt's chunks at the request's cache points, for a
model whose layers keep their state only where a chunk ends (``needs_boundaries``)."""

from __future__ import annotations

from types import SimpleNamespace

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.scheduling import PrefixCache, new_sequence
from omlx_core.scheduling.extensions import TokenInputs
from omlx_core.scheduling.prefill_planner import PrefillPlanner

BLOCK = 64


def plan_of(prompt: int, step: int, points: tuple[int, ...], *, needs_boundaries: bool = True,
            prefilled: int = 0, budget: int = 1 << 20) -> list[tuple[int, int]]:
    sequence = new_sequence(GenerationRequest("r", list(range(1, prompt + 1)),
                                              SamplingParams(max_tokens=1), cache_points=points))
    sequence.prefilled = prefilled
    planner = PrefillPlanner(state=SimpleNamespace(prefilling=[sequence], decoding={}),
                             prefix_cache=PrefixCache(block_size=BLOCK, budget_bytes=budget),
                             layout=SimpleNamespace(needs_boundaries=needs_boundaries),
                             prefill_step_size=step, inputs=TokenInputs())
    return [(start, end) for _, start, end in planner.plan()]


def test_a_chunk_ends_at_each_cache_point_and_the_step_goes_on_after_it() -> None:
    # Points at 100 and 230 of a 400-token prompt (prefill target 399), a 512-token step:
    # cut at both, then at the last block boundary before the target (its state is kept).
    assert plan_of(400, 512, (100, 230)) == [(0, 100), (100, 230), (230, 384), (384, 399)]


def test_points_behind_a_restored_prefix_or_past_the_target_change_nothing() -> None:
    assert plan_of(400, 512, (50, 399, 450), prefilled=64) == plan_of(400, 512, (), prefilled=64)


def test_no_sliver_chunk_after_a_point_the_rest_of_the_budget_does_not_reach_a_block() -> None:
    # A 256-token step from token 10 with a point at 258: the 8 tokens left would end off
    # any block boundary, so the step stops at the point and the next resumes there.
    assert plan_of(1000, 256, (258,), prefilled=10) == [(10, 258)]
    assert plan_of(1000, 256, (258,), prefilled=258) == [(258, 512)]
    # What is left after a point may still end on a boundary (its state kept there).
    assert plan_of(1000, 256, (250,)) == [(0, 250), (250, 256)]


def test_points_are_ignored_where_state_can_be_cut_anywhere_or_nothing_is_cached() -> None:
    assert plan_of(400, 512, (100,), needs_boundaries=False) == [(0, 399)]
    assert plan_of(400, 512, (100,), budget=0) == [(0, 399)]
