"""The decode latency budget on prefill chunks: while rows decode, a long prompt's
chunks are sized from the learned chunk cost so a step stays within the budget; when
nothing decodes they grow back to the prefill step; the forward gate sees every chunk,
and greedy outputs do not change."""

from __future__ import annotations

import math

from typing import Any

import pytest

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.memory.gate import DecodePlan, ForwardGate, PrefillStep
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.scheduling.batch_state import new_sequence
from omlx_core.scheduling.prefill_planner import MIN_CHUNK, ChunkCost
from omlx_core.scheduling.scheduler import Scheduler
from omlx_core.testing.models import cached_model

from tests.tiny_scheduler import tiny_scheduler

STEP = 128


class ChunkLog(ForwardGate):
    """Lets every chunk run and notes each one, with how many rows were decoding."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, int, int]] = []

    def check_prefill(self, step: PrefillStep) -> dict:
        self.chunks += [(c.request_id, c.new_tokens, step.decoding) for c in step.chunks]
        return {}

    def check_after_prefill(self, step: PrefillStep) -> dict:
        return {}

    def check_decode(self, step: Any) -> DecodePlan:
        return DecodePlan({row.request_id: 1 << 40 for row in step.rows})


def test_the_chunk_cost_model_recovers_the_cost_of_size_and_context() -> None:
    cost = ChunkCost()
    for start, tokens in [(0, 16), (0, 128), (512, 64), (2048, 32), (4096, 128), (1024, 256)] * 5:
        seconds = 0.01 + 0.002 * tokens + 1e-6 * tokens * (start + tokens / 2)
        cost.observe(ChunkCost.features([(start, start + tokens)], 1), seconds)
    for start, tokens in [(0, 64), (3840, 256), (8000, 16)]:
        # A fitted model against the cost it was fed: no clock is read here.
        true_cost = 0.01 + 0.002 * tokens + 1e-6 * tokens * (start + tokens / 2)
        assert math.isclose(cost.seconds(start, tokens), true_cost, rel_tol=0.05)


def _true_cost(start: int, tokens: int) -> float:
    return 0.01 + 0.002 * tokens + 1e-6 * tokens * (start + tokens / 2)


def test_the_margin_covers_how_far_recent_steps_ran_over_their_prediction() -> None:
    cost = ChunkCost()
    shapes = [(0, 16), (0, 128), (512, 64), (2048, 32), (4096, 128), (1024, 256)]
    for start, tokens in shapes * 6:
        cost.observe(ChunkCost.features([(start, start + tokens)], 1), _true_cost(start, tokens))
    assert cost.margin() == pytest.approx(1.0, abs=0.02)
    # A loaded machine: one step in four runs 60 % over.
    for index, (start, tokens) in enumerate(shapes * 6):
        slow = 1.6 if index % 4 == 0 else 1.0
        cost.observe(ChunkCost.features([(start, start + tokens)], 1),
                     slow * _true_cost(start, tokens))
    assert 1.3 < cost.margin() < 1.7
    # Quiet again: the window forgets the over-runs.
    for start, tokens in shapes * 8:
        cost.observe(ChunkCost.features([(start, start + tokens)], 1), _true_cost(start, tokens))
    assert cost.margin() < 1.1


def test_the_margin_is_one_until_steps_were_predicted() -> None:
    cost = ChunkCost()
    for start, tokens in [(0, 64)] * 5:
        cost.observe(ChunkCost.features([(start, start + tokens)], 1), 3 * _true_cost(start, tokens))
    assert cost.margin() == 1.0


def _drive(scheduler: Scheduler, first: list[GenerationRequest], late: GenerationRequest
           ) -> dict[str, list[int]]:
    """Start ``first``; once they decode, enqueue ``late``; step until all end."""
    sequences = [new_sequence(r) for r in first]
    for sequence in sequences:
        scheduler.enqueue(sequence)
    outputs: dict[str, list[Any]] = {s.request_id: [] for s in sequences}
    for _ in range(5000):
        scheduler.step()
        if len(sequences) == len(first) and scheduler.state.decoding:
            sequence = new_sequence(late)
            sequences.append(sequence)
            outputs[sequence.request_id] = []
            scheduler.enqueue(sequence)
        for sequence in sequences:
            while not sequence.outputs.empty():
                outputs[sequence.request_id].append(sequence.outputs.get_nowait())
        if len(sequences) > len(first) and all(o and o[-1].finished for o in outputs.values()):
            return {k: [t for o in v for t in o.token_ids] for k, v in outputs.items()}
    raise AssertionError("requests never ended")


def test_a_long_prompt_arriving_beside_decoding_rows_is_chunked_to_the_budget() -> None:
    def run(gap_s: float) -> tuple[dict[str, list[int]], list[tuple[str, int, int]], int]:
        model, tokenizer = load_model(cached_model("llama"))
        scheduler = tiny_scheduler(model, tokenizer, prefill_step_size=STEP, max_decode_gap_s=gap_s)
        gate = ChunkLog()
        scheduler.set_forward_gate(gate)
        first = [GenerationRequest(f"running-{i}", list(tokenizer.encode(f"short prompt {i} " * 3)),
                                   SamplingParams(temperature=0.0, max_tokens=12)) for i in range(2)]
        late_prompt = list(tokenizer.encode("a long document about many things " * 60))
        late = GenerationRequest("long", late_prompt, SamplingParams(temperature=0.0, max_tokens=6))
        return _drive(scheduler, first, late), gate.chunks, len(late_prompt)

    # A budget no chunk can meet: every chunk beside decoding rows is the smallest.
    budgeted, chunks, prompt_length = mlx_thread().run(lambda: run(1e-9))
    unbudgeted, plain_chunks, _ = mlx_thread().run(lambda: run(0.0))
    assert budgeted == unbudgeted
    long_chunks = [(tokens, decoding) for request_id, tokens, decoding in chunks if request_id == "long"]
    # The gate saw every chunk: together they are the prompt but its last token.
    assert sum(tokens for tokens, _ in long_chunks) == prompt_length - 1
    beside = [tokens for tokens, decoding in long_chunks if decoding]
    alone = [tokens for tokens, decoding in long_chunks if not decoding]
    assert beside and alone
    # Two chunks to learn from, then the smallest.
    assert max(beside) <= STEP // 4 and beside[2:] and set(beside[2:]) == {MIN_CHUNK}
    # Nothing decodes: back to the whole prefill step (the last chunk may be shorter).
    assert alone[0] == STEP or len(alone) == 1
    assert max(t for r, t, d in plain_chunks if r == "long" and d) == STEP


def test_a_prompt_sent_with_the_rows_now_decoding_is_prefilled_at_whole_steps() -> None:
    """A burst sent together: its short member decodes first, but the long one was
    waiting as early, so its chunks are not cut to the decode budget (first come,
    first served; each step still decodes once). A prompt sent after the rows started
    is cut (the test above)."""
    def run() -> list[tuple[str, int, int]]:
        model, tokenizer = load_model(cached_model("llama"))
        scheduler = tiny_scheduler(model, tokenizer, prefill_step_size=STEP, max_decode_gap_s=1e-9)
        gate = ChunkLog()
        scheduler.set_forward_gate(gate)
        sequences = [new_sequence(GenerationRequest(
            request_id, list(tokenizer.encode(text)), SamplingParams(temperature=0.0, max_tokens=8)))
            for request_id, text in (("short", "short prompt 1 " * 3),
                                     ("long", "a long document about many things " * 60))]
        for sequence in sequences:
            scheduler.enqueue(sequence)
        for _ in range(5000):
            scheduler.step()
            if all(sequence.phase.value == "done" for sequence in sequences):
                return gate.chunks
        raise AssertionError("requests never ended")

    chunks = mlx_thread().run(run)
    beside = [tokens for request_id, tokens, decoding in chunks if request_id == "long" and decoding]
    assert len(beside) >= 2, chunks
    assert all(tokens == STEP for tokens in beside[:-1]), chunks
