"""``POST /v1/embeddings`` and ``/v1/rerank`` (``/rerank``) on a real server on loopback:
the openai SDK's ``embeddings.create`` (float and base64), rerank over plain HTTP, models
in the pool by task, every kind of bad input a 400 naming the field before anything
reaches an engine, and an input that can never fit a 413 before any work.

Fast tests serve tiny random models (a chat llama, a BERT embedder, a cross-encoder,
loaded by the pool on demand); the slow ones serve the shipped all-MiniLM-L6-v2."""

from __future__ import annotations

import base64
import http.client
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.http import HTTPServer
from omlx_core.http.schemas import MAX_ENCODE_INPUTS
from omlx_core.server_context import ServerContext
from omlx_core.testing import cached_model
from omlx_core.testing.encoder_models import build_bert_model, cached_bert_model
from omlx_core.testing.waiting import wait_for

openai = pytest.importorskip("openai")

CHAT, EMBEDDER, RERANKER, HUGE = "tiny", "tiny-bert", "tiny-cross", "huge-heads"
DOCUMENTS = ["The capital of France is Paris.", "Water boils at one hundred degrees.",
             "How do I bake bread? Mix flour, water, salt and yeast.", "Paris"]


def post(server: HTTPServer, path: str, body: Any) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        connection.request("POST", path, body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def get(server: HTTPServer, path: str) -> Any:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        connection.request("GET", path)
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def start(tmp: Path, toml: str, **settings: str) -> ServerContext:
    config = tmp / "omlx.toml"
    config.write_text(toml)
    overrides = [(key.replace("__", "."), value, "test") for key, value in settings.items()]
    return start_engines(load_setup("cpu-small", [config], overrides), progress=False)


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerContext]:
    root = tmp_path_factory.mktemp("embed-models")
    context = start(tmp_path_factory.mktemp("config"), f"""
[server]
models = ["{CHAT}"]
embeddings = false

[models.{CHAT}]
path = "{cached_model("llama", cache_dir=root)}"

[models.{EMBEDDER}]
path = "{cached_bert_model(cache_dir=root)}"
task = "embed"

[models.{RERANKER}]
path = "{cached_bert_model(cross_encoder=True, cache_dir=root)}"
task = "rerank"
""")
    yield context
    stop_engines(context)


