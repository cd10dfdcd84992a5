"""How much memory this process holds now: the figure every limit is compared against.

Current use is the largest of mlx's active memory, the process footprint (resident set
on Linux, ``ps`` on macOS) and the recent high-water mark of both. The footprint covers
what mlx does not count (the interpreter, tokenizers, allocator caches); the high-water
mark covers memory freed a moment ago that the OS may not have taken back yet.

Only readings taken *between* forwards feed the high-water mark (the forward gate and
idle polls record; a poll that may land inside a forward does not): a reading taken
during a forward contains that forward's transient, and adding the next chunk's
estimate on top of it would count a transient twice and refuse prefills that fit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading
import time
from collections import deque
from typing import Callable, Iterable

from omlx_core.memory import probes
from omlx_core.platform.backend import active_bytes

log = logging.getLogger(__name__)

# glibc's mallopt parameters: the size above which allocations get their own mapping,
# and how many arenas (heaps) threads may spread their allocations over.
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Large enough that a forward's many per-layer activation buffers stay on the heap (at
# 128 KiB every one of them was a fresh mapping: prefill 25-140% slower, decode 15-75%
# slower, measured on SmolLM2), small enough that the big transients (score matrices,
# logits) still go back to the OS the moment they are freed.
MMAP_THRESHOLD_BYTES = 8 * 1024 * 1024


def return_freed_buffers_to_the_os() -> bool:
    """Set glibc's allocator up so freed memory goes back to the OS; call it before the
    process starts its threads (the CLI does, first thing). Returns whether it took
    (glibc only).

    - The mmap threshold is pinned: by default glibc raises it after each large free (up
      to 32 MiB), and later buffers below it come from the heap, which keeps freed memory
      resident: the footprint then stays high after a prefill's transient is gone, and
      the guard would count that transient twice.
    - One arena for every thread (unless ``MALLOC_ARENA_MAX`` is set): by default each
      thread that allocates gets an arena of its own (up to 8 per core), and each keeps
      the high-water mark of its own churn resident, where a heap trim does not reach it.
      Every HTTP worker that once handled a large request (a 7k-word prompt, refused)
      kept 2-3 MiB: a server's quiet RSS grew ~30 MiB over its first twenty such
      requests, and kept it; with one arena, by 0.7 MiB (docs/reliability.md).
    """
    if platform.system() != "Linux":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        took = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        if "MALLOC_ARENA_MAX" not in os.environ:
            took = bool(libc.mallopt(_M_ARENA_MAX, 1)) and took
        return took
    except (OSError, AttributeError) as error:  # musl and others have no mallopt
        log.debug("mallopt unavailable (%s): the footprint may lag frees", error)
        return False


def _load_malloc_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


_malloc_trim = _load_malloc_trim()


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc only; a few milliseconds)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


#: bytes freed after which :class:`FreedHeap` trims the heap: a trim costs ~1-2 ms with
#: a 1 GiB heap, so it waits for a few layers' worth
TRIM_AFTER_BYTES = 16 * 1024 * 1024


class FreedHeap:
    """Hands freed heap pages back to the OS while a long operation frees buffers as it
    goes (a decode lane copying its KV one layer at a time).

    A buffer under the mmap threshold comes from the heap, and its pages stay resident
    after it is freed until the heap is trimmed; a copy made layer by layer would
    otherwise keep the old layers resident until the operation ends: the whole KV twice
    in the resident set, although mlx held one layer twice at most. :meth:`freed`
    counts what was just freed and trims once :data:`TRIM_AFTER_BYTES` have piled up.
    It counts buffers over the threshold too: counting only those under it left a
    3-row lane's growth 130 MiB over mlx's count in the resident set (the heap's free
    pages were touched again meanwhile), counting all of them 0-1 MiB."""

    def __init__(self) -> None:
        self.pending = 0

    def freed(self, sizes: Iterable[int]) -> None:
        """Buffers of these sizes were just freed."""
        self.pending += sum(sizes)
        if self.pending >= TRIM_AFTER_BYTES:
            trim_heap()
            self.pending = 0


_helpers: set[int] = set()
_helpers_lock = threading.Lock()


def count_helper_process(pid: int) -> None:
    """Count process ``pid`` (a child that works for the server: a grammar compile
    worker) in the server's footprint from now on, until :func:`forget_helper_process`."""
    with _helpers_lock:
        _helpers.add(pid)


def forget_helper_process(pid: int) -> None:
    with _helpers_lock:
        _helpers.discard(pid)


def helper_bytes() -> int:
    """Resident bytes of the helper processes now (one read of ``statm`` each)."""
    with _helpers_lock:
        pids = list(_helpers)
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as statm:
                total += int(statm.read().split()[1]) * _PAGE_SIZE
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile (its parent forgets it), or no /proc (macOS)
    return total


#: what the footprint holds beside the engines that the server gives back on demand:
#: ``release(dry_run)`` -> the resident bytes it could give back now (given back unless
#: ``dry_run``): idle helper processes, in-process caches (compiled grammars)
_releases: list[Callable[[bool], int]] = []


def register_reclaimable(release: Callable[[bool], int]) -> None:
    """Let the memory guard count what ``release`` holds (idle helper processes, an
    in-process cache) as memory the server gives back on demand, and call it when a
    request needs the room (``release(dry_run)``: the bytes it holds that it could give
    back now; given back unless ``dry_run``)."""
    with _helpers_lock:
        _releases.append(release)


