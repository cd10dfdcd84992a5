"""Requests being generated, and the watcher that aborts those whose client went away.

A caller that can tell when its client is gone passes ``client_gone`` with the job
(the HTTP front end hands over waitress's ``environ["waitress.client_disconnected"]``).
A write to a dead socket would also fail, but only at the next token; a request still
in prefill or waiting in the engine's queue writes nothing for a long time. One thread
polls every in-flight request and closes the handle of a request whose client is gone,
so the engine drops it within one step whatever phase it is in.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from omlx_core.engine import RequestHandle

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05


@dataclass
class _Entry:
    handle: RequestHandle
    client_gone: Callable[[], bool] | None


class InFlight:
    """The handles of running requests, by request id."""

    def __init__(self, poll_interval_s: float = POLL_INTERVAL_S,
                 on_disconnect: Callable[[str], None] | None = None):
        self._on_disconnect = on_disconnect
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._poll_interval_s = poll_interval_s
        self._wake = threading.Event()
        self._stopped = False
        self._watcher: threading.Thread | None = None
        self.aborted_on_disconnect = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._entries

    def add(self, request_id: str, handle: RequestHandle,
            client_gone: Callable[[], bool] | None) -> None:
        with self._lock:
            self._entries[request_id] = _Entry(handle, client_gone)
            if client_gone is not None and self._watcher is None and not self._stopped:
                self._watcher = threading.Thread(target=self._watch, name="omlx-disconnects",
                                                 daemon=True)
                self._watcher.start()
        self._wake.set()

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def abort_all(self) -> int:
        """Close every in-flight handle (server shutdown); returns how many there were."""
        with self._lock:
            entries = list(self._entries.items())
        for request_id, entry in entries:
            _close_quietly(request_id, entry.handle)
        return len(entries)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def _watch(self) -> None:
        while not self._stopped:
            with self._lock:
                watched = [(rid, e) for rid, e in self._entries.items() if e.client_gone is not None]
            if not watched:
                self._wake.clear()
                self._wake.wait(timeout=1.0)
                continue
            for request_id, entry in watched:
                try:
                    gone = entry.client_gone()
                except Exception:  # a dead channel may fail to answer; treat it as gone
                    gone = True
                if gone:
                    log.info("client of request %s disconnected; aborting it", request_id)
                    self.remove(request_id)
                    self.aborted_on_disconnect += 1
                    _close_quietly(request_id, entry.handle)
                    if self._on_disconnect is not None:
                        self._on_disconnect(request_id)
            self._wake.wait(timeout=self._poll_interval_s)
            self._wake.clear()


def _close_quietly(request_id: str, handle: RequestHandle) -> None:
    try:
        handle.close()
    except Exception:
        log.exception("closing the handle of request %s failed", request_id)
