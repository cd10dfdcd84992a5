"""An embedding or rerank request from its job to its vectors or scores: the checks, in
the order they run, on the same path as generation (:meth:`ServingPipeline.encode`).

1. the model: one served for the task (``embed``; ``rerank``, which an embedding
   model also answers, by cosine similarity), named or (rerank) the first there is; a
   model served for something else is an :class:`InvalidRequest` naming the models that
   do the task. A lease on its engine from the model pool, which loads it if needed;
2. tokenization with the engine's own tokenizer (queries get the model's instruction,
   a reranker's pairs its prompt); token ids are checked against the vocabulary, and
   an input over the model's longest is refused naming the limit unless the job asks
   to truncate;
3. ``dimensions``: at most the model's, and shorter only for a model whose vectors
   may be shortened (Matryoshka);
4. the memory guard: preflight on the longest input alone (413: it can never fit),
   admission on the largest forward the request makes
   (:func:`~omlx_core.encoding.largest_forward`);
5. ``engine.encode`` and its one output; a client that leaves aborts it.

Nothing reaches the engine before every check passed. Vectors cut to ``dimensions``
are normalised again.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from omlx_core.encoding import (
    EncodeInput,
    EncodeOutput,
    EncodeRequest,
    EncodingEngine,
    EncodingLimits,
    largest_forward,
)
from omlx_core.memory.types import RequestRejected
from omlx_core.serving.errors import EngineFailed, InvalidRequest, RequestAborted, UnknownModel

# The pipeline is passed in, never imported: it imports this module (its encode()).
ServingPipeline = Any

#: the tasks a model may be served for that answer each kind of job
ANSWERS = {"embed": ("embed",), "rerank": ("rerank", "embed")}


@dataclass
class EncodeJob:
    """What to embed or rerank. An ``"embed"`` job has ``texts`` or ``token_ids``; a
    ``"rerank"`` job a ``query`` and ``documents``."""

    task: str
    #: ``None`` (rerank only): the first model served for reranking, else for embeddings
    model_id: str | None
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    query: str | None = None
    documents: list[str] | None = None
    #: ``"query"`` puts the model's instruction (if it has one) before each text
    input_type: str = "query"
    #: shorten every vector to this many values (then normalise again)
    dimensions: int | None = None
    #: cut inputs over the model's longest to fit, instead of refusing them
    truncate: bool = False
    #: cut every input to at most this many tokens (vLLM's ``truncate_prompt_tokens``)
    truncate_to: int | None = None
    #: the request field that holds the inputs, for error messages
    input_param: str = "input"
    keep_alive: Any = None
    id_prefix: str = "embd-"


@dataclass
class EncodeResult:
    """The answer to an :class:`EncodeJob`."""

    request_id: str
    model_id: str
    prompt_tokens: int
    #: ``"embed"``: float32 ``(inputs, dimensions)``
    vectors: np.ndarray | None = None
    #: ``"rerank"``: one relevance score per document, in document order
    scores: list[float] | None = None
    #: how the scores were made (``"cosine"``, ``"cross_encoder"``, ``"yes_no_logits"``)
    scoring: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def models_for(pipeline: ServingPipeline, task: str) -> list[str]:
    """The models a job of ``task`` may name, in the pool's order (rerankers before
    embedding models for a rerank)."""
    pool = pipeline.context.pool
    if pool is not None:
        tasks = {record.id: record.task for record in pool.records()}
    else:
        tasks = {model_id: next(iter(sorted(engine.tasks)), "generate")
                 for model_id, engine in pipeline.context.engines.items()}
    return [model_id for answering in ANSWERS[task] for model_id, own in tasks.items()
            if own == answering]


def _choose_model(pipeline: ServingPipeline, job: EncodeJob) -> str:
    able = models_for(pipeline, job.task)
    doing = "embeds" if job.task == "embed" else "reranks"
    if job.model_id is None:
        if not able:
            raise InvalidRequest(f"no model here {doing}; serve one with task = "
                                 f"\"{job.task}\" (GET /v1/models lists each model's task)",
                                 "model", "model_not_supported")
        return able[0]
    available = pipeline.available()
    if job.model_id not in available:
        raise UnknownModel(job.model_id, available)
    if job.model_id not in able:
        raise InvalidRequest(
            f"model {job.model_id!r} is not served for {'embeddings' if job.task == 'embed' else 'reranking'}"
            f"; models that {doing.rstrip('s')}: {', '.join(able) or 'none'}", "model",
            "model_not_supported")
    return job.model_id


def run_encode(pipeline: ServingPipeline, job: EncodeJob,
               client_gone: Callable[[], bool] | None = None) -> EncodeResult:
    """Run ``job`` through every check, the engine, and back (see the module docstring).

    :raises InvalidRequest: it cannot be served as sent (:class:`UnknownModel` for a
        model not served here).
    :raises RequestRejected: the memory guard refused it (its model's load, preflight,
        admission, a forward gate).
    :raises ModelLoadFailed: its model failed to load.
    :raises EngineFailed: the engine failed.
    :raises RequestAborted: it was aborted (the client left, the server is stopping).
    """
    arrived = time.monotonic()
    model_id = _choose_model(pipeline, job)
    try:
        lease = pipeline.lease(model_id, job.keep_alive)
    except RequestRejected as error:
        pipeline.events.rejected(model_id, error)
        raise
    try:
        engine = lease.engine
        if not isinstance(engine, EncodingEngine):
            raise InvalidRequest(f"model {model_id!r} is not served by an embedding or "
                                 "reranking engine", "model", "model_not_supported")
        limits = engine.encoding_limits()
        kind, inputs = _tokenize(engine, job, limits)
        _check_dimensions(job, limits, model_id)
        request_id = job.id_prefix + uuid.uuid4().hex
        output = _run(pipeline, engine, model_id, request_id, kind, inputs, limits, client_gone)
        tokens = sum(len(item) for item in inputs)
        pipeline.events.encoded(model_id, len(inputs), tokens, time.monotonic() - arrived)
    finally:
        lease.release()
    result = EncodeResult(request_id, model_id, tokens)
    if job.task == "embed":
        result.vectors = _shortened(output.vectors, job.dimensions)
    elif kind == "score":
        result.scores, result.scoring = list(output.scores), limits.scoring
    else:
        result.scores, result.scoring = _cosines(output.vectors), "cosine"
    return result


def _tokenize(engine: EncodingEngine, job: EncodeJob,
              limits: EncodingLimits) -> tuple[str, list[EncodeInput]]:
    """The request's kind for the engine and its inputs, checked against ``limits``."""
    param = job.input_param
    if job.task == "embed" and job.token_ids is not None:
        inputs = []
        for index, ids in enumerate(job.token_ids):
            if any(not 0 <= t < limits.vocab_size for t in ids):
                raise InvalidRequest(f"{param}[{index}] has token ids outside the vocabulary "
                                     f"(0..{limits.vocab_size - 1})", f"{param}[{index}]")
            cut = _cut_to(job, limits, len(ids), f"{param}[{index}]")
            inputs.append(EncodeInput(tuple(ids[:cut])))
        return "embed", inputs
    if job.task == "embed":
        items = [(f"{param}[{i}]", lambda to, t=text: engine.tokenize_input(
            t, role=job.input_type, truncate_to=to)) for i, text in enumerate(job.texts or [])]
        return "embed", [_tokenized(job, limits, name, make) for name, make in items]
    if limits.scoring != "cosine":
        items = [(f"documents[{i}]", lambda to, d=doc: engine.tokenize_pair(
            job.query, d, truncate_to=to)) for i, doc in enumerate(job.documents or [])]
        return "score", [_tokenized(job, limits, name, make) for name, make in items]
    items = [("query", lambda to: engine.tokenize_input(job.query, role="query", truncate_to=to))]
    items += [(f"documents[{i}]", lambda to, d=doc: engine.tokenize_input(
        d, role="document", truncate_to=to)) for i, doc in enumerate(job.documents or [])]
    return "embed", [_tokenized(job, limits, name, make) for name, make in items]


