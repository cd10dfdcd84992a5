"""Prompt-lookup speculation inside the batched decode step, on real tiny models and the
default model: greedy rows emit plain decoding's tokens, seeded rows plain decoding's
samples, rows with logprobs or logits processors are decoded as before beside drafting
rows, models whose caches cannot be cut back per row never draft, the memory guard
sees the verify width, and the cost model drafts only where it pays."""

from __future__ import annotations

from typing import Any

import pytest

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.memory.gate import DecodePlan, DecodeStep, ForwardGate
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.scheduling.batch_state import new_sequence
from omlx_core.scheduling.drafters import NgramDrafter
from omlx_core.scheduling.extensions import DraftVerify
from omlx_core.scheduling.scheduler import Scheduler
from omlx_core.scheduling.speculation import PromptLookupDrafts, StepCost
from omlx_core.testing.models import cached_model

from tests.tiny_scheduler import tiny_scheduler

UNLIMITED = 1 << 40


def cheap_wide_steps() -> StepCost:
    """A cost model that has seen wide steps cost what narrow ones do: every draft
    pays, so every row that has one drafts."""
    cost = StepCost(decay=1.0)
    for _ in range(200):
        cost.observe(1, 1.0)
        cost.observe(64, 1.0)
    return cost


def drafting(max_drafts: int = 4) -> PromptLookupDrafts:
    return PromptLookupDrafts(max_drafts=max_drafts, cost=cheap_wide_steps())


class RecordingGate(ForwardGate):
    """Lets everything run and keeps what it was asked."""

    def __init__(self) -> None:
        self.decode_steps: list[DecodeStep] = []
        self.prefill_steps: list[Any] = []

    def check_prefill(self, step: Any) -> dict:
        self.prefill_steps.append(step)
        return {}

    def check_after_prefill(self, step: Any) -> dict:
        return {}

    def check_decode(self, step: DecodeStep) -> DecodePlan:
        self.decode_steps.append(step)
        return DecodePlan({row.request_id: row.kv_tokens for row in step.rows})


def scheduler(model: Any, tokenizer: Any, drafts: PromptLookupDrafts | None = None,
              **options: Any) -> Scheduler:
    return tiny_scheduler(model, tokenizer, drafts=drafts, **options)


def drive(scheduler: Scheduler, requests: list[GenerationRequest], steps: int = 3000) -> dict[str, list[Any]]:
    sequences = [new_sequence(request) for request in requests]
    for sequence in sequences:
        scheduler.enqueue(sequence)
    outputs: dict[str, list[Any]] = {s.request_id: [] for s in sequences}
    for _ in range(steps):
        scheduler.step()
        for sequence in sequences:
            while not sequence.outputs.empty():
                outputs[sequence.request_id].append(sequence.outputs.get_nowait())
        if all(o and o[-1].finished for o in outputs.values()):
            return outputs
    raise AssertionError(f"requests never ended: {outputs}")


