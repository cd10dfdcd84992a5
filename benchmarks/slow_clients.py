"""Slow and idle clients against ordinary chats (issue 24, item 1), on loopback.

One ``omlx-core serve`` on the default model. Each scenario opens a crowd of hostile
connections, waits until they are established, then sends a burst of ordinary
streaming chats and times them; the crowd is kept at full strength while the chats run
(a connection the server closes is opened again, as a flood would do):

- ``idle``: connections that never send a byte;
- ``byte-a-second``: connections that send a chat request's headers one byte a second.

Two figures: the server's CPU time per second while the crowd alone is connected (what
the crowd costs, whatever else loads the machine), and the delay: the burst's median
wall time with the crowd minus its median without one, over interleaved rounds. Target:
<= 1 s with 500 connections. Every chat is bounded (``--chat-timeout``); one that does
not finish in time counts as locked out.

``--python`` starts the server with another interpreter (an older checkout's virtual
environment, ``-P`` so the current directory is not imported from): the "before"
column of a change.

    python -m benchmarks.slow_clients [--connections 500] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.servers import ServerProcess, ServerSettings, free_port, omlx_spec

#: (chats, max_tokens): the ordinary burst, as in the issue's report
BURST = (4, 48)
#: seconds the crowd is connected alone, its cost to the server measured, before the burst
CROWD_ALONE_S = 5.0
HEADERS = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           b"Content-Type: application/json\r\nContent-Length: 64\r\n\r\n")


@dataclass
class Row:
    scenario: str
    connections: int
    completed: int
    chats: int
    wall_s: float
    ttft_median_s: float
    reopened: int = 0
    #: server CPU seconds per second while the crowd alone is connected (no chats)
    crowd_cpu: float = 0.0
    #: server CPU seconds the burst took
    burst_cpu: float = 0.0
    round: int = 0


class Crowd:
    """``count`` hostile connections to ``port``, kept open (reopened when the server
    closes one) by one thread, for as long as the ``with`` block lasts."""

    def __init__(self, port: int, count: int, *, byte_a_second: bool):
        self.port = port
        self.count = count
        self.byte_a_second = byte_a_second
        self.reopened = 0
        self._sockets: list[tuple[socket.socket, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="crowd", daemon=True)

    def _open(self) -> tuple[socket.socket, int]:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.setblocking(False)
        return sock, 0

    def __enter__(self) -> "Crowd":
        self._sockets = [self._open() for _ in range(self.count)]
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(1.0):
            for index, (sock, sent) in enumerate(self._sockets):
                try:
                    closed = sock.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if not closed and self.byte_a_second:
                    try:
                        sock.send(HEADERS[sent % len(HEADERS):][:1])
                        sent += 1
                    except OSError:
                        closed = True
                if closed:
                    sock.close()
                    self.reopened += 1
                    try:
                        sock, sent = self._open()
                    except OSError:
                        continue
                self._sockets[index] = (sock, sent)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for sock, _ in self._sockets:
            sock.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def burst(server: ServerProcess, served_id: str, banned: Sequence[int],
          timeout: float) -> tuple[int, float, float]:
    """Completed chats, wall seconds, median TTFT of one ordinary burst."""
    chats, max_tokens = BURST

    def one(index: int) -> float | None:
        body = chat_body(served_id, [{"role": "user", "content": f"Tell me about river {index}."}],
                         max_tokens, banned)
        try:
            record = stream_chat(server.host, server.port, body, timeout=timeout)
        except (OSError, RuntimeError):
            return None
        return record.ttft if record.complete else None

    started = time.perf_counter()
    ttfts, _ = run_concurrently(chats, one)
    wall = time.perf_counter() - started
    done = sorted(t for t in ttfts if t is not None)
    return len(done), wall, (done[len(done) // 2] if done else float("nan"))


def measure(server: ServerProcess, served_id: str, banned: Sequence[int], connections: int,
            timeout: float, rounds: int) -> list[Row]:
    chats = BURST[0]
    burst(server, served_id, banned, timeout)  # warm-up

    def timed_burst() -> tuple[int, float, float, float]:
        before = cpu_seconds(server.pid)
        completed, wall, ttft = burst(server, served_id, banned, timeout)
        return completed, wall, ttft, cpu_seconds(server.pid) - before

    def alone(seconds: float = CROWD_ALONE_S) -> float:
        before = cpu_seconds(server.pid)
        time.sleep(seconds)
        return (cpu_seconds(server.pid) - before) / seconds

    rows = []
    for round_ in range(rounds):
        completed, wall, ttft, cpu = timed_burst()
        rows.append(Row("none", 0, completed, chats, wall, ttft, 0, alone(), cpu, round_))
        for name, slow in (("idle", False), ("byte-a-second", True)):
            with Crowd(server.port, connections, byte_a_second=slow) as crowd:
                crowd_cpu = alone()
                completed, wall, ttft, cpu = timed_burst()
                rows.append(Row(name, connections, completed, chats, wall, ttft, crowd.reopened,
                                crowd_cpu, cpu, round_))
            time.sleep(1.0)
    return rows


def render(rows: Sequence[Row], header: Sequence[str]) -> str:
    lines = ["# Slow and idle clients against ordinary chats", "", *header, "",
             "| round | crowd | connections | chats completed | burst wall s | median TTFT s "
             "| crowd connections the server closed | server CPU, crowd alone | "
             "server CPU s, burst |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.round} | {row.scenario} | {row.connections} | "
                     f"{row.completed}/{row.chats} | {row.wall_s:.2f} | {row.ttft_median_s:.2f} | "
                     f"{row.reopened} | {row.crowd_cpu:.0%} | {row.burst_cpu:.2f} |")
    lines += ["", "| crowd | median burst wall s | delay s (median against no crowd) | "
                  "chats completed |", "|---|---:|---:|---:|"]
    base = statistics.median(r.wall_s for r in rows if r.connections == 0)
    for scenario in dict.fromkeys(r.scenario for r in rows):
        mine = [r for r in rows if r.scenario == scenario]
        wall = statistics.median(r.wall_s for r in mine)
        delay = "" if scenario == "none" else f"{wall - base:+.2f}"
        lines.append(f"| {scenario} | {wall:.2f} | {delay} | "
                     f"{sum(r.completed for r in mine)}/{sum(r.chats for r in mine)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slow_clients",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=500,
                        help="hostile connections per scenario (default 500)")
    parser.add_argument("--chat-timeout", type=float, default=180.0,
                        help="seconds one ordinary chat may take before it counts as locked "
                             "out (default 180)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (no crowd, idle crowd, slow crowd), interleaved so "
                             "that other load on the machine hits all alike (default 3)")
    parser.add_argument("--python", default=None,
                        help="interpreter to start the server with (default: this one)")
    parser.add_argument("--label", default="this checkout",
                        help="what the server runs, for the report")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model

    model_dir = ensure_default_model()
    config = load_config(None)
    served_id = config["server.models"][0]
    settings = ServerSettings.of_config(config)
    port = free_port()
    spec = omlx_spec(None, port, settings, served_id)
    if args.python:
        spec = type(spec)(spec.name, spec.label, [args.python, "-P", *spec.argv[1:]],
                          spec.model_id, spec.lacks, spec.env)
    chats, max_tokens = BURST
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; model `{model_dir.name}`; "
        f"server: {args.label}",
        f"- burst: {chats} concurrent streaming chats of {max_tokens} tokens (special tokens "
        "banned); delay: the median burst wall time with a crowd minus the median without",
        f"- crowds of {args.connections} connections on 127.0.0.1, reopened when closed",
    ]
    with ServerProcess(spec, port) as server:
        rows = measure(server, served_id, special_token_ids(model_dir), args.connections,
                       args.chat_timeout, args.rounds)
    publish_report(render(rows, header), args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
