"""Rules the tests themselves follow, each enforced by a scan of every test module (and
of the conformance kit in ``omlx_core/testing``), each scan shown to catch what it is for:

- no assertion on elapsed time, on a rate or count per wall-clock unit, or on a speed
  ratio between two runs: they fail on a loaded machine (two cores shared by several
  test runs) without anything being wrong; tests wait on events and conditions, and
  timing belongs in the benchmarks under ``benchmarks/``, which print a table;
- no assertion that cannot fail (``assert x if c else True``, ``assert x or True``,
  ``assert x == x``, ``assert len(x) >= 0``, a non-empty literal);
- no sleep used to order events: a sleep only paces a polling loop that exits on its
  condition and fails when the condition never comes (no timers, no loop that falls
  through), and a bounded wait that must succeed gives at least :data:`MIN_BOUND_S`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
KIT = TESTS.parent / "omlx_core" / "testing"
CLOCKS = frozenset({"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time",
                    "time_ns"})
#: names that hold a duration even where the scan cannot follow the value (a tuple a
#: helper returned, unpacked)
DURATIONS = frozenset({"elapsed", "seconds", "duration", "took", ".elapsed", ".seconds",
                       ".duration", ".took"})
#: names that say they hold a duration (used where a factor meets them: ``20 * wall_s``)
DURATION_NAME = re.compile(r"(^|_)(elapsed|duration|took|wall|latency|seconds|secs)(_|$)"
                           r"|_(s|ms|us|ns)$")
#: names that say they hold a rate per wall-clock unit
RATE_NAME = re.compile(r"(^|_)(per_s|per_sec|per_second|tok_s|tps|hz|throughput)(_|$)")
#: the shortest bound a wait that must succeed may give: a test fails on a hang through
#: such bounds (or the per-test timeout), never because a loaded machine was slow
MIN_BOUND_S = 10.0
#: calls that wait (their bound: the keyword ``timeout``/``timeout_s``, or the positional
#: argument at this index)
WAITS = {"wait": 0, "join": 0, "result": 0, "flush": 0, "acquire": 1, "next_output": 0,
         "wait_for": 1, "wait_until": 1, "wait_for_output": 3}
#: waits that end a test with a failure when they run out (the rest only when asserted)
MUST_SUCCEED = frozenset({"join", "wait_for", "wait_until", "wait_for_output"})
#: sleeps that are the behaviour under test (a slow peer), not a way to order events
SIMULATED_SLOWNESS = {
    ("test_http_connection_guard.py", "chunks"):
        "a stream slower than the request timeout is what the connection guard must leave alone",
    ("test_http_connection_guard.py", "test_keep_alive_between_requests_and_long_streams_are_left_alone"):
        "a keep-alive connection idle past the request timeout is what the guard must leave alone",
    ("waiting.py", "wait_for"):
        "returns whether the condition came; a call that drops the answer is caught below",
}


def sources() -> list[Path]:
    return sorted(TESTS.rglob("*.py")) + sorted(KIT.glob("*.py"))


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


def _timed_names(tree: ast.AST) -> set[str]:
    """Names assigned from a clock reading anywhere in the module, and names assigned
    from those, plus :data:`DURATIONS`."""
    timed: set[str] = set(DURATIONS)
    while True:
        before = len(timed)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value:
                if _reads_clock(node.value, timed):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    timed.update(n for t in targets if (n := _name_of(t)) is not None)
        if len(timed) == before:
            return timed


def _compares(node: ast.Assert) -> list[ast.Compare]:
    return [c for c in ast.walk(node.test) if isinstance(c, ast.Compare)]


def timed_assertions(source: str) -> list[int]:
    """Lines of ``assert`` statements whose comparison involves a clock reading: a clock
    call, a name (or attribute) assigned from one anywhere in the module (``started``,
    ``outcome.seconds``), a name that says it is a duration (``elapsed``), or a call
    that measures one (``matmul_benchmark_ms()``) bounded by anything but zero."""
    tree = ast.parse(source)
    timed = _timed_names(tree)
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)
            and any(_reads_clock(c, timed) or _bounds_a_measured_time(c) for c in _compares(node))]


def _bounds_a_measured_time(compare: ast.Compare) -> bool:
    """``x_ms() < 10_000``: an ordering of a call whose name says it returns a duration
    (a setting's getter compared for equality, ``retry_after_s() == 1.0``, is not)."""
    operands = [compare.left, *compare.comparators]
    measured = any(isinstance(o, ast.Call) and DURATION_NAME.search((_name_of(o.func) or "").lstrip("."))
                   for o in operands)
    ordered = any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in compare.ops)
    others = [o for o in operands if not isinstance(o, ast.Call)]
    return measured and ordered and not all(
        isinstance(o, ast.Constant) and o.value == 0 for o in others)


