"""The decode batch gives plain mlx-lm's tokens.

The same schedule (rows joining at different steps and leaving at different lengths,
greedy and seeded rows, logit biases, a penalty after a bias, logprobs) runs through
mlx-lm's own ``BatchGenerator`` (its public ``insert``/``next``) and through the
scheduler, whose decode batch is this project's (``omlx_core.scheduling.decode_batch``),
with and without lanes and speculation: every row's tokens must be equal, and the
logprobs of rows that report them equal to float32 rounding (the two batch their
prefill forwards differently).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.scheduling.batch_state import new_sequence
from omlx_core.scheduling.sampling import BatchSampling, make_logits_processors, make_sampler
from omlx_core.scheduling.speculation import PromptLookupDrafts, StepCost
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


def run_mlx_lm(model: Any, rows: list[Row], *, vocab: int, eos: list[int]) -> list[Outcome]:
    """Each row's tokens (and logprobs where it asks for them) from mlx-lm's generator,
    the stop token that ends a row left out (the engine does not hand it out)."""
    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                               prefill_step_size=64, stop_tokens=[[t] for t in eos])
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
        for response in generator.next()[1]:
            outcome = outcomes[by_uid[response.uid]]
            if response.finish_reason == "stop":
                del by_uid[response.uid]
                continue
            outcome.tokens.append(response.token)
            if rows[by_uid[response.uid]].params.logprobs is not None:
                outcome.logprobs.append(response.logprobs)
            if response.finish_reason is not None:
                del by_uid[response.uid]
        step += 1
        assert step < 500, "the schedule does not end"
    mx.eval([o.logprobs for o in outcomes])
    generator.close()
    return outcomes


def cheap_wide_steps() -> StepCost:
    """A cost model that has seen wide steps cost what narrow ones do: every draft pays."""
    cost = StepCost(decay=1.0)
    for _ in range(200):
        cost.observe(1, 1.0)
        cost.observe(64, 1.0)
    return cost


def run_ours(model: Any, tokenizer: Any, rows: list[Row], *, lanes: bool, speculation: bool
             ) -> list[Outcome]:
    """Each row's tokens and chosen logprobs from the scheduler; with ``lanes``, rows of
    different lengths decode in lanes of their own (checked to have happened); with
    ``speculation``, every draft the cost model sees is verified (whether a tiny random
    model's rows find drafts is up to it: ``test_batched_speculation.py`` has rows that
    do)."""
    drafts = PromptLookupDrafts(max_drafts=4, cost=cheap_wide_steps()) if speculation else None
    # A 600-token fixed cost splits rows of different lengths into lanes of their own.
    scheduler = tiny_scheduler(model, tokenizer, cache_bytes=0, max_batch_size=8,
                               prefill_step_size=64, decode_lanes=lanes, drafts=drafts)
    if lanes:
        scheduler.decode._fixed_tokens = 8.0
    outcomes = [Outcome() for _ in rows]
    live: dict[int, Any] = {}
    most_lanes = step = 0
    while step == 0 or live or any(row.joins_at >= step for row in rows):
        most_lanes = max(most_lanes, len(scheduler.decode.lanes))
        for index, row in enumerate(rows):
            if row.joins_at == step:
                params = SamplingParams(**{**row.params.__dict__, "max_tokens": row.max_tokens,
                                           "seed": row.seed})
                sequence = new_sequence(GenerationRequest(f"r{index}", row.prompt, params))
                scheduler.enqueue(sequence)
                live[index] = sequence
        scheduler.step()
        for index, sequence in list(live.items()):
            while not sequence.outputs.empty():
                output = sequence.outputs.get_nowait()
                outcomes[index].tokens += output.token_ids
                if output.logprobs:
                    outcomes[index].logprobs += [lp.logprob for lp in output.logprobs]
                if output.finished:
                    assert output.finish_reason in ("stop", "length"), output
                    del live[index]
        step += 1
        assert step < 500, "the schedule does not end"
    scheduler.shutdown()
    assert (most_lanes > 1) == lanes
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
        Row(9, prompt(11, 7) * 4, 14, SamplingParams(logit_bias=banned)),
    ]


def assert_same(reference: list[Outcome], ours: list[Outcome]) -> None:
    for index, (a, b) in enumerate(zip(reference, ours)):
        assert a.tokens == b.tokens, f"row {index}: tokens differ"
        assert len(b.logprobs) == len(a.logprobs), f"row {index}: logprobs missing"
        for step, (full, chosen) in enumerate(zip(a.logprobs, b.logprobs)):
            expected = full[a.tokens[step]].item()
            assert abs(expected - chosen) < 1e-4, f"row {index}, step {step}: logprobs differ"


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3", "qwen3_next", "gpt_oss"])
@pytest.mark.parametrize("lanes,speculation", [(False, False), (True, False), (True, True)])
def test_the_decode_batch_gives_mlx_lms_tokens(family, lanes, speculation):
    def compare():
        model, tokenizer = load_model(cached_model(family))
        vocab = model.args.vocab_size
        rows = schedule(vocab)
        reference = run_mlx_lm(model, rows, vocab=vocab, eos=list(tokenizer.eos_token_ids))
        assert_same(reference, run_ours(model, tokenizer, rows, lanes=lanes, speculation=speculation))

    mlx_thread().run(compare)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_decode_batch_gives_mlx_lms_tokens_with_low_precision_logits(tmp_path, dtype):
    from omlx_core.testing.models import build_model

    def compare():
        model, tokenizer = load_model(build_model("llama", tmp_path / dtype, dtype=dtype))
        vocab = model.args.vocab_size
        rows = [row for row in schedule(vocab) if row.params.logprobs is None]
        reference = run_mlx_lm(model, rows, vocab=vocab, eos=list(tokenizer.eos_token_ids))
        assert_same(reference, run_ours(model, tokenizer, rows, lanes=True, speculation=False))

    mlx_thread().run(compare)


def plain_greedy(model: Any, prompt: list[int], max_tokens: int, params: SamplingParams,
                 eos: set[int]) -> list[int]:
    """Plain mlx-lm: ``generate_step`` over one prompt alone, stopped where the engine
    stops (an end-of-sequence token, not handed out)."""
    from mlx_lm.generate import generate_step

    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  logits_processors=list(make_logits_processors(params, len(prompt)))):
        if int(token) in eos:
            break
        tokens.append(int(token))
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("lanes,speculation", [(False, False), (True, True)])
def test_the_default_model_gives_plain_mlx_lms_tokens(lanes, speculation):
    """Chat prompts decoded together (lanes, drafts) give each the tokens plain mlx-lm
    gives it alone."""
    from omlx_core.models.default import ensure_default_model

    def compare():
        model, tokenizer = load_model(ensure_default_model(progress=False))
        banned = {t: -100.0 for t in range(17)}
        questions = ["What is the capital of France?", "Name three colors.",
                     "Write a haiku about the sea.", "Repeat after me: " + "alpha beta gamma delta " * 20]
        rows = []
        for index, question in enumerate(questions):
            prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                        add_generation_prompt=True))
            params = SamplingParams(temperature=0.0, logit_bias=banned if index % 2 else {})
            rows.append(Row(index, prompt, 24, params))
        eos = set(tokenizer.eos_token_ids)
        reference = [Outcome(plain_greedy(model, row.prompt, row.max_tokens, row.params, eos))
                     for row in rows]
        ours = run_ours(model, tokenizer, rows, lanes=lanes, speculation=speculation)
        for index, (a, b) in enumerate(zip(reference, ours)):
            assert b.tokens == a.tokens, f"{questions[index]!r}: tokens differ"

    mlx_thread().run(compare)


class _Greedy:
    """A row of the sampling's batch that samples greedily and reports no logprobs."""

    sampler = None
    processors = ()

    class request:
        class sampling:
            logprobs = None