def tokens(outputs: list[Any]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def repetitive(tokenizer: Any, sampling: SamplingParams, count: int = 3) -> list[GenerationRequest]:
    """Prompts that repeat themselves, with different lengths and budgets, so rows
    draft, accept different amounts and finish at different steps."""
    return [GenerationRequest(f"r{i}", list(tokenizer.encode(f"alpha beta gamma delta {i} " * (3 + i))),
                              SamplingParams(**{**sampling.__dict__, "max_tokens": 30 + 7 * i,
                                                "seed": 11 + i}))
            for i in range(count)]


def compare(family: str, sampling: SamplingParams, extra: list[GenerationRequest] = ()
            ) -> tuple[dict, dict, dict]:
    def run() -> tuple[dict, dict, dict]:
        model, tokenizer = load_model(cached_model(family))
        requests = repetitive(tokenizer, sampling) + list(extra)
        plain = drive(scheduler(model, tokenizer), requests)
        drafts = drafting()
        drafted = drive(scheduler(model, tokenizer, drafts), requests)
        return plain, drafted, drafts.stats()["speculation"]

    return mlx_thread().run(run)


def test_prompt_lookup_drafts_are_a_draft_verify() -> None:
    assert isinstance(PromptLookupDrafts(), DraftVerify)
    with pytest.raises(ValueError, match="max_drafts"):
        PromptLookupDrafts(max_drafts=0)


def test_greedy_rows_emit_plain_decodings_tokens_while_drafting() -> None:
    plain, drafted, stats = compare("llama", SamplingParams(temperature=0.0))
    assert stats["verify_steps"] > 0 and stats["accepted"] > 0, stats
    for request_id, outputs in plain.items():
        assert tokens(drafted[request_id]) == tokens(outputs), request_id
        assert drafted[request_id][-1].finish_reason == outputs[-1].finish_reason
        usage, plain_usage = drafted[request_id][-1].usage, outputs[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == \
            (plain_usage.prompt_tokens, plain_usage.completion_tokens, plain_usage.cached_tokens)
        assert plain_usage.draft_tokens == plain_usage.accepted_draft_tokens == 0
        assert 0 <= usage.accepted_draft_tokens <= usage.draft_tokens
    # Each request's usage counts its own drafts: together, what the engine verified.
    assert sum(o[-1].usage.draft_tokens for o in drafted.values()) == stats["drafted"]
    assert sum(o[-1].usage.accepted_draft_tokens for o in drafted.values()) == stats["accepted"]


def test_a_biased_row_drafts_with_its_bias_at_every_position() -> None:
    def run() -> tuple[dict, dict, dict]:
        model, tokenizer = load_model(cached_model("llama"))
        requests = repetitive(tokenizer, SamplingParams(temperature=0.0))
        banned = {t: -100.0 for t in requests[0].prompt_tokens[4:8]}
        requests = [GenerationRequest(r.request_id, r.prompt_tokens,
                                      SamplingParams(**{**r.sampling.__dict__, "logit_bias": banned}))
                    for r in requests]
        plain = drive(scheduler(model, tokenizer), requests)
        drafts = drafting()
        drafted = drive(scheduler(model, tokenizer, drafts), requests)
        return plain, drafted, {"stats": drafts.stats()["speculation"], "banned": banned}

    plain, drafted, info = mlx_thread().run(run)
    assert info["stats"]["accepted"] > 0, info
    for request_id, outputs in plain.items():
        assert tokens(drafted[request_id]) == tokens(outputs)
        assert not set(tokens(outputs)) & set(info["banned"])


def test_rows_with_logprobs_or_processors_decode_as_before_beside_drafting_rows() -> None:
    def run() -> tuple[dict, dict, dict]:
        model, tokenizer = load_model(cached_model("llama"))
        prompt = list(tokenizer.encode("alpha beta gamma delta 9 " * 4))
        extra = [
            GenerationRequest("logprobs", prompt, SamplingParams(temperature=0.0, max_tokens=25, logprobs=2)),
            GenerationRequest("biased", prompt, SamplingParams(temperature=0.0, max_tokens=25,
                                                               logit_bias={prompt[1]: 5.0},
                                                               presence_penalty=0.5)),
        ]
        requests = repetitive(tokenizer, SamplingParams(temperature=0.0), count=2) + extra
        plain = drive(scheduler(model, tokenizer), requests)
        drafts = drafting()
        drafted = drive(scheduler(model, tokenizer, drafts), requests)
        return plain, drafted, drafts.stats()["speculation"]

    plain, drafted, stats = mlx_thread().run(run)
    assert stats["verify_steps"] > 0, stats
    for request_id, outputs in plain.items():
        assert tokens(drafted[request_id]) == tokens(outputs), request_id
    plain_logprobs = [lp for o in plain["logprobs"] for lp in (o.logprobs or ())]
    drafted_logprobs = [lp for o in drafted["logprobs"] for lp in (o.logprobs or ())]
    assert len(drafted_logprobs) == len(plain_logprobs) == 25
    for ours, theirs in zip(drafted_logprobs, plain_logprobs):
        assert ours.token_id == theirs.token_id
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def test_seeded_rows_emit_plain_decodings_samples_and_repeat_them() -> None:
    # Cold enough that the tiny random model repeats itself: drafts are kept and missed.
    sampling = SamplingParams(temperature=0.03)
    plain, drafted, stats = compare("llama", sampling)
    _, again, _ = compare("llama", sampling)
    assert stats["verify_steps"] > 0 and stats["accepted"] > 0, stats
    for request_id, outputs in plain.items():
        assert tokens(drafted[request_id]) == tokens(outputs) == tokens(again[request_id])


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "gpt_oss"])
def test_models_whose_caches_cannot_be_cut_back_per_row_never_draft(family: str) -> None:
    """A sliding-window (gemma3) or recurrent (qwen3_next) layer cannot roll one row back
    by its own count: those models decode plain, with the same tokens."""
    plain, drafted, stats = compare(family, SamplingParams(temperature=0.0))
    assert stats["verify_steps"] == 0 and stats["steps"] > 0
    for request_id, outputs in plain.items():
        assert tokens(drafted[request_id]) == tokens(outputs)


