"""Serving under a memory ceiling against serving with none, in one run (issue 11's
scenario 4, shrunk to what two CPU cores prefill in minutes).

Two omlx-core servers on the default model, started as ``./setup.sh serve`` starts
them, one after the other: once with ``--memory-ceiling`` (the only flag added, printed
in the report) and once without. Each gets the same burst of concurrent streaming chats
(short, medium and long prompts; most answers short, a few long enough to grow their KV
past what admission reserved, so decode growth and preemption are exercised). Special
tokens are banned so every stream runs to its ``max_tokens``.

Per server: how many requests completed (status 200 and ``[DONE]``), wall time, goodput
(completion tokens of completed requests per second of wall time), the server's peak
resident memory (the kernel's ``VmHWM``, reset once the model is loaded, so it is the
run's own peak), preemptions, and the ratios of the ceiling run to the free run.
Targets: every request completes under the ceiling too, wall time <= 2x, goodput
>= 0.5x, peak <= the ceiling.

    python -m benchmarks.ceiling [--ceiling 1GiB] [--kv-bits 8] [--out docs/ceiling-bench.md]

``--kv-bits`` serves both with a quantized KV cache (the flag is added to both commands
and printed in the report).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.prompts import text_of_tokens
from omlx_core.bench.servers import ServerProcess, ServerSettings, free_port, omlx_spec
from omlx_core.memory.probes import parse_kib_fields
from omlx_core.settings import format_size, parse_size

DEFAULT_OUT = Path("docs/ceiling-bench.md")
MIB = 2**20

#: (kind, prompt tokens, max_tokens, count): the burst every server gets
MIX = (("short", 200, 64, 4), ("medium", 800, 64, 4), ("long", 1800, 64, 2),
       ("long answer", 200, 320, 2))


@dataclass
class Outcome:
    kind: str
    status: str
    completion_tokens: int = 0
    seconds: float = 0.0


@dataclass
class ServerRun:
    label: str
    argv: list[str]
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    peak_bytes: int | None = None
    idle_bytes: int | None = None
    preemptions: float = 0.0
    admission_waits: float = 0.0
    #: VmRSS samples taken during the burst (``PeakRss``)
    rss_samples: int = 0

    @property
    def completed(self) -> int:
        return sum(1 for o in self.outcomes if o.status == "200")

    @property
    def goodput(self) -> float:
        tokens = sum(o.completion_tokens for o in self.outcomes if o.status == "200")
        return tokens / self.wall_s if self.wall_s else 0.0


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads (the server's compile
    threads start its grammar workers; each thread's children are listed apart)."""
    children: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(child) for child in listing.read_text().split()]
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return children


