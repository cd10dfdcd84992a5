"""Serving one model over ``mx.distributed`` ranks on this machine (ring over loopback).

    python -m benchmarks.distributed [--model DIR] [--ranks 2] [--max-tokens 64]
    python -m benchmarks.distributed --only collectives

Three tables, one run:

1. **Collectives**: ``all_sum`` latency and bandwidth across message sizes on N ranks
   (what the scaling model in docs/distributed.md is built from).
2. **Throughput**: decode tok/s at 1 and 8 concurrent streams, ``omlx-core serve
   --distributed tensor`` against ``mlx_lm.server`` in its distributed mode, both on N
   ranks, same model, same prompts; end-of-sequence banned so every stream generates
   exactly ``--max-tokens`` tokens.
3. **Capacity**: the longest prompt served (200, not 413) under the same per-rank
   memory ceiling on 1 rank and on N ranks.

Every rank is a process started here with ``MLX_RANK`` and a ring ``MLX_HOSTFILE``,
as ``mlx.launch`` would. On a machine with a few cores, N ranks share them: they are
not faster than one; the tables say what they cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat

SIZES = (4, 1 << 10, 16 << 10, 256 << 10, 4 << 20, 32 << 20)


# -- ranks -----------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ranks(command: list[str], ranks: int, workdir: Path, name: str) -> list[subprocess.Popen]:
    """``command`` on ``ranks`` processes joined by a ring on loopback (1: no group)."""
    hostfile = workdir / f"{name}-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(ranks)]))
    processes = []
    for rank in range(ranks):
        env = dict(os.environ)
        if ranks > 1:
            env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        log = open(workdir / f"{name}-rank{rank}.log", "w")
        processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return processes


def stop_ranks(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_http(port: int, processes: list[subprocess.Popen], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a rank exited before the server came up")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.5)
    raise RuntimeError(f"no server on port {port} after {timeout_s} s")


# -- 1. collectives --------------------------------------------------------------------------


def collectives_worker(repeats: int) -> None:
    """Run on every rank: time all_sum per size; rank 0 prints the rows as JSON."""
    import mlx.core as mx

    group = mx.distributed.init()
    rows = []
    for size in SIZES:
        data = mx.ones((max(1, size // 4),), dtype=mx.float32)
        mx.eval(mx.distributed.all_sum(data))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(mx.distributed.all_sum(data))
            times.append(time.perf_counter() - started)
        rows.append({"bytes": size, "median_s": statistics.median(times)})
    if group.rank() == 0:
        print(json.dumps(rows), flush=True)


def collectives(ranks: int, workdir: Path, repeats: int) -> list[dict]:
    processes = start_ranks([sys.executable, "-m", "benchmarks.distributed", "--worker",
                             "--repeats", str(repeats)], ranks, workdir, "collectives")
    for process in processes:
        process.wait(timeout=600)
    lines = (workdir / "collectives-rank0.log").read_text().strip().splitlines()
    return json.loads(lines[-1])


# -- 2. throughput ---------------------------------------------------------------------------


def throughput(port: int, model: str, banned: list[int], streams: int, max_tokens: int) -> float:
    def one(index: int):
        body = chat_body(model, [{"role": "user", "content": f"Tell a story about topic {index}."}],
                         max_tokens, banned)
        return stream_chat("127.0.0.1", port, body)

    records, wall = run_concurrently(streams, one)
    return sum(r.completion_tokens for r in records) / wall


def serve_and_measure(command: list[str], ranks: int, port: int, workdir: Path, name: str,
                      model: str, banned: list[int], max_tokens: int) -> dict[int, float]:
    processes = start_ranks(command, ranks, workdir, name)
    try:
        wait_http(port, processes)
        throughput(port, model, banned, 1, 8)  # warm-up
        return {streams: throughput(port, model, banned, streams, max_tokens) for streams in (1, 8)}
    finally:
        stop_ranks(processes)


# -- 3. capacity -----------------------------------------------------------------------------


def served(port: int, model: str, tokens: int) -> bool:
    body = {"model": model, "prompt": "hello " * tokens, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status == 200
    except urllib.error.HTTPError as error:
        if error.code in (413, 503):
            return False
        raise


def longest_prompt(port: int, model: str, ceiling_tokens: int) -> int:
    low, high = 0, ceiling_tokens
    while high - low > max(16, low // 50):
        middle = (low + high) // 2
        if served(port, model, middle):
            low = middle
        else:
            high = middle
    return low


def capacity(model_dir: Path, ranks: int, ceiling: str, workdir: Path, max_prompt: int) -> int:
    port = _free_port()
    command = [sys.executable, "-m", "omlx_core", "serve", "--model", str(model_dir),
               "--port", str(port), "--tier", "cluster", "--memory-ceiling", ceiling,
               "--set", f"engine.max_context={max_prompt + 64}",
               "--distributed", "tensor"]
    processes = start_ranks(command, ranks, workdir, f"capacity{ranks}")
    try:
        wait_http(port, processes)
        return longest_prompt(port, model_dir.name, max_prompt)
    finally:
        stop_ranks(processes)


# -- the run ---------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="mlx-lm model directory (default: the "
                        "embedded default model, 9 heads: use --ranks 3)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--ceiling", default="600MiB", help="per-rank memory ceiling for capacity")
    parser.add_argument("--max-prompt", type=int, default=8000)
    parser.add_argument("--only", choices=("collectives", "throughput", "capacity"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        collectives_worker(args.repeats)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="omlx-bench-dist-"))
    if args.only in (None, "collectives"):
        rows = collectives(args.ranks, workdir, args.repeats)
        print(f"\nall_sum on {args.ranks} ranks, ring over loopback (median of {args.repeats})")
        print(table(["bytes", "latency", "algorithm bandwidth"],
                    [[f"{r['bytes']:,}", f"{r['median_s'] * 1e6:,.0f} us",
                      f"{r['bytes'] / r['median_s'] / 1e9:.3f} GB/s"] for r in rows]))
    if args.only == "collectives":
        return 0
    from omlx_core.models.default import ensure_default_model

    model_dir = (args.model or ensure_default_model()).resolve()
    if args.only in (None, "throughput"):
        banned = special_token_ids(model_dir)
        port = _free_port()
        ours = serve_and_measure(
            [sys.executable, "-m", "omlx_core", "serve", "--model", str(model_dir), "--port",
             str(port), "--tier", "cluster", "--distributed", "tensor"],
            args.ranks, port, workdir, "omlx", model_dir.name, banned, args.max_tokens)
        port = _free_port()
        theirs = serve_and_measure(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
            args.ranks, port, workdir, "mlxlm", str(model_dir), banned, args.max_tokens)
        print(f"\ndecode throughput, {args.ranks} ranks tensor parallel, {args.max_tokens} "
              "tokens per stream")
        print(table(["streams", "omlx-core tok/s", "mlx_lm.server tok/s", "ratio"],
                    [[str(s), f"{ours[s]:.1f}", f"{theirs[s]:.1f}", f"{ours[s] / theirs[s]:.2f}x"]
                     for s in (1, 8)]))
    if args.only in (None, "capacity"):
        one = capacity(model_dir, 1, args.ceiling, workdir, args.max_prompt)
        many = capacity(model_dir, args.ranks, args.ceiling, workdir, args.max_prompt)
        print(f"\nlongest prompt served under a {args.ceiling} per-rank ceiling "
              f"(searched up to {args.max_prompt} tokens)")
        print(table(["ranks", "longest prompt (tokens)"], [["1", str(one)], [str(args.ranks), str(many)]]))
    print(f"\nlogs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
