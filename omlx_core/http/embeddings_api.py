"""Embeddings and reranking over HTTP: OpenAI's ``POST /v1/embeddings`` and the
Cohere/Jina rerank shape (``POST /v1/rerank`` and ``/rerank``, as llama.cpp and vLLM
accept it). Translation only: the serving pipeline's :meth:`encode` runs the checks, the
model pool and the memory guard, as for every route."""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

import falcon
import numpy as np

from omlx_core.config.keep_alive import parse_keep_alive
from omlx_core.http.body import read_request
from omlx_core.http.errors import bad_request
from omlx_core.http.schemas import EMBEDDINGS_REQUEST, RERANK_REQUEST
from omlx_core.serving import EncodeJob, ServingPipeline


def _keep_alive(body: Mapping[str, Any]) -> Any:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        parse_keep_alive(value)
    except ValueError as exc:
        raise bad_request(f"keep_alive: {exc}", "keep_alive", "invalid_keep_alive") from None
    return value


def _truncation(body: Mapping[str, Any]) -> dict[str, Any]:
    cut = body.get("truncate_prompt_tokens")  # JSON's 16.0 is a schema integer too
    return {"truncate": bool(body.get("truncate")),
            "truncate_to": int(cut) if cut is not None else None,
            "keep_alive": _keep_alive(body)}


def embeddings_job(body: Mapping[str, Any]) -> EncodeJob:
    """The job of a schema-checked ``/v1/embeddings`` body."""
    given = body["input"]
    texts = token_ids = None
    if isinstance(given, str):
        texts = [given]
    elif all(isinstance(item, str) for item in given):
        texts = list(given)
    elif all(isinstance(item, list) for item in given):
        token_ids = [[int(t) for t in item] for item in given]
    else:
        token_ids = [[int(t) for t in given]]
    dimensions = body.get("dimensions")
    return EncodeJob("embed", body["model"], texts=texts, token_ids=token_ids,
                     input_type=body.get("input_type") or "query",
                     dimensions=int(dimensions) if dimensions is not None else None,
                     input_param="input", id_prefix="embd-", **_truncation(body))


def rerank_job(body: Mapping[str, Any]) -> EncodeJob:
    """The job of a schema-checked rerank body."""
    documents = [doc if isinstance(doc, str) else doc["text"] for doc in body["documents"]]
    return EncodeJob("rerank", body.get("model"), query=body["query"], documents=documents,
                     input_param="documents", id_prefix="rerank-", **_truncation(body))


#: one float32 of a vector as JSON: 9 significant digits are the fewest that give every
#: float32 back exactly, and printf formats them ~3x as fast as ``json.dumps`` writes the
#: 17-digit repr of the float64 each would become (a body ~40 % shorter for the client
#: to parse, too)
FLOAT32_FORMAT = "%.9g"


def _encoded(vector: np.ndarray, encoding_format: str) -> str:
    """``vector`` as the JSON text of its ``embedding`` field."""
    if encoding_format == "base64":
        return '"' + base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") + '"'
    if vector.dtype != np.float32 or not np.isfinite(vector).all():
        return json.dumps(vector.tolist())
    return "[" + ",".join([FLOAT32_FORMAT] * len(vector)) % tuple(vector.tolist()) + "]"


def embeddings_body(vectors: np.ndarray, encoding_format: str, model_id: str,
                    prompt_tokens: int) -> str:
    """The ``/v1/embeddings`` response's JSON text."""
    data = ",".join('{"object":"embedding","index":%d,"embedding":%s}'
                    % (index, _encoded(vector, encoding_format))
                    for index, vector in enumerate(vectors))
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return (f'{{"object":"list","data":[{data}],"model":{json.dumps(model_id)},'
            f'"usage":{json.dumps(usage)}}}')


class Embeddings:
    """``POST /v1/embeddings``."""

    def __init__(self, pipeline: ServingPipeline, max_body: int):
        self.pipeline = pipeline
        self.max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_request(req, self.max_body, EMBEDDINGS_REQUEST)
        result = self.pipeline.encode(embeddings_job(body),
                                      client_gone=req.env.get("waitress.client_disconnected"))
        encoding_format = body.get("encoding_format") or "float"
        resp.content_type = falcon.MEDIA_JSON
        resp.text = embeddings_body(result.vectors, encoding_format, result.model_id,
                                    result.prompt_tokens)


class Rerank:
    """``POST /v1/rerank`` and ``/rerank``: documents by relevance to the query, most
    relevant first, each with its ``index`` in the request. ``scoring`` says how the
    scores were made: ``cross_encoder`` or ``yes_no_logits`` (a reranker), ``cosine``
    (an embedding model: the cosine similarity of the query's and the document's vectors)."""

    def __init__(self, pipeline: ServingPipeline, max_body: int):
        self.pipeline = pipeline
        self.max_body = max_body

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_request(req, self.max_body, RERANK_REQUEST)
        job = rerank_job(body)
        result = self.pipeline.encode(job, client_gone=req.env.get("waitress.client_disconnected"))
        order = sorted(range(len(result.scores)), key=lambda i: -result.scores[i])
        if body.get("top_n") is not None:
            order = order[:int(body["top_n"])]
        with_documents = bool(body.get("return_documents"))
        results = []
        for index in order:
            entry: dict[str, Any] = {"index": index, "relevance_score": result.scores[index]}
            if with_documents:
                entry["document"] = {"text": job.documents[index]}
            results.append(entry)
        resp.media = {"id": result.request_id, "object": "rerank", "model": result.model_id,
                      "scoring": result.scoring, "results": results,
                      "usage": {"prompt_tokens": result.prompt_tokens,
                                "total_tokens": result.prompt_tokens}}


__all__ = ["Embeddings", "FLOAT32_FORMAT", "Rerank", "embeddings_body", "embeddings_job", "rerank_job"]