def test_the_memory_guard_budgets_the_verify_width() -> None:
    def run() -> tuple[list[DecodeStep], dict[str, int]]:
        model, tokenizer = load_model(cached_model("llama"))
        gate = RecordingGate()
        sched = scheduler(model, tokenizer, drafting(max_drafts=5))
        sched.set_forward_gate(gate)
        requests = repetitive(tokenizer, SamplingParams(temperature=0.0), count=2)
        drive(sched, requests)
        return gate.decode_steps, {r.request_id: len(r.prompt_tokens) for r in requests}

    steps, prompts = mlx_thread().run(run)
    assert steps
    first = steps[0]
    for row in first.rows:
        # The prompt, the first token (fed by the first decode step), and five drafts.
        assert row.kv_tokens == prompts[row.request_id] + 1 + 5


def test_the_step_cost_model_recovers_fixed_and_per_token_cost() -> None:
    cost = StepCost()
    for tokens_fed in (4, 8, 16, 32, 8, 4, 64) * 10:
        cost.observe(tokens_fed, 0.02 + 0.001 * tokens_fed)
    fixed, per_token = cost.coefficients()
    assert fixed == pytest.approx(0.02, rel=0.05)
    assert per_token == pytest.approx(0.001, rel=0.05)


def test_one_step_held_up_by_the_machine_does_not_stop_drafting() -> None:
    """A wide step the OS preempted (measured at 10x its cost) is counted as at most
    twice its prediction: rows that copy their input keep drafting after it, and the
    plain steps that follow do not leave its slope in place."""
    drafts = PromptLookupDrafts(max_drafts=6)
    for _ in range(30):
        drafts.cost.observe(1, 0.05)
    for width in (7, 4, 7):
        drafts.cost.observe(width, 0.05 + 0.005 * width)
    assert drafts._best_width(1, [(0.9, 6)]) > 1
    drafts.cost.observe(7, 10 * (0.05 + 0.005 * 7))
    for _ in range(5):
        drafts.cost.observe(1, 0.05)
    assert drafts._best_width(1, [(0.9, 6)]) > 1
    # A machine that really got slower moves the model all the same.
    for _ in range(150):
        drafts.cost.observe(1, 0.5 + 0.05)
        drafts.cost.observe(7, 0.5 + 0.05 * 7)
    fixed, per_token = drafts.cost.coefficients()
    assert fixed == pytest.approx(0.5, rel=0.1)
    assert per_token == pytest.approx(0.05, rel=0.1)


def test_the_width_pays_only_where_drafts_are_kept() -> None:
    """Wide steps cost per token fed: rows whose drafts keep missing draft nothing, rows
    that copy their input draft, and a big batch needs more to widen all its rows."""
    drafts = PromptLookupDrafts(max_drafts=6)
    for tokens_fed in (1, 2, 4, 8, 16) * 10:
        drafts.cost.observe(tokens_fed, 0.05 + 0.01 * tokens_fed)
    assert drafts._best_width(1, [(0.05, 6)]) == 1
    assert drafts._best_width(1, [(0.9, 6)]) > 2
    assert drafts._best_width(8, [(0.15, 6)] * 8) == 1
    assert drafts._best_width(8, [(0.9, 6)] + [(0.1, 6)] * 7) == 1
    assert drafts._best_width(8, [(0.95, 6)] * 8) > 1


