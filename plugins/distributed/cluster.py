"""The process group serving one model: its collectives, and when it is dead.

Every rank's collectives run on its MLX thread; :meth:`Cluster.broadcast` moves rank 0's
bytes (a :mod:`.wire` message: never pickle) to every rank. Whether the group is alive
is :mod:`.liveness`'s to tell, not how long a step takes: a slow machine is not a dead
rank. A rank whose heartbeats stop (killed, stopped, cut off), or a step during which no
rank makes progress, ends the group: rank 0 ends every in-flight request with an error
and refuses new ones (the listeners registered with :meth:`Cluster.on_death`), keeps
answering ``/health`` for ``plugin.distributed.exit_after_s``, then exits with
:data:`EXIT_GROUP_DEAD` so a supervisor restarts the whole group. A follower whose rank
0 is gone exits at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import mlx.core as mx

from omlx_core.plugins.distributed.liveness import Heartbeats, heartbeat_address
from omlx_core.plugins.distributed.wire import MAX_MESSAGE_BYTES, WireError, decode_hello, encode_hello

log = logging.getLogger(__name__)

#: the exit status of a rank whose group died (a supervisor restarts the group)
EXIT_GROUP_DEAD = 75
#: bytes every exchange carries in its first collective; longer payloads take a second
HEADER_BYTES = 4096
_LENGTH_BYTES = 8
#: how often the watchdog looks at the open step's progress
_WATCH_S = 0.25


class GroupDead(BaseException):
    """A rank of the group stopped answering; the group cannot serve any more.

    Not an ``Exception``: a scheduler part that logs an ``Exception`` and goes on (a
    forward gate that raised) would run the next forward against the dead peer, which
    can hang with the GIL held. This ends the MLX thread instead; the process exits
    after ``exit_after_s`` anyway."""


class Cluster:
    """This process's rank in the ``mx.distributed`` group, its collectives and liveness."""

    def __init__(self, group: Any, *, heartbeat_s: float = 1.0, liveness_timeout_s: float = 5.0,
                 stall_timeout_s: float = 300.0, exit_after_s: float = 5.0,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.heartbeat_s = heartbeat_s
        self.liveness_timeout_s = liveness_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.exit_after_s = exit_after_s
        #: why the group is dead (names the rank), or ``None`` while it serves
        self.dead: str | None = None
        #: steps this rank has taken (sent with its heartbeats)
        self.steps = 0
        self._exit = exit
        self._step_since: float | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._heartbeats: Heartbeats | None = None
        self._watchdog = threading.Thread(target=self._watch, name="omlx-dist-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- collectives (MLX thread) -----------------------------------------------------

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass ``None``): bytes, which the
        caller decodes with :mod:`.wire`."""
        data = bytes(data or b"") if self.leader else b""
        header = bytearray(HEADER_BYTES)
        if self.leader:
            header[:_LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")
            first = data[:HEADER_BYTES - _LENGTH_BYTES]
            header[_LENGTH_BYTES:_LENGTH_BYTES + len(first)] = first
        received = self._sum_bytes(bytes(header))
        length = int.from_bytes(received[:_LENGTH_BYTES], "little")
        if length > MAX_MESSAGE_BYTES:
            # Not rank 0's: a length no message has. Refuse it before allocating it.
            raise WireError(f"a broadcast of {length} bytes announced, over {MAX_MESSAGE_BYTES}")
        body = received[_LENGTH_BYTES:_LENGTH_BYTES + length]
        rest = length - len(body)
        if rest > 0:
            body += self._sum_bytes(data[len(body):] if self.leader else bytes(rest))
        return body

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
        if self._heartbeats is None and self.size > 1:
            self._join_heartbeats()
        self._step_since = time.monotonic()

    def step_ended(self) -> None:
        if self._step_since is not None:
            self._step_since = None
            self.steps += 1

    def _join_heartbeats(self) -> None:
        """Every rank's first step: rank 0 says where it listens (one broadcast), and
        every other rank connects."""
        heartbeats = Heartbeats(self.rank, self.size, interval_s=self.heartbeat_s,
                                timeout_s=self.liveness_timeout_s, exit_after_s=self.exit_after_s,
                                on_dead=self.declare_dead, steps=lambda: self.steps)
        self._heartbeats = heartbeats
        if self.leader:
            self.broadcast(encode_hello(heartbeats.listen(heartbeat_address())))
            return
        try:
            hello = decode_hello(self.broadcast(None))
            heartbeats.connect(hello)
        except (WireError, OSError) as exc:
            self.declare_dead(f"rank {self.rank} cannot join rank 0's heartbeats "
                              f"({type(exc).__name__}: {exc})")
            raise GroupDead(self.dead) from exc

    def stopping(self) -> None:
        """The group is shutting down on purpose: a closed connection is not a death."""
        heartbeats = self._heartbeats
        if heartbeats is not None:
            heartbeats.close(leaving=self.dead is None)

    def on_death(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` (on the thread that found it) when the group dies."""
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
        self.stopping()

    def _watch(self) -> None:
        """A step open for ``stall_timeout_s`` through which no rank used CPU: stuck."""
        while not self._closed.wait(_WATCH_S):
            since = self._step_since
            heartbeats = self._heartbeats
            if since is None or heartbeats is None or self.stall_timeout_s <= 0:
                continue
            now = time.monotonic()
            if now - since <= self.stall_timeout_s:
                continue
            if heartbeats.progressed_since(now - self.stall_timeout_s):
                continue
            self.declare_dead(
                f"the group made no progress for {self.stall_timeout_s:g} s "
                "(plugin.distributed.stall_timeout_s): a step is open and no rank is computing; "
                f"{self.missing()} is stuck")
            return


def _model_stream() -> Any:
    """The stream the model's forwards run on (mlx-lm's, one per thread): a collective
    queued there runs after the forwards already queued (decode steps are evaluated
    asynchronously), in the same order on every rank. On another stream it could
    overtake them on one rank and not on another, and pair with their collectives."""
    from mlx_lm.generate import generation_stream

    return generation_stream


_CLUSTER: Cluster | None = None


def cluster(**settings: float) -> Cluster:
    """This process's :class:`Cluster`, joined on first use (``mx.distributed.init``);
    ``settings`` (heartbeat_s, liveness_timeout_s, stall_timeout_s, exit_after_s) apply
    then."""
    global _CLUSTER
    if _CLUSTER is None:
        group = mx.distributed.init()
        _CLUSTER = Cluster(group, **settings)
    return _CLUSTER