def test_low_precision_greedy_picks_from_the_log_softmax_like_mlx_lm():
    """Two bfloat16 logits one step apart round to one log-softmax value: mlx-lm picks the
    lower id, and so must the batch's sampling (the argmax of the logits is the other)."""
    from mlx_lm.sample_utils import greedy_sampler

    def pick():
        row = [0.9] * 1000
        row[3], row[7] = 1.0, 1.0078125  # one bfloat16 step apart
        logits = mx.array([row], dtype=mx.bfloat16)
        ours, _logprobs = BatchSampling().sample([_Greedy()], logits)
        stock = greedy_sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return ours.item(), stock.item(), mx.argmax(logits, axis=-1).item()

    ours, stock, of_logits = mlx_thread().run(pick)
    assert (stock, of_logits) == (3, 7), "the case no longer rounds the two logits together"
    assert ours == stock


def test_rows_that_do_not_report_logprobs_compute_none():
    def sample():
        logits = mx.random.normal((2, 50), key=mx.random.key(3))
        reporting = _Greedy()
        reporting.request = type("R", (), {"sampling": type("S", (), {"logprobs": 0})})
        return BatchSampling().sample([_Greedy(), reporting], logits)

    tokens, logprobs = mlx_thread().run(sample)
    assert logprobs[0] is None and logprobs[1] is not None and logprobs[1].shape == (50,)