@pytest.fixture
def client(server: HTTPServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def decoded(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def error_of(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    return body["error"]


# -- answers --------------------------------------------------------------------------------


def test_the_openai_sdk_embeds_as_float_and_as_base64(client: Any) -> None:
    texts = ["hello world", "The capital of France is Paris.", "x"]
    floats = client.embeddings.create(model=EMBEDDER, input=texts)
    packed = client.embeddings.create(model=EMBEDDER, input=texts, encoding_format="base64")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == EMBEDDER
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    # Asked for base64, the SDK hands the strings over as sent: little-endian float32.
    assert np.allclose(np.array([decoded(d.embedding) for d in packed.data]), vectors, atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3
    one = client.embeddings.create(model=EMBEDDER, input="hello world", user="someone")
    assert np.allclose(one.data[0].embedding, vectors[0], atol=1e-5)


def test_token_id_inputs_are_encoded_as_given(server: HTTPServer, context: ServerContext) -> None:
    engine = context.engines.get(EMBEDDER) or context.pool.load(EMBEDDER).engine
    ids = list(engine.tokenize_input("hello world").token_ids)
    status, body = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": [ids, ids[:3]]})
    assert status == 200, body
    status, by_text = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": "hello world"})
    assert np.allclose(body["data"][0]["embedding"], by_text["data"][0]["embedding"], atol=1e-5)
    status, single = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": ids})
    assert status == 200 and len(single["data"]) == 1


def test_a_reranker_sorts_the_documents_with_their_indices(server: HTTPServer) -> None:
    for path in ("/v1/rerank", "/rerank"):
        status, body = post(server, path, {"model": RERANKER, "query": "capital of France",
                                           "documents": [DOCUMENTS[0], {"text": DOCUMENTS[1]},
                                                         *DOCUMENTS[2:]],
                                           "top_n": 3, "return_documents": True})
        assert status == 200, body
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == sorted(scores, reverse=True) and len(scores) == 3
        assert all(DOCUMENTS[r["index"]] == r["document"]["text"] for r in body["results"])
        assert body["model"] == RERANKER and body["scoring"] == "cross_encoder"
        assert body["usage"]["total_tokens"] > 0


def test_an_embedding_model_reranks_by_cosine_and_says_so(server: HTTPServer) -> None:
    status, body = post(server, "/v1/rerank", {"model": EMBEDDER, "query": "Paris",
                                               "documents": DOCUMENTS})
    assert status == 200 and body["scoring"] == "cosine", body
    assert sorted(r["index"] for r in body["results"]) == [0, 1, 2, 3]
    assert "document" not in body["results"][0]
    _, embedded = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": ["Paris", *DOCUMENTS],
                                                  "input_type": "query"})
    vectors = np.array([d["embedding"] for d in embedded["data"]])
    cosines = vectors[1:] @ vectors[0]
    assert np.allclose([r["relevance_score"] for r in body["results"]],
                       np.sort(cosines)[::-1], atol=1e-5)
    status, default = post(server, "/v1/rerank", {"query": "Paris", "documents": DOCUMENTS})
    assert status == 200 and default["model"] == RERANKER  # a reranker before an embedder


def test_models_list_their_task_and_the_pool_loads_encoders_on_demand(
        server: HTTPServer, context: ServerContext) -> None:
    models = {m["id"]: m for m in get(server, "/v1/models")["data"]}
    assert (models[CHAT]["task"], models[EMBEDDER]["task"], models[RERANKER]["task"]) == (
        "generate", "embed", "rerank")
    assert models[EMBEDDER]["engine"] == "encoder" and not models[EMBEDDER]["pinned"]
    health = get(server, "/health")
    assert health["pool"]["models"][EMBEDDER]["task"] == "embed"
    if EMBEDDER in health["engines"]:
        assert health["engines"][EMBEDDER]["task"] == "embed"
    spec = get(server, "/openapi.json")
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank"):
        assert "requestBody" in spec["paths"][path]["post"], path
    assert set(spec["components"]["schemas"]["EmbeddingsRequest"]["required"]) == {"model", "input"}


def test_truncate_cuts_an_input_the_model_cannot_take_whole(server: HTTPServer) -> None:
    long = "word " * 400
    status, body = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": long,
                                                   "truncate": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == 128, body
    for given in (16, 16.0):  # an integral float is a JSON Schema integer
        status, cut = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": long,
                                                      "truncate_prompt_tokens": given})
        assert status == 200 and cut["usage"]["prompt_tokens"] == 16, cut
    status, cut = post(server, "/rerank", {"model": RERANKER, "query": "q", "documents": [long],
                                           "truncate_prompt_tokens": 20.0, "top_n": 1.0})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 20, cut


# -- bad input: a 400 naming the field, before any engine sees it --------------------------------


