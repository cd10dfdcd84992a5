"""Two models alternating request by request (an agent and its small helper model):
omlx-core's model pool against ``mlx_lm.server``, which swaps in the model a request
names (so it reloads on every switch).

The two models are the default model converted twice (float16 "agent" and the GGUF's
own 4-bit quantization "helper": ``omlx-core models convert-gguf --dtype``), in one
directory served as ``server.model_dirs``. Three runs, one after the other, each with
the same sequence of requests (one at a time, streaming, short prompt, few tokens):

- omlx-core with both models resident (no ceiling);
- omlx-core with a pinned memory ceiling that fits only one of them at a time
  (``--memory-ceiling``; the pool unloads the idle one to load the other);
- ``mlx_lm.server --model <agent>``, each request naming the model's directory.

Per run: p50/p95 time to first token, requests per second, completion tokens per
second. Targets: p50 TTFT >= 3x lower than mlx_lm.server with both resident; no worse
than it when only one fits.

    python -m benchmarks.model_pool [--requests 40] [--max-tokens 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, stream_chat
from omlx_core.bench.servers import (ServerProcess, ServerSettings, ServerSpec, free_port,
                                     mlx_lm_spec, omlx_spec)
from omlx_core.settings import format_size

MIB = 2**20
VARIANTS = (("agent", "float16"), ("helper", "keep"))
PROMPT = [{"role": "user", "content": "Name one colour."}]


@dataclass
class Run:
    label: str
    ttfts: list[float]
    seconds: float
    completion_tokens: int
    note: str = ""
    #: the server's memory in use with both models resident, and their measured bytes
    in_use_bytes: int = 0
    models_bytes: dict[str, int] | None = None
    measured_bytes: dict[str, int] | None = None

    def p(self, q: float) -> float:
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def convert_models(root: Path) -> dict[str, Path]:
    from omlx_core.models.default import default_gguf_path
    from omlx_core.models.gguf import convert_gguf

    dirs = {}
    for name, dtype in VARIANTS:
        out = root / f"smollm2-{name}"
        if not out.exists():
            convert_gguf(default_gguf_path(), out, dtype=dtype, progress=False)
        dirs[name] = out
    return dirs


def _get(port: int, path: str) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("GET", path)
    data = json.loads(connection.getresponse().read())
    connection.close()
    return data


def alternate(port: int, names: list[str], requests: int, max_tokens: int, label: str) -> Run:
    ttfts, tokens = [], 0
    started = time.perf_counter()
    for index in range(requests):
        record = stream_chat("127.0.0.1", port,
                             chat_body(names[index % len(names)], PROMPT, max_tokens))
        ttfts.append(record.ttft)
        tokens += record.completion_tokens
    return Run(label, ttfts, time.perf_counter() - started, tokens)


def omlx_run(dirs: dict[str, Path], requests: int, max_tokens: int, ceiling: int | None,
             label: str) -> Run:
    port = free_port()
    config = Path(tempfile.mkdtemp(prefix="omlx-pool-bench-")) / "omlx.toml"
    config.write_text(f'[server]\nmodels = []\nmodel_dirs = ["{dirs["agent"].parent}"]\n'
                      'keep_alive = "-1"\n')
    settings = ServerSettings(tier="cpu-small", max_batch_size=8, prefill_step_size=512,
                              http_threads=8)
    spec = omlx_spec(None, port, settings)
    argv = spec.argv + ["--config", str(config)]
    if ceiling is not None:
        argv += ["--memory-ceiling", f"{ceiling // MIB}MiB"]
    spec = ServerSpec(spec.name, spec.label, argv, "")
    names = [p.name for p in dirs.values()]
    with ServerProcess(spec, port) as server:
        # Warm both (a first load is not what this measures), then the alternation.
        for name in names:
            stream_chat("127.0.0.1", port, chat_body(name, PROMPT, 1))
        run = alternate(port, names, requests, max_tokens, label)
        models = {m["id"]: m for m in _get(port, "/v1/models")["data"]}
        memory = _get(port, "/health").get("memory") or {}
        run.in_use_bytes = int(memory.get("baseline_bytes") or 0)
        run.models_bytes = {n: int(models[n]["planned_bytes"] or 0) for n in names}
        run.measured_bytes = {n: int(models[n]["measured_bytes"] or models[n]["weights_bytes"]
                                     or 0) for n in names}
        metrics = _get_text(port, "/metrics")
        evictions = next((line.split()[-1] for line in metrics.splitlines()
                          if line.startswith('omlx_model_unloads_total{reason="evicted"}')), "0")
        run.note = (f"resident at the end: {', '.join(n for n in names if models[n]['state'] == 'resident')}; "
                    f"evictions: {float(evictions):.0f}")
        server.stop()
    return run


def _get_text(port: int, path: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("GET", path)
    text = connection.getresponse().read().decode()
    connection.close()
    return text


def mlx_lm_run(dirs: dict[str, Path], requests: int, max_tokens: int) -> Run:
    port = free_port()
    settings = ServerSettings(tier="cpu-small", max_batch_size=8, prefill_step_size=512,
                              http_threads=8)
    spec = mlx_lm_spec(dirs["agent"], port, settings)
    names = [str(p) for p in dirs.values()]
    with ServerProcess(spec, port):
        for name in names:
            stream_chat("127.0.0.1", port, chat_body(name, PROMPT, 1))
        return alternate(port, names, requests, max_tokens, "mlx_lm.server (swaps per request)")


def ceiling_for_one(both: Run) -> int:
    """Room for the larger model next to the idle server, not for both: from the first
    run's idle baseline with both resident, less both models, plus the larger one's
    plan, the transient margin and three quarters of the smaller one's plan (half was
    1 MiB short of the larger model's load on a 2-core run: the baseline reads low)."""
    planned = sorted((both.models_bytes or {}).values())
    idle = both.in_use_bytes - sum((both.measured_bytes or {}).values())
    return max(0, idle) + planned[-1] + 64 * MIB + planned[0] * 3 // 4


