"""The decode batch's lanes: rows of like lengths share one generator's padded batch, and
a row that would make every other row read its length in padding decodes in a lane of
its own (its own forward each step), with the same greedy tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omlx_core.mlx_thread import mlx_thread
from omlx_core.scheduling.decode_batch import pick_lane
from omlx_core.testing import engine_io

from tests.test_batched_engine import GREEDY, collect, prompt_of, start_engine, submit, wait_idle
from tests.tiny_scheduler import tiny_scheduler

EOS = 2


def reference_greedy(path, prompt, n) -> list[int]:
    """Plain mlx-lm greedy decoding of one prompt, the end-of-sequence token banned."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    from omlx_core.models.loader import load_model

    def compute():
        model, _ = load_model(path)
        banned = make_logits_processors(logit_bias={EOS: -100.0})
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                                 logits_processors=banned)]

    return mlx_thread().run(compute)


def test_rows_of_like_lengths_share_a_lane():
    assert pick_lane([[300] * 8], 310, fixed_tokens=12_000) == 0
    assert pick_lane([[300] * 8], 290, fixed_tokens=12_000) == 0


def test_a_row_padding_every_other_row_to_its_length_opens_its_own_lane():
    # Joining would read 9 x 5,000 positions a step instead of 8 x 300 + 5,000 and a
    # second pass over the weights (12,000 positions' worth).
    assert pick_lane([[300] * 8], 5_000, fixed_tokens=12_000) is None


def test_a_row_joins_the_lane_it_pads_least():
    lanes = [[5_000], [300] * 8]
    assert pick_lane(lanes, 320, fixed_tokens=12_000) == 1
    assert pick_lane(lanes, 4_900, fixed_tokens=12_000) == 0


def test_padding_that_costs_less_than_a_forward_joins():
    # One short row next to a long one: padding it costs less than the weights again.
    assert pick_lane([[5_000]], 300, fixed_tokens=12_000) == 0
    assert pick_lane([], 300, fixed_tokens=12_000) is None


def test_models_without_plain_kv_layers_keep_one_lane():
    assert pick_lane([[10]], 100_000, fixed_tokens=float("inf")) == 0


@pytest.fixture
def llama_engine(tiny_model_path):
    path = tiny_model_path("llama")
    # Whole-prompt chunks: the long prompt joins while the short rows still decode.
    engine = start_engine(path, **{"plugin.batched.prefill_step_size": 1024})
    yield engine, path
    engine.shutdown()


def lanes_of(engine) -> list[int]:
    return mlx_thread().run(lambda: sorted(len(lane.rows) for lane in engine.scheduler.decode.lanes))


def test_a_long_prompt_decodes_in_its_own_lane_with_the_same_tokens(llama_engine):
    engine, path = llama_engine
    # The tiny model's weights weigh what ~830 KV positions do: a ~800-token row next to
    # three short ones would triple what every step reads.
    short = [prompt_of(engine, 4, salt) for salt in range(3)]
    # Every row runs to max_tokens: the end-of-sequence token is banned.
    sampling = replace(GREEDY, logit_bias={EOS: -100.0})
    runners = [submit(engine, prompt, replace(sampling, max_tokens=400)) for prompt in short]
    firsts = [engine_io.first_output(handle) for handle in runners]
    assert lanes_of(engine) == [3]
    long_prompt = prompt_of(engine, 400, 9)
    assert len(long_prompt) > 600
    handle = submit(engine, long_prompt, replace(sampling, max_tokens=8))
    long_first = engine_io.first_output(handle)
    assert lanes_of(engine) == [1, 3]
    long_tokens = list(long_first.token_ids) + [t for output in engine_io.collect(handle) for t in output.token_ids]
    runner_tokens = []
    for first, runner in zip(firsts, runners):
        runner_tokens.append(list(first.token_ids)
                             + [t for output in engine_io.collect(runner) for t in output.token_ids])
    wait_idle(engine)
    assert lanes_of(engine) == []
    assert long_tokens == reference_greedy(path, long_prompt, 8)
    for prompt, tokens in zip(short, runner_tokens):
        assert tokens == reference_greedy(path, prompt, 400)


def test_lanes_close_when_their_rows_end(llama_engine):
    engine, _ = llama_engine
    handles = [submit(engine, prompt_of(engine, 4, salt), replace(GREEDY, max_tokens=6))
               for salt in range(2)]
    assert all(collect(h).finish_reason == "length" for h in handles)
    wait_idle(engine)
    assert lanes_of(engine) == []


def test_a_scheduler_without_lanes_keeps_every_row_in_one(tiny_model_path):
    """The distributed engine's choice: every rank must take the same steps, and a lane
    decision read from one rank's share of the weights could differ between ranks."""
    from omlx_core.models.loader import load_model

    def build(lanes):
        model, tokenizer = load_model(tiny_model_path("llama"))
        scheduler = tiny_scheduler(model, tokenizer, block_size=16, cache_bytes=1 << 20,
                                   prefill_step_size=64, decode_lanes=lanes)
        return scheduler.decode._fixed_tokens

    assert mlx_thread().run(lambda: build(False)) == float("inf")
    assert mlx_thread().run(lambda: build(True)) is None  # measured at the first join
