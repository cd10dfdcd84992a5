"""The process group serving one model, and its liveness.

Every rank's collectives run on its MLX thread; a collective whose peer died or hangs
never returns, so a watchdog thread times each step from its exchange to its end
(:meth:`Cluster.step_started` .. :meth:`Cluster.step_ended`). Past
``plugin.distributed.collective_timeout_s`` it declares the group dead: rank 0 ends
every in-flight request with an error and refuses new ones (the listeners registered
with :meth:`Cluster.on_death`), keeps answering ``/health`` for
``plugin.distributed.exit_after_s``, then exits with :data:`EXIT_GROUP_DEAD` so a
supervisor restarts the whole group. A follower whose rank 0 is gone exits at once.

A collective stuck in ``mx.eval`` releases the GIL, but an mlx call made meanwhile
from another thread may wait for it while holding the GIL, which freezes every Python
thread, this watchdog's too (the memory guard's ``mx.set_cache_limit`` did, until it
moved to the MLX thread). So each step also arms :func:`faulthandler.dump_traceback_later`,
whose C thread needs no GIL: past the timeout plus ``exit_after_s`` plus
:data:`BACKSTOP_GRACE_S` it prints every thread's stack and exits with status 1.
Requests in flight then see their connection close instead of an error event.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import threading
import time
from typing import Any, Callable

import mlx.core as mx

log = logging.getLogger(__name__)

#: the exit status of a rank whose group died (a supervisor restarts the group)
EXIT_GROUP_DEAD = 75
#: bytes every exchange carries in its first collective; longer payloads take a second
HEADER_BYTES = 4096
#: how long after the graceful exit was due the GIL-free backstop ends the process
BACKSTOP_GRACE_S = 5.0
_LENGTH_BYTES = 8


class GroupDead(BaseException):
    """A rank of the group stopped answering; the group cannot serve any more.

    Not an ``Exception``: a scheduler part that logs an ``Exception`` and goes on (a
    forward gate that raised) would run the next forward against the dead peer, which
    can hang with the GIL held. This ends the MLX thread instead; the process exits
    after ``exit_after_s`` anyway."""


class Cluster:
    """This process's rank in the ``mx.distributed`` group, its collectives and watchdog."""

    def __init__(self, group: Any, *, collective_timeout_s: float, exit_after_s: float,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.collective_timeout_s = collective_timeout_s
        self.exit_after_s = exit_after_s
        #: why the group is dead (names the rank), or ``None`` while it serves
        self.dead: str | None = None
        self._exit = exit
        self._step_since: float | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="omlx-dist-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- collectives (MLX thread) -----------------------------------------------------

    def broadcast(self, payload: Any) -> Any:
        """Rank 0's ``payload`` on every rank (the others pass ``None``)."""
        data = pickle.dumps(payload) if self.leader else b""
        header = bytearray(HEADER_BYTES)
        if self.leader:
            header[:_LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")
            first = data[:HEADER_BYTES - _LENGTH_BYTES]
            header[_LENGTH_BYTES:_LENGTH_BYTES + len(first)] = first
        received = self._sum_bytes(bytes(header))
        log.debug("rank %d broadcast: %d bytes sent, header %r", self.rank, len(data), received[:16])
        length = int.from_bytes(received[:_LENGTH_BYTES], "little")
        body = received[_LENGTH_BYTES:_LENGTH_BYTES + length]
        rest = length - len(body)
        if rest > 0:
            body += self._sum_bytes(data[len(body):] if self.leader else bytes(rest))
        return pickle.loads(body)

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length on each), by rank."""
        mine = mx.array(values, dtype=mx.float32)[None]
        everyone = mx.distributed.all_gather(mine, group=self.group, stream=_model_stream())
        self._evaluate(everyone)
        return everyone.tolist()

    def _sum_bytes(self, data: bytes) -> bytes:
        # Only rank 0 contributes non-zero bytes, so the sum is its bytes on every rank.
        array = mx.array(memoryview(data), dtype=mx.uint8) if data else mx.zeros((0,), mx.uint8)
        total = mx.distributed.all_sum(array, group=self.group, stream=_model_stream())
        self._evaluate(total)
        return bytes(memoryview(total))

    def _evaluate(self, array: Any) -> None:
        # Whoever asked (a scheduler part that logs and goes on, say) the group is dead
        # once a collective breaks: the ranks are out of step.
        try:
            mx.eval(array)
        except Exception as exc:
            self.declare_dead(f"a collective failed on rank {self.rank} ({type(exc).__name__}: "
                              f"{exc}); {self.missing()} is gone or out of step")
            raise GroupDead(self.dead) from exc

    # -- liveness ---------------------------------------------------------------------

    def step_started(self) -> None:
        if self.dead is not None:
            raise GroupDead(self.dead)
        self._step_since = time.monotonic()
        faulthandler.dump_traceback_later(
            self.collective_timeout_s + self.exit_after_s + BACKSTOP_GRACE_S, exit=True)

    def step_ended(self) -> None:
        if self._step_since is not None:
            self._step_since = None
            faulthandler.cancel_dump_traceback_later()

    def on_death(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` (on the watchdog thread) when the group dies."""
        self._listeners.append(listener)

    def declare_dead(self, reason: str) -> None:
        """Mark the group dead, tell the listeners, and exit the process: rank 0 after
        ``exit_after_s`` (``/health`` names the missing rank meanwhile), others at once."""
        with self._lock:
            if self.dead is not None or self._closed.is_set():
                return
            self.dead = reason
        log.error("distributed group is dead: %s", reason)
        for listener in self._listeners:
            try:
                listener(reason)
            except Exception:
                log.exception("a listener of the group's death failed")
        threading.Thread(target=self._exit_later, name="omlx-dist-exit", daemon=True).start()

    def _exit_later(self) -> None:
        if self.leader and self.exit_after_s > 0:
            self._closed.wait(self.exit_after_s)
        log.error("rank %d exits with status %d so a supervisor restarts the group",
                  self.rank, EXIT_GROUP_DEAD)
        logging.shutdown()
        self._exit(EXIT_GROUP_DEAD)

    def missing(self) -> str:
        """Which ranks a hung collective waits for, as far as rank ``self.rank`` can tell."""
        if not self.leader:
            return "rank 0"
        if self.size == 2:
            return "rank 1"
        return f"one of ranks 1..{self.size - 1}"

    def close(self) -> None:
        self._closed.set()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        while not self._closed.wait(0.25):
            since = self._step_since
            if since is None or time.monotonic() - since <= self.collective_timeout_s:
                continue
            self.declare_dead(
                f"{self.missing()} did not answer: a step's collectives on rank {self.rank} "
                f"waited more than {self.collective_timeout_s:g} s "
                "(plugin.distributed.collective_timeout_s)")
            return


def _model_stream() -> Any:
    """The stream the model's forwards run on (mlx-lm's, one per thread): a collective
    queued there runs after the forwards already queued (decode steps are evaluated
    asynchronously), in the same order on every rank. On another stream it could
    overtake them on one rank and not on another, and pair with their collectives."""
    from mlx_lm.generate import generation_stream

    return generation_stream


_CLUSTER: Cluster | None = None


def cluster(*, collective_timeout_s: float = 10.0, exit_after_s: float = 5.0) -> Cluster:
    """This process's :class:`Cluster`, joined on first use (``mx.distributed.init``)."""
    global _CLUSTER
    if _CLUSTER is None:
        group = mx.distributed.init()
        _CLUSTER = Cluster(group, collective_timeout_s=collective_timeout_s,
                           exit_after_s=exit_after_s)
    return _CLUSTER
