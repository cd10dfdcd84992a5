"""The primary path: one request at a time, decoded by draft-and-verify on the MLX thread.

Each :meth:`PrimaryPath.step` does one bounded unit of work: one prefill chunk (asked of
the forward gate first, like every guarded engine's), or one speculation cycle:

1. the drafter proposes up to ``block_size - 1`` tokens after the anchor (the last
   committed token, not yet in the target's cache);
2. one target forward scores ``[anchor, drafts...]``;
3. the longest agreeing prefix is accepted (:mod:`.acceptance`) and the target adds
   its own next token after it;
4. the target's cache is rolled back past the rejected drafts (:mod:`.rollback`).

Every cycle emits at least one token, so a cycle whose draft missed costs about a
plain decode step.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from omlx_core.engine import (
    GenerationOutput,
    GenerationRequest,
    QueuedRequestHandle,
    RequestProgress,
    Usage,
)
from omlx_core.scheduling import PrefillChunk, PrefillStep
from omlx_core.scheduling import KeyStream, accept_greedy, accept_sampled
from omlx_core.scheduling import Drafter, DraftState
from omlx_core.plugins.dflash.memory import PrimaryPathGuard
from omlx_core.plugins.dflash.rollback import TargetCache

log = logging.getLogger(__name__)


class SpeculativeRequestHandle(QueuedRequestHandle):
    """A primary-path request's outputs, one item per speculation cycle (a cycle's tokens
    already come together; they are not merged further, so they stream as they come)."""


@dataclass
class SpeculationCounters:
    """Totals over every request the primary path served."""

    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class _Request:
    request: GenerationRequest
    outputs: queue.SimpleQueue
    cache: TargetCache
    draft: DraftState
    keys: KeyStream | None
    history: list[int]
    prefilled: int = 0
    completion: int = 0
    drafted: int = 0
    accepted: int = 0
    finished: bool = False
    pending_tokens: list[int] = field(default_factory=list)
    #: ``time.monotonic()`` when the path began it, and when its first token came
    began: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id


#: how soon a prefill chunk the gate held back (``wait``) is asked about again
RETRY_S = 0.05


class PrimaryPath:
    """The speculative worker the engine attaches to the MLX thread.

    :param model: the loaded target; :param tokenizer: its mlx-lm tokenizer wrapper.
    :param drafter: a loaded :class:`~.drafters.Drafter`.
    :param guard: where the enforcer's limits and the forward gate arrive.
    :param on_idle: called (on the MLX thread) each time a request ends, so the engine
        can route the next lone request here again.
    """

    def __init__(self, *, model: Any, tokenizer: Any, model_id: str, model_config: Any,
                 drafter: Drafter, guard: PrimaryPathGuard, prefill_step_size: int,
                 on_finished: Callable[[str, str], None] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.model_config = model_config
        self.drafter = drafter
        self.guard = guard
        self.prefill_step_size = prefill_step_size
        self.counters = SpeculationCounters()
        self._on_finished = on_finished
        self._lock = threading.Lock()
        self._waiting: deque[tuple[GenerationRequest, queue.SimpleQueue]] = deque()
        self._aborted: set[str] = set()
        self._current: _Request | None = None
        #: the id of the request this path serves or is about to (set under the lock)
        self._claimed: str | None = None
        #: when a prefill chunk the gate held back (``wait``) is asked about again
        self._retry_at = 0.0

    # -- called from request threads -------------------------------------------------

    def try_claim(self, request: GenerationRequest, outputs: queue.SimpleQueue) -> bool:
        """Take ``request`` if the path is idle; ``False`` leaves it to the fallback."""
        with self._lock:
            if self._claimed is not None:
                return False
            self._claimed = request.request_id
            self._waiting.append((request, outputs))
        return True

    def abort(self, request_id: str) -> bool:
        """Mark ``request_id`` aborted if this path has it; whether it had."""
        with self._lock:
            if request_id != self._claimed:
                return False
            self._aborted.add(request_id)
        return True

    @property
    def busy(self) -> bool:
        return self._claimed is not None

    def progress(self) -> list[RequestProgress]:
        """The request this path runs (none while it is idle or about to begin one)."""
        current = self._current
        if current is None:
            return []
        now, prompt = time.monotonic(), len(current.request.prompt_tokens)
        decoding = current.prefilled >= prompt - 1 and current.completion > 0
        return [RequestProgress(
            request_id=current.request_id, phase="decoding" if decoding else "prefilling",
            prompt_tokens=prompt, prefilled_tokens=current.prefilled,
            prefill_tokens=max(0, prompt - 1), completion_tokens=current.completion,
            max_tokens=int(current.request.sampling.max_tokens or 0), age_s=now - current.began,
            prefill_s=0.0 if decoding else now - current.began,
            decode_s=now - current.first_token_at if current.first_token_at else 0.0)]

    # -- the Worker contract, on the MLX thread ------------------------------------------

    def has_work(self) -> bool:
        if self._current is not None:
            return time.monotonic() >= self._retry_at or self._current_aborted()
        return bool(self._waiting)

    def wake_at(self) -> float | None:
        waiting = self._current is not None and self._retry_at > time.monotonic()
        return self._retry_at if waiting else None

    def _current_aborted(self) -> bool:
        with self._lock:
            return self._current is not None and self._current.request_id in self._aborted

    def step(self) -> None:
        if self._current is None:
            with self._lock:
                if not self._waiting:
                    return
                request, outputs = self._waiting.popleft()
            try:
                self._current = self._begin(request, outputs)
            except Exception as exc:
                log.exception("starting speculative request %s failed", request.request_id)
                outputs.put(GenerationOutput(
                    request.request_id, finish_reason="error", error=f"{type(exc).__name__}: {exc}",
                    error_type="internal", usage=Usage(len(request.prompt_tokens), 0)))
                with self._lock:
                    self._claimed = None
                return
        current = self._current
        if self._current_aborted():
            return self._end(current, GenerationOutput(current.request_id, finish_reason="abort"))
        prompt = current.request.prompt_tokens
        if current.prefilled < len(prompt) - 1:
            return self._prefill_chunk(current)
        self._speculate(current)

    def fail(self, exc: BaseException) -> None:
        current = self._current
        if current is not None:
            self._end(current, GenerationOutput(
                current.request_id, finish_reason="error", error=f"{type(exc).__name__}: {exc}",
                error_type="internal"))

    def shutdown(self) -> None:
        """Abort the waiting request and the running one (on the MLX thread)."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for request, outputs in waiting:
            outputs.put(GenerationOutput(request.request_id, finish_reason="abort",
                                         usage=Usage(len(request.prompt_tokens), 0)))
        if self._current is not None:
            self._end(self._current, GenerationOutput(self._current.request_id,
                                                      finish_reason="abort"))
        with self._lock:
            self._claimed = None

    # -- one request -------------------------------------------------------------------

    def _begin(self, request: GenerationRequest, outputs: queue.SimpleQueue) -> _Request:
        sampling = request.sampling
        keys = None
        if sampling.temperature > 0:
            keys = KeyStream(sampling.seed if sampling.seed is not None else secrets.randbits(63))
        prompt = [int(t) for t in request.prompt_tokens]
        self.counters.requests += 1
        return _Request(request, outputs, TargetCache(self.model), self.drafter.begin(prompt), keys,
                        history=list(prompt))

    def _prefill_chunk(self, current: _Request) -> None:
        prompt = current.history
        total = len(current.request.prompt_tokens)
        start = current.prefilled
        end = min(total - 1, start + self.prefill_step_size)
        # cached_tokens is the KV this request's earlier chunks wrote; nothing on this
        # path is ever reused from a cache (reused_tokens stays 0).
        step = PrefillStep(self.model_id, (PrefillChunk(current.request_id, end - start, start,
                                                        total),),
                           decoding=0, chunk_size=self.prefill_step_size, limits=self.guard.limits,
                           model_config=self.model_config)
        gate = self.guard.gate
        refused = gate.check_prefill(step) if gate is not None else {}
        if current.request_id in refused:
            rejected = refused[current.request_id]
            if rejected.wait:  # what holds the memory gives it back by itself: ask again
                self._retry_at = time.monotonic() + RETRY_S
                return None
            return self._refuse(current, rejected)
        tokens = prompt[start:end]
        capture = self._capture()
        with capture:
            current.cache.forward(tokens, logits=False)
        self.drafter.prefill(current.draft, tokens, capture.hidden())
        current.prefilled = end
        if gate is None:
            return
        # The forward's transient sits in mlx's buffer cache until emptied; a reading
        # that included it would count memory already free.
        mx.clear_cache()
        try:
            after = gate.check_after_prefill(step)
        except Exception:
            log.exception("post-forward memory check failed; request %s goes on",
                          current.request_id)
            return
        if current.request_id in after:
            self._refuse(current, after[current.request_id])

    def _capture(self) -> Any:
        from omlx_core.plugins.dflash.hidden import HiddenCapture

        return HiddenCapture(self.model, self.drafter.target_layer_ids)

    def _refuse(self, current: _Request, rejected: Any) -> None:
        self._end(current, GenerationOutput(current.request_id, finish_reason="error",
                                            error=str(rejected), rejected=rejected))

    def _speculate(self, current: _Request) -> None:
        sampling = current.request.sampling
        remaining = int(sampling.max_tokens) - current.completion
        # The target always adds one token after the accepted drafts. The first token
        # comes from a plain one-token forward, so it streams as soon as prefill ends.
        limit = min(self.drafter.block_size - 1, remaining - 1) if current.completion else 0
        draft = self.drafter.propose(current.draft, current.history, limit, sampling, current.keys)
        drafts = draft.tokens[:max(0, limit)]
        fed = [current.history[-1]] + drafts
        cache = current.cache
        if drafts and cache.hybrid:
            cache.checkpoint()
        capture = self._capture()
        with capture:
            logits = cache.forward(fed)
        if sampling.temperature == 0:
            verdict = accept_greedy(logits, drafts)
        else:
            log_q = draft.log_probs[:len(drafts)] if draft.log_probs is not None else None
            verdict = accept_sampled(logits, drafts, sampling, current.keys, log_q)
        kept = 1 + verdict.accepted
        cache.rollback(fed, kept)
        hidden = capture.hidden()
        self.drafter.commit(current.draft, fed, kept,
                            hidden[:, :kept] if hidden is not None else None)
        self.counters.cycles += 1
        self.counters.drafted += len(drafts)
        self.counters.accepted += verdict.accepted
        current.drafted += len(drafts)
        current.accepted += verdict.accepted
        for token in verdict.tokens:
            if self._emit(current, token):
                return
        self._flush(current)

    def _emit(self, current: _Request, token: int) -> bool:
        """Add one generated token; ``True`` when it ended the request."""
        sampling = current.request.sampling
        current.completion += 1
        current.first_token_at = current.first_token_at or time.monotonic()
        current.history.append(token)
        request_id = current.request_id
        eos = getattr(self.tokenizer, "eos_token_ids", ()) or ()
        if token in eos or token in sampling.stop_token_ids:
            self._end(current, GenerationOutput(request_id, finish_reason="stop"))
            return True
        current.pending_tokens.append(token)
        if current.completion >= sampling.max_tokens:
            self._end(current, GenerationOutput(request_id, finish_reason="length"))
            return True
        return False

    def _flush(self, current: _Request) -> None:
        if current.pending_tokens:
            current.outputs.put(GenerationOutput(current.request_id,
                                                 token_ids=tuple(current.pending_tokens)))
        current.pending_tokens.clear()

    def _end(self, current: _Request, output: GenerationOutput) -> None:
        if current.finished:
            return
        current.finished = True
        self._current = None
        self.drafter.end(current.draft)
        usage = Usage(len(current.request.prompt_tokens), current.completion,
                      draft_tokens=current.drafted, accepted_draft_tokens=current.accepted)
        current.outputs.put(GenerationOutput(
            output.request_id, token_ids=tuple(current.pending_tokens) + output.token_ids,
            finish_reason=output.finish_reason, error=output.error,
            error_type=output.error_type, rejected=output.rejected, usage=usage))
        current.pending_tokens.clear()
        with self._lock:
            self._aborted.discard(current.request_id)
            self._claimed = None
        if self._on_finished is not None:
            try:
                self._on_finished(current.request_id, output.finish_reason or "error")
            except Exception:
                log.exception("on_request_finished listener failed")


__all__ = ["PrimaryPath", "SpeculationCounters", "SpeculativeRequestHandle"]
