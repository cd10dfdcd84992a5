"""The writer's bounded work queue: FIFO, withdrawable, and aware of the item being worked on."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class WorkQueue(Generic[T]):
    """A bounded FIFO for one consumer thread.

    Unlike :class:`queue.Queue` it can withdraw queued items that match a predicate
    (cleanup cancels a request's pending writes) and it knows which item the consumer
    holds between :meth:`take` and :meth:`release`, so a cleanup can tell whether it
    must wait for that one.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"queue size must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._held: T | None = None
        self.lock = threading.Condition()

    def put(self, item: T, timeout: float) -> None:
        """Append ``item``, waiting up to ``timeout`` seconds for room; raises :class:`queue.Full`."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while len(self._items) >= self.maxsize:
                left = deadline - time.monotonic()
                if left <= 0 or not self.lock.wait(left):
                    if len(self._items) >= self.maxsize:
                        raise queue.Full
            self._items.append(item)
            self.lock.notify_all()

    def wait_for_room(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until an item could be put; whether it could."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while len(self._items) >= self.maxsize:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
            return True

    def put_unbounded(self, item: T) -> None:
        """Append ``item`` even when full (the stop sentinel must always get in)."""
        with self.lock:
            self._items.append(item)
            self.lock.notify_all()

    def take(self) -> T:
        """The oldest item, waiting for one; it is *held* until :meth:`release`."""
        with self.lock:
            while not self._items:
                self.lock.wait()
            self._held = self._items.popleft()
            self.lock.notify_all()
            return self._held

    def release(self) -> None:
        with self.lock:
            self._held = None
            self.lock.notify_all()

    @property
    def held(self) -> T | None:
        """The item the consumer is working on (read under :attr:`lock` to act on it)."""
        return self._held

    def withdraw(self, predicate: Callable[[T], bool]) -> list[T]:
        """Remove and return every queued (not held) item matching ``predicate``."""
        with self.lock:
            taken = [item for item in self._items if predicate(item)]
            if taken:
                self._items = deque(item for item in self._items if not predicate(item))
                self.lock.notify_all()
            return taken

    def any(self, predicate: Callable[[T], bool]) -> bool:
        """Whether a queued or held item matches ``predicate``."""
        with self.lock:
            held = self._held
            return (held is not None and predicate(held)) or any(predicate(i) for i in self._items)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or held; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self._items or self._held is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
            return True

    def __len__(self) -> int:
        with self.lock:
            return len(self._items)