def _is_duration(node: ast.AST, timed: set[str]) -> bool:
    name = _name_of(node)
    if name is None and isinstance(node, ast.Call):
        name = _name_of(node.func)
    return _reads_clock(node, timed) or (name is not None and (
        bool(DURATION_NAME.search(name.lstrip("."))) or name in timed))


def rate_assertions(source: str) -> list[int]:
    """Lines of ``assert`` statements that compare a rate or count per wall-clock unit
    (``samples >= 20 * run.wall_s``, ``tokens / elapsed > 50``, ``tok_per_s > 100``) or a
    speed ratio between two runs (``fast_ms * 5 < slow_ms``, ``slow_ms / fast_ms > 5``):
    a comparison in which a duration is multiplied or divided, or a rate is compared
    with anything but zero."""
    tree = ast.parse(source)
    timed = _timed_names(tree)
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in _compares(node):
            operands = [compare.left, *compare.comparators]
            scaled = any(isinstance(op, (ast.Mult, ast.Div, ast.FloorDiv))
                         and (_is_duration(b.left, timed) or _is_duration(b.right, timed))
                         for operand in operands for b in ast.walk(operand)
                         if isinstance(b, ast.BinOp) for op in [b.op])
            rated = any(RATE_NAME.search((_name_of(o) or "").lstrip(".")) for o in operands) and not any(
                isinstance(o, ast.Constant) and o.value in (0, None) for o in operands)
            if scaled or rated:
                lines.append(node.lineno)
                break
    return lines


def _truthy_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.JoinedStr)):
        return bool(getattr(node, "elts", None) or getattr(node, "keys", None)
                    or getattr(node, "values", None))
    return False


def _cannot_fail(test: ast.AST) -> bool:
    same = ast.dump
    if _truthy_constant(test):
        return True
    if isinstance(test, ast.IfExp):
        return _truthy_constant(test.body) or _truthy_constant(test.orelse)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        plain = {same(v) for v in test.values}
        return any(_truthy_constant(v) or (isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not)
                                           and same(v.operand) in plain) for v in test.values)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right, op = test.left, test.comparators[0], test.ops[0]
        calls = any(isinstance(n, ast.Call) for n in ast.walk(left))  # f() == f(): idempotence
        if isinstance(op, (ast.Eq, ast.LtE, ast.GtE, ast.Is)) and same(left) == same(right) \
                and not calls:
            return True
        is_len = lambda n: isinstance(n, ast.Call) and getattr(n.func, "id", None) == "len"  # noqa: E731
        zero = lambda n: isinstance(n, ast.Constant) and n.value == 0  # noqa: E731
        return ((is_len(left) and isinstance(op, ast.GtE) and zero(right))
                or (zero(left) and isinstance(op, ast.LtE) and is_len(right)))
    return False


def tautologies(source: str) -> list[int]:
    """Lines of ``assert`` statements that hold whatever the code under test does."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Assert) and _cannot_fail(node.test)]


def _sleeps(node: ast.AST, sleep_names: set[str]) -> bool:
    """A call that only lets time pass: ``time.sleep(x)``, ``sleep(x)`` (imported), or a
    wait on an event made for the purpose (``threading.Event().wait(x)``)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "sleep" and _name_of(func.value) in ("time", "asyncio"):
        return True
    if isinstance(func, ast.Name) and func.id in sleep_names:
        return True
    return (isinstance(func, ast.Attribute) and func.attr == "wait"
            and isinstance(func.value, ast.Call) and _name_of(func.value.func) in (".Event", "Event"))


