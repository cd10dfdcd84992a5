"""The one thread that runs every mlx operation of the process.

mlx streams, the Metal/CUDA command queues behind them and mlx-lm's generation
stream are per thread, and model weights loaded on one thread and used on another
invite races. So a process has exactly one MLX thread: model loads run on it as
tasks (:meth:`MLXThread.run`), and each engine's scheduler is a :class:`Worker` the
thread steps round-robin while it has work. Other threads only enqueue and wake it.
Nothing on this thread may sleep or wait for time to pass: a worker that wants to act
later says so with the optional ``wake_at`` (see :class:`Worker`).

Every engine plugin, built-in or third-party, should do its mlx work here. A thread that
used mlx streams must also outlive the process: mlx keeps a per-thread stream worker, and
a thread that exits early aborts the process at exit ("terminate called without an
active exception"). This one never exits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Worker(Protocol):
    """A scheduler the MLX thread steps.

    A worker may also define ``wake_at() -> float | None`` (optional, looked up with
    ``getattr``): a ``time.monotonic()`` time at which :meth:`has_work` will turn true
    without any :meth:`MLXThread.wake` (e.g. when a batching window closes), or ``None``.
    The idle thread waits no longer than the earliest such time; it must be cheap too.
    """

    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything now; called often, must be cheap."""

    def step(self) -> None:
        """Do one bounded unit of work (one prefill budget and one decode step)."""

    def fail(self, exc: BaseException) -> None:
        """:meth:`step` raised ``exc``: end what is in flight and get back to a clean state."""


class MLXThread:
    """Runs tasks and steps workers, one at a time, on a single daemon thread."""

    def __init__(self, name: str = "omlx-mlx") -> None:
        self._cond = threading.Condition()
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()
        self._workers: list[Worker] = []
        #: set while the thread waits for work (no task queued, no worker with work)
        self._quiet = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on the MLX thread; the future holds its result."""
        future: Future = Future()
        with self._cond:
            self._tasks.append((lambda: fn(*args, **kwargs), future))
            self._cond.notify_all()
        return future

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the MLX thread and wait for its result (directly when already on it)."""
        if self.is_current():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def attach(self, worker: Worker) -> None:
        with self._cond:
            if worker not in self._workers:
                self._workers.append(worker)
            self._cond.notify_all()

    def detach(self, worker: Worker) -> None:
        with self._cond:
            if worker in self._workers:
                self._workers.remove(worker)

    def workers(self) -> list[Worker]:
        """The workers attached now (a copy)."""
        with self._cond:
            return list(self._workers)

    def others_busy(self, worker: Worker) -> bool:
        """Whether a worker other than ``worker`` has work now: for a worker that yields
        to the others (an embedding engine paces itself beside chat). Call it on the MLX
        thread, from ``step``."""
        return any(other is not worker and other.has_work() for other in list(self._workers))

    def wait_quiet(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to have nothing to do (no task
        queued, no worker with work); whether it has. For background work that should
        leave the cores to forwards while there are any (the SSD tier's writer): the
        answer can be stale by the time the caller acts on it, so use it to defer work,
        never to order it."""
        return self._quiet.wait(timeout)

    def wake(self) -> None:
        """Tell the thread that a worker may have new work."""
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            # One round per call: its locals (the last task, the workers stepped) are
            # released before the thread sleeps, so a detached engine's model can be freed.
            self._round()

    def _round(self) -> None:
        with self._cond:
            # has_work() is read under the lock that wake() takes, so a request
            # enqueued before its wake() can never be missed here.
            while not self._tasks and not any(w.has_work() for w in self._workers):
                self._quiet.set()
                self._cond.wait(self._idle_timeout())
            self._quiet.clear()
            tasks = list(self._tasks)
            self._tasks.clear()
            workers = list(self._workers)
        for fn, future in tasks:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller, never lost
                    future.set_exception(exc)
        for worker in workers:
            if not worker.has_work():
                continue
            try:
                worker.step()
            except Exception as exc:
                log.exception("engine step failed; failing its in-flight requests")
                try:
                    worker.fail(exc)
                except Exception:
                    log.exception("recovering from a failed step failed too")

    def _idle_timeout(self) -> float | None:
        """Seconds until the earliest worker's ``wake_at``; ``None``: wait for a wake."""
        times = []
        for worker in self._workers:
            wake_at = getattr(worker, "wake_at", None)
            when = wake_at() if wake_at is not None else None
            if when is not None:
                times.append(when)
        return max(0.0, min(times) - time.monotonic()) if times else None


_instance: MLXThread | None = None
_instance_lock = threading.Lock()


def mlx_thread() -> MLXThread:
    """The process's MLX thread, started on first use."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = MLXThread()
        return _instance