def _tokenized(job: EncodeJob, limits: EncodingLimits, param: str,
               make: Callable[[int | None], EncodeInput]) -> EncodeInput:
    try:
        item = make(job.truncate_to)
        cut = _cut_to(job, limits, len(item), param)
        return make(cut) if cut < len(item) else item
    except ValueError as exc:  # a cut that leaves no room for the text
        raise InvalidRequest(f"{param}: {exc}", param) from None


def _cut_to(job: EncodeJob, limits: EncodingLimits, length: int, param: str) -> int:
    """The length an input of ``length`` tokens is cut to (``length``: not cut)."""
    cap = min(limits.max_length, job.truncate_to or limits.max_length)
    if length <= cap:
        return length
    if job.truncate or job.truncate_to:
        return cap
    raise InvalidRequest(f"{param} is {length} tokens, over this model's {limits.max_length}-"
                         "token limit; shorten it, or send truncate: true to have it cut",
                         param, "context_length_exceeded")


def _check_dimensions(job: EncodeJob, limits: EncodingLimits, model_id: str) -> None:
    wanted = job.dimensions
    if wanted is None or job.task != "embed":
        return
    if wanted > limits.dimensions:
        raise InvalidRequest(f"dimensions={wanted} is over model {model_id!r}'s "
                             f"{limits.dimensions}; ask for 1 to {limits.dimensions}",
                             "dimensions")
    if wanted < limits.dimensions and not limits.matryoshka:
        raise InvalidRequest(
            f"model {model_id!r} gives {limits.dimensions}-dimensional vectors and does not "
            "declare Matryoshka training, so a shorter vector would not be an embedding; "
            f"leave dimensions out (or set [models.{model_id}] matryoshka = true if it was "
            "trained so)", "dimensions")


