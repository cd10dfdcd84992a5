"""An omlx-core engine plugin that serves one request at a time, memory-guarded.

Everything a plugin needs: a ``@hookimpl`` that registers an engine, and an engine
class that keeps the contract of :mod:`omlx_core.engine`:

- it is built as ``SequentialEngine(model, host)``; the :class:`~omlx_core.host.EngineHost`
  is all it uses of the server: the MLX thread its worker runs on, and ``host.memory``,
  where the enforcer leaves the latest limits and the forward gate it asks before every
  prefill chunk;
- it is a :class:`~omlx_core.engine.GuardedEngine`: :meth:`SequentialEngine.memory_hints`
  tells the memory guard how it allocates, so preflight (413) and admission cost its
  requests right;
- it streams token ids: the serving pipeline turns them into text with the engine's
  ``detokenizer()`` and handles stop strings;
- it honours the required sampling fields (temperature, top_p, top_k, min_p, seed,
  max_tokens, stop token ids) and declares no optional ones, so the serving pipeline
  refuses penalties, ``logit_bias`` and logprobs with a 400 instead of ignoring them.

The conformance suite (:mod:`omlx_core.testing.conformance`) checks all of this; its
tests in ``tests/test_conformance.py`` run it against this engine.
"""

from __future__ import annotations

import collections
import queue
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from omlx_core.engine import (
    EngineLimits,
    GenerationOutput,
    GenerationRequest,
    GuardedEngine,
    MemoryHints,
    QueuedRequestHandle,
    Usage,
)
from omlx_core.hookspecs import hookimpl
from omlx_core.scheduling import PrefillChunk, PrefillStep

#: prompt tokens one prefill forward takes (what memory_hints tells the guard)
PREFILL_STEP = 256


@hookimpl
def register_engines(register):
    register("sequential", SequentialEngine)


@dataclass
class _Request:
    """A request, and once it is served its cache, prefill progress and random key."""

    request: GenerationRequest
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cache: list[Any] | None = None
    key: Any = None
    prefilled: int = 0
    completion: int = 0
    last_token: int | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


