"""Rules the tests themselves follow: no assertion on elapsed time.

A test that asserts ``elapsed < x`` fails on a loaded machine (two cores shared by
several test runs) without anything being wrong. Tests wait on events and conditions
instead; timing belongs in the benchmarks under ``benchmarks/``, which print a table.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = frozenset({"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time",
                    "time_ns"})
#: names that hold a duration even where the scan cannot follow the value (a tuple a
#: helper returned, unpacked)
DURATIONS = frozenset({"elapsed", "seconds", "duration", "took", ".elapsed", ".seconds",
                       ".duration", ".took"})


def _is_clock(node: ast.AST) -> bool:
    """``time.monotonic`` and its kind, called or passed on (``run(time.monotonic)``)."""
    if isinstance(node, ast.Attribute):
        return node.attr in CLOCKS and isinstance(node.value, ast.Name) and node.value.id == "time"
    return False


def _name_of(target: ast.AST) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return "." + target.attr
    return None


def _reads_clock(node: ast.AST, timed: set[str]) -> bool:
    for child in ast.walk(node):
        if _is_clock(child) or _name_of(child) in timed:
            return True
    return False


def timed_assertions(source: str) -> list[int]:
    """Lines of ``assert`` statements whose comparison involves a clock reading: a clock
    call, a name (or attribute) assigned from one anywhere in the module (``started``,
    ``outcome.seconds``), or a name that says it is a duration (``elapsed``)."""
    tree = ast.parse(source)
    timed: set[str] = set(DURATIONS)
    while True:  # names assigned from timed names are timed too
        before = len(timed)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value:
                if _reads_clock(node.value, timed):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    timed.update(n for t in targets if (n := _name_of(t)) is not None)
        if len(timed) == before:
            break
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and any(
                isinstance(c, ast.Compare) and _reads_clock(c, timed) for c in ast.walk(node.test)):
            lines.append(node.lineno)
    return lines


def test_no_test_asserts_on_elapsed_time() -> None:
    found = [f"{path.name}:{line}" for path in sorted(TESTS.rglob("*.py"))
             for line in timed_assertions(path.read_text())]
    assert not found, ("assertions on elapsed time fail on a loaded machine; wait on an event "
                       "or a condition instead (timings go into benchmarks/): "
                       + ", ".join(found))


def test_the_scan_catches_what_it_is_for() -> None:
    caught = '''
import time
def test_a():
    started = time.monotonic()
    work()
    assert time.monotonic() - started < 0.3, "too slow"
def test_b():
    begun = time.perf_counter()
    ran = run(time.perf_counter)
    assert ran - begun < 0.5
def test_c():
    started = time.time()
    elapsed = time.time() - started
    assert ok and elapsed < 60
def test_d(outcome):
    outcome.seconds = time.monotonic() - outcome.started
    assert all(o.seconds < 1.0 for o in [outcome])
def test_f(server):
    status, seconds, body = server.ask("hello")
    assert status == 413 and seconds < 1.0
'''
    assert len(timed_assertions(caught)) == 5
    allowed = '''
import time
def test_e(event):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not event.is_set():
        time.sleep(0.01)
    assert event.is_set()
    assert retry_after >= 1
'''
    assert timed_assertions(allowed) == []
