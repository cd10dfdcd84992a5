"""Refusals of large bodies are answered at the pace of a slow link.

Reading and parsing a request's body is the server's cost whether it serves the request
or refuses it: a 2.5 MiB JSON body takes ~25 ms of a core to read, parse and refuse. A
client that sends such bodies the server refuses (a grammar over its caps, invalid JSON)
and sends the next as soon as the answer comes could otherwise keep both cores of a small
machine parsing: three such clients slowed every other client's chat 3x. So a refusal
(4xx) of a body of at least :data:`PACE_FROM_BYTES` is answered no faster than
:data:`REFUSED_BYTES_PER_S` allows for its size (at most :data:`MAX_DELAY_S`): a client
that waits for its answers sends a few of them a second instead of forty. Requests the
server serves, and small ones it refuses, are answered at once. At most
:data:`MAX_PACED` answers wait at a time (each holds a worker thread); past that they
go out at once.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import falcon

__all__ = ["MAX_DELAY_S", "MAX_PACED", "PACE_FROM_BYTES", "REFUSED_BYTES_PER_S", "RefusalPacing"]

PACE_FROM_BYTES = 256 * 1024
REFUSED_BYTES_PER_S = 1024 * 1024
MAX_DELAY_S = 5.0
MAX_PACED = 16


class RefusalPacing:
    """Falcon middleware: hold the 4xx answer to a large body for its size's time."""

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep
        self._paced = threading.BoundedSemaphore(MAX_PACED)
        #: refusals answered late, for the benchmarks
        self.paced_total = 0

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        length = req.content_length or 0
        if length < PACE_FROM_BYTES or not 400 <= resp.status_code < 500:
            return
        if not self._paced.acquire(blocking=False):
            return
        try:
            self.paced_total += 1
            self._sleep(min(MAX_DELAY_S, length / REFUSED_BYTES_PER_S))
        finally:
            self._paced.release()
