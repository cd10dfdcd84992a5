"""Requests and aborts on their way to the MLX thread, and the batch window over them.

Request threads put arrivals and aborts here; the scheduler drains them at the start of
each step, on the MLX thread. On an idle engine the first arrivals wait a moment for
others (:meth:`Inbox.window_closes`), so that requests sent together are prefilled in
one forward.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Callable, Iterator

from omlx_core.scheduling.batch_state import BatchState, SequenceState


class Inbox:
    """Arrivals and aborts from any thread; the batch window (see the module)."""

    def __init__(self, *, model_id: str, wake: Callable[[], None], batch_window_s: float,
                 batch_window_max_s: float) -> None:
        self.model_id = model_id
        self.wake = wake
        self.batch_window_s = batch_window_s
        self.batch_window_max_s = max(batch_window_s, batch_window_max_s)
        self.arrivals: deque[SequenceState] = deque()
        self.aborts: deque[str] = deque()
        #: requests the pipeline is preparing for this engine (:meth:`expecting`)
        self.expected = 0
        self.stopped = False
        self._lock = threading.Lock()

    def put(self, sequence: SequenceState) -> None:
        with self._lock:
            if self.stopped:
                raise RuntimeError(f"engine for model {self.model_id!r} is shut down; "
                                   "start it again before submitting requests")
            sequence.arrived = time.monotonic()
            self.arrivals.append(sequence)
        self.wake()

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self.wake()

    def stop(self) -> None:
        with self._lock:
            self.stopped = True

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """Count a request on its way here (tokenized and checked by the pipeline) while
        the block runs: an open batch window waits for it (:meth:`window_closes`)."""
        with self._lock:
            self.expected += 1
        try:
            yield
        finally:
            with self._lock:
                self.expected -= 1
            self.wake()

    def drain(self) -> tuple[list[SequenceState], list[str]]:
        """Everything that arrived since the last drain (MLX thread)."""
        arrivals = [self.arrivals.popleft() for _ in range(len(self.arrivals))]
        aborts = [self.aborts.popleft() for _ in range(len(self.aborts))]
        return arrivals, aborts

    def window_closes(self, state: BatchState) -> float | None:
        """When the batch window over the arrivals closes (closed already, perhaps), or
        ``None`` when they wait for no window.

        On an idle engine, new requests wait ``batch_window_s`` after the first of them
        arrived: requests sent together reach the server a few milliseconds apart, and
        those that arrive in the window are prefilled in one forward instead of waiting
        for the first one's whole step. While more requests are on their way (the
        pipeline tokenizes and checks each first: tens of milliseconds apart when sent
        together), the window stays open for them, up to ``batch_window_max_s``. It
        closes early once the new requests fill the free slots. Nothing sleeps: the
        scheduler's ``has_work`` says no until then and the MLX thread wakes at its
        ``wake_at``, free for other engines and tasks meanwhile.
        """
        arrivals = self.arrivals
        if (not arrivals or self.batch_window_s <= 0 or state.prefilling or state.decoding
                or len(arrivals) + len(state.waiting) >= state.free_slots()):
            return None
        # Only the MLX thread (which asks this) takes requests out of the inbox.
        # A request submitted stays counted until its expecting() block ends, a moment
        # later: that end wakes the MLX thread, which then finds the window closed.
        longest = self.batch_window_max_s if self.expected else self.batch_window_s
        return arrivals[0].arrived + longest

    def __len__(self) -> int:
        return len(self.arrivals)


__all__ = ["Inbox"]
