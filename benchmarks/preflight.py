"""Latency of the memory guard's preflight, the check every request passes on the HTTP
request thread before any response byte, at 1, 8 and 32 request threads at once.

A server is started on a tiny llama model (tier ``cpu-small``, a ceiling that never
binds), one request is served so that the prefix cache and the enforcer's idle baseline
are as they are between requests, then each thread calls
``MemoryGuard.preflight`` on a 512-token prompt back to back and every call is timed.
The table gives the median and 90th percentile of one call, and the calls per second
of all threads together.

    python -m benchmarks.preflight [--calls 200] [--label after]

It uses only the guard's public calls, so the same file measures another checkout: run
it with that checkout's interpreter (``/path/to/other/.venv/bin/python
benchmarks/preflight.py``) to compare code before and after a change.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from omlx_core.bootstrap import load_setup, start_engines, stop_engines
from omlx_core.engine import SamplingParams
from omlx_core.serving import Job, ServingPipeline
from omlx_core.testing import cached_model

THREADS = (1, 8, 32)
PROMPT_TOKENS = 512


def time_preflights(guard, engine, threads: int, calls: int) -> tuple[list[float], float]:
    """Per-call seconds of ``calls`` preflights on each of ``threads`` threads started
    together, and the wall seconds all of them took."""
    prompt = [(7 * i) % 200 + 10 for i in range(PROMPT_TOKENS)]
    start = threading.Barrier(threads + 1)
    durations: list[list[float]] = [[] for _ in range(threads)]

    def run(slot: int) -> None:
        start.wait()
        for call in range(calls):
            began = time.perf_counter()
            guard.preflight(engine, f"t{slot}-{call}", prompt, max_tokens=64)
            durations[slot].append(time.perf_counter() - began)

    workers = [threading.Thread(target=run, args=(slot,)) for slot in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    return [d for per_thread in durations for d in per_thread], time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="preflights per thread")
    parser.add_argument("--label", default="", help="a name for this run in the table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = cached_model("llama", 0, cache_dir=root / "models")
        config = root / "omlx.toml"
        config.write_text(f'[server]\nmodels = ["tiny"]\n\n[models.tiny]\npath = "{model_dir}"\n')
        context = start_engines(load_setup("cpu-small", [config], [
            ("memory.tier", "custom", "bench"), ("memory.custom_ceiling", "64GiB", "bench")]),
            progress=False)
        try:
            guard, engine = context.memory_guard, context.engines["tiny"]
            generation = ServingPipeline(context).start(Job(
                "tiny", SamplingParams(temperature=0, max_tokens=2),
                token_ids=list(range(10, 60)), prompt_param="prompt"))
            list(generation.deltas())
            generation.close()
            time_preflights(guard, engine, 1, 20)  # warm: estimator imports, first logs
            rows = []
            for threads in THREADS:
                durations, wall = time_preflights(guard, engine, threads, args.calls)
                durations.sort()
                rows.append((threads, len(durations), statistics.median(durations),
                             durations[int(0.9 * (len(durations) - 1))], len(durations) / wall))
        finally:
            stop_engines(context)
    label = f" ({args.label})" if args.label else ""
    print(f"| threads{label} | calls | median µs | p90 µs | calls/s |")
    print("|---:|---:|---:|---:|---:|")
    for threads, count, median, p90, rate in rows:
        print(f"| {threads} | {count} | {median * 1e6:.0f} | {p90 * 1e6:.0f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
