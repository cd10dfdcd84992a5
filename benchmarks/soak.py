"""A soak of one server under a memory ceiling: mixed traffic for a bounded time, on
loopback, with every answer and the server's memory, files and threads checked
(issue 24, item 2).

One ``omlx-core serve --memory-ceiling CEILING`` on the default model takes, from a few
client threads and in a seeded random order: OpenAI chats (streamed and not, with
tools, with a JSON response format), completions, Anthropic messages, Responses,
streams the client hangs up on after two tokens (cancels), prompts too large for the
ceiling (must be 413 before any byte), bodies over ``server.max_body`` (413), bad
bodies (must be 400), and slow clients: one that sends its request in pieces over two
seconds, one that reads its stream slowly. Verdicts:

- no 5xx, and no truncated 200 (a stream without ``[DONE]`` or with an in-band error,
  a JSON body that does not parse);
- every refusal (4xx) is the one a fresh server with the same flags gives the same
  request, sent alone;
- the server's resident memory stays under the ceiling at every sample (VmRSS at
  ``SAMPLE_HZ`` and the kernel's own high-water mark, VmHWM, which counts from the
  process's start);
- with the server quiet (no request in flight), at the end of the warm-up and at the
  end: its footprint (its resident memory and its helper processes', as the memory
  guard reads it) less the caches it gives back on demand (the prefix cache, mlx's
  buffer cache, idle helpers: ``omlx_memory_reclaimable_bytes``) differs by at most
  ``MAX_DRIFT``, and open file descriptors (less the pipes to helper processes, which
  come and go with the work) and threads do not grow. The caches are left
  out because what a bounded cache holds at one instant is not a leak: a quiet reading
  taken while the caches held 30 MiB more failed the raw check at +4.1 %
  while this figure was -0.1 %. The raw drift is printed beside it.

    python -m benchmarks.soak [--minutes 30] [--ceiling 0.9GiB] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.ceiling import child_pids, status_fields
from omlx_core.bench import publish_report
from omlx_core.bench.servers import ServerProcess, ServerSpec, free_port
from omlx_core.settings import format_size, parse_size

MIB = 2**20
SEED = 20261124
#: samples a second the sampler aims at (at least 20 come even on a loaded machine)
SAMPLE_HZ = 50
MAX_DRIFT = 0.02
CLIENTS = 6
#: seconds one request may take before it counts as a failure (a bound, never a goal)
REQUEST_TIMEOUT = 300.0
#: words of a prompt that cannot fit under a 0.9 GiB ceiling yet is inside the model's
#: 8k context (so the verdict is the memory guard's 413, not a context-length 400)
OVERSIZED_WORDS = 7000
#: refused requests replayed on the fresh server (the distinct ones, at most this many)
MAX_REPLAYS = 24
RSS_CHECK = "RSS under the ceiling at every sample (VmRSS and VmHWM)"
DRIFT_CHECK = f"RSS drift after warm-up, less the caches it gives back, <= {MAX_DRIFT:.0%}"


# -- what one request did ---------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    status: int
    #: what went wrong, empty when the answer was what this kind must get
    problem: str = ""
    seconds: float = 0.0
    #: the request, kept for refusals so a fresh server can be asked the same
    request: tuple[str, bytes] | None = None
    error_code: str = ""


@dataclass(frozen=True)
class Request:
    kind: str
    path: str
    body: bytes
    #: statuses this kind may get; any other one is a problem
    expect: tuple[int, ...]
    stream: bool = False
    #: the answer must be this JSON ``error.code`` (refusals)
    code: str = ""


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def make_request(kind: str, rng: random.Random, model: str) -> Request:
    """One request of ``kind``, varied by ``rng``."""
    words = " ".join(rng.choice(("river", "stone", "lamp", "cloud", "field", "song", "bread",
                                 "north", "glass", "window")) for _ in range(rng.randint(4, 40)))
    max_tokens = rng.randint(8, 32)
    user = [{"role": "user", "content": f"Write about {words}."}]
    chat = {"model": model, "messages": user, "max_tokens": max_tokens, "temperature": 0.0}
    if kind == "chat":
        stream = rng.random() < 0.5
        return Request(kind, "/v1/chat/completions", _json({**chat, "stream": stream}), (200,),
                       stream)
    if kind == "completion":
        stream = rng.random() < 0.5
        return Request(kind, "/v1/completions", _json({
            "model": model, "prompt": f"Once upon a time, {words}", "max_tokens": max_tokens,
            "stream": stream, "temperature": 0.7, "seed": rng.randint(0, 2**31)}), (200,), stream)
    if kind == "tools":
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}
        return Request(kind, "/v1/chat/completions", _json({
            **chat, "max_tokens": 48, "tools": [tool], "tool_choice": "required"}), (200,))
    if kind == "json":
        return Request(kind, "/v1/chat/completions", _json({
            **chat, "max_tokens": 32, "response_format": {"type": "json_object"},
            "stream": rng.random() < 0.5}), (200,), False)
    if kind == "anthropic":
        stream = rng.random() < 0.5
        return Request(kind, "/v1/messages", _json({
            "model": model, "max_tokens": max_tokens, "messages": user, "stream": stream}),
            (200,), stream)
    if kind == "responses":
        stream = rng.random() < 0.5
        return Request(kind, "/v1/responses", _json({
            "model": model, "input": f"Write about {words}.", "max_output_tokens": max_tokens,
            "stream": stream}), (200,), stream)
    if kind in ("cancel", "slow reader"):
        return Request(kind, "/v1/chat/completions", _json({
            **chat, "max_tokens": 48, "stream": True}), (200,), True)
    if kind == "slow sender":
        return Request(kind, "/v1/chat/completions", _json(chat), (200,))
    if kind == "oversized prompt":
        prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in
                          range(OVERSIZED_WORDS + rng.randint(0, 500)))
        path, body = rng.choice((
            ("/v1/chat/completions", {"model": model, "max_tokens": 8, "stream": True,
                                      "messages": [{"role": "user", "content": prompt}]}),
            ("/v1/completions", {"model": model, "max_tokens": 8, "prompt": prompt}),
            ("/v1/messages", {"model": model, "max_tokens": 8,
                              "messages": [{"role": "user", "content": prompt}]}),
            ("/v1/responses", {"model": model, "max_output_tokens": 8, "input": prompt,
                               "stream": True})))
        return Request(kind, path, _json(body), (413,), code="prefill_memory_exceeded")
    if kind == "oversized body":
        filler = "x" * (9 * MIB)
        return Request(kind, "/v1/chat/completions", _json({
            "model": model, "messages": [{"role": "user", "content": filler}]}), (413,),
            code="request_too_large")
    if kind == "bad body":
        raw = rng.choice((
            b"{not json", _json({"model": model}),
            _json({**chat, "max_tokens": -1}), _json({**chat, "temperature": "hot"}),
            _json({"model": model, "messages": [{"role": "wizard", "content": "hi"}]}),
            _json({"model": model, "max_tokens": 8, "messages": "hello"})))
        return Request(kind, "/v1/chat/completions", raw, (400,))
    raise ValueError(f"unknown request kind {kind!r}")


#: kind -> weight in the mix
MIX = {"chat": 6, "completion": 4, "tools": 2, "json": 2, "anthropic": 3, "responses": 3,
       "cancel": 2, "slow reader": 1, "slow sender": 1, "oversized prompt": 2,
       "oversized body": 0.3, "bad body": 3}


# -- sending one request and judging its answer -----------------------------------------------


def _read_stream(response: http.client.HTTPResponse, request: Request,
                 on_line: Callable[[int], bool] | None = None) -> str:
    """Read an SSE body to its end; a problem, or "" when it ended as it must."""
    anthropic = request.path == "/v1/messages"
    responses = request.path == "/v1/responses"
    done = False
    lines = 0
    for raw in response:
        line = raw.strip()
        if line.startswith(b"event: error") or b'"type": "error"' in line[:40] \
                or line.startswith(b'data: {"error"'):
            return f"in-band error: {line[:300]!r}"
        if not line.startswith(b"data: "):
            continue
        lines += 1
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            done = True
        elif anthropic and b'"message_stop"' in data:
            done = True
        elif responses and (b'"response.completed"' in data or b'"response.incomplete"' in data):
            done = True
        else:
            try:
                json.loads(data)
            except ValueError:
                return f"a data line that is not JSON: {data[:200]!r}"
        if on_line is not None and on_line(lines):
            return ""
    return "" if done else "stream ended without its end marker (truncated 200)"


def send(port: int, request: Request) -> Outcome:
    started = time.monotonic()
    outcome = Outcome(request.kind, 0)
    said = ""  # an error body's code and message, for the report
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        if request.kind == "slow sender":
            connection.putrequest("POST", request.path)
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(request.body)))
            connection.endheaders()
            pieces = 4
            size = -(-len(request.body) // pieces)
            for index in range(pieces):
                time.sleep(0.5)
                connection.send(request.body[index * size:(index + 1) * size])
        else:
            connection.request("POST", request.path, body=request.body,
                               headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        outcome.status = response.status
        if response.status != 200:
            body = response.read()
            try:
                error = json.loads(body)
                error = error.get("error", error)
                outcome.error_code = str(error.get("code") or error.get("type") or "")
                said = f" ({outcome.error_code}: {str(error.get('message', ''))[:240]})"
            except (ValueError, AttributeError):
                outcome.problem = f"a {response.status} whose body is not JSON: {body[:200]!r}"
            outcome.request = (request.path, request.body)
        elif request.stream or "text/event-stream" in (response.getheader("Content-Type") or ""):
            if request.kind == "cancel":
                outcome.problem = _read_stream(response, request, on_line=lambda n: n >= 3)
            elif request.kind == "slow reader":
                def slowly(_: int) -> bool:
                    time.sleep(0.1)
                    return False
                outcome.problem = _read_stream(response, request, on_line=slowly)
            else:
                outcome.problem = _read_stream(response, request)
        else:
            body = response.read()
            try:
                json.loads(body)
            except ValueError:
                outcome.problem = f"a 200 whose body is not JSON (truncated?): {body[-200:]!r}"
    except (OSError, http.client.HTTPException) as exc:
        outcome.problem = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    if outcome.status not in request.expect and not outcome.problem:
        outcome.problem = f"HTTP {outcome.status}{said}, expected {request.expect}"
    if request.code and outcome.status in request.expect and outcome.error_code != request.code:
        outcome.problem = f"error code {outcome.error_code!r}, expected {request.code!r}"
    outcome.seconds = time.monotonic() - started
    return outcome


# -- watching the server process --------------------------------------------------------------


@dataclass
class Sample:
    at: float
    rss: int
    hwm: int
    threads: int


def read_status(pid: int) -> Sample:
    values = status_fields(pid)
    return Sample(time.monotonic(), values["VmRSS"], values["VmHWM"], values["Threads"])


def open_fds(pid: int) -> int:
    """``pid``'s open file descriptors, less its ends of the pipes to its helper
    processes: a grammar compile worker comes and goes with the work (and the memory
    guard stops idle ones), and its two pipes with it."""
    helpers = {link for child in child_pids(pid) for link in _fd_links(child)
               if link.startswith("pipe:")}
    return sum(1 for link in _fd_links(pid) if link not in helpers)


def _fd_links(pid: int) -> list[str]:
    links = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return links
    for name in names:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed meanwhile
    return links


class Sampler:
    """The server's RSS, VmHWM and threads at ``SAMPLE_HZ``, on a thread."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def _run(self) -> None:
        period = 1.0 / SAMPLE_HZ
        tick = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append(read_status(self.pid))
            except (OSError, KeyError):
                return
            tick = max(tick + period, time.monotonic() - period)
            self._stop.wait(max(0.0, tick - time.monotonic()))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass(frozen=True)
