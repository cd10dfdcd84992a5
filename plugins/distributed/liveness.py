"""Whether every rank of a group is alive: heartbeats on a connection of their own, and
progress.

A step's collectives wait for the slowest rank, so how long a step takes says nothing
about whether a rank is dead: three ranks of the default model on two cores took longer
than 10 s for a step that was merely slow, and a fixed step timeout ended the group at
its first answer. So liveness is told apart from speed:

- **heartbeats.** Every rank keeps a TCP connection to rank 0 (where rank 0 listens it
  says once, over the group's own collective: :class:`~.wire.Hello`, with a random token
  a connection must open with). Each side sends a small beat every
  ``plugin.distributed.heartbeat_s`` from a thread of its own, however long a step
  takes. A rank whose connection closes (killed: at once) or which sends nothing for
  ``plugin.distributed.liveness_timeout_s`` (stopped, or cut off) is dead.
- **progress.** Each beat carries the sender's CPU time. A step that stays open for
  ``plugin.distributed.stall_timeout_s`` while no rank used CPU (every rank waiting on
  another: a group that is stuck, not slow) ends the group too.
- **this process's own threads.** Each beat also re-arms
  :func:`faulthandler.dump_traceback_later`, whose thread needs no GIL: if every Python
  thread freezes (one waiting for mlx while it holds the GIL), the process prints its
  stacks and exits with status 1 after the liveness timeout, ``exit_after_s`` and
  :data:`BACKSTOP_GRACE_S`.

A beat is a fixed 27-byte record (magic, version, rank, sequence, steps, CPU
milliseconds): nothing on this connection is parsed beyond it. A rank that stops on
purpose (rank 0 shutting the group down, a follower obeying it) first sends one record
of the same shape with the leaving magic, so its closed connection is not taken for a
death: the followers hear rank 0 leave over this connection and its stop over the
collective, in either order.
"""

from __future__ import annotations

import faulthandler
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from typing import Callable

from omlx_core.plugins.distributed.wire import Hello

__all__ = ["BACKSTOP_GRACE_S", "Heartbeats", "heartbeat_address"]

log = logging.getLogger(__name__)

#: how long after the graceful exit was due the GIL-free backstop ends the process
BACKSTOP_GRACE_S = 5.0
#: CPU seconds the whole group must use over a stall window to count as progressing
PROGRESS_CPU_S = 0.5
_BEAT = struct.Struct(">4sBHIQQ")
_MAGIC = b"OMXB"
_LEAVING = b"OMXL"  # the sender stops on purpose; its connection closes next
_VERSION = 1
_OPEN = struct.Struct(">16sH")  # the token, then the connecting rank


