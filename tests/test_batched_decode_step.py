"""The fused sampling decode step gives mlx-lm's tokens and logprobs.

The same schedule (rows joining at different steps and leaving at different lengths,
greedy and seeded rows, logit biases, a penalty after a bias) runs through mlx-lm's own
``BatchGenerator`` and through one whose decode batch is :class:`FusedSamplingBatch`;
every row's tokens must be equal, and the logprobs of rows that report them equal too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from omlx_core.engine import SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.scheduling.decode_step import FusedSamplingBatch, fuse_sampling
from omlx_core.scheduling.sampling import make_logits_processors, make_sampler
from omlx_core.testing.models import cached_model

from tests.tiny_scheduler import tiny_scheduler


@dataclass
class Row:
    """One request of a schedule: when it joins, its prompt and how it samples."""

    joins_at: int
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


def run_schedule(model: Any, rows: list[Row], *, fused: bool, vocab: int) -> list[Outcome]:
    """Each row's generated tokens (and its logprobs where it asks for them)."""
    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                               prefill_step_size=64)
    wants: dict[int, bool] = {}
    if fused:
        assert fuse_sampling(generator, lambda uid: wants[uid])
    outcomes = [Outcome() for _ in rows]
    by_uid: dict[int, int] = {}
    step = 0
    while step == 0 or by_uid or any(row.joins_at >= step for row in rows):
        for index, row in enumerate(rows):
            if row.joins_at == step:
                (uid,) = generator.insert(
                    [row.prompt], max_tokens=[row.max_tokens],
                    samplers=[make_sampler(row.params, row.seed, vocab)],
                    logits_processors=[make_logits_processors(row.params, len(row.prompt))])
                by_uid[uid] = index
                wants[uid] = row.params.logprobs is not None
        _, generated = generator.next()
        for response in generated:
            outcome = outcomes[by_uid[response.uid]]
            outcome.tokens.append(response.token)
            if rows[by_uid[response.uid]].params.logprobs is not None:
                outcome.logprobs.append(response.logprobs)
            if response.finish_reason is not None:
                del by_uid[response.uid]
        step += 1
        assert step < 500, "the schedule does not end"
    mx.eval([o.logprobs for o in outcomes])
    if fused:
        assert isinstance(generator._generation_batch, FusedSamplingBatch)
    generator.close()
    return outcomes


def schedule(vocab: int) -> list[Row]:
    def prompt(length: int, salt: int) -> list[int]:
        return [(salt * 31 + i * 7) % (vocab - 4) + 3 for i in range(length)]

    banned = {t: -100.0 for t in range(3)}  # the tiny tokenizer's special tokens
    return [
        Row(0, prompt(5, 1), 12),
        Row(0, prompt(17, 2), 20, SamplingParams(logit_bias=banned)),
        Row(0, prompt(9, 3), 6, SamplingParams(logit_bias={5: 3.0, 9: -2.0}, logprobs=2)),
        Row(3, prompt(23, 4), 15, SamplingParams(logit_bias=banned, repetition_penalty=1.3)),
        Row(4, prompt(3, 5), 10, SamplingParams(temperature=0.8, top_p=0.9), seed=7),
        Row(7, prompt(40, 6), 9, SamplingParams(logprobs=0)),
        Row(9, prompt(11, 7), 14, SamplingParams(logit_bias=banned)),
    ]


def assert_same(stock: list[Outcome], fused: list[Outcome]) -> None:
    for index, (a, b) in enumerate(zip(stock, fused)):
        assert a.tokens == b.tokens, f"row {index}: tokens differ"
        assert len(a.logprobs) == len(b.logprobs)
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert mx.array_equal(x, y).item(), f"row {index}, step {step}: logprobs differ"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_next"])
def test_fused_step_gives_mlx_lm_tokens_and_logprobs(family):
    def compare():
        model, _tokenizer = load_model(cached_model(family))
        vocab = model.args.vocab_size
        rows = schedule(vocab)
        stock = run_schedule(model, rows, fused=False, vocab=vocab)
        fused = run_schedule(model, rows, fused=True, vocab=vocab)
        assert all(len(o.tokens) == r.max_tokens for o, r in zip(stock, rows)), \
            "every row should run to its max_tokens (no stop tokens in this schedule)"
        assert_same(stock, fused)

    mlx_thread().run(compare)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fused_step_gives_mlx_lm_tokens_with_low_precision_logits(tmp_path, dtype):
    from omlx_core.testing.models import build_model

    def compare():
        model, _tokenizer = load_model(build_model("llama", tmp_path / dtype, dtype=dtype))
        vocab = model.args.vocab_size
        rows = schedule(vocab)
        assert_same(run_schedule(model, rows, fused=False, vocab=vocab),
                    run_schedule(model, rows, fused=True, vocab=vocab))

    mlx_thread().run(compare)