class Quiet:
    """The server with no request in flight: what it holds when nothing runs."""

    fds: int
    threads: int
    rss: int
    #: what the server says it could give back on demand (prefix caches, mlx's buffer
    #: cache, queued host copies): RSS less this is what no cache explains
    reclaimable: int = 0


def reclaimable_bytes(port: int) -> int:
    """``omlx_memory_reclaimable_bytes`` from the server's /metrics (0 when absent)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        connection.close()
    for line in text.splitlines():
        if line.startswith("omlx_memory_reclaimable_bytes "):
            return int(float(line.split()[1]))
    return 0


def quiet_counts(pid: int, port: int, settle_s: float = 2.0, bound_s: float = 20.0) -> Quiet:
    """Open fds, threads and RSS once fds and threads have stopped changing (at most
    ``bound_s``); the RSS after ``settle_s`` more, so the memory guard's idle poll has
    handed freed heap pages back."""
    deadline = time.monotonic() + bound_s
    last = (open_fds(pid), read_status(pid).threads)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = (open_fds(pid), read_status(pid).threads)
        if now == last:
            break
        last = now
    time.sleep(settle_s)
    return Quiet(last[0], last[1], read_status(pid).rss + helper_rss(pid),
                 reclaimable_bytes(port))


def helper_rss(pid: int) -> int:
    """Resident bytes of ``pid``'s child processes (grammar compile workers): the
    server's footprint counts them, and its reclaimable figure counts the idle ones."""
    total = 0
    for child in child_pids(pid):
        try:
            total += status_fields(child).get("VmRSS", 0)
        except OSError:
            continue  # gone meanwhile
    return total