def report(runs: list[Run], args: argparse.Namespace, ceiling: int) -> str:
    peer = runs[-1]
    lines = [
        "## Model pool: two models alternating, vs mlx_lm.server (issue 20)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end (the machine is shared with other jobs). "
        f"{args.requests} streaming chat requests one at a time, alternating between the "
        f"default model at float16 and at its GGUF's 4-bit quantization, {args.max_tokens} "
        "tokens each; both models warmed first. The one-fits run pins the ceiling at "
        f"{format_size(ceiling)} (`--memory-ceiling`).",
        "",
        "| server | p50 TTFT | p95 TTFT | req/s | tok/s | p50 TTFT vs mlx_lm.server | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        ratio = peer.p(0.5) / run.p(0.5) if run.p(0.5) > 0 else float("inf")
        lines.append(f"| {run.label} | {run.p(0.5) * 1000:.0f} ms | {run.p(0.95) * 1000:.0f} ms "
                     f"| {len(run.ttfts) / run.seconds:.2f} | {run.completion_tokens / run.seconds:.1f} "
                     f"| {ratio:.2f}x lower | {run.note} |")
    lines += ["", f"Command: `python -m benchmarks.model_pool --requests {args.requests} "
                  f"--max-tokens {args.max_tokens}`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where the two converted models go (default: a new temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    root = args.models_dir or Path(tempfile.mkdtemp(prefix="omlx-pool-models-"))
    root.mkdir(parents=True, exist_ok=True)
    dirs = convert_models(root)
    both = omlx_run(dirs, args.requests, args.max_tokens, None, "omlx-core, both resident")
    ceiling = ceiling_for_one(both)
    runs = [both, omlx_run(dirs, args.requests, args.max_tokens, ceiling,
                           "omlx-core, ceiling fits one"),
            mlx_lm_run(dirs, args.requests, args.max_tokens)]
    publish_report(report(runs, args, ceiling), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