class SequentialEngine(GuardedEngine):
    """Runs requests in arrival order, each to completion."""

    def __init__(self, model, host):
        super().__init__(model, host)
        self._waiting: "collections.deque[_Request]" = collections.deque()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._current: _Request | None = None

    # -- the Engine contract, called from any thread -----------------------------------

    def start(self) -> None:
        from omlx_core.scheduling import activation_dtype_bytes, load_model

        self._model, self._tokenizer = self.host.thread.run(load_model, self.model.path)
        self._dtype_bytes = self.host.thread.run(activation_dtype_bytes, self._model)
        self._vocab = int(self._model.args.vocab_size)
        self.host.thread.attach(self)

    def shutdown(self) -> None:
        self.host.thread.detach(self)
        with self._lock:
            pending, self._waiting = list(self._waiting), collections.deque()
        for request in pending:
            self._finish(request, "abort")

    def limits(self) -> EngineLimits:
        context = self.model.config.get("max_position_embeddings")
        return EngineLimits(context_length=context, vocab_size=self._vocab, max_running=1)

    def memory_hints(self) -> MemoryHints:
        # Prefill evaluates the cache only (the last prompt token is the first decode
        # step's input); one request at a time, so no padded batch.
        return MemoryHints(prefill_step_size=PREFILL_STEP, activation_dtype_bytes=self._dtype_bytes,
                           prefill_full_logits=False, cached_kv_resident=True,
                           decode_batch_padded=False)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        return list(self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **template_kwargs))

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def detokenizer(self) -> Any:
        return self._tokenizer.detokenizer

    def submit(self, request: GenerationRequest) -> QueuedRequestHandle:
        if not request.prompt_tokens:
            raise ValueError("prompt_tokens is empty; a request needs at least one prompt token")
        queued = _Request(request)
        with self._lock:
            self._waiting.append(queued)
        self.host.thread.wake()
        return QueuedRequestHandle(request.request_id, queued.outputs, self.abort)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
        self.host.thread.wake()

    def stats(self) -> dict[str, Any]:
        return {"queue_depth": len(self._waiting), "running": int(self._current is not None)}

    # -- the Worker contract, called on the MLX thread ------------------------------------

    def has_work(self) -> bool:
        return self._current is not None or bool(self._waiting) or bool(self._aborted)

    def step(self) -> None:
        import mlx.core as mx

        with self._lock:
            aborted, self._aborted = self._aborted, set()
            dropped = [r for r in self._waiting if r.request_id in aborted]
            for request in dropped:
                self._waiting.remove(request)
            taken = self._waiting.popleft() if self._current is None and self._waiting else None
        for request in dropped:
            self._finish(request, "abort")
        if taken is not None:
            self._current = self._begin(taken)
        current = self._current
        if current is None:
            return
        if current.request_id in aborted:
            return self._end("abort")
        prompt = list(current.request.prompt_tokens)
        if current.prefilled < len(prompt) - 1:
            return self._prefill_chunk(current, prompt)
        token_in = prompt[-1] if current.last_token is None else current.last_token
        logits = self._model(mx.array([[token_in]]), cache=current.cache)[:, -1, :]
        self._emit_token(current, self._sample(current, logits))

    def fail(self, exc: BaseException) -> None:
        if self._current is not None:
            self._end("error", error=f"{type(exc).__name__}: {exc}", error_type="internal")

    # -- one request -------------------------------------------------------------------

    def _begin(self, request: _Request) -> _Request:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        seed = request.request.sampling.seed
        request.cache = make_prompt_cache(self._model)
        request.key = mx.random.key(seed if seed is not None else secrets.randbits(32))
        return request

    def _prefill_chunk(self, current: _Request, prompt: list[int]) -> None:
        import mlx.core as mx

        start = current.prefilled
        end = min(len(prompt) - 1, start + PREFILL_STEP)
        step = PrefillStep(self.model.id, (PrefillChunk(current.request_id, end - start, start,
                                                        len(prompt)),),
                           decoding=0, chunk_size=PREFILL_STEP, limits=self.host.memory.limits,
                           model_config=self.model.config)
        gate = self.host.memory.forward_gate
        refused = gate.check_prefill(step) if gate is not None else {}
        if current.request_id not in refused:
            self._model(mx.array(prompt[start:end])[None], cache=current.cache)
            mx.eval([layer.state for layer in current.cache])
            current.prefilled = end
            refused = gate.check_after_prefill(step) if gate is not None else {}
        if current.request_id in refused:
            rejected = refused[current.request_id]
            self._end("error", error=str(rejected), rejected=rejected)

    def _sample(self, current: _Request, logits: Any) -> int:
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        sampling = current.request.sampling
        if sampling.temperature == 0:
            return int(mx.argmax(logits, axis=-1).item())
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        scaled = logprobs / sampling.temperature
        if 0 < sampling.top_k < scaled.shape[-1]:
            scaled = apply_top_k(scaled, sampling.top_k)
        if 0.0 < sampling.top_p < 1.0:
            scaled = apply_top_p(scaled, sampling.top_p)
        if sampling.min_p > 0.0:
            scaled = apply_min_p(scaled, sampling.min_p)
        # Each request draws from its own key, so its seed fixes its tokens whatever
        # else runs on the MLX thread.
        current.key, draw = mx.random.split(current.key)
        return int(mx.random.categorical(scaled, key=draw).item())

    def _emit_token(self, current: _Request, token: int) -> None:
        sampling = current.request.sampling
        current.completion += 1
        current.last_token = token
        if token in self._tokenizer.eos_token_ids or token in sampling.stop_token_ids:
            return self._end("stop")
        if current.completion >= sampling.max_tokens:
            return self._end("length", token_ids=(token,))
        current.outputs.put(GenerationOutput(current.request_id, token_ids=(token,)))

    def _end(self, reason: str, **output: Any) -> None:
        current, self._current = self._current, None
        self._finish(current, reason, **output)

    @staticmethod
    def _finish(request: _Request, reason: str, **output: Any) -> None:
        usage = Usage(len(request.request.prompt_tokens), request.completion)
        request.outputs.put(GenerationOutput(request.request_id, finish_reason=reason,
                                             usage=usage, **output))