def status_fields(pid: int | str) -> dict[str, int]:
    """A process's ``/proc/<pid>/status`` fields: sizes (VmRSS, VmHWM, RssFile, ...) in
    bytes, counts (Threads) as they are; ``pid`` may be ``"self"``."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return parse_kib_fields(status.read())


def reset_peak(pid: int) -> bool:
    """Reset a process's VmHWM to its resident set now; whether the kernel allowed it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """While the ``with`` block runs, a thread samples process ``pid``'s VmRSS every
    ``interval_s``; :attr:`peak` is the highest of the :attr:`samples` taken (0 if the
    process is gone)."""

    def __init__(self, pid: int, interval_s: float):
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                self.peak = max(self.peak, status_fields(self.pid)["VmRSS"])
                self.samples += 1
            except (OSError, KeyError):  # gone (a zombie's status has no VmRSS)
                return
            self._done.wait(self.interval_s)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _metrics(host: str, port: int) -> dict[str, float]:
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.partition("{")[0]  # summed over labels
            values[name] = values.get(name, 0.0) + float(value)
    return values


def prompts(model_dir: Path, mix: Sequence[tuple[str, int, int, int]] = MIX,
            ) -> list[tuple[str, list[dict[str, str]], int]]:
    """(kind, messages, max_tokens) of every chat of ``mix``'s (kind, prompt tokens,
    max_tokens, count) rows: seeded prose to summarize."""
    jobs = []
    for number, (kind, tokens, max_tokens, count) in enumerate(mix):
        for index in range(count):
            passage = text_of_tokens(model_dir, tokens, seed=100 * number + index)
            jobs.append((kind, [{"role": "user", "content": f"Summarize these rules:\n{passage}"}],
                         max_tokens))
    return jobs


def measure(label: str, settings: ServerSettings, model_dir: Path, served_id: str,
            banned: Sequence[int], extra_argv: Sequence[str]) -> ServerRun:
    port = free_port()
    spec = omlx_spec(None, port, settings, served_id)
    spec = type(spec)(spec.name, spec.label, spec.argv + list(extra_argv), spec.model_id)
    run = ServerRun(label, spec.typed())
    jobs = prompts(model_dir)
    with ServerProcess(spec, port) as server:
        # Warm up (first forward compiles nothing on CPU, but loads pages), then reset
        # the kernel's high-water mark so the peak is this burst's.
        stream_chat(server.host, port, chat_body(served_id, jobs[0][1][:1], 4, banned))
        run.idle_bytes = status_fields(server.pid)["VmRSS"]
        reset = reset_peak(server.pid)
        def one(index: int) -> Outcome:
            kind, messages, max_tokens = jobs[index]
            started = time.perf_counter()
            try:
                record = stream_chat(server.host, port, chat_body(served_id, messages, max_tokens,
                                                                  banned))
            except RuntimeError as error:
                text = str(error)
                status = text.split()[1] if text.startswith("HTTP ") else "in-band error"
                return Outcome(kind, status, 0, time.perf_counter() - started)
            status = "200" if record.complete else "truncated"
            return Outcome(kind, status, record.completion_tokens, time.perf_counter() - started)

        with PeakRss(server.pid, 0.005) as sampled:
            run.outcomes, run.wall_s = run_concurrently(len(jobs), one)
        fields = status_fields(server.pid)
        run.peak_bytes = max(fields.get("VmHWM", 0) if reset else 0, sampled.peak)
        run.rss_samples = sampled.samples
        metrics = _metrics(server.host, port)
        run.preemptions = metrics.get("omlx_memory_preemptions_total", 0.0)
    return run


def render(runs: Sequence[ServerRun], header: Sequence[str], ceiling: int) -> str:
    lines = ["# Serving under a memory ceiling against none", "", *header, "",
             "| server | completed | wall s | goodput tok/s | peak RSS | idle RSS | preemptions |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        lines.append(f"| `{' '.join(run.argv)}` | {run.completed}/{len(run.outcomes)} | "
                     f"{run.wall_s:.1f} | {run.goodput:.1f} | "
                     f"{format_size(run.peak_bytes or 0)} | {format_size(run.idle_bytes or 0)} | "
                     f"{run.preemptions:.0f} |")
    lines += ["", "| kind | server | statuses | median s |", "|---|---|---|---|"]
    for run in runs:
        for kind, *_ in MIX:
            mine = [o for o in run.outcomes if o.kind == kind]
            statuses: dict[str, int] = {}
            for o in mine:
                statuses[o.status] = statuses.get(o.status, 0) + 1
            seconds = sorted(o.seconds for o in mine)
            median = seconds[len(seconds) // 2] if seconds else 0.0
            lines.append(f"| {kind} | {run.label} | "
                         f"{', '.join(f'{s}x{n}' for s, n in sorted(statuses.items()))} | "
                         f"{median:.1f} |")
    if len(runs) == 2:
        capped, free = runs
        wall = capped.wall_s / free.wall_s if free.wall_s else float("nan")
        goodput = capped.goodput / free.goodput if free.goodput else float("nan")
        under = capped.peak_bytes is not None and capped.peak_bytes <= ceiling
        lines += ["", f"- under the ceiling: {capped.completed}/{len(capped.outcomes)} completed "
                      f"(target: all); wall time {wall:.2f}x the free run's (target <= 2x); "
                      f"goodput {goodput:.2f}x (target >= 0.5x); peak "
                      f"{format_size(capped.peak_bytes or 0)} "
                      f"{'<=' if under else '>'} the {format_size(ceiling)} ceiling"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ceiling", default="1GiB",
                        help="the --memory-ceiling of the capped server (default 1GiB)")
    parser.add_argument("--kv-bits", type=int, default=0,
                        help="serve both with this quantized KV cache (8 or 4; default 0: full precision)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where to write the report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    kv = ["--kv-bits", str(args.kv_bits)] if args.kv_bits else []
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model

    ceiling = parse_size(args.ceiling)
    model_dir = ensure_default_model()
    config = load_config(None)
    served_id = config["server.models"][0]
    settings = ServerSettings.of_config(config)
    banned = special_token_ids(model_dir)
    mix = ", ".join(f"{count} {kind} ({tokens}-token passage, max_tokens {max_tokens})"
                    for kind, tokens, max_tokens, count in MIX)
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; model `{model_dir.name}`",
        "- both servers started as `./setup.sh serve` starts them"
        + (f" with `{' '.join(kv)}`" if kv else "") + "; the capped one adds only "
        f"`--memory-ceiling {args.ceiling}` ({format_size(ceiling)})",
        f"- one burst of {sum(m[3] for m in MIX)} concurrent streaming chats: {mix}; greedy, "
        "special tokens banned so each runs to max_tokens",
        "- completed: HTTP 200 and `[DONE]`; goodput: completion tokens of completed requests "
        "over wall time; peak RSS: the server's VmHWM after the warm-up (and RSS sampled "
        "every 5 ms)",
    ]
    runs = [measure("ceiling", settings, model_dir, served_id, banned,
                    ["--memory-ceiling", args.ceiling, *kv]),
            measure("none", settings, model_dir, served_id, banned, kv)]
    publish_report(render(runs, header, ceiling), args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