def _run(pipeline: ServingPipeline, engine: EncodingEngine, model_id: str, request_id: str,
         kind: str, inputs: list[EncodeInput], limits: EncodingLimits,
         client_gone: Callable[[], bool] | None) -> EncodeOutput:
    """Preflight, admission, the engine; the request's one output."""
    release = _reserve(pipeline, engine, request_id, inputs, limits)
    try:
        try:
            handle = engine.encode(EncodeRequest(request_id, kind, inputs))
        except ValueError as exc:
            raise InvalidRequest(f"the engine cannot serve this request: {exc}") from None
        except Exception as exc:
            raise EngineFailed(f"the engine failed to take the request: "
                               f"{type(exc).__name__}: {exc}") from exc
        pipeline.in_flight.add(request_id, handle, client_gone)
        try:
            output = None
            while output is None:
                output = handle.next_output(None)
        finally:
            pipeline.in_flight.remove(request_id)
            handle.close()
    finally:
        release()
    if output.finish_reason == "stop":
        return output
    if output.finish_reason == "abort":
        raise RequestAborted(output.error or "the request was aborted before it finished")
    if output.rejected is not None:
        pipeline.events.rejected(model_id, output.rejected)
        raise output.rejected
    if output.error_type == "invalid":
        raise InvalidRequest(f"the engine cannot serve this request: {output.error}")
    raise EngineFailed(output.error or "the engine reported an error")


def _reserve(pipeline: ServingPipeline, engine: EncodingEngine, request_id: str,
             inputs: list[EncodeInput], limits: EncodingLimits) -> Callable[[], None]:
    guard = pipeline.context.memory_guard
    if guard is None:
        return lambda: None
    lengths = [len(item) for item in inputs]
    rows, width = largest_forward(lengths, limits)
    try:
        guard.preflight_encode(engine, request_id, width)
        ticket = guard.admit_encode(engine, request_id, rows, width, sum(lengths))
    except RequestRejected as error:
        pipeline.events.rejected(engine.model.id, error)
        raise
    return ticket.release


def _normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def _shortened(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    if dimensions is None or dimensions >= vectors.shape[-1]:
        return vectors
    return _normalized(vectors[:, :dimensions])


def _cosines(vectors: np.ndarray) -> list[float]:
    """Cosine similarity of the first vector (the query) with each of the others."""
    unit = _normalized(vectors)
    return [float(score) for score in unit[1:] @ unit[0]]


__all__ = ["ANSWERS", "EncodeJob", "EncodeResult", "models_for", "run_encode"]