BAD_EMBEDDINGS = [
    ({"model": EMBEDDER, "input": ""}, "input", "empty"),
    ({"model": EMBEDDER, "input": []}, "input", "empty"),
    ({"model": EMBEDDER, "input": ["a", ""]}, "input[1]", "empty"),
    ({"model": EMBEDDER, "input": [[]]}, "input[0]", "empty"),
    ({"model": EMBEDDER, "input": ["a"] * (MAX_ENCODE_INPUTS + 1)}, "input", "2048"),
    ({"model": EMBEDDER, "input": ["a", 3]}, "input[1]", "string"),
    ({"model": EMBEDDER, "input": [{"text": "a"}]}, "input[0]", "string"),
    ({"model": EMBEDDER, "input": [[101, 10 ** 6]]}, "input[0]", "vocabulary"),
    ({"model": EMBEDDER, "input": [5, 10 ** 6]}, "input[0]", "vocabulary"),
    ({"model": EMBEDDER, "input": [-1]}, "input[0]", "at least 0"),
    ({"model": EMBEDDER}, "input", "input"),
    ({"model": EMBEDDER, "input": "a", "dimensions": 0}, "dimensions", "at least 1"),
    ({"model": EMBEDDER, "input": "a", "dimensions": -3}, "dimensions", "at least 1"),
    ({"model": EMBEDDER, "input": "a", "dimensions": 33}, "dimensions", "32"),
    ({"model": EMBEDDER, "input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"model": EMBEDDER, "input": "a", "encoding_format": "int8"}, "encoding_format", "base64"),
    ({"model": EMBEDDER, "input": "word " * 400}, "input[0]", "128-token limit"),
    ({"model": EMBEDDER, "input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "at least 1"),
    ({"model": EMBEDDER, "input": "a", "keep_alive": "soon"}, "keep_alive", "keep_alive"),
    ({"model": CHAT, "input": "a"}, "model", EMBEDDER),
    ({"model": RERANKER, "input": "a"}, "model", EMBEDDER),
    ({"model": "", "input": "a"}, "model", "empty"),
]


@pytest.mark.parametrize("body,param,words", BAD_EMBEDDINGS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_EMBEDDINGS)])
def test_bad_embedding_requests_are_400_naming_the_field_and_reach_no_engine(
        server: HTTPServer, context: ServerContext, body: dict[str, Any], param: str,
        words: str) -> None:
    context.pool.load(EMBEDDER)
    before = {model_id: engine.stats().get("requests") for model_id, engine in
              context.engines.items()}
    status, answer = post(server, "/v1/embeddings", body)
    assert status == 400, answer
    error = error_of(answer)
    assert error["param"] == param and words in error["message"], error
    assert {model_id: engine.stats().get("requests") for model_id, engine in
            context.engines.items()} == before


BAD_RERANKS = [
    ({"model": RERANKER, "query": "q", "documents": []}, "documents", "empty"),
    ({"model": RERANKER, "query": "q"}, "documents", "documents"),
    ({"model": RERANKER, "query": "q", "documents": ["a", ""]}, "documents[1]", "non-empty"),
    ({"model": RERANKER, "query": "q", "documents": ["a", 7]}, "documents[1]", "non-empty"),
    ({"model": RERANKER, "query": "q", "documents": [{"title": "a"}]}, "documents[0].text",
     "missing"),
    ({"model": RERANKER, "query": "q", "documents": ["a"] * (MAX_ENCODE_INPUTS + 1)},
     "documents", "2048"),
    ({"model": RERANKER, "query": "", "documents": ["a"]}, "query", "empty"),
    ({"model": RERANKER, "documents": ["a"]}, "query", "query"),
    ({"model": RERANKER, "query": "q", "documents": ["a"], "top_n": 0}, "top_n", "at least 1"),
    ({"model": RERANKER, "query": "q", "documents": ["a"], "top_n": -1}, "top_n", "at least 1"),
    ({"model": RERANKER, "query": "q", "documents": ["a"], "return_documents": "yes"},
     "return_documents", "boolean"),
    ({"model": RERANKER, "query": "q", "documents": ["word " * 400]}, "documents[0]",
     "256-token limit"),
    ({"model": CHAT, "query": "q", "documents": ["a"]}, "model", RERANKER),
]


@pytest.mark.parametrize("body,param,words", BAD_RERANKS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_RERANKS)])
def test_bad_rerank_requests_are_400_naming_the_field_and_reach_no_engine(
        server: HTTPServer, context: ServerContext, body: dict[str, Any], param: str,
        words: str) -> None:
    context.pool.load(RERANKER)
    before = {model_id: engine.stats().get("requests") for model_id, engine in
              context.engines.items()}
    status, answer = post(server, "/rerank", body)
    assert status == 400, answer
    error = error_of(answer)
    assert error["param"] == param and words in error["message"], error
    assert {model_id: engine.stats().get("requests") for model_id, engine in
            context.engines.items()} == before


