"""The encoder engine's BERT against an independent float64 NumPy BERT written in the
tests (``tests/numpy_bert.py``: from the architecture's definition, not from the engine's
code), and all-MiniLM-L6-v2 against sentence-transformers' documented similarity.

The reference reads the checkpoint's safetensors by their Hugging Face names, runs each
text alone (no padding, no mask), with exact erf GELU, and mean-pools and normalises as
sentence-transformers' modules say. The engine runs the same texts in its padded,
masked, batched forwards and one by one: every vector must agree to cosine >= 0.999.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from omlx_core.encoding import EncodeRequest
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.encoder.engine import EncoderEngine
from omlx_core.testing import make_test_host
from omlx_core.testing.encoder_models import TINY_MAX_SEQ_LENGTH, cached_bert_model
from tests.numpy_bert import NumpyBert

#: sentence-transformers' documentation: util.cos_sim of these two with all-MiniLM-L6-v2
DOCUMENTED_PAIR = ("A man is eating food.", "A man is eating a piece of bread.")
DOCUMENTED_COSINE = 0.7553

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "hi",
    "Paris",
    "The capital of France is Paris; the capital of Italy is Rome; the capital of Japan is Tokyo.",
    "How do I bake bread? Mix flour, water, salt and yeast; knead the dough for ten minutes; "
    "let it rise for an hour; shape the loaf; bake it in a hot oven until the crust is brown.",
    "Numbers too: 1, 2, 3, 10, 42, 100, 2048, 3.14, 50%, $20 and x = y + 1.",
    "Water boils at one hundred degrees at sea level, and freezes at zero.",
    "What is the weather like today? It is sunny in the morning, cloudy in the afternoon, and "
    "it will probably rain tonight. Please remember to bring an umbrella.",
    "Seven days make a week, twelve months make a year, and there are four seasons: spring, "
    "summer, autumn and winter.",
    "user@example.com #tag A -> B",
    "Ünïcödé têxt wïth àccents and émojis 🙂",
    " ".join(["The server keeps a careful account of every byte it hands out."] * 8),
    " ".join(["A journey of a thousand miles begins with a single step."] * 3),
    "x",
]


# -- the engine ------------------------------------------------------------------------------


def started_engine(path: Path, model_id: str) -> Iterator[EncoderEngine]:
    engine = EncoderEngine(spec_for_path(path, engine="encoder"),
                           make_test_host("cpu-small", model_id=model_id))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def engine_vectors(engine: EncoderEngine, texts: list[str], request_id: str) -> np.ndarray:
    inputs = [engine.tokenize_input(text) for text in texts]
    output = next(iter(engine.encode(EncodeRequest(request_id, "embed", inputs))))
    assert output.finish_reason == "stop", output.error
    return output.vectors


def agreement(engine: EncoderEngine, reference: NumpyBert, texts: list[str]) -> dict[str, Any]:
    """The worst cosine between the engine's and the reference's vector of each text,
    batched (one request) and unbatched (a request per text)."""
    expected = np.stack([reference.embed(t, engine.encoding_limits().max_length) for t in texts])
    batched = engine_vectors(engine, texts, "batched")
    alone = np.concatenate([engine_vectors(engine, [t], f"alone-{i}") for i, t in enumerate(texts)])

    def worst(vectors: np.ndarray) -> float:
        return float(np.min(np.sum(vectors.astype(np.float64) * expected, axis=1)
                            / np.linalg.norm(vectors, axis=1)))

    return {"batched": worst(batched), "unbatched": worst(alone),
            "forwards": engine.stats()["forwards"]}


# -- a tiny random BERT (fast) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EncoderEngine]:
    path = cached_bert_model(cache_dir=tmp_path_factory.mktemp("bert"))
    yield from started_engine(path, "tiny-bert")


def test_a_tiny_random_bert_agrees_with_the_numpy_reference_batched_and_alone(
        tiny_engine: EncoderEngine) -> None:
    reference = NumpyBert(tiny_engine.model.path)
    texts = [t for t in TEXTS if len(reference.tokenizer.encode(t).ids) <= TINY_MAX_SEQ_LENGTH]
    assert len(texts) >= 20
    lengths = {len(reference.tokenizer.encode(t).ids) for t in texts}
    assert min(lengths) <= 4 and max(lengths) >= 40, lengths  # mixed lengths, padded batches
    found = agreement(tiny_engine, reference, texts)
    assert found["batched"] >= 0.999 and found["unbatched"] >= 0.999, found


# -- the shipped model (all-MiniLM-L6-v2) --------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_engine() -> Iterator[EncoderEngine]:
    from omlx_core.models.default_embedding import ensure_default_embedding_model

    yield from started_engine(ensure_default_embedding_model(progress=False), "all-minilm-l6-v2")


@pytest.mark.slow
def test_minilm_reproduces_the_documented_similarity(minilm_engine: EncoderEngine) -> None:
    vectors = engine_vectors(minilm_engine, list(DOCUMENTED_PAIR), "pair")
    cosine = float(vectors[0] @ vectors[1])
    assert abs(cosine - DOCUMENTED_COSINE) <= 0.0005, cosine


@pytest.mark.slow
def test_minilm_agrees_with_the_numpy_reference_on_mixed_lengths_batched_and_alone(
        minilm_engine: EncoderEngine) -> None:
    reference = NumpyBert(minilm_engine.model.path)
    lengths = [len(reference.tokenizer.encode(t).ids) for t in TEXTS]
    assert len(TEXTS) >= 20 and min(lengths) <= 4 and max(lengths) >= 100, lengths
    found = agreement(minilm_engine, reference, TEXTS)
    assert found["batched"] >= 0.999 and found["unbatched"] >= 0.999, found


@pytest.mark.slow
def test_minilm_agrees_with_the_numpy_reference_on_short_texts_packed_in_one_forward(
        minilm_engine: EncoderEngine) -> None:
    """Inputs up to the packed route's width share a forward with no padding (one token
    axis, each attending to its own tokens): the same vectors as the reference's."""
    from omlx_core.plugins.encoder.cpu_routes import KERNEL_MAX_WIDTH

    reference = NumpyBert(minilm_engine.model.path)
    short = [t for t in TEXTS if len(reference.tokenizer.encode(t).ids) <= KERNEL_MAX_WIDTH]
    assert len(short) >= 15
    before = minilm_engine.stats()["forwards"]
    expected = np.stack([reference.embed(t, KERNEL_MAX_WIDTH) for t in short])
    batched = engine_vectors(minilm_engine, short, "short")
    assert minilm_engine.stats()["forwards"] == before + 1
    cosines = np.sum(batched.astype(np.float64) * expected, axis=1) / np.linalg.norm(batched, axis=1)
    assert float(cosines.min()) >= 0.999, cosines
