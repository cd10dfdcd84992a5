"""The batched scheduler's declared extension points, driven step by step on a real
tiny model: the draft/verify seam takes several tokens per row and step, the cache key
decides what the prefix cache stores, and the defaults are what text models get."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pytest

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.scheduling.batch_state import SequenceState, new_sequence
from omlx_core.scheduling.extensions import (
    CacheKey,
    ChunkInputs,
    DraftVerify,
    NoDrafts,
    TokenInputs,
    token_key,
)
from omlx_core.scheduling.scheduler import Scheduler
from omlx_core.testing.models import cached_model

from tests.tiny_scheduler import tiny_scheduler

BLOCK = 8


class TwoTokensPerStep:
    """A :class:`DraftVerify` whose every step hands out two tokens per row, as a step
    that accepted one draft per row would: it runs the plain step twice, so its tokens
    are plain decoding's by construction."""

    #: the second plain step feeds one more token per row
    lookahead = 1

    def __init__(self) -> None:
        self.asked: list[int] = []

    def stats(self) -> Mapping[str, Any]:
        return {"two_token_steps": len(self.asked)}

    def drafting(self, rows: Mapping[str, SequenceState]) -> bool:
        self.asked.append(len(rows))
        return True

    def verify(self, lane: Any, model: Any, sampling: Any) -> list[Any]:
        return [*lane.plain_step(model, sampling), *lane.plain_step(model, sampling)]


def _scheduler(model: Any, tokenizer: Any, **extensions: Any) -> Scheduler:
    return tiny_scheduler(model, tokenizer, block_size=BLOCK, **extensions)


def _drive(scheduler: Scheduler, requests: list[GenerationRequest]) -> dict[str, list[Any]]:
    """Enqueue ``requests`` and step the scheduler until every one has ended."""
    sequences = [new_sequence(request) for request in requests]
    for sequence in sequences:
        scheduler.enqueue(sequence)
    outputs: dict[str, list[Any]] = {s.request_id: [] for s in sequences}
    for _ in range(500):
        scheduler.step()
        for sequence in sequences:
            while not sequence.outputs.empty():
                outputs[sequence.request_id].append(sequence.outputs.get_nowait())
        if all(o and o[-1].finished for o in outputs.values()):
            return outputs
    raise AssertionError(f"requests never ended: {outputs}")


def _tokens(outputs: list[Any]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _requests(tokenizer: Any, salt: str) -> list[GenerationRequest]:
    # Odd and even lengths: a row's last token falls on either half of a two-token step.
    return [GenerationRequest(f"{salt}-{i}", list(tokenizer.encode(f"{salt} words number {i} " * (i + 2))),
                              SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for i, max_tokens in enumerate((7, 10, 13))]


def test_the_defaults_are_the_declared_protocols() -> None:
    assert isinstance(TokenInputs(), ChunkInputs)
    assert isinstance(NoDrafts(), DraftVerify)
    assert isinstance(token_key, CacheKey)
    assert isinstance(TwoTokensPerStep(), DraftVerify)
    assert not NoDrafts().drafting({})
    with pytest.raises(TypeError):
        TokenInputs().embeddings(None, 0, 1)  # type: ignore[arg-type]


def test_a_draft_verify_step_hands_out_several_tokens_per_row_in_order() -> None:
    def run() -> tuple[dict[str, list[Any]], dict[str, list[Any]], list[int], int, int]:
        model, tokenizer = load_model(cached_model("llama"))
        plain_scheduler = _scheduler(model, tokenizer)
        plain = _drive(plain_scheduler, _requests(tokenizer, "plain"))
        drafts = TwoTokensPerStep()
        scheduler = _scheduler(model, tokenizer, drafts=drafts)
        twice = _drive(scheduler, _requests(tokenizer, "plain"))
        return (plain, twice, drafts.asked, plain_scheduler.counters.decode_steps,
                scheduler.counters.decode_steps)

    plain, twice, asked, plain_steps, decode_steps = mlx_thread().run(run)
    for request_id, outputs in plain.items():
        assert _tokens(twice[request_id]) == _tokens(outputs)
        assert twice[request_id][-1].finish_reason == outputs[-1].finish_reason == "length"
        assert twice[request_id][-1].usage == outputs[-1].usage
    # Asked once per decode step, with the rows then decoding (all three prefill in
    # one step and join together).
    assert len(asked) == decode_steps and asked[0] == 3
    # Two plain steps in each: half the steps.
    assert decode_steps == (plain_steps + 1) // 2


def test_the_cache_key_decides_what_the_prefix_cache_stores() -> None:
    """A key that differs from the tokens (an image's digest in the vlm engine) names
    the blocks: a request with the same tokens and another key finds none of them."""
    salted: dict[str, int] = {}

    def salted_key(sequence: SequenceState, tokens: Sequence[int]) -> Sequence[int]:
        salt = salted.setdefault(sequence.request.request_id.split("-")[0], len(salted))
        return [t + 100_000 * salt for t in tokens]

    def run() -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        model, tokenizer = load_model(cached_model("llama"))
        scheduler = _scheduler(model, tokenizer, cache_key=salted_key)
        prompt = list(tokenizer.encode("the same prompt, long enough for blocks " * 3))
        sampling = SamplingParams(temperature=0.0, max_tokens=3)
        first = _drive(scheduler, [GenerationRequest("a-1", prompt, sampling)])
        again = _drive(scheduler, [GenerationRequest("a-2", prompt, sampling),
                                   GenerationRequest("b-1", prompt, sampling)])
        return first, again

    first, again = mlx_thread().run(run)
    assert first["a-1"][-1].usage.cached_tokens == 0
    assert again["a-2"][-1].usage.cached_tokens > BLOCK
    assert again["b-1"][-1].usage.cached_tokens == 0
    assert _tokens(again["a-2"]) == _tokens(again["b-1"]) == _tokens(first["a-1"])
