"""Waitress, extended so that slow and idle clients cannot lock others out.

Stock waitress stops accepting at ``connection_limit`` (100) and frees a slot only when
``channel_timeout`` (120 s) closes a connection that has been silent that long. A
client that never finishes its headers, or sends them a byte a second, keeps its slot:
150 such connections kept ordinary chats waiting two minutes. Here

- a request must arrive whole (headers and body) within ``request_timeout`` seconds of
  its first byte, and a new connection must send its first byte within as long; past
  that it gets a ``408`` (or, if it sent nothing, is closed). Streams and keep-alive
  connections between requests are not affected: their limit stays ``channel_timeout``;
- the connection limit is far above what the engines can run, and the soft limit on
  open files is raised to hold it (``poll()``, not ``select()``, so descriptors past
  1024 work);
- acceptance is fair: near the limit the connections that have waited longest without
  a request being served are closed to make room, so a flood ages out instead of
  holding the door shut, and a burst of connections is accepted in one loop turn.

Bytes still arrive on waitress's one event-loop thread, and a request reaches a worker
thread only once it is whole, so a slow client never holds a worker.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from typing import Any, Callable

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher

log = logging.getLogger(__name__)

#: files the process needs besides client connections: model weights, SSD cache
#: blocks, the worker threads' pipes, logs
FILES_BESIDES_CONNECTIONS = 256
#: share of the connection limit at which the longest-waiting idle connections are closed
EVICT_AT = 0.9
#: connections accepted per readiness event of the listening socket
ACCEPT_BURST = 64
#: how often the deadlines are checked, seconds
CHECK_INTERVAL_S = 1

TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s")


def timeout_body(request_timeout: float) -> bytes:
    return (b'{"error": {"type": "invalid_request_error", "code": "request_timeout", '
            b'"message": "the request did not arrive whole within %.3g s of its first byte '
            b'(server.request_timeout_s); send the headers and body without pausing"}}'
            % request_timeout)


class GuardedChannel(HTTPChannel):
    """An HTTP connection that remembers since when its current request has been arriving."""

    #: when the first byte of the request being received came; ``None`` between requests
    arriving_since: float | None = None
    #: whether any byte has come on this connection
    heard_from: bool = False

    def received(self, data: bytes) -> bool:
        if data:
            self.heard_from = True
            if self.arriving_since is None:
                self.arriving_since = time.monotonic()
        result = super().received(data)
        if self.request is None:
            self.arriving_since = None
        return result

    def serving(self) -> bool:
        """Whether a request on this connection is queued for or running on a worker."""
        return bool(self.requests)

    def waiting_since(self) -> float:
        """Since when this connection has held a slot without a request being served."""
        if self.arriving_since is not None:
            return self.arriving_since
        return time.monotonic() - (time.time() - self.last_activity)

    def time_out(self, body: bytes) -> None:
        """Answer 408 and close once it is sent (main thread; no request is being served)."""
        payload = TIMEOUT_RESPONSE % (len(body), body)
        with self.outbuf_lock:
            self.outbufs[-1].append(payload)
            self.current_outbuf_count += len(payload)
            self.total_outbufs_len += len(payload)
        self.close_when_flushed = True


class IdleWorkers:
    """Waitress's idle worker threads, the most recently idle last: stands in for the
    dispatcher's queue condition (``notify`` and ``notify_all`` run under its lock).

    Each worker waits on a lock of its own, made once, where ``threading.Condition``
    makes a lock at every wait; and the worker woken is the last one to go idle, where
    the condition wakes the longest idle. With a condition, each of the many idle
    workers kept the lock of its last wait until every other worker had served a
    request; those made while a model was loaded sat among its objects, and each kept
    a 1 MiB arena of Python's small-object allocator after the model was unloaded.
    """

    def __init__(self) -> None:
        self._waiting: list[threading.Lock] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, held: threading.Lock, wake: threading.Lock) -> None:
        """Wait until notified: ``held`` (the dispatcher's lock, held by the caller) is
        released meanwhile and held again on return; ``wake`` is the caller's own lock,
        held by it."""
        self._waiting.append(wake)
        held.release()
        try:
            wake.acquire()
        finally:
            held.acquire()

    def notify(self, n: int = 1) -> None:
        for _ in range(min(n, len(self._waiting))):
            self._waiting.pop().release()

    def notify_all(self) -> None:
        self.notify(len(self._waiting))


class ReleasingDispatcher(ThreadedTaskDispatcher):
    """Waitress's worker threads, woken last idle first (:class:`IdleWorkers`), each
    letting go of its last request once it is served.

    Stock waitress keeps the last task in the idle thread's loop variable, and the task
    keeps its connection (buffers, parser, locks): every thread pinned one finished
    connection, and like the waiters' locks, those made while a model was loaded kept
    allocator arenas resident after the unload (one per request, up to the thread
    count, over model load/unload cycles)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue_cv = IdleWorkers()

    def handler_thread(self, thread_no: int) -> None:
        wake = threading.Lock()
        wake.acquire()
        while True:
            with self.lock:
                while not self.queue and self.stop_count == 0:
                    self.active_count -= 1
                    self.queue_cv.wait(self.lock, wake)
                    self.active_count += 1
                if self.stop_count > 0:
                    self.active_count -= 1
                    self.stop_count -= 1
                    self.threads.discard(thread_no)
                    self.thread_exit_cv.notify()
                    break
                task = self.queue.popleft()
            try:
                task.service()
            except BaseException:
                self.logger.exception("Exception when servicing %r", task)
            task = None


class GuardedServer(TcpWSGIServer):
    """Waitress's TCP server with the deadlines and fair acceptance of this module."""

    channel_class = GuardedChannel

    def __init__(self, application: Callable, *, request_timeout: float,
                 map: dict[int, Any], **kwargs: Any):  # noqa: A002 - waitress's keyword
        self.request_timeout = float(request_timeout)
        #: every socket of this server's event loop (its own and its connections'), by
        #: file descriptor: the map given to waitress, kept under a public name
        self.socket_map = map
        self._timeout_body = timeout_body(self.request_timeout)
        #: connections closed by the deadlines and by eviction (tests read them)
        self.timed_out = 0
        self.never_spoke = 0
        self.evicted = 0
        super().__init__(application, map=map, **kwargs)

    def readable(self) -> bool:
        threshold = int(self.adj.connection_limit * EVICT_AT)
        if self.accepting and len(self.socket_map) >= threshold:
            closing = sum(1 for channel in self.active_channels.values()
                          if channel.will_close or channel.close_when_flushed)
            self.evict(len(self.socket_map) - closing - threshold + 1)
        return super().readable()

    def handle_accept(self) -> None:
        for _ in range(ACCEPT_BURST):
            if len(self.socket_map) >= self.adj.connection_limit:
                return
            before = len(self.socket_map)
            super().handle_accept()
            if len(self.socket_map) == before:  # nothing more waiting (or a failed accept)
                return

    def maintenance(self, now: float) -> None:
        super().maintenance(now)
        cutoff = time.monotonic() - self.request_timeout
        for channel in list(self.active_channels.values()):
            if not isinstance(channel, GuardedChannel) or channel.serving():
                continue
            if channel.will_close or channel.close_when_flushed:
                continue
            if channel.arriving_since is not None and channel.arriving_since < cutoff:
                self.timed_out += 1
                channel.time_out(self._timeout_body)
            elif not channel.heard_from and channel.waiting_since() < cutoff:
                self.never_spoke += 1
                channel.will_close = True

    def evict(self, count: int) -> None:
        """Close the ``count`` connections that have waited longest without a request
        being served; they close on the loop's next turn."""
        if count <= 0:
            return
        idle = [channel for channel in self.active_channels.values()
                if isinstance(channel, GuardedChannel) and not channel.serving()
                and not channel.will_close and not channel.close_when_flushed]
        idle.sort(key=GuardedChannel.waiting_since)
        for channel in idle[:count]:
            channel.will_close = True
            self.evicted += 1


def open_files_for(connections: int) -> int:
    """Raise the soft limit on open files so ``connections`` fit beside the process's other
    files, up to the hard limit; the number of connections that fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + FILES_BESIDES_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            log.info("raised the soft limit on open files from %d to %d (hard limit %s) so "
                     "%d client connections fit (server.connection_limit)", soft, raised,
                     "unlimited" if hard == resource.RLIM_INFINITY else hard, connections)
            soft = raised
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitting = max(soft - FILES_BESIDES_CONNECTIONS, 16)
        log.warning("the hard limit on open files is %d: at most %d client connections, not "
                    "the %d of server.connection_limit; raise it (ulimit -Hn) to hold more",
                    soft, fitting, connections)
        return fitting
    return connections


def create_server(application: Callable, *, request_timeout: float,
                  **adjustments: Any) -> GuardedServer:
    """A :class:`GuardedServer` on the first address ``adjustments`` name (as
    ``waitress.create_server`` would make for one address)."""
    adjustments["connection_limit"] = open_files_for(int(adjustments["connection_limit"]))
    adjustments.setdefault("asyncore_use_poll", True)
    adjustments.setdefault("cleanup_interval", CHECK_INTERVAL_S)
    adj = Adjustments(**adjustments)
    dispatcher = ReleasingDispatcher()
    dispatcher.set_thread_count(adj.threads)
    return GuardedServer(application, request_timeout=request_timeout, map={},
                         dispatcher=dispatcher, adj=adj, sockinfo=adj.listen[0])