def test_a_missing_drafter_drifts_back_and_tries_again() -> None:
    drafter = NgramDrafter(token_cost=0.0)
    state = drafter.begin([1, 2, 3, 1, 2, 3])
    draft = drafter.propose(state, [1, 2, 3, 1, 2, 3, 1], 4, SamplingParams(), None)
    assert draft.tokens == [2, 3, 1]
    drafter.commit(state, [1, *draft.tokens], 1, None)
    history = [1, 2, 3, 1, 2, 3, 1, 7]
    # 7 never occurred before: no match, nothing to expect.
    assert drafter.outlook(state, history) == 0.0
    history += [1, 2, 3, 1]
    missed = drafter.outlook(state, history)
    assert missed < drafter.prior(4)
    for _ in range(50):
        drafter.skip(state)
    assert drafter.outlook(state, history) > missed


@pytest.mark.slow
def test_the_default_model_copies_its_input_with_the_same_tokens(default_model_dir) -> None:
    def run() -> tuple[dict, dict, dict]:
        model, tokenizer = load_model(default_model_dir)
        text = ("The quarterly report shows revenue of 4.2 million dollars, up 12 percent, "
                "driven by the new subscription plan and lower churn in Europe.")
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this sentence exactly:\n{text}"}],
            add_generation_prompt=True)
        requests = [GenerationRequest("copy", list(prompt), SamplingParams(temperature=0.0, max_tokens=40))]
        plain = drive(scheduler(model, tokenizer), requests)
        drafts = drafting()
        drafted = drive(scheduler(model, tokenizer, drafts), requests)
        return plain, drafted, drafts.stats()["speculation"]

    plain, drafted, stats = mlx_thread().run(run)
    assert tokens(drafted["copy"]) == tokens(plain["copy"])
    assert stats["accepted"] > 10, stats


@pytest.mark.parametrize("in_place,dtype", [(True, "float32"), (False, "float32"),
                                            (True, "bfloat16")])
def test_rolling_rows_back_equals_mlx_lms_right_padding_roll(in_place, dtype, monkeypatch):
    """The speculation's rollback moves each row as mlx-lm's prepare(right_padding) and
    finalize() do: the same kept positions, offsets and left padding (what lies in the
    padding, masked, may differ), in place in NumPy views and as mlx slice copies (which
    a dtype NumPy cannot view, bfloat16, falls back to)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache

    from omlx_core.scheduling import speculation

    if not in_place:
        monkeypatch.setattr(speculation, "_roll_in_place", lambda layer, shifts: False)

    def filled() -> BatchKVCache:
        cache = BatchKVCache([2, 0, 1, 3])
        keys, values = (mx.random.normal((4, 2, 40, 8), key=mx.random.key(seed)).astype(getattr(mx, dtype))
                        for seed in (1, 2))
        cache.update_and_fetch(keys, values)
        return cache

    shifts = [0, 3, 1, 5]
    theirs, ours = filled(), filled()
    theirs.prepare(right_padding=shifts)
    theirs.finalize()
    speculation.roll_rows(ours, shifts)
    assert theirs._idx == ours._idx
    assert mx.array_equal(theirs.offset, ours.offset).item()
    assert mx.array_equal(theirs.left_padding, ours.left_padding).item()
    for row, start in enumerate(ours.left_padding.tolist()):
        for a, b in ((theirs.keys, ours.keys), (theirs.values, ours.values)):
            np.testing.assert_array_equal(np.array(a[row, :, start:ours._idx].astype(mx.float32)),
                                          np.array(b[row, :, start:ours._idx].astype(mx.float32)))
