"""The writer's bounded work queue: FIFO, withdrawable, and aware of the item being worked on."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class WorkQueue(Generic[T]):
    """A FIFO for one consumer thread, bounded in items and in bytes.

    Unlike :class:`queue.Queue` it can withdraw queued items that match a predicate
    (cleanup cancels a request's pending writes) and it knows which item the consumer
    holds between :meth:`take` and :meth:`release`, so a cleanup can tell whether it
    must wait for that one. Items weigh ``weight(item)`` bytes (host memory they hold
    until written); queued and held items together stay within ``max_bytes``, except
    that one item always fits an empty queue, whatever it weighs.
    """

    def __init__(self, maxsize: int, max_bytes: int | None = None,
                 weight: Callable[[T], int] = lambda item: 0) -> None:
        if maxsize < 1:
            raise ValueError(f"queue size must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._weight = weight
        self._items: deque[T] = deque()
        self._held: T | None = None
        #: bytes of the queued and held items
        self._bytes = 0
        #: producers waiting for room
        self._waiting = 0
        self.lock = threading.Condition()

    def _has_room_locked(self, nbytes: int) -> bool:
        if len(self._items) >= self.maxsize:
            return False
        if self.max_bytes is None or self._bytes == 0:
            return True
        return self._bytes + nbytes <= self.max_bytes

    def put(self, item: T, timeout: float) -> None:
        """Append ``item``, waiting up to ``timeout`` seconds for room; raises :class:`queue.Full`."""
        nbytes = self._weight(item)
        deadline = time.monotonic() + timeout
        with self.lock:
            while not self._has_room_locked(nbytes):
                left = deadline - time.monotonic()
                if left <= 0 or not self._wait_for_room(left):
                    if not self._has_room_locked(nbytes):
                        raise queue.Full
            self._items.append(item)
            self._bytes += nbytes
            self.lock.notify_all()

    def wait_for_room(self, timeout: float, nbytes: int = 0) -> bool:
        """Wait up to ``timeout`` seconds until an item of ``nbytes`` could be put; whether
        it could."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not self._has_room_locked(nbytes):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wait_for_room(left)
            return True

    def _wait_for_room(self, timeout: float) -> bool:
        self._waiting += 1
        try:
            return self.lock.wait(timeout)
        finally:
            self._waiting -= 1

    @property
    def pressed(self) -> bool:
        """Whether the consumer should not put its work off: a producer waits for room, or
        half the items or bytes the queue may hold are queued."""
        with self.lock:
            return (self._waiting > 0 or 2 * len(self._items) >= self.maxsize
                    or (self.max_bytes is not None and 2 * self._bytes >= self.max_bytes))

    def put_unbounded(self, item: T) -> None:
        """Append ``item`` even when full (the stop sentinel must always get in)."""
        with self.lock:
            self._items.append(item)
            self._bytes += self._weight(item)
            self.lock.notify_all()

    def wait_for_item(self) -> None:
        """Wait until an item is queued (it stays queued: :meth:`take` takes it)."""
        with self.lock:
            while not self._items:
                self.lock.wait()

    def take(self) -> T | None:
        """The oldest item, *held* until :meth:`release`; ``None`` when none is queued (the
        consumer waits with :meth:`wait_for_item`)."""
        with self.lock:
            if not self._items:
                return None
            self._held = self._items.popleft()
            self.lock.notify_all()
            return self._held

    def release(self) -> None:
        with self.lock:
            if self._held is not None:
                self._bytes -= self._weight(self._held)
            self._held = None
            self.lock.notify_all()

    @property
    def nbytes(self) -> int:
        """Bytes the queued and held items weigh."""
        with self.lock:
            return self._bytes

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
                self._bytes -= sum(self._weight(item) for item in taken)
                self.lock.notify_all()
            return taken

    def withdraw_newest(self, predicate: Callable[[T], bool], nbytes: int) -> list[T]:
        """Remove queued items matching ``predicate``, newest first, until they weigh at
        least ``nbytes`` or none is left; returns them."""
        with self.lock:
            taken: list[T] = []
            freed = 0
            for item in reversed(self._items):
                if freed >= nbytes:
                    break
                if predicate(item):
                    taken.append(item)
                    freed += self._weight(item)
            if taken:
                ids = {id(item) for item in taken}
                self._items = deque(item for item in self._items if id(item) not in ids)
                self._bytes -= freed
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
