"""Reliability under memory pressure: a real ``omlx-core serve`` process with a small
pinned ceiling takes a seeded, randomized mix of concurrent long prompts, oversized
prompts and normal requests over loopback.

Required, and checked here: the server stays alive; its peak resident memory (the
kernel's own high-water mark, VmHWM, reset once the model is loaded, plus RSS sampled
every few milliseconds) stays under the ceiling; every oversized request is refused
with HTTP 413 before any body byte; every request that fits completes; nothing is left
queued or running at the end.

Set ``OMLX_RELIABILITY_REPORT=path.md`` to write the figures as a Markdown table; only
then are the fitting requests also sent to a server whose ceiling never binds, for the
report's throughput and latency comparison (a figure, not a check: the suite skips it).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.ceiling import PeakRss, status_fields
from omlx_core.plugins.estimator.prefill import estimate_for_config
from omlx_core.testing.models import build_model
from omlx_core.testing.waiting import free_port, wait_for_output

pytestmark = pytest.mark.slow

MIB = 1024**2
SEED = 20260521
CEILING = 480 * MIB
#: a ceiling that never binds, for the same requests without memory pressure
FREE_CEILING = 64 * 1024**3
#: prefill chunk of the cpu-small tier the server runs
CHUNK = 256
#: a generous bound on the idle server's footprint (interpreter, libraries, weights)
MAX_BASELINE = 200 * MIB
CLIENTS = 12
COUNTS = {"normal": 56, "long": 28, "oversized": 20}
LONG_TOKENS = (1024, 2048)
OVERSIZED_TOKENS = (16_384, 40_000)
#: how long one client waits for its answer before the run counts as hung
TIME_LIMIT_S = 240

#: a small llama whose KV and attention scores are large enough to matter: 16 KiB of KV
#: per token, 8 MiB of scores per 256-token chunk per 1k tokens attended
MODEL = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
         "head_dim": 64, "intermediate_size": 1024, "num_hidden_layers": 4,
         "max_position_embeddings": 65_536}


# -- the server process ----------------------------------------------------------------------


class Server:
    """``python -m omlx_core serve`` on a loopback port, with its log captured."""

    def __init__(self, model_dir: Path, ceiling: int, log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omlx_core", "serve", "--tier", "cpu-small",
             "--model", str(model_dir), "--memory-ceiling", str(ceiling),
             "--port", str(self.port), "--threads", str(CLIENTS),
             "--set", "plugin.batched.prefix_cache_budget=32MiB", "--set", "memory.queue_size=128"],
            stdout=self._log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMLX_LOG_LEVEL": "INFO"})
        try:
            wait_for_output(self.process, log_path, "omlx-core ready:", timeout=120)
        except AssertionError:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text()

    def baseline(self) -> int:
        match = re.search(r"baseline in use ([\d.]+) MiB", self.log())
        assert match, self.log()
        return int(float(match.group(1)) * MIB)

    def alive(self) -> bool:
        return self.process.poll() is None

    def reset_peak(self) -> bool:
        """Restart the kernel's VmHWM count; False where this kernel or sandbox refuses
        (the peak then includes start-up, which only makes the check stricter)."""
        try:
            with open(f"/proc/{self.process.pid}/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            return False
        return True

    def status(self) -> dict[str, int]:
        return status_fields(self.process.pid)

    def get(self, path: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        status, body = self.get("/metrics")
        assert status == 200
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()


# -- the workload ---------------------------------------------------------------------------


@dataclass
class Job:
    index: int
    kind: str  # "normal", "long" or "oversized"
    path: str
    body: dict[str, Any]
    prompt_tokens: int
    estimate: int
    stream: bool


@dataclass
class Outcome:
    job: Job
    status: int = 0
    content_type: str = ""
    first_bytes: bytes = b""
    finish_reason: str | None = None
    error: Any = None
    body: Any = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def make_jobs(config: dict[str, Any]) -> list[Job]:
    rng = random.Random(SEED)
    jobs: list[Job] = []

    def estimate(tokens: int) -> int:
        return estimate_for_config(config, tokens, 0, CHUNK, full_logits=True).total

    for kind, count in COUNTS.items():
        for _ in range(count):
            stream = rng.random() < 0.5
            if kind == "normal":
                tokens = rng.randint(8, 120)
                prompt = [rng.randrange(3, 500) for _ in range(tokens)]
                body = {"prompt": prompt, "max_tokens": rng.randint(4, 16)}
            else:
                low, high = LONG_TOKENS if kind == "long" else OVERSIZED_TOKENS
                tokens = rng.randint(low, high)
                prompt = [rng.randrange(3, 500) for _ in range(tokens)]
                body = {"prompt": prompt, "max_tokens": rng.randint(2, 8)}
            body.update({"model": "medium", "temperature": 0.7, "seed": rng.randrange(10**6),
                         "stream": stream})
            jobs.append(Job(len(jobs), kind, "/v1/completions", body, tokens, estimate(tokens),
                            stream))
    rng.shuffle(jobs)
    return jobs


def send(port: int, job: Job) -> Outcome:
    outcome = Outcome(job)
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIME_LIMIT_S)
    try:
        connection.request("POST", job.path, body=json.dumps(job.body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        outcome.status = response.status
        outcome.content_type = response.getheader("Content-Type", "")
        data = response.read()
        outcome.first_bytes = data[:16]
    finally:
        connection.close()
    outcome.seconds = time.monotonic() - started
    if outcome.content_type.startswith("application/json"):
        outcome.body = json.loads(data)
        if outcome.status == 200:
            choice = outcome.body["choices"][0]
            outcome.finish_reason = choice.get("finish_reason")
        else:
            outcome.error = outcome.body.get("error")
    elif outcome.content_type.startswith("text/event-stream"):
        for line in data.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                outcome.error = event["error"]
            for choice in event.get("choices", []):
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    return outcome


# -- the test ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("reliability") / "medium", overrides=MODEL)


def test_server_under_memory_pressure_never_crosses_its_ceiling(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    jobs = make_jobs(config)
    assert len(jobs) >= 100
    # The mix is unambiguous whatever the idle footprint turns out to be.
    for job in jobs:
        if job.kind == "oversized":
            assert job.estimate > CEILING, job
        else:
            assert MAX_BASELINE + job.estimate < CEILING * 0.95, job

    server = Server(model_dir, CEILING, tmp_path / "server.log")
    try:
        baseline = server.baseline()
        assert baseline < MAX_BASELINE, f"idle server holds {baseline / MIB:.0f} MiB"
        loaded = server.status()
        peak_reset = server.reset_peak()
        started = time.monotonic()
        with PeakRss(server.process.pid, 0.005) as sampler:
            with ThreadPoolExecutor(CLIENTS) as pool:
                outcomes = list(pool.map(lambda job: send(server.port, job), jobs))
        elapsed = time.monotonic() - started
        peak = server.status()["VmHWM"]
        alive = server.alive()
        metrics = server.metrics()
    finally:
        server.stop()
    server_log = server.log()

    report_path = os.environ.get("OMLX_RELIABILITY_REPORT")
    free_outcomes: list[Outcome] = []
    free_elapsed = 0.0
    if report_path:
        # The same fitting requests, sent the same way, to a server whose ceiling never
        # binds: what the ceiling costs in throughput and latency.
        fitting = [job for job in jobs if job.kind != "oversized"]
        free = Server(model_dir, FREE_CEILING, tmp_path / "free.log")
        try:
            free_started = time.monotonic()
            with ThreadPoolExecutor(CLIENTS) as pool:
                free_outcomes = list(pool.map(lambda job: send(free.port, job), fitting))
            free_elapsed = time.monotonic() - free_started
        finally:
            free.stop()
        assert all(o.status == 200 for o in free_outcomes)
    # No false refusal: every refused request, sent alone to a fresh server with the
    # same ceiling, is refused there too.
    refused = [o.job for o in outcomes if o.status != 200]
    fresh = Server(model_dir, CEILING, tmp_path / "fresh.log")
    try:
        alone = [send(fresh.port, job) for job in refused]
    finally:
        fresh.stop()
    false_refusals = [o.job.index for o in alone if o.status == 200]

    figures = summarize(outcomes, baseline=baseline, loaded=loaded["VmRSS"], peak=peak,
                        peak_reset=peak_reset, sampled_peak=sampler.peak,
                        samples=sampler.samples, elapsed=elapsed,
                        waited=server_log.count("waits for memory"),
                        gate_refusals=server_log.count("forward gate refuses"),
                        capped=latencies([o for o in outcomes if o.job.kind != "oversized"]),
                        free=latencies(free_outcomes) if free_outcomes else None,
                        free_elapsed=free_elapsed,
                        refused=len(refused), false_refusals=len(false_refusals),
                        preempted=sum(value for name, value in metrics.items()
                                      if name.startswith("omlx_memory_preemptions_total")))
    print("\n" + format_report(figures))
    if report_path:
        Path(report_path).write_text(format_report(figures) + "\n")

    refusals = [line for line in server_log.splitlines() if "forward gate refuses" in line]
    assert not refusals, "the forward gate refused requests that fit:\n" + "\n".join(refusals[:5])
    assert not false_refusals, f"refused here but served alone by a fresh server: {false_refusals}"
    assert alive, "the server process died"
    assert peak < CEILING, f"peak RSS {peak / MIB:.1f} MiB crossed the {CEILING / MIB:.0f} MiB ceiling"
    assert sampler.peak < CEILING
    for outcome in outcomes:
        job = outcome.job
        if job.kind == "oversized":
            assert outcome.status == 413, (job.index, outcome.status, outcome.body)
            # Refused before any body byte: a JSON error, never a started stream.
            assert outcome.content_type.startswith("application/json"), outcome.content_type
            assert outcome.error["code"] == "prefill_memory_exceeded"
            assert outcome.error["binding_ceiling"] == "custom"
            assert outcome.error["advice"], outcome.error
        else:
            assert outcome.status == 200, (job.kind, job.prompt_tokens, outcome.status, outcome.body)
            assert outcome.error is None, (job.kind, job.prompt_tokens, outcome.error)
            assert outcome.finish_reason in ("stop", "length"), (job.kind, outcome.finish_reason)
    # Nothing is left waiting, running or reserved.
    assert metrics["omlx_admission_queue_depth"] == 0
    assert metrics["omlx_http_requests_in_flight"] == 0
    for name in ("queue_depth", "running", "prefilling"):
        assert metrics[f'omlx_engine_{name}{{model="medium"}}'] == 0, name
    assert metrics['omlx_engine_finished_error{model="medium"}'] == 0


def latencies(outcomes: list[Outcome]) -> dict[str, float]:
    """Median and 95th-percentile seconds of ``outcomes`` and their count."""
    seconds = sorted(o.seconds for o in outcomes)
    return {"count": len(seconds), "p50": seconds[len(seconds) // 2],
            "p95": seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))]}


def summarize(outcomes: list[Outcome], **measured: Any) -> dict[str, Any]:
    by_kind: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome.job.kind, []).append(outcome)
    kinds = {}
    for kind, group in sorted(by_kind.items()):
        statuses: dict[int, int] = {}
        for outcome in group:
            statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
        seconds = sorted(o.seconds for o in group)
        kinds[kind] = {
            "count": len(group),
            "statuses": statuses,
            "tokens": (min(o.job.prompt_tokens for o in group),
                       max(o.job.prompt_tokens for o in group)),
            "estimate_mib": (min(o.job.estimate for o in group) / MIB,
                             max(o.job.estimate for o in group) / MIB),
            "median_s": seconds[len(seconds) // 2],
            "max_s": seconds[-1],
        }
    return {"kinds": kinds, **measured}


def format_report(figures: dict[str, Any]) -> str:
    lines = [
        f"- requests: {sum(k['count'] for k in figures['kinds'].values())} "
        f"({CLIENTS} concurrent clients, seed {SEED}), wall time {figures['elapsed']:.1f} s",
        f"- ceiling (--memory-ceiling): {CEILING / MIB:.0f} MiB; idle baseline "
        f"{figures['baseline'] / MIB:.1f} MiB; RSS when loaded {figures['loaded'] / MIB:.1f} MiB",
        f"- peak RSS during the run: {figures['peak'] / MIB:.1f} MiB (VmHWM"
        f"{'' if figures['peak_reset'] else ', start-up included'}), "
        f"{figures['sampled_peak'] / MIB:.1f} MiB sampled ({figures['samples']} samples)",
        f"- requests that waited in the admission queue: {figures['waited']}; "
        f"refused by the forward gate: {figures['gate_refusals']}; preempted: "
        f"{figures['preempted']:.0f}",
    ]
    if figures["free"] is not None:
        lines.append(
            f"- the {figures['capped']['count']} fitting requests against the same ones sent to a "
            f"server whose ceiling never binds ({FREE_CEILING // 1024**3} GiB): wall time "
            f"{figures['elapsed']:.1f} s vs {figures['free_elapsed']:.1f} s (throughput "
            f"{figures['free_elapsed'] / figures['elapsed']:.2f}x the free run's, the oversized "
            f"requests' 413s included in the capped run's time); latency p50 "
            f"{figures['capped']['p50']:.2f} s vs {figures['free']['p50']:.2f} s, p95 "
            f"{figures['capped']['p95']:.2f} s vs {figures['free']['p95']:.2f} s")
    lines += [
        f"- false refusals: {figures['false_refusals']} of the {figures['refused']} refused "
        f"requests were served when sent alone to a fresh server with the same ceiling",
        "",
        "| kind | count | prompt tokens | estimate (MiB) | HTTP statuses | median s | max s |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, k in figures["kinds"].items():
        statuses = ", ".join(f"{s}x{n}" for s, n in sorted(k["statuses"].items()))
        lines.append(f"| {kind} | {k['count']} | {k['tokens'][0]}-{k['tokens'][1]} | "
                     f"{k['estimate_mib'][0]:.1f}-{k['estimate_mib'][1]:.1f} | {statuses} | "
                     f"{k['median_s']:.2f} | {k['max_s']:.2f} |")
    return "\n".join(lines)
