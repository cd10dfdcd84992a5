"""An omlx-core engine plugin that serves one request at a time.

Everything a plugin needs: a ``@hookimpl`` that registers an engine factory, and an
:class:`~omlx_core.engine.Engine` subclass. Its mlx work runs on the process's one MLX
thread (:mod:`omlx_core.mlx_thread`) as a worker stepped one token at a time, so it
shares the machine fairly with other engines. It honours temperature, top_p, top_k,
min_p and max_tokens; stop strings, penalties and batching are what the built-in
``batched`` engine is for.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any, Iterator, Mapping, Sequence

from omlx_core.engine import Engine, GenerationOutput, GenerationRequest, RequestHandle, Usage
from omlx_core.hookspecs import hookimpl
from omlx_core.mlx_thread import mlx_thread

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


class _Current:
    """The request being generated and its token stream."""

    def __init__(self, handle: _Handle, tokens: Iterator[Any]):
        self.handle = handle
        self.tokens = tokens
        self.completion = 0


class SequentialEngine(Engine):
    """Runs requests in arrival order, each to completion."""

    def __init__(self, model, config):
        self.model = model
        self._waiting: "collections.deque[_Handle]" = collections.deque()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._current: _Current | None = None
        self._thread = mlx_thread()

    # -- the Engine contract, called from any thread -----------------------------------

    def start(self) -> None:
        from omlx_core.models.loader import load_model

        self._model, self._tokenizer = self._thread.run(load_model, self.model.path)
        self._thread.attach(self)

    def shutdown(self) -> None:
        self._thread.detach(self)
        with self._lock:
            pending = list(self._waiting)
            self._waiting.clear()
        for handle in pending:
            self._finish(handle, "abort", 0)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        return list(self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **template_kwargs))

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def submit(self, request: GenerationRequest) -> RequestHandle:
        handle = _Handle(self, request)
        with self._lock:
            self._waiting.append(handle)
        self._thread.wake()
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
        self._thread.wake()

    # -- the Worker contract, called on the MLX thread -----------------------------------

    def has_work(self) -> bool:
        return self._current is not None or bool(self._waiting)

    def step(self) -> None:
        if self._current is None:
            with self._lock:
                handle = self._waiting.popleft()
            self._current = _Current(handle, self._generate(handle.request))
        current = self._current
        request_id = current.handle.request_id
        with self._lock:
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
        if aborted:
            return self._end("abort")
        response = next(current.tokens, None)
        if response is None:
            return self._end("length")
        current.completion = response.generation_tokens
        current.handle.outputs.put(GenerationOutput(request_id, response.text, (response.token,)))
        if response.finish_reason:
            self._end(response.finish_reason)

    def fail(self, exc: BaseException) -> None:
        if self._current is not None:
            handle = self._current.handle
            self._current = None
            handle.outputs.put(GenerationOutput(handle.request_id, finish_reason="error",
                                                error=str(exc)))
            handle.outputs.put(_DONE)

    def _generate(self, request: GenerationRequest) -> Iterator[Any]:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        sampling = request.sampling
        sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p,
                               top_k=sampling.top_k, min_p=sampling.min_p)
        return stream_generate(self._model, self._tokenizer, list(request.prompt_tokens),
                               max_tokens=sampling.max_tokens, sampler=sampler)

    def _end(self, reason: str) -> None:
        current, self._current = self._current, None
        self._finish(current.handle, reason, current.completion)

    @staticmethod
    def _finish(handle: _Handle, reason: str, completion: int) -> None:
        handle.outputs.put(GenerationOutput(
            handle.request_id, finish_reason=reason,
            usage=Usage(len(handle.request.prompt_tokens), completion)))
        handle.outputs.put(_DONE)
