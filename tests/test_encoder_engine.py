"""The encoder engine: which inputs share a forward, what it asks the forward gate and
what it does with a refusal, aborts, a cross-encoder's scores, and decoders as embedders
and rerankers (tiny random models; the default model served with task = "embed")."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from omlx_core.encoding import EncodeRequest, largest_forward
from omlx_core.memory.gate import ForwardGate, PrefillStep
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, Rejection, RequestRejected
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.encoder.batching import Waiting, padded_tokens, plan_forward
from omlx_core.plugins.encoder.engine import EncoderEngine
from omlx_core.testing import build_model, make_test_host
from omlx_core.testing.encoder_models import cached_bert_model
from omlx_core.testing.engine_io import first_output
from tests.numpy_bert import NumpyBert
from tests.test_encoder_bert import TEXTS, engine_vectors, started_engine

# -- which inputs share a forward ------------------------------------------------------------


def waiting(*lengths: int) -> list[Waiting]:
    return [Waiting(index, length) for index, length in enumerate(lengths)]


def test_the_oldest_input_is_always_in_the_next_forward() -> None:
    queue = waiting(200, 5, 6, 7, 5, 190)
    plan = plan_forward(queue, max_tokens=400, max_rows=8)
    assert queue[0] in plan and padded_tokens(plan) <= 400
    assert [item.length for item in plan] == [190, 200]


def test_inputs_nearest_in_length_share_a_forward_within_its_caps() -> None:
    queue = waiting(10, 100, 11, 9, 12, 101, 10, 8)
    plan = plan_forward(queue, max_tokens=1000, max_rows=4)
    # Shorter neighbours first (they keep the width), never the 100-token ones.
    assert [item.length for item in plan] == [8, 9, 10, 10] and queue[0] in plan
    assert padded_tokens(plan) == 40
    plan = plan_forward(queue, max_tokens=20, max_rows=64)
    assert [item.length for item in plan] == [9, 10] and queue[0] in plan
    assert plan_forward([], max_tokens=100, max_rows=4) == []


def test_an_input_longer_than_the_token_cap_runs_alone() -> None:
    queue = waiting(300, 5, 5)
    assert plan_forward(queue, max_tokens=100, max_rows=8) == [queue[0]]


def test_admission_reserves_the_largest_forward_a_request_makes() -> None:
    from omlx_core.encoding import EncodingLimits

    limits = EncodingLimits(max_length=512, vocab_size=100, dimensions=8, max_batch_tokens=1024,
                            max_batch_rows=16)
    assert largest_forward([10] * 100, limits) == (16, 10)
    assert largest_forward([10, 300, 20], limits) == (3, 300)
    assert largest_forward([512] * 5, limits) == (2, 512)


# -- the forward gate --------------------------------------------------------------------------


class ScriptedGate(ForwardGate):
    """Refuses every forward of more than ``max_rows`` rows (and a lone row when
    ``refuse_alone``), recording each step it is asked about."""

    def __init__(self, max_rows: int, refuse_alone: bool = False):
        self.max_rows = max_rows
        self.refuse_alone = refuse_alone
        self.steps: list[PrefillStep] = []
        self.after: list[PrefillStep] = []

    def _refusal(self, request_id: str) -> RequestRejected:
        return RequestRejected(Rejection(estimated_bytes=1, limit_bytes=1,
                                         breakdown=CeilingBreakdown(custom=1), stage="forward",
                                         cause="memory_short", request_id=request_id),
                               retry_after_s=1.0)

    def check_prefill(self, step: PrefillStep) -> dict[str, RequestRejected]:
        self.steps.append(step)
        if len(step.chunks) > self.max_rows or (self.refuse_alone and len(step.chunks) == 1):
            return {chunk.request_id: self._refusal(chunk.request_id) for chunk in step.chunks}
        return {}

    def check_after_prefill(self, step: PrefillStep) -> dict[str, RequestRejected]:
        self.after.append(step)
        return {}


@pytest.fixture
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EncoderEngine]:
    path = cached_bert_model(cache_dir=tmp_path_factory.getbasetemp() / "bert")
    yield from started_engine(path, "tiny-bert")


def fitting(engine: EncoderEngine) -> list[str]:
    """The test texts the tiny model takes whole."""
    limit = engine.encoding_limits().max_length
    return [text for text in TEXTS if len(engine.tokenize_input(text)) <= limit]


def with_gate(engine: EncoderEngine, gate: ForwardGate) -> None:
    engine.host.memory.apply_memory_limits(LimitSnapshot(hard_bytes=1 << 40,
                                                         breakdown=CeilingBreakdown()))
    engine.host.memory.set_forward_gate(gate)


def test_each_forward_is_asked_of_the_gate_as_an_encode_step_of_padded_rows(
        tiny_engine: EncoderEngine) -> None:
    gate = ScriptedGate(max_rows=1 << 20)
    with_gate(tiny_engine, gate)
    engine_vectors(tiny_engine, TEXTS[:6], "asked")
    step = gate.steps[-1]
    assert step.encode and len(step.chunks) == 6 and gate.after[-1] is step
    width = max(chunk.new_tokens for chunk in step.chunks)
    assert all(chunk.new_tokens == width and chunk.cached_tokens == 0 and chunk.forward == 0
               for chunk in step.chunks)
    assert sorted(chunk.prompt_tokens for chunk in step.chunks) == sorted(
        len(tiny_engine.tokenize_input(text)) for text in TEXTS[:6])


def test_a_refused_batch_is_split_until_the_gate_lets_it_run_and_the_vectors_do_not_change(
        tiny_engine: EncoderEngine) -> None:
    texts = fitting(tiny_engine)
    expected = engine_vectors(tiny_engine, texts, "ungated")
    gate = ScriptedGate(max_rows=3)
    with_gate(tiny_engine, gate)
    vectors = engine_vectors(tiny_engine, texts, "gated")
    assert np.allclose(vectors, expected, atol=1e-5)
    ran = [len(step.chunks) for step in gate.after]
    assert max(ran) <= 3 and sum(ran) == len(texts)
    assert tiny_engine.stats()["gate_splits"] >= 1


def test_a_lone_row_the_gate_refuses_ends_its_request_with_the_rejection(
        tiny_engine: EncoderEngine) -> None:
    with_gate(tiny_engine, ScriptedGate(max_rows=0, refuse_alone=True))
    handle = tiny_engine.encode(EncodeRequest("refused", "embed",
                                              [tiny_engine.tokenize_input("hello")]))
    output = first_output(handle)
    assert output.finish_reason == "error" and output.rejected is not None
    assert output.rejected.stage == "forward" and output.vectors is None


def test_an_aborted_request_ends_with_abort_and_leaves_the_others_whole(
        tiny_engine: EncoderEngine) -> None:
    gate_open = threading.Event()

    class HeldGate(ScriptedGate):
        def check_prefill(self, step: PrefillStep) -> dict[str, RequestRejected]:
            gate_open.wait(30)
            return super().check_prefill(step)

    with_gate(tiny_engine, HeldGate(max_rows=1 << 20))
    long = [tiny_engine.tokenize_input(text) for text in fitting(tiny_engine)]
    kept = tiny_engine.encode(EncodeRequest("kept", "embed", long[:3]))
    dropped = tiny_engine.encode(EncodeRequest("dropped", "embed", long))
    tiny_engine.abort("dropped")
    gate_open.set()
    assert next(iter(dropped)).finish_reason == "abort"
    assert next(iter(kept)).finish_reason == "stop"
    assert tiny_engine.stats()["queue_depth"] == 0 and not tiny_engine.progress()


def test_a_request_the_engine_cannot_serve_is_refused_before_it_queues(
        tiny_engine: EncoderEngine) -> None:
    from omlx_core.encoding import EncodeInput

    too_long = EncodeInput(tuple([5] * (tiny_engine.encoding_limits().max_length + 1)))
    for request, words in ((EncodeRequest("a", "score", [EncodeInput((1, 2))]), "answers"),
                           (EncodeRequest("b", "embed", []), "at least one"),
                           (EncodeRequest("c", "embed", [too_long]), "tokens"),
                           (EncodeRequest("d", "embed", [EncodeInput((1, 10 ** 6))]),
                            "vocabulary")):
        with pytest.raises(ValueError, match=words):
            tiny_engine.encode(request)
    assert tiny_engine.stats()["requests"] == 0


# -- a cross-encoder --------------------------------------------------------------------------


def test_a_cross_encoder_scores_pairs_as_the_reference_classifies_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    path = cached_bert_model(cross_encoder=True, cache_dir=tmp_path_factory.mktemp("cross"))
    reference = NumpyBert(path)
    for engine in started_engine(path, "tiny-cross"):
        assert engine.tasks == frozenset({"rerank"})
        query = "how do I bake bread?"
        pairs = [engine.tokenize_pair(query, doc) for doc in TEXTS[:8]]
        assert all(item.token_type_ids is not None and item.token_type_ids[-1] == 1
                   for item in pairs)
        output = next(iter(engine.encode(EncodeRequest("scored", "score", pairs))))
        expected = [1 / (1 + np.exp(-reference.classify(list(p.token_ids),
                                                          list(p.token_type_ids))))
                    for p in pairs]
        assert np.allclose(output.scores, expected, atol=1e-4)
        assert np.argsort(output.scores).tolist() == np.argsort(expected).tolist()
        cut = engine.tokenize_pair(query, TEXTS[19], truncate_to=24)
        assert len(cut) == 24 and cut.token_ids[-1] == pairs[0].token_ids[-1]


# -- decoders as embedders and rerankers ------------------------------------------------------------


def decoder(tmp_path: Path, **table: Any) -> tuple[EncoderEngine, Any]:
    """A tiny random llama served with ``table`` as its [models] table, whose tokenizer
    has "yes" and "no" as tokens of their own (a reranker answers in one token), and the
    same model loaded by mlx-lm for the expected values."""
    from mlx_lm import load
    from tokenizers import Tokenizer

    from omlx_core.bootstrap import load_setup

    path = build_model("llama", tmp_path / "llama", overrides={"vocab_size": 520})
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.save(str(path / "tokenizer.json"))
    lines = "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())
    config = tmp_path / "omlx.toml"
    config.write_text(f'[models.dec]\npath = "{path}"\nengine = "encoder"\n{lines}')
    setup = load_setup("cpu-small", [config])
    engine = EncoderEngine(spec_for_path(path, engine="encoder"),
                           make_test_host(setup.config, model_id="dec"))
    engine.start()
    return engine, load(str(path))


def test_a_decoder_embeds_with_the_last_real_token_batched_as_alone(tmp_path: Path) -> None:
    import mlx.core as mx

    engine, (model, tokenizer) = decoder(tmp_path, task="embed")
    try:
        texts = ["hi", "The capital of France is Paris.", TEXTS[12], "a b"]
        inputs = [engine.tokenize_input(text) for text in texts]
        assert all(item.token_ids[-1] == tokenizer.eos_token_id for item in inputs)
        batched = next(iter(engine.encode(EncodeRequest("b", "embed", inputs)))).vectors
        for index, item in enumerate(inputs):
            states = model.model(mx.array([list(item.token_ids)]))[0]
            last = np.array(states[-1])
            expected = last / np.linalg.norm(last)
            alone = next(iter(engine.encode(EncodeRequest(f"a{index}", "embed", [item])))).vectors
            assert np.allclose(alone[0], expected, atol=1e-5)
            assert np.allclose(batched[index], alone[0], atol=1e-5)
            # not the padding's state, not the first token's
            wrong = np.array(states[0]) / np.linalg.norm(np.array(states[0]))
            assert not np.allclose(batched[index], wrong, atol=1e-3) or len(item) == 1
    finally:
        engine.shutdown()


def test_a_decoder_embedder_puts_its_instruction_before_queries_only(tmp_path: Path) -> None:
    engine, (_model, tokenizer) = decoder(tmp_path, task="embed", instruction="Find the capital")
    try:
        query = engine.tokenize_input("France", role="query")
        document = engine.tokenize_input("France", role="document")
        assert tokenizer.decode(list(query.token_ids)).startswith("Instruct: Find the capital\n")
        assert len(query) > len(document) and query.token_ids[-len(document):] == document.token_ids
    finally:
        engine.shutdown()


def test_a_decoder_reranker_scores_as_its_yes_and_no_logits_say(tmp_path: Path) -> None:
    import mlx.core as mx

    engine, (model, tokenizer) = decoder(tmp_path, task="rerank")
    try:
        yes, no = (tokenizer.convert_tokens_to_ids(word) for word in ("yes", "no"))
        pairs = [engine.tokenize_pair("capital of France?", doc) for doc in TEXTS[:6]]
        output = next(iter(engine.encode(EncodeRequest("r", "score", pairs))))
        expected = []
        for item in pairs:
            logits = model(mx.array([list(item.token_ids)]))[0, -1]
            expected.append(float(mx.sigmoid(logits[yes] - logits[no])))
        assert np.allclose(output.scores, expected, atol=1e-4)
        assert np.argsort(output.scores).tolist() == np.argsort(expected).tolist()
        assert engine.encoding_limits().scoring == "yes_no_logits"
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_the_default_model_served_with_task_embed_gives_the_same_vectors_batched_and_alone(
        default_model_dir: Path, tmp_path: Path) -> None:
    from omlx_core.bootstrap import load_setup

    config = tmp_path / "omlx.toml"
    config.write_text('[models.smollm2-embed]\nembedded = true\ntask = "embed"\n')
    setup = load_setup("cpu-small", [config])
    assert setup.config.models["smollm2-embed"].engine == "encoder"
    engine = EncoderEngine(spec_for_path(default_model_dir, engine="encoder"),
                           make_test_host(setup.config, model_id="smollm2-embed"))
    engine.start()
    try:
        texts = TEXTS[:12]
        batched = engine_vectors(engine, texts, "batched")
        alone = np.concatenate([engine_vectors(engine, [t], f"a{i}") for i, t in enumerate(texts)])
        assert batched.shape == (12, 576)
        # Equal to float32 rounding (a padded batch's matmuls block differently: ~1e-6).
        assert np.allclose(batched, alone, rtol=0, atol=1e-5), np.abs(batched - alone).max()
        assert np.min(np.sum(batched * alone, axis=1)) >= 0.99999
        assert engine.stats()["forwards"] >= 13
    finally:
        engine.shutdown()