# -- the soak ---------------------------------------------------------------------------------


@dataclass
class SoakResult:
    seconds: float
    ceiling: int
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    warm_up_end: float = 0.0
    #: the server quiet at the end of the warm-up and at the end
    quiet: tuple[Quiet, Quiet] = (Quiet(0, 0, 0), Quiet(0, 0, 0))
    #: refusals a fresh server answered otherwise: (kind, status here, status there)
    disagreements: list[tuple[str, str, str]] = field(default_factory=list)
    replayed: int = 0
    load: tuple[float, float] = (0.0, 0.0)

    @property
    def server_errors(self) -> int:
        return sum(1 for o in self.outcomes if o.status >= 500)

    @property
    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    @property
    def peak_rss(self) -> int:
        return max((s.rss for s in self.samples), default=0)

    @property
    def peak_hwm(self) -> int:
        return max((s.hwm for s in self.samples), default=0)

    def drift(self) -> float:
        """RSS of the quiet server at the end against at the end of the warm-up."""
        warm, end = self.quiet
        return (end.rss - warm.rss) / warm.rss if warm.rss else 0.0

    def drift_without_caches(self) -> float:
        """The same for RSS less what the server could give back (its caches): the
        part a leak would grow, whatever the bounded caches hold (the verdict)."""
        warm, end = self.quiet
        base = warm.rss - warm.reclaimable
        return ((end.rss - end.reclaimable) - base) / base if base > 0 else 0.0

    def busy_drift(self) -> float:
        """The same for the busy server: the median of the last tenth of the samples
        after the warm-up against the first tenth's (varies with what runs; a figure)."""
        after = [s for s in self.samples if s.at >= self.warm_up_end]
        if len(after) < 20:
            return 0.0
        window = max(len(after) // 10, 10)
        first = statistics.median(s.rss for s in after[:window])
        last = statistics.median(s.rss for s in after[-window:])
        return (last - first) / first

    def verdicts(self) -> dict[str, bool]:
        return {
            "no 5xx": self.server_errors == 0,
            "no truncated 200 or other wrong answer": not self.problems,
            "every refusal is a fresh server's": not self.disagreements,
            RSS_CHECK:
                self.peak_hwm <= self.ceiling and self.peak_rss <= self.ceiling,
            DRIFT_CHECK: abs(self.drift_without_caches()) <= MAX_DRIFT,
            "no growth in open fds": self.quiet[1].fds <= self.quiet[0].fds,
            "no growth in threads": self.quiet[1].threads <= self.quiet[0].threads,
        }


def server_spec(port: int, ceiling: str, extra: Sequence[str] = ()) -> ServerSpec:
    argv = [sys.executable, "-m", "omlx_core", "--log-level", "INFO", "serve",
            "--host", "127.0.0.1", "--port", str(port), "--memory-ceiling", ceiling, *extra]
    return ServerSpec("omlx", f"omlx-core serve --memory-ceiling {ceiling}", argv, model_id="")


def soak(seconds: float, ceiling: str = "0.9GiB", *, warm_up: float | None = None,
         clients: int = CLIENTS, seed: int = SEED, server_args: Sequence[str] = (),
         progress: Callable[[str], None] | None = None) -> SoakResult:
    """Run the soak for ``seconds`` of traffic (plus start-up, quiet counts and the
    fresh server's replays) and return what it saw; the verdicts are the caller's.
    ``server_args`` go to both servers' ``serve`` command (``--set KEY=VALUE``)."""
    from omlx_core.config import load_config

    model = load_config(None)["server.models"][0]
    warm_up = seconds * 0.2 if warm_up is None else warm_up
    result = SoakResult(seconds, parse_size(ceiling), load=(os.getloadavg()[0], 0.0))
    port = free_port()
    say = progress or (lambda text: None)
    with ServerProcess(server_spec(port, ceiling, server_args), port) as server:
        pid = server.pid
        for kind in ("chat", "anthropic"):  # the first requests load pages and caches
            send(port, make_request(kind, random.Random(seed), model))
        lock = threading.Lock()
        paused = threading.Event()
        idle = threading.Semaphore(0)
        stop_at = time.monotonic() + seconds
        kinds, weights = zip(*MIX.items())

        def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < stop_at:
                if paused.is_set():
                    idle.release()
                    while paused.is_set() and time.monotonic() < stop_at + 60:
                        time.sleep(0.05)
                    continue
                request = make_request(rng.choices(kinds, weights)[0], rng, model)
                outcome = send(port, request)
                with lock:
                    result.outcomes.append(outcome)
                    if outcome.problem:
                        say(f"problem: {outcome.kind} {outcome.status} {outcome.problem}")

        def quiet() -> Quiet:
            paused.set()
            for _ in range(clients):
                idle.acquire(timeout=REQUEST_TIMEOUT)
            counts = quiet_counts(pid, port)
            paused.clear()
            return counts

        with Sampler(pid) as sampler:
            threads = [threading.Thread(target=client, args=(i,), daemon=True)
                       for i in range(clients)]
            for thread in threads:
                thread.start()
            time.sleep(max(0.0, min(warm_up, stop_at - time.monotonic())))
            warm_counts = quiet()
            result.warm_up_end = time.monotonic()
            say(f"warm-up over: {len(result.outcomes)} requests, {warm_counts}")
            for thread in threads:
                thread.join(seconds + REQUEST_TIMEOUT + 120)
            end_counts = quiet_counts(pid, port)
        result.samples = sampler.samples
        result.quiet = (warm_counts, end_counts)
        result.load = (result.load[0], os.getloadavg()[0])
        say(f"traffic over: {len(result.outcomes)} requests")
    refused = {}
    for outcome in result.outcomes:
        if 400 <= outcome.status < 500 and outcome.request is not None:
            refused.setdefault(outcome.request, outcome)
    replays = list(refused.values())
    random.Random(seed).shuffle(replays)
    replays = replays[:MAX_REPLAYS]
    port = free_port()
    with ServerProcess(server_spec(port, ceiling, server_args), port):
        for outcome in replays:
            assert outcome.request is not None
            path, body = outcome.request
            again = send(port, Request(outcome.kind, path, body, (outcome.status,)))
            result.replayed += 1
            if (again.status, again.error_code) != (outcome.status, outcome.error_code):
                result.disagreements.append((outcome.kind,
                                             f"{outcome.status} {outcome.error_code}",
                                             f"{again.status} {again.error_code}"))
    return result


def render(result: SoakResult, header: Sequence[str]) -> str:
    lines = [*header, "",
             "| kind | requests | statuses | wrong answers | median s | max s |",
             "|---|---:|---|---:|---:|---:|"]
    for kind in MIX:
        mine = [o for o in result.outcomes if o.kind == kind]
        if not mine:
            continue
        statuses: dict[int, int] = {}
        for o in mine:
            statuses[o.status] = statuses.get(o.status, 0) + 1
        seconds = sorted(o.seconds for o in mine)
        lines.append(f"| {kind} | {len(mine)} | "
                     f"{', '.join(f'{s}x{n}' for s, n in sorted(statuses.items()))} | "
                     f"{sum(1 for o in mine if o.problem)} | {seconds[len(seconds) // 2]:.2f} | "
                     f"{seconds[-1]:.2f} |")
    lines += ["", "| check | figure | verdict |", "|---|---|---|"]
    figures = {
        "no 5xx": f"{result.server_errors} of {len(result.outcomes)}",
        "no truncated 200 or other wrong answer": f"{len(result.problems)}",
        "every refusal is a fresh server's":
            f"{result.replayed - len(result.disagreements)} of {result.replayed} replayed agree",
        RSS_CHECK:
            f"peak VmRSS {result.peak_rss / MIB:.1f} MiB, VmHWM {result.peak_hwm / MIB:.1f} MiB, "
            f"ceiling {result.ceiling / MIB:.1f} MiB ({len(result.samples)} samples)",
        DRIFT_CHECK:
            f"{result.drift():+.2%} quiet ({result.quiet[0].rss / MIB:.1f} -> "
            f"{result.quiet[1].rss / MIB:.1f} MiB); less the caches it could give back "
            f"{result.drift_without_caches():+.2%} ("
            f"{(result.quiet[0].rss - result.quiet[0].reclaimable) / MIB:.1f} -> "
            f"{(result.quiet[1].rss - result.quiet[1].reclaimable) / MIB:.1f} MiB); "
            f"busy medians {result.busy_drift():+.2%}",
        "no growth in open fds": f"{result.quiet[0].fds} -> {result.quiet[1].fds}",
        "no growth in threads": f"{result.quiet[0].threads} -> {result.quiet[1].threads}",
    }
    for check, ok in result.verdicts().items():
        lines.append(f"| {check} | {figures[check]} | {'pass' if ok else 'FAIL'} |")
    for outcome in result.problems[:10]:
        lines.append(f"\n- {outcome.kind}: HTTP {outcome.status}: {outcome.problem}")
    for kind, here, there in result.disagreements[:10]:
        lines.append(f"\n- refusal of a {kind} request: {here} here, {there} on a fresh server")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic time (default 30)")
    parser.add_argument("--ceiling", default="0.9GiB", help="--memory-ceiling (default 0.9GiB)")
    parser.add_argument("--clients", type=int, default=CLIENTS,
                        help=f"concurrent client threads (default {CLIENTS})")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    started = datetime.datetime.now().astimezone()
    result = soak(args.minutes * 60, args.ceiling, clients=args.clients,
                  progress=lambda text: print(text, flush=True))
    span = result.samples[-1].at - result.samples[0].at if len(result.samples) > 1 else 1.0
    rate = len(result.samples) / span
    header = [
        f"- {started:%Y-%m-%d %H:%M %Z}, {platform.machine()}, {os.cpu_count()} CPUs, load "
        f"average {result.load[0]:.1f} at the start, {result.load[1]:.1f} at the end; "
        f"`omlx-core serve --memory-ceiling {args.ceiling}` on the default model",
        f"- {args.minutes:g} min of traffic from {args.clients} clients (seed {SEED}), "
        f"{len(result.outcomes)} requests; warm-up: the first 20 %; RSS sampled "
        f"{rate:.0f} times a second; {format_size(result.ceiling)} ceiling",
    ]
    publish_report(render(result, header), args.out)
    return 0 if all(result.verdicts().values()) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