def _fails(nodes: list[ast.AST]) -> bool:
    """Whether any of ``nodes`` holds an ``assert``, a ``raise`` or a ``pytest.fail``."""
    return any(isinstance(n, (ast.Assert, ast.Raise))
               or (isinstance(n, ast.Call) and _name_of(n.func) == ".fail")
               for node in nodes for n in ast.walk(node))


def _exits_on_a_condition(loop: ast.For | ast.While) -> bool:
    if isinstance(loop, ast.While) and not (isinstance(loop.test, ast.Constant) and loop.test.value):
        return True
    return any(isinstance(n, ast.If) and any(isinstance(x, (ast.Break, ast.Return, ast.Raise))
                                             for s in n.body for x in ast.walk(s))
               for s in loop.body for n in ast.walk(s))


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _polling_loop_fails(loop: ast.For | ast.While, parents: dict[ast.AST, ast.AST]) -> bool:
    """The loop exits on its condition, and the test fails when the condition never
    comes: the loop (or its ``else``) asserts or raises, or the statement after it does
    (after clean-up calls)."""
    if not _exits_on_a_condition(loop):
        return False
    if _fails(loop.body) or _fails(loop.orelse):
        return True
    block = next((b for field in ("body", "orelse", "finalbody")
                  for b in [getattr(parents[loop], field, None)] if isinstance(b, list) and loop in b), [])
    after = block[block.index(loop) + 1:]
    while after and isinstance(after[0], ast.Expr) and isinstance(after[0].value, ast.Call) \
            and not _fails(after[:1]):
        after = after[1:]  # clean-up calls (``self.close()``) before the failure
    return _fails(after[:1])


def unordered_sleeps(source: str, module: str = "") -> list[int]:
    """Lines of sleeps and timers that order events: a timer
    (``threading.Timer(0.2, release.set)``), a sleep that is not the pace of a polling
    loop which exits on its condition and fails when it never comes (a sleep on its own,
    a scripted delay, a loop that falls through), or a call of
    :func:`omlx_core.testing.waiting.wait_for` whose answer is dropped (``wait_for_output``
    fails by itself). Sleeps listed in
    :data:`SIMULATED_SLOWNESS` (by module and function) are the behaviour under test."""
    tree = ast.parse(source)
    parents = _parents(tree)
    sleep_names = {alias.asname or alias.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio")
                   for alias in node.names if alias.name == "sleep"}
    waits = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "omlx_core.testing.waiting" for alias in node.names
             if alias.name == "wait_for"}
    lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Call) and _name_of(node.value.func) in waits]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name_of(node.func) in (".Timer", "Timer"):
            lines.append(node.lineno)
            continue
        if not _sleeps(node, sleep_names):
            continue
        scope, loop = parents.get(node), None
        while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if loop is None and isinstance(scope, (ast.For, ast.While)):
                loop = scope
            scope = parents.get(scope)
        if (module, getattr(scope, "name", None)) in SIMULATED_SLOWNESS:
            continue
        if loop is None or not _polling_loop_fails(loop, parents):
            lines.append(node.lineno)
    return sorted(lines)


def _constants(tree: ast.Module) -> dict[str, float]:
    """The module's top-level numeric constants (``POLL_S = 0.05``)."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float))
            for t in node.targets if isinstance(t, ast.Name)}


def _seconds(node: ast.AST | None, constants: dict[str, float]) -> float | None:
    """The value of a bound written as a number, a module constant or their product."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        left, right = _seconds(node.left, constants), _seconds(node.right, constants)
        if left is not None and right is not None:
            return left * right if isinstance(node.op, ast.Mult) else left + right
    return None


