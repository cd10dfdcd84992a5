"""The encoder engine: embeddings and relevance scores from one model, batched across
requests, every forward asked of the memory guard's forward gate first.

Requests arrive tokenized (:meth:`EncoderEngine.encode`); their inputs wait in arrival
order, and each step of the MLX thread runs one forward over the inputs
:func:`~.batching.plan_forward` picks (the oldest waiting input and those nearest it in
length, within ``max_batch_tokens`` padded tokens and ``max_batch_rows`` rows). Before
the forward, the gate gets a :class:`~omlx_core.memory.gate.PrefillStep` with one chunk
per row at the forward's padded width (``encode=True``: nothing is cached). When it
refuses a forward of several rows, the next one takes half as many rows (the cap grows
back after each forward that ran); a lone row refused while other requests wait is
retried a moment later; a lone row of the only request ends it with the rejection
(HTTP 503 with ``Retry-After``). After the forward, ``check_after_prefill`` is the
backstop, as for a prefill.

The engine shares the MLX thread with the chat engines. While another of its workers
has work, a forward is cut to what takes ``busy_forward_ms`` at the measured speed, and
the next one waits until forwards have taken no more than ``busy_share`` of the time:
chat streams keep their speed beside an embedding client; alone, embeddings take the
whole thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omlx_core.encoding import (
    EncodeOutput,
    EncodeRequest,
    EncodingEngine,
    EncodingLimits,
    EncodeInput,
)
from omlx_core.engine import EngineLimits, MemoryHints, QueuedRequestHandle, RequestProgress
from omlx_core.memory.gate import PrefillChunk, PrefillStep
from omlx_core.plugins.encoder.backbone import BertBackbone, DecoderBackbone, PaddedBatch
from omlx_core.plugins.encoder.batching import Waiting, padded_tokens, plan_forward
from omlx_core.plugins.encoder.layout import EncoderLayout, read_layout

if TYPE_CHECKING:
    from omlx_core.host import EngineHost
    from omlx_core.models.registry import ModelSpec

log = logging.getLogger(__name__)

#: seconds per padded token assumed before the first forward was timed (a slow CPU's
#: small encoder): the first forward beside chat stays short
UNMEASURED_S_PER_TOKEN = 1e-3
#: how long a lone row the gate refused waits before it is asked about again, while
#: other requests are in the engine (their forwards may free the room)
RETRY_S = 0.05


@dataclass
class _Job:
    """One request inside the engine: its inputs, what is done, where its output goes."""

    request: EncodeRequest
    seq: int
    arrived: float
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    results: dict[int, Any] = field(default_factory=dict)
    started: float | None = None
    done_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tokens(self) -> int:
        return sum(len(item) for item in self.request.inputs)

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.request.inputs)


def load_backbone(path: Any, layout: EncoderLayout, config: dict[str, Any]) -> Any:
    """The backbone ``layout`` names, loaded (call on the MLX thread)."""
    kind = BertBackbone if layout.backbone == "bert" else DecoderBackbone
    return kind(path, layout, config)


class EncoderEngine(EncodingEngine):
    """Embeds or scores with one model (see the module docstring)."""

    def __init__(self, model: ModelSpec, host: EngineHost):
        super().__init__(model, host)
        self.layout = read_layout(model.path, model.config, host.model_entry)
        self.tasks = frozenset({self.layout.task})
        self.kind = "embed" if self.layout.task == "embed" else "score"
        self.max_batch_tokens = int(host.model_setting("max_batch_tokens",
                                                       "plugin.encoder.max_batch_tokens"))
        self.max_batch_rows = int(host.model_setting("max_batch_rows",
                                                     "plugin.encoder.max_batch_rows"))
        self.busy_share = float(host.model_setting("busy_share", "plugin.encoder.busy_share"))
        self.busy_forward_s = float(host.model_setting(
            "busy_forward_ms", "plugin.encoder.busy_forward_ms")) / 1000
        #: measured seconds per padded token of a forward (moving average)
        self._s_per_token: float | None = None
        self._backbone: Any = None
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._waiting: deque[Waiting] = deque()
        self._aborted: set[str] = set()
        self._seq = itertools.count()
        self._row_cap = self.max_batch_rows
        self._retry_at = 0.0
        self._running: list[_Job] = []
        self.counters = {"requests": 0, "forwards": 0, "rows": 0, "tokens": 0,
                         "padded_tokens": 0, "gate_splits": 0, "gate_waits": 0, "refused": 0,
                         "paced_s": 0.0}

    # -- the contract, from any thread ---------------------------------------------------

    def start(self) -> None:
        self._backbone = self.host.thread.run(load_backbone, self.model.path, self.layout,
                                              dict(self.model.config))
        self.host.thread.attach(self)

    def shutdown(self) -> None:
        self.host.thread.detach(self)
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            self._waiting.clear()
        for job in jobs:
            self._put(job, "abort", error="the server is shutting down")
        self.host.thread.run(self._drop_backbone)

    def _drop_backbone(self) -> None:
        self._backbone = None

    def encoding_limits(self) -> EncodingLimits:
        backbone = self._backbone
        return EncodingLimits(
            max_length=backbone.max_length, vocab_size=backbone.vocab_size,
            dimensions=backbone.dimensions if self.kind == "embed" else 0,
            max_batch_tokens=self.max_batch_tokens, max_batch_rows=self.max_batch_rows,
            matryoshka=self.layout.matryoshka, normalized=self.layout.normalize,
            scoring=self.layout.scoring)

    def limits(self) -> EngineLimits:
        backbone = self._backbone
        return EngineLimits(context_length=backbone.max_length, vocab_size=backbone.vocab_size,
                            max_running=self.max_batch_rows)

    def memory_hints(self) -> MemoryHints:
        return MemoryHints(prefill_step_size=self.max_batch_tokens,
                           activation_dtype_bytes=self._backbone.dtype_bytes,
                           prefill_full_logits=False, cached_kv_resident=True,
                           decode_batch_padded=False)

    def tokenize_input(self, text: str, *, role: str = "document",
                       truncate_to: int | None = None) -> EncodeInput:
        return self._backbone.tokenize_input(text, role, truncate_to)

    def tokenize_pair(self, query: str, document: str, *,
                      truncate_to: int | None = None) -> EncodeInput:
        if self.kind != "score":
            return super().tokenize_pair(query, document, truncate_to=truncate_to)
        return self._backbone.tokenize_pair(query, document, truncate_to)

    def encode(self, request: EncodeRequest) -> QueuedRequestHandle:
        if request.kind != self.kind:
            raise ValueError(f"model {self.model.id!r} answers {self.kind!r} requests, not "
                             f"{request.kind!r}")
        if not request.inputs:
            raise ValueError("an encode request needs at least one input")
        backbone = self._backbone
        for index, item in enumerate(request.inputs):
            if not 0 < len(item) <= backbone.max_length:
                raise ValueError(f"input {index} is {len(item)} tokens; this model takes 1 to "
                                 f"{backbone.max_length}")
            if any(not 0 <= t < backbone.vocab_size for t in item.token_ids):
                raise ValueError(f"input {index} has token ids outside the vocabulary "
                                 f"(0..{backbone.vocab_size - 1})")
        job = _Job(request, next(self._seq), time.monotonic())
        with self._lock:
            self._jobs[job.seq] = job
            self._waiting.extend(Waiting((job.seq, index), len(item))
                                 for index, item in enumerate(request.inputs))
            self.counters["requests"] += 1
        self.host.thread.wake()
        return QueuedRequestHandle(request.request_id, job.outputs, self.abort)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
        self.host.thread.wake()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            jobs = list(self._jobs.values())
        running = sum(1 for job in jobs if job.started is not None)
        return {"task": self.layout.task, "queue_depth": len(jobs) - running,
                "running": running, **self.counters}

    def progress(self) -> list[RequestProgress]:
        now = time.monotonic()
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda job: job.seq)
        rows = []
        for position, job in enumerate(j for j in jobs if j.started is None):
            rows.append(RequestProgress(job.request_id, "waiting", job.tokens,
                                        queue_position=position + 1, age_s=now - job.arrived))
        for job in jobs:
            if job.started is not None:
                rows.append(RequestProgress(
                    job.request_id, "encoding", job.tokens, prefilled_tokens=job.done_tokens,
                    prefill_tokens=job.tokens, age_s=now - job.arrived,
                    prefill_s=now - job.started))
        return rows

    # -- the worker, on the MLX thread ---------------------------------------------------

    def has_work(self) -> bool:
        if self._aborted:
            return True
        return bool(self._waiting) and time.monotonic() >= self._retry_at

    def wake_at(self) -> float | None:
        return self._retry_at if self._waiting and self._retry_at > time.monotonic() else None

    def step(self) -> None:
        self._end_aborted()
        busy = self.host.thread.others_busy(self)
        max_tokens = self.max_batch_tokens
        if busy:
            rate = self._s_per_token or UNMEASURED_S_PER_TOKEN
            max_tokens = min(max_tokens, max(1, int(self.busy_forward_s / rate)))
        with self._lock:
            plan = plan_forward(self._waiting, max_tokens=max_tokens, max_rows=self._row_cap)
            rows = [(self._jobs[item.key[0]], item.key[1]) for item in plan]
            pending = len(self._jobs)
        if not rows:
            return
        width = max(item.length for item in plan)
        step = PrefillStep(
            self.model.id, tuple(PrefillChunk(job.request_id, width, 0, item.length,
                                              forward=0 if len(plan) > 1 else None)
                                 for (job, _), item in zip(rows, plan)),
            decoding=0, chunk_size=padded_tokens(plan), limits=self.host.memory.limits,
            running=pending, model_config=self.model.config, encode=True)
        gate = self.host.memory.forward_gate
        refused = gate.check_prefill(step) if gate is not None else {}
        if refused:
            self._refused(rows, refused)
            return
        with self._lock:
            for item in plan:
                self._waiting.remove(item)
        self._running = [job for job, _ in rows]
        for job in self._running:
            job.started = job.started or time.monotonic()
        inputs = [job.request.inputs[index] for job, index in rows]
        started = time.monotonic()
        out = self._backbone.run(PaddedBatch.of(inputs, self._backbone.pad_id), self.kind)
        self._running = []
        self._count(plan)
        self._pace(time.monotonic() - started, padded_tokens(plan), busy)
        self._row_cap = min(self.max_batch_rows, self._row_cap * 2)
        for (job, index), value, item in zip(rows, out, plan):
            job.results[index] = value
            job.done_tokens += item.length
        stopped = gate.check_after_prefill(step) if gate is not None else {}
        for job, _ in rows:
            if job.request_id in stopped:
                self._end(job, "error", error=str(stopped[job.request_id]),
                          rejected=stopped[job.request_id])
            elif job.complete and job.seq in self._jobs:
                self._finish(job)

    def _pace(self, seconds: float, tokens: int, busy: bool) -> None:
        """Learn the forward's speed; while another engine has work, wait long enough
        that forwards take at most ``busy_share`` of the thread's time."""
        rate = seconds / max(1, tokens)
        self._s_per_token = rate if self._s_per_token is None else (
            0.7 * self._s_per_token + 0.3 * rate)
        if busy and self.busy_share < 1.0:
            self._retry_at = time.monotonic() + seconds * (1 - self.busy_share) / self.busy_share
            self.counters["paced_s"] += round(self._retry_at - time.monotonic(), 3)

    def _refused(self, rows: list[tuple[_Job, int]], refused: Any) -> None:
        """Act on the gate's refusal of the planned forward: fewer rows next time, a
        retry in a moment (the memory is given back by itself: other requests end), or
        the request's end."""
        if len(rows) > 1:
            self._row_cap = max(1, len(rows) // 2)
            self.counters["gate_splits"] += 1
            return
        job = rows[0][0]
        rejected = refused[job.request_id]
        if rejected.wait:  # other requests (or a helper's work) give the memory back
            self._retry_at = time.monotonic() + RETRY_S
            self.counters["gate_waits"] += 1
            return
        self.counters["refused"] += 1
        self._end(job, "error", error=str(rejected), rejected=rejected)

    def fail(self, exc: BaseException) -> None:
        # A failure outside a forward cannot say whose inputs caused it: every request
        # ends, or the next step would fail the same way.
        running, self._running = self._running, []
        if not running:
            with self._lock:
                running = list(self._jobs.values())
        for job in running:
            self._end(job, "error", error=f"{type(exc).__name__}: {exc}", error_type="internal")

    def _count(self, plan: list[Waiting]) -> None:
        self.counters["forwards"] += 1
        self.counters["rows"] += len(plan)
        self.counters["tokens"] += sum(item.length for item in plan)
        self.counters["padded_tokens"] += padded_tokens(plan)

    def _end_aborted(self) -> None:
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            jobs = [job for job in self._jobs.values() if job.request_id in aborted]
        for job in jobs:
            self._end(job, "abort", error="the request was aborted")

    def _finish(self, job: _Job) -> None:
        ordered = [job.results[index] for index in range(len(job.request.inputs))]
        with self._lock:
            self._jobs.pop(job.seq, None)
        if self.kind == "embed":
            self._put(job, "stop", vectors=np.stack(ordered).astype(np.float32))
        else:
            self._put(job, "stop", scores=tuple(float(score) for score in ordered))
        self.host.on_request_finished(job.request_id, "stop")

    def _end(self, job: _Job, reason: str, **output: Any) -> None:
        with self._lock:
            if self._jobs.pop(job.seq, None) is None:
                return
            self._waiting = deque(item for item in self._waiting if item.key[0] != job.seq)
        self._put(job, reason, **output)
        self.host.on_request_finished(job.request_id, reason)

    @staticmethod
    def _put(job: _Job, reason: str, **output: Any) -> None:
        job.outputs.put(EncodeOutput(job.request_id, reason, tokens=job.tokens, **output))


__all__ = ["EncoderEngine", "RETRY_S", "load_backbone"]