def unregister_reclaimable(release: Callable[[bool], int]) -> None:
    with _helpers_lock:
        if release in _releases:
            _releases.remove(release)


def reclaimable_outside_engines() -> int:
    """Resident bytes the registered releases could give back now."""
    with _helpers_lock:
        releases = list(_releases)
    return sum(max(0, int(release(True))) for release in releases)


def reclaim_outside_engines() -> int:
    """Give back what every registered release holds; the resident bytes it held."""
    with _helpers_lock:
        releases = list(_releases)
    return sum(max(0, int(release(False))) for release in releases)


#: what the footprint holds beside the engines that comes back by itself: ``held()`` ->
#: the resident bytes of work in flight that ends on its own within a bound (a grammar
#: compile, stopped at its deadline), after which it is given back or reclaimable
_in_flight: list[Callable[[], int]] = []


def register_in_flight(held: Callable[[], int]) -> None:
    """Let the memory guard count what ``held()`` reports (a helper process busy with
    work that ends by itself, such as a grammar compile under its deadline) as memory
    that comes back without anyone giving it back: a request that fits once that work
    ends waits for it instead of being refused."""
    with _helpers_lock:
        _in_flight.append(held)


def unregister_in_flight(held: Callable[[], int]) -> None:
    with _helpers_lock:
        if held in _in_flight:
            _in_flight.remove(held)


def in_flight_outside_engines() -> int:
    """Resident bytes held now by work in flight that ends by itself."""
    with _helpers_lock:
        sources = list(_in_flight)
    return sum(max(0, int(held())) for held in sources)


def footprint_bytes() -> int:
    """Resident bytes of this process and its helper processes, after handing freed heap
    pages back to the OS.

    Buffers under the mmap threshold come from the heap, which keeps freed pages
    resident; without the trim a transient already gone would still be counted as in
    use (a few milliseconds, once per gate decision or poll). A helper's memory (a
    grammar being compiled) is the server's as much as its own heap is.
    """
    trim_heap()
    footprint = probes.probe_process_footprint()
    return (footprint.rss_bytes if footprint else 0) + helper_bytes()


def resident_now() -> int | None:
    """This process's resident set now, cheaply (one read of ``/proc/self/statm``, no
    heap trim), or ``None`` where there is no such file (macOS: ``ps`` is too slow to
    run every scheduler step).

    For the readings taken every step: between two polls, memory outside mlx grows
    without mlx seeing it (host copies of the blocks queued for the SSD tier, file
    pages of libraries touched for the first time), so the last poll's figure for it
    can be tens of MiB low (docs/reliability.md).
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE + helper_bytes()
    except (OSError, ValueError, IndexError):
        return None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryUsage:
    """Reads current use and keeps the recent high-water mark; safe from any thread."""

    def __init__(self, window_s: float = 2.0, *,
                 read_active: Callable[[], int] = active_bytes,
                 read_footprint: Callable[[], int] = footprint_bytes,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._read_active = read_active
        self._read_footprint = read_footprint
        # What lives beside the engines (idle helpers, compiled grammars) is given back
        # only where the footprint counts it.
        self._counts_outside_engines = read_footprint is footprint_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self._peak = 0

    def reclaimable_outside_engines(self) -> int:
        """What the footprint holds beside the engines that could be given back now
        (idle helper processes, compiled grammars)."""
        return reclaimable_outside_engines() if self._counts_outside_engines else 0

    def reclaim_outside_engines(self) -> int:
        """Give back what the footprint holds beside the engines; the bytes it held."""
        return reclaim_outside_engines() if self._counts_outside_engines else 0

    def in_flight_outside_engines(self) -> int:
        """What the footprint holds beside the engines for work in flight that ends by
        itself (a grammar compile in a helper process)."""
        return in_flight_outside_engines() if self._counts_outside_engines else 0

    def resident(self) -> int:
        """Bytes held right now: max(mlx active, process footprint)."""
        return max(self._read_active(), self._read_footprint())

    def recent_peak(self) -> int:
        """The largest recorded reading within the last ``window_s`` seconds."""
        with self._lock:
            self._expire(self._clock())
            return max((value for _, value in self._samples), default=0)

    def high_water(self, *, record: bool = True) -> int:
        """max(resident now, recent peak); ``record`` adds this reading to the window
        (only for readings taken between forwards, see the module docstring)."""
        now_bytes = self.resident()
        with self._lock:
            now = self._clock()
            self._expire(now)
            recent = max((value for _, value in self._samples), default=0)
            if record:
                self._samples.append((now, now_bytes))
            self._peak = max(self._peak, now_bytes)
        return max(now_bytes, recent)

    @property
    def peak_bytes(self) -> int:
        """The largest reading ever taken (recorded or not)."""
        return self._peak

    def forget_recent(self) -> None:
        """Drop the recorded readings: memory was just given back on purpose (caches
        evicted, the heap trimmed), so the next reading alone is the truth."""
        with self._lock:
            self._samples.clear()

    def observe(self, value: int) -> None:
        """Count a reading made elsewhere toward :attr:`peak_bytes` only."""
        with self._lock:
            self._peak = max(self._peak, value)

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
