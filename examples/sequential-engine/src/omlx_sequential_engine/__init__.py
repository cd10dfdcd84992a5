"""An omlx-core engine plugin that serves one request at a time, memory-guarded.

Everything a plugin needs: a ``@hookimpl`` that registers an engine, and an engine
class that keeps the contract of :mod:`omlx_core.engine`:

- it is a :class:`~omlx_core.engine.GuardedEngine`: :meth:`SequentialEngine.memory_hints`
  tells the memory guard how it allocates, so preflight (413) and admission cost its
  requests right;
- it is its own :class:`~omlx_core.memory.gate.MemoryReceiver` (the built-in
  ``memory_guard`` plugin resolves it to itself): it keeps the latest limit snapshot and
  asks the forward gate before every prefill chunk, so a chunk that would run the
  machine out of memory is refused before it runs;
- its mlx work runs on the process's one MLX thread as a worker stepped one chunk or
  one token at a time, so it shares the machine fairly with other engines;
- it honours the required sampling fields (temperature, top_p, top_k, min_p, seed,
  max_tokens, stop strings and stop token ids) and declares no optional ones, so the
  serving pipeline refuses penalties, ``logit_bias`` and logprobs with a 400 instead of
  ignoring them.

The conformance suite (:mod:`omlx_core.testing.conformance`) checks all of this; its
tests in ``tests/test_conformance.py`` run it against this engine.
"""

from __future__ import annotations

import collections
import queue
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from omlx_core.engine import (
    EngineLimits,
    GenerationOutput,
    GenerationRequest,
    GuardedEngine,
    MemoryHints,
    RequestHandle,
    Usage,
)
from omlx_core.hookspecs import hookimpl
from omlx_core.memory.gate import ForwardGate, MemoryReceiver, PrefillChunk, PrefillStep
from omlx_core.mlx_thread import mlx_thread
from omlx_core.text import TextAssembler

#: prompt tokens one prefill forward takes (what memory_hints tells the guard)
PREFILL_STEP = 256
_DONE = object()


@hookimpl
def register_engines(register):
    register("sequential", SequentialEngine)


class _Handle(RequestHandle):
    def __init__(self, engine: "SequentialEngine", request: GenerationRequest):
        self.request_id = request.request_id
        self.request = request
        self._engine = engine
        self.outputs: "queue.Queue[Any]" = queue.Queue()

    def __iter__(self) -> Iterator[GenerationOutput]:
        while (item := self.outputs.get()) is not _DONE:
            yield item

    def close(self) -> None:
        self._engine.abort(self.request_id)


@dataclass
class _Current:
    """The request being served: its cache, how far its prompt is prefilled, its text."""

    handle: _Handle
    cache: list[Any]
    text: TextAssembler
    key: Any
    prefilled: int = 0
    completion: int = 0
    last_token: int | None = None


