"""Grammar compiles wait their turn: a bounded queue, shared fairly between clients, in
front of a few worker processes whose compiles stop at their deadline.

Unbounded, three slow grammars sent at once held both compile threads for minutes while
every other client's grammar (a tool call included) waited past its own time limit. Now:

- the queue holds ``grammar.compile_queue_size`` compiles waiting; past that, and past
  ``grammar.compile_queue_per_client`` of one client's waiting or running, a compile is
  refused at once (:class:`~omlx_core.grammar.errors.GrammarBusy`: 503 with
  ``Retry-After``);
- clients take turns: the next compile is the oldest of the client served longest ago
  (one never served first), so one client's flood does not delay another's grammar by
  more than the compiles already running;
- each grammar is compiled first in a
  :class:`~omlx_core.grammar.compile_worker.CompileWorker` process, killed past
  ``grammar.compile_timeout_s`` or past ``grammar.compile_memory_limit`` over the
  worker's idle size (a 400 naming the setting); a worker that grew is restarted, so what
  a compile took is given back. Only then is it compiled in the server (by the job's
  ``build``, on the same queue slot), where it takes what it took there. The workers'
  memory is counted in the server's footprint, which the memory guard judges;
- a compile that waited a whole deadline without starting is refused (503) rather than
  started late.

A client is what the HTTP front end sets in :data:`compile_client` for the request: the
API key it presented when the server has keys, else its address.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from omlx_core.grammar.compile_worker import CompileFailed, CompileKilled, CompileWorker
from omlx_core.grammar.errors import GrammarBusy, GrammarCompileTimeout, GrammarError
from omlx_core.memory.usage import (register_in_flight, register_reclaimable,
                                    unregister_in_flight, unregister_reclaimable)
from omlx_core.settings import format_size

__all__ = ["CompileJob", "CompileQueue", "CompileSettings", "compile_client", "compile_queue",
           "configure_compiles"]

log = logging.getLogger(__name__)

#: who is asking, for the queue's fairness (set per request by the HTTP front end)
compile_client: contextvars.ContextVar[str] = contextvars.ContextVar("compile_client",
                                                                     default="local")
#: a worker with no compile for this long ends (its memory back to the system)
WORKER_IDLE_S = 300.0


@dataclass(frozen=True)
class CompileSettings:
    """``grammar.*``: the defaults are ``tiers/base.toml``'s."""

    workers: int = 2
    queue_size: int = 16
    per_client: int = 4
    timeout_s: float = 10.0
    memory_limit: int = 1024**3

    @classmethod
    def from_config(cls, config: Any) -> CompileSettings:
        return cls(int(config["grammar.compile_workers"]), int(config["grammar.compile_queue_size"]),
                   int(config["grammar.compile_queue_per_client"]),
                   float(config["grammar.compile_timeout_s"]),
                   int(config["grammar.compile_memory_limit"]))


@dataclass
class CompileJob:
    """One grammar to compile for one tokenizer."""

    tokenizer_key: str
    #: the serialized tokenizer info, made when a worker does not have it yet
    tokenizer_info: Callable[[], str]
    #: what the worker compiles: kind, source and options
    request: dict[str, Any]
    #: the request field the grammar came from, for errors
    field: str
    #: compiles it in this process once the worker did within its limits
    build: Callable[[], Any]
    #: seconds the compile may run (the queue's own limit when ``None``)
    timeout_s: float | None = None
    client: str = "local"
    queued_at: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    #: its place in arrival order (set by the queue)
    order: int = 0


class _FairQueue:
    """Waiting jobs by client, bounded in all and per client; the next job is the oldest
    of the client served longest ago (one never served first)."""

    #: clients whose last turn is remembered at most (the others count as new)
    REMEMBERED = 1024

    def __init__(self) -> None:
        self.by_client: dict[str, deque[CompileJob]] = {}
        self.waiting = 0
        self._turns = 0
        self._last_turn: dict[str, int] = {}
        self._arrivals = 0

    def put(self, job: CompileJob) -> None:
        self._arrivals += 1
        job.order = self._arrivals
        self.by_client.setdefault(job.client, deque()).append(job)
        self.waiting += 1

    def take(self) -> CompileJob | None:
        if not self.by_client:
            return None
        client = min(self.by_client, key=lambda c: (self._last_turn.get(c, 0),
                                                    self.by_client[c][0].order))
        jobs = self.by_client[client]
        job = jobs.popleft()
        if not jobs:
            del self.by_client[client]
        self.waiting -= 1
        self._turns += 1
        self._last_turn[client] = self._turns
        if len(self._last_turn) > self.REMEMBERED:
            self._last_turn = {c: t for c, t in self._last_turn.items() if c in self.by_client}
        return job

    def of(self, client: str) -> int:
        return len(self.by_client.get(client, ()))