def test_an_unknown_model_is_404_naming_the_models(server: HTTPServer) -> None:
    status, body = post(server, "/v1/embeddings", {"model": "nope", "input": "a"})
    assert status == 404 and EMBEDDER in error_of(body)["message"]


# -- memory: an input that can never fit --------------------------------------------------------


def test_an_input_that_can_never_fit_is_413_before_any_work(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.test_http_api import small_ceiling

    # 64 one-wide heads: a 6,002-token input's attention scores alone are ~11 GiB.
    path = build_bert_model(tmp_path_factory.mktemp("huge"), max_seq_length=8192, overrides={
        "num_attention_heads": 64, "hidden_size": 64, "max_position_embeddings": 8192})
    context = start(tmp_path_factory.mktemp("guarded"),
                    f'[server]\nmodels = ["{HUGE}"]\nembeddings = false\n\n'
                    f'[models.{HUGE}]\npath = "{path}"\ntask = "embed"\n',
                    memory__tier="custom", memory__custom_ceiling=small_ceiling())
    try:
        assert wait_for(lambda: context.memory_guard.snapshot is not None)
        with HTTPServer(context, port=0) as server:
            status, body = post(server, "/v1/embeddings", {"model": HUGE,
                                                           "input": ["a", "a " * 6000]})
            assert status == 413, body
            error = error_of(body)
            assert error["code"] == "prefill_memory_exceeded" and error["binding_ceiling"] == "custom"
            assert error["estimated_bytes"] > error["limit_bytes"] and error["advice"]
            assert context.engines[HUGE].stats()["requests"] == 0
            status, body = post(server, "/v1/embeddings", {"model": HUGE, "input": ["a", "b c"]})
            assert status == 200, body
    finally:
        stop_engines(context)


# -- the shipped model on a real server -----------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    context = start(tmp_path_factory.mktemp("minilm"), '[server]\nmodels = ["all-minilm-l6-v2"]\n')
    try:
        with HTTPServer(context, port=0) as server:
            yield server
    finally:
        stop_engines(context)


@pytest.mark.slow
def test_the_shipped_model_through_the_openai_sdk_and_plain_http_rerank(
        minilm_server: HTTPServer) -> None:
    with openai.OpenAI(base_url=minilm_server.url + "/v1", api_key="unused",
                       max_retries=0) as client:
        pair = ["A man is eating food.", "A man is eating a piece of bread."]
        floats = client.embeddings.create(model="all-minilm-l6-v2", input=pair)
        packed = client.embeddings.create(model="all-minilm-l6-v2", input=pair,
                                          encoding_format="base64")
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (2, 384)
    assert abs(float(vectors[0] @ vectors[1]) - 0.7553) <= 0.0005
    assert np.allclose([decoded(d.embedding) for d in packed.data], vectors, atol=1e-6)
    status, body = post(minilm_server, "/v1/rerank", {
        "model": "all-minilm-l6-v2", "query": "What is the man eating?",
        "documents": ["The sky is blue today.", "A man is eating a piece of bread.",
                      "Cats sleep most of the day."], "return_documents": True})
    assert status == 200 and body["scoring"] == "cosine", body
    assert body["results"][0]["index"] == 1
    models = {m["id"]: m for m in get(minilm_server, "/v1/models")["data"]}
    assert models["all-minilm-l6-v2"]["task"] == "embed"


def test_base64_is_little_endian_float32(server: HTTPServer) -> None:
    _, floats = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": "hello"})
    _, packed = post(server, "/v1/embeddings", {"model": EMBEDDER, "input": "hello",
                                                "encoding_format": "base64"})
    assert np.allclose(decoded(packed["data"][0]["embedding"]), floats["data"][0]["embedding"],
                       atol=1e-7)