def _inside_raises(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` runs inside ``with pytest.raises(...)``: expected to fail."""
    return any(isinstance(scope, ast.With) and any(
        isinstance(item.context_expr, ast.Call) and _name_of(item.context_expr.func) == ".raises"
        for item in scope.items) for scope in _ancestors(node, parents))


def short_bounds(source: str) -> list[int]:
    """Lines where a wait that must succeed is bounded below :data:`MIN_BOUND_S`: a
    deadline ``clock() + 2``, a ``timeout``/``timeout_s`` parameter defaulting to less,
    or a wait (:data:`WAITS`) given less that is asserted, or joined. A wait asserted
    *not* to succeed (``assert not done.wait(0.3)``: nothing happens meanwhile, or one
    inside ``pytest.raises``) may be short."""
    tree = ast.parse(source)
    constants = _constants(tree)
    parents = _parents(tree)
    lines = []

    def short(node: ast.AST | None) -> bool:
        seconds = _seconds(node, constants)
        return seconds is not None and 0 < seconds < MIN_BOUND_S

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Call) \
                and _is_clock(node.left.func) and short(node.right):
            lines.append(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults \
                + node.args.kw_defaults
            lines += [node.lineno for a, d in zip(arguments, defaults)
                      if a.arg in ("timeout", "timeout_s") and short(d)]
        elif isinstance(node, ast.Call) and (name := (_name_of(node.func) or "").lstrip(".")) in WAITS:
            bound = next((k.value for k in node.keywords if k.arg in ("timeout", "timeout_s")),
                         node.args[WAITS[name]] if len(node.args) > WAITS[name] else None)
            if not short(bound):
                continue
            parent = parents.get(node)
            negated = (isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
                       or _inside_raises(node, parents))
            asserted = any(isinstance(p, ast.Assert) for p in _ancestors(node, parents))
            if not negated and (name in MUST_SUCCEED or asserted):
                lines.append(node.lineno)
    return sorted(set(lines))


#: calls that wait for as long as it takes when given no bound
UNBOUNDED_WHEN_BARE = frozenset({"join", "wait", "result", "acquire", "communicate", "get",
                                 "next_output"})
#: names of request handles (an engine's outputs; iterating one waits without a bound)
HANDLE_NAME = re.compile(r"(^|_)handle$")


def _is_subprocess_wait(func: ast.AST) -> bool:
    """``subprocess.run`` and the calls like it, which wait for the child to end."""
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "subprocess"
            and func.attr in ("run", "call", "check_call", "check_output"))


def unbounded_waits(source: str) -> list[int]:
    """Lines of waits with no bound: ``thread.join()``, ``event.wait()``,
    ``future.result()``, ``queue.get()``, ``process.wait()``, ``handle.next_output()``,
    and reading a request handle by iteration (``for output in handle``,
    ``next(iter(handle))``, ``list(handle)``): a hang there holds the test until the
    per-test timeout instead of failing with what it waited for."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = (_name_of(node.func) or "").lstrip(".")
            bare = not node.args and not any(k.arg in ("timeout", "timeout_s") for k in node.keywords)
            if isinstance(node.func, ast.Attribute) and name in UNBOUNDED_WHEN_BARE and bare:
                lines.append(node.lineno)
            elif (_is_subprocess_wait(node.func)
                  and not any(k.arg == "timeout" for k in node.keywords)):
                lines.append(node.lineno)
            elif name in ("iter", "list") and node.args and HANDLE_NAME.search(
                    (_name_of(node.args[0]) or "").lstrip(".")):
                lines.append(node.lineno)
        elif isinstance(node, (ast.For, ast.comprehension)) and HANDLE_NAME.search(
                (_name_of(node.iter) or "").lstrip(".")):
            lines.append(getattr(node, "lineno", None) or node.iter.lineno)
    return sorted(set(lines))


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]):
    while (node := parents.get(node)) is not None:
        yield node


def _scan(rule) -> list[str]:
    found = []
    for path in sources():
        source = path.read_text()
        lines = rule(source, path.name) if rule is unordered_sleeps else rule(source)
        found += [f"{path.relative_to(TESTS.parent)}:{line}" for line in lines]
    return found


def test_no_test_asserts_on_elapsed_time() -> None:
    found = _scan(timed_assertions)
    assert not found, ("assertions on elapsed time fail on a loaded machine; wait on an event "
                       "or a condition instead (timings go into benchmarks/): "
                       + ", ".join(found))


def test_no_test_asserts_on_a_rate_or_a_speed_ratio() -> None:
    found = _scan(rate_assertions)
    assert not found, ("a rate per wall-clock unit or a speed ratio between two runs depends on "
                       "the machine's load; count what the code did instead, and put speed in "
                       "a benchmark that prints a table: " + ", ".join(found))


def test_no_assertion_holds_whatever_the_code_does() -> None:
    found = _scan(tautologies)
    assert not found, "these assertions cannot fail: " + ", ".join(found)


def test_no_sleep_orders_events() -> None:
    found = _scan(unordered_sleeps)
    assert not found, ("a sleep or timer that orders events races on a loaded machine; wait on "
                       "an event, or poll a condition in a loop that fails when it never comes "
                       "(omlx_core.testing.waiting.wait_for, asserted): " + ", ".join(found))


def test_every_wait_is_bounded() -> None:
    found = _scan(unbounded_waits)
    assert not found, ("waits without a bound hang the suite on a deadlock; give each a "
                       "timeout (omlx_core.testing.engine_io reads request handles with one): "
                       + ", ".join(found))


def test_every_wait_that_must_succeed_is_bounded_generously() -> None:
    found = _scan(short_bounds)
    assert not found, (f"bounds under {MIN_BOUND_S:.0f} s on waits that must succeed fail on a "
                       "loaded machine; a bound is there to end a hang, not to time the code: "
                       + ", ".join(found))


# -- each scan catches what it is for ----------------------------------------------------------


def test_the_time_scan_catches_what_it_is_for() -> None:
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
def test_g():
    assert 0.0 < blas.matmul_benchmark_ms(repeats=1) < 10_000.0
'''
    assert len(timed_assertions(caught)) == 6
    allowed = '''
import time
def test_e(event):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not event.is_set():
        time.sleep(0.01)
    assert event.is_set()
    assert retry_after >= 1
    assert blas.matmul_benchmark_ms(repeats=1) > 0.0
    assert queue.retry_after_s() == 1.0
'''
    assert timed_assertions(allowed) == []


def test_the_rate_scan_catches_what_it_is_for() -> None:
    caught = '''
def test_samples(run):
    assert run.rss_samples >= 20 * run.wall_s, (run.rss_samples, run.wall_s)
def test_blas(tmp_path):
    _, preloaded_ms = run_script(tmp_path)
    _, reference_ms = run_script(tmp_path, reference=True)
    assert preloaded_ms * 5 < reference_ms
def test_ratio(fast_ms, slow_ms):
    assert slow_ms / fast_ms >= 5.0
def test_count_per_second(tokens, elapsed):
    assert tokens / elapsed > 50
def test_throughput(result):
    assert result.decode_tokens_per_s > 100
'''
    assert rate_assertions(caught) == [3, 7, 9, 11, 13]
    allowed = '''
def test_a(sample, stats, recorder):
    assert sample.decode_tokens_per_s is None
    assert sample.decode_tokens_per_s > 0
    assert sample.ttft_p95_s >= sample.ttft_p50_s
    assert stats["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert queue.retry_after_s() == 1.0
    assert tokens_generated - before < 3000
'''
    assert rate_assertions(allowed) == []


def test_the_tautology_scan_catches_what_it_is_for() -> None:
    caught = '''
def test_a(health):
    assert health["finished"]["abort"] >= 1 if isinstance(
        health.get("finished"), dict) else True
    assert True
    assert ok or True
    assert (status, "message")
    assert result == result
    assert len(rows) >= 0
    assert done or not done
    assert f"{x}"
'''
    assert tautologies(caught) == [3, 5, 6, 7, 8, 9, 10, 11]
    allowed = '''
def test_b(health, rows):
    assert health["finished"]["abort"] >= 1
    assert rows == expected or rows == []
    assert not rows
    assert len(rows) >= 1
    assert x if y else z
'''
    assert tautologies(allowed) == []


def test_the_sleep_scan_catches_what_it_is_for() -> None:
    caught = '''
import threading
import time
from time import sleep
def test_a(queue):
    arrivals.arrive("small")
    time.sleep(0.05)
    assert arrivals.order == ["running", "small"]
def test_b(pin):
    threading.Timer(0.2, pin.release.set).start()
def test_c(engine):
    handle.close()
    for _ in range(500):
        if not engine.busy:
            break
        time.sleep(0.01)
    run(engine)
def play(script, handle):
    for delay, output in script:
        sleep(delay)
        handle.put(output)
def test_d():
    threading.Event().wait(0.3)
from omlx_core.testing.waiting import wait_for
def test_g(engine):
    wait_for(lambda: engine.idle(), 60)
'''
    assert unordered_sleeps(caught) == [7, 10, 16, 20, 23, 26]
    # A wait that fails by itself when what it waits for never comes may drop its answer.
    assert unordered_sleeps('''
from omlx_core.testing.waiting import wait_for_output
def test_h(server, log):
    wait_for_output(server, log, "ready", timeout=60)
''') == []
    allowed = '''
import threading
import time
def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")
def test_e(engine):
    for _ in range(2000):
        if engine.idle():
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("never idle")
def test_f(event):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not event.is_set():
        time.sleep(0.01)
    assert event.is_set()
def chunks():
    for i in range(4):
        time.sleep(1.0)
        yield b"chunk"
'''
    assert unordered_sleeps(allowed, "test_http_connection_guard.py") == []


def test_the_bound_scan_catches_what_it_is_for() -> None:
    caught = '''
import time
POLL_S = 0.05
def wait_until(condition, timeout: float = 2.0):
    pass
def test_a(engine, context, thread, event):
    assert wait_for(lambda: engine_idle(context), timeout=5), engine.stats()
    wait_for(lambda: received(engine), timeout=POLL_S * 10)
    thread.join(2)
    deadline = time.monotonic() + 2
    assert store.flush(timeout_s=2)
    assert event.wait(3)
    wait_for_output(server, log, "ready", timeout=5)
'''
    assert short_bounds(caught) == [4, 7, 8, 9, 10, 11, 12, 13]
    allowed = '''
import time
def test_b(done, handle, thread):
    assert not done.wait(0.3)
    assert wait_for(lambda: idle(), timeout=60)
    while (output := handle.next_output(timeout=0)) is not None:
        pass
    thread.join(60)
    deadline = time.monotonic() + 120
    queue.get(timeout=0.1)
    with pytest.raises(AssertionError):
        wait_for_output(silent, log, "ready", timeout=1)
'''
    assert short_bounds(allowed) == []


def test_the_unbounded_wait_scan_catches_what_it_is_for() -> None:
    caught = '''
def test_a(engine, thread, event, future, process, outputs):
    thread.join()
    event.wait()
    future.result()
    process.wait()
    outputs.get()
    handle = engine.submit(request)
    next(iter(handle))
    for output in handle:
        pass
    final = list(handle)[-1]
    tokens = [t for o in handle for t in o.token_ids]
    last = handle.next_output()
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
'''
    assert unbounded_waits(caught) == [3, 4, 5, 6, 7, 9, 10, 12, 13, 14, 15]
    allowed = '''
def test_b(engine, thread, event, process, config):
    thread.join(60)
    assert event.wait(timeout=60)
    process.wait(timeout=30)
    value = config.get("key")
    for handle in handles:
        collect(handle)
    first = handle.next_output(timeout=60)
    eos = next(iter(tokenizer.eos_token_ids))
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
'''
    assert unbounded_waits(allowed) == []