class SequentialEngine(GuardedEngine, MemoryReceiver):
    """Runs requests in arrival order, each to completion."""

    def __init__(self, model, config):
        self.model = model
        self._waiting: "collections.deque[_Handle]" = collections.deque()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._current: _Current | None = None
        #: the request the MLX thread has taken from the queue (set under the lock)
        self._current_id: str | None = None
        self._thread = mlx_thread()
        self._limits = None
        self._gate: ForwardGate | None = None

    # -- the Engine contract, called from any thread -----------------------------------

    def start(self) -> None:
        from omlx_core.models.loader import activation_dtype_bytes, load_model

        self._model, self._tokenizer = self._thread.run(load_model, self.model.path)
        self._dtype_bytes = self._thread.run(activation_dtype_bytes, self._model)
        self._vocab = int(self._model.args.vocab_size)
        self._thread.attach(self)

    def shutdown(self) -> None:
        self._thread.detach(self)
        with self._lock:
            pending = list(self._waiting)
            self._waiting.clear()
        for handle in pending:
            self._finish(handle, GenerationOutput(handle.request_id, finish_reason="abort"))

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

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not request.prompt_tokens:
            raise ValueError("prompt_tokens is empty; a request needs at least one prompt token")
        handle = _Handle(self, request)
        with self._lock:
            self._waiting.append(handle)
        self._thread.wake()
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            waiting = [h for h in self._waiting if h.request_id == request_id]
            for handle in waiting:
                self._waiting.remove(handle)
            if request_id == self._current_id:
                self._aborted.add(request_id)
        for handle in waiting:
            self._finish(handle, GenerationOutput(request_id, finish_reason="abort"))
        self._thread.wake()

    def stats(self) -> dict[str, Any]:
        return {"queue_depth": len(self._waiting), "running": int(self._current is not None)}

    # -- the MemoryReceiver contract, called from the enforcer's thread ------------------

    def apply_memory_limits(self, snapshot) -> None:
        self._limits = snapshot

    def set_forward_gate(self, gate: ForwardGate | None) -> None:
        self._gate = gate

    # -- the Worker contract, called on the MLX thread ------------------------------------

    def has_work(self) -> bool:
        return self._current is not None or bool(self._waiting)

    def step(self) -> None:
        import mlx.core as mx

        if self._current is None:
            with self._lock:
                if not self._waiting:
                    return
                handle = self._waiting.popleft()
                self._current_id = handle.request_id
            self._current = self._begin(handle)
        current = self._current
        request_id = current.handle.request_id
        with self._lock:
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
        if aborted:
            return self._end(GenerationOutput(request_id, finish_reason="abort"))
        prompt = list(current.handle.request.prompt_tokens)
        if current.prefilled < len(prompt) - 1:
            return self._prefill_chunk(current, prompt)
        token_in = prompt[-1] if current.last_token is None else current.last_token
        logits = self._model(mx.array([[token_in]]), cache=current.cache)[:, -1, :]
        token = self._sample(current, logits)
        self._emit_token(current, token)

    def fail(self, exc: BaseException) -> None:
        if self._current is not None:
            self._end(GenerationOutput(self._current.handle.request_id, finish_reason="error",
                                       error=f"{type(exc).__name__}: {exc}", error_type="internal"))

    # -- one request -------------------------------------------------------------------

    def _begin(self, handle: _Handle) -> _Current:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        sampling = handle.request.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        return _Current(handle, make_prompt_cache(self._model),
                        TextAssembler(self._tokenizer.detokenizer, sampling.stop),
                        mx.random.key(seed))

    def _prefill_chunk(self, current: _Current, prompt: list[int]) -> None:
        import mlx.core as mx

        start = current.prefilled
        end = min(len(prompt) - 1, start + PREFILL_STEP)
        step = PrefillStep(self.model.id, (PrefillChunk(current.handle.request_id, end - start,
                                                        start, len(prompt)),),
                           decoding=0, chunk_size=PREFILL_STEP, limits=self._limits,
                           model_config=self.model.config)
        gate = self._gate
        refused = gate.check_prefill(step) if gate is not None else {}
        if current.handle.request_id in refused:
            rejected = refused[current.handle.request_id]
            return self._end(GenerationOutput(current.handle.request_id, finish_reason="error",
                                              error=str(rejected), rejected=rejected))
        self._model(mx.array(prompt[start:end])[None], cache=current.cache)
        mx.eval([layer.state for layer in current.cache])
        current.prefilled = end
        after = gate.check_after_prefill(step) if gate is not None else {}
        if current.handle.request_id in after:
            rejected = after[current.handle.request_id]
            self._end(GenerationOutput(current.handle.request_id, finish_reason="error",
                                       error=str(rejected), rejected=rejected))

    def _sample(self, current: _Current, logits: Any) -> int:
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        sampling = current.handle.request.sampling
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

    def _emit_token(self, current: _Current, token: int) -> None:
        sampling = current.handle.request.sampling
        request_id = current.handle.request_id
        current.completion += 1
        current.last_token = token
        if token in self._tokenizer.eos_token_ids or token in sampling.stop_token_ids:
            text, _ = current.text.finish()
            return self._end(GenerationOutput(request_id, text, finish_reason="stop"))
        text, stopped = current.text.add(token)
        if stopped:
            return self._end(GenerationOutput(request_id, text, (token,), finish_reason="stop",
                                              stop_sequence=current.text.stop_sequence))
        if current.completion >= sampling.max_tokens:
            tail, stopped = current.text.finish()
            return self._end(GenerationOutput(
                request_id, text + tail, (token,), finish_reason="stop" if stopped else "length",
                stop_sequence=current.text.stop_sequence))
        current.handle.outputs.put(GenerationOutput(request_id, text, (token,)))

    def _end(self, output: GenerationOutput) -> None:
        current, self._current = self._current, None
        with self._lock:
            self._current_id = None
            self._aborted.discard(output.request_id)
        completion = current.completion if current is not None else 0
        self._finish(current.handle, output, completion)

    @staticmethod
    def _finish(handle: _Handle, output: GenerationOutput, completion: int = 0) -> None:
        usage = Usage(len(handle.request.prompt_tokens), completion)
        handle.outputs.put(GenerationOutput(
            output.request_id, output.text, output.token_ids, finish_reason=output.finish_reason,
            error=output.error, error_type=output.error_type, rejected=output.rejected,
            stop_sequence=output.stop_sequence, usage=usage))
        handle.outputs.put(_DONE)
