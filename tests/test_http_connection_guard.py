"""Slow and idle clients cannot lock others out of the waitress server
(:mod:`omlx_core.http.connection_guard`): on a real waitress server on loopback, a flood
of connections that never finish their request does not keep a normal request out, a
request that does not arrive whole in time gets a 408, a silent connection is closed,
while keep-alive connections between requests and long streams are left alone. Its
worker threads wake last idle first and keep nothing of a request once it is served."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Iterator

import pytest

from omlx_core.http.connection_guard import GuardedServer, ReleasingDispatcher, create_server
from omlx_core.testing.waiting import wait_for

REQUEST_TIMEOUT = 1.0
WAIT = 60.0  # a bound on every blocking read, never an assertion


def app(environ, start_response):
    if environ["PATH_INFO"] == "/stream":
        def chunks():
            for i in range(4):
                time.sleep(REQUEST_TIMEOUT)
                yield b"chunk %d\n" % i
        start_response("200 OK", [("Content-Type", "text/plain")])
        return chunks()
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", str(len(body) + 3))])
    return [b"ok:" + body]


@pytest.fixture
def server() -> Iterator[GuardedServer]:
    server = create_server(app, request_timeout=REQUEST_TIMEOUT, host="127.0.0.1", port=0,
                           threads=2, connection_limit=64)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield server
    server.task_dispatcher.shutdown(timeout=5)
    from waitress import wasyncore
    server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map, ignore_all=True))
    thread.join(10)


def connect(server: GuardedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.effective_port), timeout=WAIT)
    return sock


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        if _ and b"content-length:" in head.lower():
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) >= length:
                return data


def post(sock: socket.socket, body: bytes, close: bool = False) -> bytes:
    connection = b"close" if close else b"keep-alive"
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (connection, len(body), body))
    return read_response(sock)


def test_a_flood_of_connections_that_never_finish_does_not_keep_a_request_out(server) -> None:
    # twice the connection limit, each with an unfinished request; stock waitress stops
    # accepting at the limit until channel_timeout (120 s) frees a slot
    flood = []
    for i in range(128):
        sock = connect(server)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Len")
        flood.append(sock)
    try:
        with connect(server) as sock:
            assert post(sock, b"hello", close=True).endswith(b"ok:hello")
        assert server.evicted + server.timed_out > 0
    finally:
        for sock in flood:
            sock.close()


def test_a_request_that_does_not_arrive_in_time_gets_408(server) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\npartial")
        response = read_response(sock)
    assert response.startswith(b"HTTP/1.1 408 ")
    error = json.loads(response.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "server.request_timeout_s" in error["message"]
    assert server.timed_out == 1


def test_a_byte_a_second_header_is_cut_off(server) -> None:
    request = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        answer = b""
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            sock.settimeout(REQUEST_TIMEOUT / 2)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            finally:
                sock.settimeout(WAIT)
            break
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_a_silent_connection_is_closed(server) -> None:
    with connect(server) as sock:
        assert sock.recv(1) == b""
    assert server.never_spoke == 1


def test_keep_alive_between_requests_and_long_streams_are_left_alone(server) -> None:
    with connect(server) as sock:
        assert post(sock, b"one").endswith(b"ok:one")
        time.sleep(REQUEST_TIMEOUT * 3)  # idle between requests: channel_timeout's business
        assert post(sock, b"two").endswith(b"ok:two")
    with connect(server) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response = read_response(sock)
    assert response.startswith(b"HTTP/1.1 200 ") and b"chunk 3" in response
    assert server.timed_out == server.never_spoke == 0


def test_the_soft_open_files_limit_is_raised_to_hold_the_connections() -> None:
    script = (
        "import logging, resource, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from omlx_core.http.connection_guard import open_files_for\n"
        "print('fits', open_files_for(1000))\n"
        "print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "raised the soft limit on open files from 256 to 1256" in out
    assert "fits 1000" in out and "soft 1256" in out


class Task:
    """What waitress queues for a worker: served by ``service``."""

    def __init__(self) -> None:
        self.served_by: str | None = None
        self.done = threading.Event()

    def service(self) -> None:
        self.served_by = threading.current_thread().name
        self.done.set()

    def cancel(self) -> None:
        self.done.set()


def test_the_last_idle_worker_serves_and_no_worker_keeps_a_served_request() -> None:
    """Stock waitress wakes the longest idle of its workers, each making a lock per wait,
    and each idle worker kept its last request (and the request its connection): with
    many workers, every request's objects lived on, and those made during a model load
    kept allocator arenas after the unload."""
    dispatcher = ReleasingDispatcher()
    dispatcher.set_thread_count(4)
    try:
        assert wait_for(lambda: len(dispatcher.queue_cv) == 4, WAIT)
        served, gone = [], []
        for _ in range(6):
            task = Task()
            dispatcher.add_task(task)
            assert task.done.wait(WAIT)
            served.append(task.served_by)
            gone.append(weakref.ref(task))
            del task
            assert wait_for(lambda: len(dispatcher.queue_cv) == 4, WAIT)
        assert len(set(served)) == 1, served
        assert wait_for(lambda: all(ref() is None for ref in gone), WAIT)
    finally:
        dispatcher.shutdown(timeout=WAIT)
    assert not dispatcher.threads
