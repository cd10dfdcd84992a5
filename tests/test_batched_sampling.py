"""Per-request samplers, logits processors and logprobs of the batched engine."""

from __future__ import annotations

from dataclasses import replace

import math

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.engine import SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.scheduling.sampling import (
    SeededSampler,
    check_sampling,
    make_logits_processors,
    make_sampler,
    token_logprob,
)

VOCAB = 8
LOGITS = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, -0.5, 3.0]


def on_mlx(fn):
    return mlx_thread().run(fn)


def apply(params: SamplingParams, context: list[int], prompt_length: int) -> np.ndarray:
    def compute():
        logits = mx.array([LOGITS])
        tokens = mx.array(context, dtype=mx.int32)
        for processor in make_logits_processors(params, prompt_length):
            logits = processor(tokens, logits)
        return np.array(logits[0])

    return on_mlx(compute)


def test_no_processors_for_default_params():
    assert make_logits_processors(SamplingParams(), 3) == ()


def test_logit_bias_adds_to_the_named_tokens():
    out = apply(SamplingParams(logit_bias={1: 5.0, 7: -2.0}), [0], 1)
    expected = np.array(LOGITS)
    expected[1] += 5.0
    expected[7] -= 2.0
    np.testing.assert_allclose(out, expected)


def test_repetition_penalty_covers_prompt_and_completion():
    out = apply(SamplingParams(repetition_penalty=2.0), [0, 1, 1, 4], 2)
    expected = np.array(LOGITS)
    expected[0] /= 2.0  # positive: divided
    expected[1] *= 2.0  # negative: multiplied, once although seen twice
    expected[4] /= 2.0  # completion token
    np.testing.assert_allclose(out, expected)


def test_presence_penalty_counts_completion_tokens_once():
    out = apply(SamplingParams(presence_penalty=0.5), [0, 2, 4, 4, 5], 2)
    expected = np.array(LOGITS)
    expected[4] -= 0.5
    expected[5] -= 0.5
    np.testing.assert_allclose(out, expected)  # prompt tokens 0 and 2 untouched


def test_frequency_penalty_scales_with_the_count():
    out = apply(SamplingParams(frequency_penalty=0.5), [0, 2, 4, 4, 5], 2)
    expected = np.array(LOGITS)
    expected[4] -= 1.0
    expected[5] -= 0.5
    np.testing.assert_allclose(out, expected)


def test_penalties_do_nothing_before_the_first_completion_token():
    out = apply(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), [0, 2], 2)
    np.testing.assert_allclose(out, np.array(LOGITS))


def test_greedy_requests_share_the_generators_sampler():
    assert make_sampler(SamplingParams(temperature=0), seed=1, vocab_size=VOCAB) is None


def test_seeded_sampler_depends_on_seed_and_step_only():
    params = SamplingParams(temperature=1.0)

    def draws(seed: int, n: int = 32) -> list[int]:
        # Lazy arrays belong to the stream of the thread that built them: build here.
        logprobs = mx.log(mx.ones((1, 64)) / 64)
        sampler = SeededSampler(params, seed, 64)
        return [sampler(logprobs).item() for _ in range(n)]

    first, again, other = on_mlx(lambda: (draws(7), draws(7), draws(8)))
    assert first == again
    assert first != other
    assert len(set(first)) > 8  # a uniform distribution really is sampled


def test_top_k_one_is_greedy_whatever_the_seed():
    params = SamplingParams(temperature=5.0, top_k=1)
    logprobs = mx.array([LOGITS])
    picks = on_mlx(lambda: {SeededSampler(params, seed, VOCAB)(logprobs).item() for seed in range(20)})
    assert picks == {7}


def test_top_p_keeps_only_the_nucleus():
    params = SamplingParams(temperature=1.0, top_p=0.5)
    logprobs = mx.array([[math.log(0.6), math.log(0.3), math.log(0.1)]])
    picks = on_mlx(lambda: {SeededSampler(params, seed, 3)(logprobs).item() for seed in range(50)})
    assert picks == {0}


def test_token_logprob_reports_chosen_and_ranked_top():
    def compute():
        logprobs = mx.array(LOGITS) - mx.logsumexp(mx.array(LOGITS))
        return token_logprob(logprobs, 2, 3), np.array(logprobs)

    entry, reference = on_mlx(compute)
    assert entry.token_id == 2
    assert entry.logprob == pytest.approx(reference[2], abs=1e-6)
    assert [t for t, _ in entry.top] == [7, 0, 4]
    assert [lp for _, lp in entry.top] == pytest.approx([reference[7], reference[0], reference[4]], abs=1e-6)


@pytest.mark.parametrize("params, word", [
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(min_p=2), "min_p"),
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(repetition_penalty=0), "repetition_penalty"),
])
def test_invalid_sampling_names_the_parameter(params, word):
    if word != "max_tokens":
        params = replace(params, max_tokens=8)
    with pytest.raises(ValueError, match=word):
        check_sampling(params)
