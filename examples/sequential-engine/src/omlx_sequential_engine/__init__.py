"""An omlx-core engine plugin that serves one request at a time.

Everything a plugin needs: a ``@hookimpl`` that registers an engine factory, and an
:class:`~omlx_core.engine.Engine` subclass. All mlx work runs on the engine's own thread.
It honours temperature, top_p, top_k, min_p and max_tokens; stop strings, penalties and
batching are what the built-in ``batched`` engine is for.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator, Mapping, Sequence

from omlx_core.engine import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    RequestHandle,
    Usage,
)
from omlx_core.hookspecs import hookimpl

_DONE = object()


@hookimpl
def register_engines(register):
    register("sequential", SequentialEngine)


class _Handle(RequestHandle):
    def __init__(self, engine: "SequentialEngine", request_id: str):
        self.request_id = request_id
        self._engine = engine
        self.outputs: "queue.Queue[Any]" = queue.Queue()

    def __iter__(self) -> Iterator[GenerationOutput]:
        while (item := self.outputs.get()) is not _DONE:
            yield item

    def close(self) -> None:
        self._engine.abort(self.request_id)


class SequentialEngine(Engine):
    """Runs requests in arrival order, each to completion, on one worker thread."""

    def __init__(self, model, config):
        self.model = model
        self.default_max_tokens = config["engine.max_tokens"]
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._aborted: set[str] = set()
        self._ready = threading.Event()
        self._worker = threading.Thread(target=self._run, name="sequential-mlx", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> None:
        self._worker.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        self._requests.put(_DONE)
        self._worker.join(timeout=30)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        return list(self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **template_kwargs))

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def submit(self, request: GenerationRequest) -> RequestHandle:
        handle = _Handle(self, request.request_id)
        self._requests.put((request, handle))
        return handle

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def _run(self) -> None:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        from omlx_core.models.loader import load_model

        try:
            self._model, self._tokenizer = load_model(self.model.path)
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        while (item := self._requests.get()) is not _DONE:
            request, handle = item
            sampling = request.sampling
            sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p,
                                   top_k=sampling.top_k, min_p=sampling.min_p)
            completion, reason = 0, "length"
            try:
                for response in stream_generate(
                        self._model, self._tokenizer, list(request.prompt_tokens),
                        max_tokens=sampling.max_tokens, sampler=sampler):
                    if request.request_id in self._aborted:
                        reason = "abort"
                        break
                    completion = response.generation_tokens
                    handle.outputs.put(GenerationOutput(
                        request.request_id, response.text, (response.token,)))
                    if response.finish_reason:
                        reason = response.finish_reason
            except Exception as exc:  # report in-band; the next request still runs
                handle.outputs.put(GenerationOutput(request.request_id, finish_reason="error",
                                                    error=str(exc)))
                handle.outputs.put(_DONE)
                continue
            self._aborted.discard(request.request_id)
            handle.outputs.put(GenerationOutput(
                request.request_id, finish_reason=reason,
                usage=Usage(len(request.prompt_tokens), completion)))
            handle.outputs.put(_DONE)