def test_rows_that_do_not_report_logprobs_get_none():
    def run():
        model, _tokenizer = load_model(cached_model("llama"))
        generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
        assert fuse_sampling(generator, lambda uid: uid == 1)
        generator.insert([[5, 6, 7], [8, 9, 10, 11]], max_tokens=[4, 4])
        seen: dict[int, list[Any]] = {0: [], 1: []}
        for _ in range(6):
            for response in generator.next()[1]:
                seen[response.uid].append(response.logprobs)
        generator.close()
        return seen, model.args.vocab_size

    seen, vocab = mlx_thread().run(run)
    # The first token of a row comes from mlx-lm's own step as it joins; later ones from ours.
    assert all(lp is None for lp in seen[0][1:]) and len(seen[0]) == 4
    assert all(lp is not None and lp.shape == (vocab,) for lp in seen[1])


@pytest.mark.parametrize("fused", [True, False])
def test_the_batched_engine_decodes_with_the_step_its_setting_names(fused):
    from mlx_lm.generate import GenerationBatch

    def build():
        model, tokenizer = load_model(cached_model("llama"))
        scheduler = tiny_scheduler(model, tokenizer, block_size=16, cache_bytes=1 << 20,
                                   prefill_step_size=64, fused_sampling=fused)
        return type(scheduler.decode.new_generator()._generation_batch)

    assert mlx_thread().run(build) is (FusedSamplingBatch if fused else GenerationBatch)


def test_the_setting_is_on_by_default():
    from omlx_core.config import load_config
    from omlx_core.scheduling.engine import EngineSettings

    assert EngineSettings.from_config(load_config(None)).fused_sampling is True


@pytest.mark.slow
def test_default_model_fused_step_gives_mlx_lm_tokens():
    from omlx_core.models.default import ensure_default_model

    def compare():
        model, _tokenizer = load_model(ensure_default_model(progress=False))
        vocab = model.args.vocab_size
        banned = {t: -100.0 for t in range(17)}
        rows = [Row(0, list(range(100, 130)), 24, SamplingParams(logit_bias=banned)),
                Row(0, list(range(400, 412)), 16),
                Row(2, list(range(900, 950)), 20, SamplingParams(logit_bias=banned, logprobs=1)),
                Row(5, list(range(2000, 2007)), 12, SamplingParams(logit_bias=banned))]
        stock = run_schedule(model, rows, fused=False, vocab=vocab)
        fused = run_schedule(model, rows, fused=True, vocab=vocab)
        assert_same(stock, fused)

    mlx_thread().run(compare)


def test_low_precision_greedy_picks_from_the_log_softmax_like_mlx_lm():
    """Two bfloat16 logits one step apart round to one log-softmax value: mlx-lm picks the
    lower id, and so must the fused step (the argmax of the logits is the other one)."""
    from mlx_lm.sample_utils import greedy_sampler

    def pick():
        row = [0.9] * 1000
        row[3], row[7] = 1.0, 1.0078125  # one bfloat16 step apart
        logits = mx.array([row], dtype=mx.bfloat16)
        batch = FusedSamplingBatch.empty(None, greedy_sampler)
        batch.uids, batch.samplers = [0], [None]
        batch.wants_logprobs = lambda _uid: False
        fused, _logprobs = batch._sample(logits)
        stock = greedy_sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return fused.item(), stock.item(), mx.argmax(logits, axis=-1).item()

    fused, stock, of_logits = mlx_thread().run(pick)
    assert (stock, of_logits) == (3, 7), "the case no longer rounds the two logits together"
    assert fused == stock