def heartbeat_address() -> str:
    """The address rank 0 listens for heartbeats on: its own address in the group's
    ring hostfile (``MLX_HOSTFILE``), JACCL's coordinator host, else this host's name's."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            with open(hostfile) as handle:
                hosts = json.load(handle)
            first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
            return str(first).rsplit(":", 1)[0].strip("[]")
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            log.warning("cannot read rank 0's address from MLX_HOSTFILE; heartbeats use this "
                        "host's name")
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0].strip("[]")
    return socket.gethostbyname(socket.gethostname())


class Heartbeats:
    """This rank's heartbeat connections: to every other rank on rank 0, to rank 0
    elsewhere. ``on_dead(reason)`` is called once, from one of its threads."""

    def __init__(self, rank: int, size: int, *, interval_s: float, timeout_s: float,
                 exit_after_s: float, on_dead: Callable[[str], None],
                 steps: Callable[[], int]) -> None:
        self.rank = rank
        self.size = size
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.exit_after_s = exit_after_s
        self._on_dead = on_dead
        self._steps = steps
        self._lock = threading.Lock()
        self._peers: dict[int, socket.socket] = {}
        #: per rank: when its last beat came, and the CPU seconds it reported over time
        self._last_seen: dict[int, float] = {}
        self._received: dict[int, int] = {}
        self._left: set[int] = set()
        self._cpu: dict[int, list[tuple[float, float]]] = {}
        self._closed = threading.Event()
        self._dead = False
        self._listener: socket.socket | None = None
        self._token = b""
        self._sequence = 0

    # -- joining ------------------------------------------------------------------------

    def listen(self, address: str) -> Hello:
        """Rank 0: listen on ``address`` for the other ranks; the hello to broadcast."""
        self._token = secrets.token_bytes(16)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen(self.size)
        self._listener = listener
        now = time.monotonic()
        for rank in range(1, self.size):
            self._last_seen[rank] = now  # each must connect and beat within the timeout
        threading.Thread(target=self._accept, name="omlx-dist-hb-accept", daemon=True).start()
        self._start()
        return Hello(address, listener.getsockname()[1], self._token.hex())

    def connect(self, hello: Hello) -> None:
        """Another rank: connect to rank 0 as ``hello`` says."""
        self._token = bytes.fromhex(hello.token)
        connection = socket.create_connection((hello.address, hello.port), timeout=self.timeout_s)
        _tune(connection)
        connection.sendall(_OPEN.pack(self._token, self.rank))
        self._last_seen[0] = time.monotonic()
        self._adopt(0, connection)
        self._start()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        listener.settimeout(0.5)
        while not self._closed.is_set() and len(self._peers) < self.size - 1:
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            connection.settimeout(self.timeout_s)
            try:
                token, rank = _OPEN.unpack(_read_exactly(connection, _OPEN.size))
            except (OSError, EOFError, struct.error):
                connection.close()
                continue
            if not hmac.compare_digest(token, self._token) or not 0 < rank < self.size \
                    or rank in self._peers:
                connection.close()  # not one of this group's ranks
                continue
            _tune(connection)
            self._adopt(rank, connection)
        listener.close()

    def _adopt(self, rank: int, connection: socket.socket) -> None:
        connection.settimeout(None)
        with self._lock:
            self._peers[rank] = connection
        threading.Thread(target=self._receive, args=(rank, connection),
                         name=f"omlx-dist-hb-rank{rank}", daemon=True).start()

    def _start(self) -> None:
        threading.Thread(target=self._beat, name="omlx-dist-hb", daemon=True).start()

    # -- the threads --------------------------------------------------------------------

    def _receive(self, rank: int, connection: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                record = _read_exactly(connection, _BEAT.size)
            except (OSError, EOFError):
                self._died(f"rank {rank} closed its heartbeat connection: it exited or its "
                           "machine is gone")
                return
            magic, version, sender, _sequence, _steps, cpu_ms = _BEAT.unpack(record)
            if magic == _LEAVING and version == _VERSION and sender == rank:
                with self._lock:
                    self._left.add(rank)
                    self._last_seen.pop(rank, None)
                    self._peers.pop(rank, None)  # no beat goes to it any more
                connection.close()
                log.info("rank %d stops on purpose; its heartbeats end", rank)
                return
            if magic != _MAGIC or version != _VERSION or sender != rank:
                self._died(f"rank {rank}'s heartbeat connection carried something else than "
                           "heartbeats")
                return
            now = time.monotonic()
            with self._lock:
                self._last_seen[rank] = now
                self._received[rank] = self._received.get(rank, 0) + 1
                samples = self._cpu.setdefault(rank, [])
                samples.append((now, cpu_ms / 1000.0))
                del samples[:-1024]

    def _beat(self) -> None:
        while not self._closed.wait(self.interval_s):
            faulthandler.dump_traceback_later(
                self.timeout_s + self.exit_after_s + BACKSTOP_GRACE_S, exit=True)
            self._sequence += 1
            cpu_ms = int(time.process_time() * 1000)
            record = _BEAT.pack(_MAGIC, _VERSION, self.rank, self._sequence & 0xFFFFFFFF,
                                self._steps(), cpu_ms)
            now = time.monotonic()
            with self._lock:
                peers = list(self._peers.items())
                samples = self._cpu.setdefault(self.rank, [])
                samples.append((now, cpu_ms / 1000.0))
                del samples[:-1024]
                silent = [(rank, now - seen) for rank, seen in self._last_seen.items()
                          if now - seen > self.timeout_s]
            for rank, connection in peers:
                try:
                    connection.sendall(record)
                except OSError:
                    self._died(f"rank {rank}'s heartbeat connection broke: it exited or its "
                               "machine is gone")
            for rank, quiet in silent:
                self._died(f"rank {rank} did not answer: no heartbeat for {quiet:.1f} s "
                           "(plugin.distributed.liveness_timeout_s): it is stopped, hung or "
                           "cut off")

    def _died(self, reason: str) -> None:
        with self._lock:
            if self._dead or self._closed.is_set():
                return
            self._dead = True
        self._on_dead(reason)

    # -- progress -----------------------------------------------------------------------

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` said it stops on purpose."""
        with self._lock:
            return rank in self._left

    def beats_sent(self) -> int:
        """Heartbeats this rank has sent so far."""
        return self._sequence

    def beats_received(self, rank: int) -> int:
        """Heartbeats read from ``rank`` so far."""
        with self._lock:
            return self._received.get(rank, 0)

    def progressed_since(self, since: float) -> bool:
        """Whether the ranks this one hears from (itself included) used at least
        :data:`PROGRESS_CPU_S` of CPU between ``since`` and their latest beat."""
        with self._lock:
            used = 0.0
            for samples in self._cpu.values():
                before = [cpu for at, cpu in samples if at <= since]
                if before and samples:
                    used += samples[-1][1] - before[-1]
                elif samples:
                    used += samples[-1][1] - samples[0][1]
        return used >= PROGRESS_CPU_S

    def close(self, *, leaving: bool = True) -> None:
        """Close every connection; ``leaving``: this rank stops on purpose and says so
        first (a rank of a dead group does not: the others must hear it go)."""
        self._closed.set()
        faulthandler.cancel_dump_traceback_later()
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        record = _BEAT.pack(_LEAVING, _VERSION, self.rank, self._sequence & 0xFFFFFFFF, 0, 0)
        for connection in peers:
            try:
                if leaving:
                    connection.sendall(record)
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()
        if self._listener is not None:
            self._listener.close()


def _tune(connection: socket.socket) -> None:
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise EOFError("closed")
        data += chunk
    return data