class CompileQueue:
    """The process's compile queue and its workers (one thread drives each worker)."""

    def __init__(self, settings: CompileSettings | None = None) -> None:
        self.settings = settings or CompileSettings()
        self._lock = threading.Condition()
        self._queue = _FairQueue()
        self._running: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self._workers: list[CompileWorker] = []
        #: names of the workers running a compile now
        self._busy: set[str] = set()
        self._closed = False
        register_reclaimable(self.release_idle)
        register_in_flight(self.busy_bytes)
        #: counters for /metrics and the benchmarks
        self.refused = 0
        self.killed = 0
        self.compiled = 0

    # -- submitting ---------------------------------------------------------------------

    def submit(self, job: CompileJob) -> Future:
        """Queue ``job``; its future ends with ``(job.build(), WorkerOutput)`` or raises
        (``CompileFailed``, ``GrammarError``, ``GrammarCompileTimeout``, ``GrammarBusy``).

        :raises GrammarBusy: the queue is full, or ``job.client`` has its share in it.
        """
        settings = self.settings
        with self._lock:
            if self._closed:
                raise GrammarBusy("the grammar compiler is shutting down", settings.timeout_s)
            mine = self._queue.of(job.client) + self._running.get(job.client, 0)
            if mine >= settings.per_client:
                self.refused += 1
                raise GrammarBusy(
                    f"this client already has {mine} grammars compiling or waiting to, its "
                    f"share of the compile queue (grammar.compile_queue_per_client = "
                    f"{settings.per_client}); retry when one has finished", self._retry_after())
            if self._queue.waiting >= settings.queue_size:
                self.refused += 1
                raise GrammarBusy(
                    f"the grammar compile queue is full ({self._queue.waiting} waiting, "
                    f"grammar.compile_queue_size = {settings.queue_size}); retry shortly",
                    self._retry_after())
            self._queue.put(job)
            self._ensure_threads()
            self._lock.notify()
        return job.future

    def _retry_after(self) -> float:
        """When a place is likely free: one compile's time limit, spread over the workers,
        for every job ahead."""
        settings = self.settings
        ahead = self._queue.waiting + sum(self._running.values())
        return max(1.0, math.ceil(settings.timeout_s * max(1, ahead) / max(1, settings.workers)))

    # -- the workers ----------------------------------------------------------------------

    def _ensure_threads(self) -> None:
        while len(self._threads) < self.settings.workers:
            worker = CompileWorker(f"grammar-compile-{len(self._threads)}")
            thread = threading.Thread(target=self._serve, args=(worker,), name=worker.name,
                                      daemon=True)
            self._workers.append(worker)
            self._threads.append(thread)
            thread.start()

    def _next(self, worker: CompileWorker) -> CompileJob | None:
        with self._lock:
            while True:
                if self._closed:
                    return None
                job = self._queue.take()
                if job is not None:
                    self._running[job.client] = self._running.get(job.client, 0) + 1
                    self._busy.add(worker.name)
                    return job
                if not self._lock.wait(WORKER_IDLE_S) and worker.running:
                    worker.stop()  # idle: give its memory back

    def _serve(self, worker: CompileWorker) -> None:
        # Every worker starts with the first grammar: what they hold is there from then
        # on, not added later by a burst of compiles. Starting counts as busy: the
        # guard does not stop a worker half-way through its start (which it did when
        # it reclaimed idle workers, each start then ending in a logged crash).
        with self._lock:
            self._busy.add(worker.name)
        try:
            worker.start()
        except Exception:
            if not self._closed:
                log.exception("grammar compile worker %s did not start; it is retried with "
                              "its first compile", worker.name)
        finally:
            with self._lock:
                self._busy.discard(worker.name)
        while (job := self._next(worker)) is not None:
            try:
                self._run(worker, job)
            finally:
                with self._lock:
                    self._busy.discard(worker.name)
                    left = self._running.get(job.client, 1) - 1
                    if left:
                        self._running[job.client] = left
                    else:
                        self._running.pop(job.client, None)
        worker.stop()

    def _run(self, worker: CompileWorker, job: CompileJob) -> None:
        settings = self.settings
        if not job.future.set_running_or_notify_cancel():
            return
        timeout = settings.timeout_s if job.timeout_s is None else job.timeout_s
        waited = time.monotonic() - job.queued_at
        if waited > max(timeout, settings.timeout_s):
            self.refused += 1
            job.future.set_exception(GrammarBusy(
                f"the grammar waited {waited:.1f} s for a compile worker "
                "(grammar.compile_workers are busy); retry shortly", self._retry_after()))
            return
        try:
            output = worker.compile(job.tokenizer_key, job.tokenizer_info, job.request,
                                    deadline_s=timeout, memory_limit=settings.memory_limit)
        except CompileKilled as killed:
            self.killed += 1
            job.future.set_exception(self._killed(job, killed, timeout))
            return
        except CompileFailed as failed:
            job.future.set_exception(CompileFailed(str(failed)))
            return
        except Exception as exc:  # the worker could not be started or talked to
            log.exception("grammar compile worker %s failed", worker.name)
            worker.stop()
            job.future.set_exception(GrammarBusy(
                f"the grammar compiler failed ({type(exc).__name__}); retry shortly",
                self._retry_after()))
            return
        if worker.resident_bytes() - worker.idle_bytes > settings.memory_limit // 2:
            worker.stop()  # what the compile left in its heap goes back now
        try:
            built = job.build()
        except Exception as exc:  # xgrammar here refused what it compiled there
            job.future.set_exception(CompileFailed(str(exc) or type(exc).__name__))
            return
        self.compiled += 1
        job.future.set_result((built, output))

    def _killed(self, job: CompileJob, killed: CompileKilled, timeout: float) -> Exception:
        kind = str(job.request.get("kind", "grammar")).replace("_", " ")
        if killed.reason == "memory":
            log.warning("a grammar compile passed grammar.compile_memory_limit (%s) and was "
                        "stopped", format_size(self.settings.memory_limit))
            return GrammarCompileTimeout(
                job.field, f"compiling this {kind} took more than "
                f"{format_size(self.settings.memory_limit)} of memory "
                "(grammar.compile_memory_limit) and was stopped; simplify it (fewer "
                "alternatives, smaller repetition bounds, less nesting)")
        if killed.reason == "crash":
            return GrammarError(job.field, f"this {kind} crashed the grammar compiler; "
                                "simplify it (less nesting, fewer alternatives)")
        log.warning("a grammar compile ran past its %g s limit and was stopped", timeout)
        return GrammarCompileTimeout(
            job.field, f"compiling this {kind} took longer than {timeout:g} s "
            "(grammar.compile_timeout_s) and was stopped; simplify it (fewer alternatives, "
            "smaller repetition bounds, less nesting)")

    # -- lifetime -----------------------------------------------------------------------

    def release_idle(self, dry_run: bool) -> int:
        """The resident bytes of the workers with no compile now; unless ``dry_run``,
        stopped (each starts again with its next compile). The memory guard counts them
        as memory the server gives back on demand (``register_reclaimable``): idle
        workers never make a request that fits look as if it did not."""
        with self._lock:
            total = 0
            for worker in self._workers:
                if worker.name in self._busy or not worker.running:
                    continue
                total += worker.resident_bytes()
                if not dry_run:
                    worker.stop()
            return total

    def busy_bytes(self) -> int:
        """The resident bytes of the workers running a compile now (starting up
        included): held until the compile ends, at its deadline at the latest, after
        which the worker is idle and :meth:`release_idle` gives them back. The memory
        guard lets a request that fits without them wait for them
        (``register_in_flight``)."""
        with self._lock:
            return sum(worker.resident_bytes() for worker in self._workers
                       if worker.name in self._busy)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def close(self) -> None:
        """Refuse new compiles, fail the waiting ones, end the workers."""
        with self._lock:
            self._closed = True
            while (job := self._queue.take()) is not None:
                job.future.set_exception(GrammarBusy("the grammar compiler is shutting down",
                                                     self.settings.timeout_s))
            self._lock.notify_all()
        unregister_reclaimable(self.release_idle)
        unregister_in_flight(self.busy_bytes)
        for worker in self._workers:
            worker.stop()


_QUEUE: CompileQueue | None = None
_QUEUE_LOCK = threading.Lock()


def compile_queue() -> CompileQueue:
    """The process's compile queue (default settings until :func:`configure_compiles`)."""
    global _QUEUE
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = CompileQueue()
        return _QUEUE


def configure_compiles(settings: CompileSettings) -> CompileQueue:
    """Use ``settings`` from now on (a server's ``[grammar]``); compiles under way end
    under the settings they started with."""
    global _QUEUE
    with _QUEUE_LOCK:
        old, _QUEUE = _QUEUE, None
        if old is not None and old.settings == settings:
            _QUEUE = old
            return old
        _QUEUE = CompileQueue(settings)
    if old is not None:
        old.close()
    return _QUEUE


@atexit.register
def _close_at_exit() -> None:
    if _QUEUE is not None:
        _QUEUE.close()
