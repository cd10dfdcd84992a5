"""The weight-streaming bound of this machine for a model: how fast any server could decode.

A decode step of ``r`` streams reads every weight of the model once (the logits' matmul
reads the tied embedding too), so it takes at least as long as one matmul of ``r`` rows
against a matrix of the model's size. :func:`measure_bound` times that matmul in a fresh
process with the environment the servers get, two ways, and keeps the faster: mlx's
``x @ w.T`` in the weights' dtype (the BLAS, as an unpacked linear layer computes it),
and, where this machine runs it, the CPU kernels' packed product that omlx-core's float32
linear layers use (:mod:`omlx_core.models.packed_linear`; on the default model 2-2.5x
faster than OpenBLAS: a bound timed with the BLAS alone would no longer bound our
server). It divides: at most ``r / seconds`` tokens per second at ``r`` streams,
whatever a server does around its matmuls. Speculation can pass it: a verify step
decodes several tokens per weight pass.

    python -m omlx_core.bench.bound MODEL_DIR [--rows 1 16]   # prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

#: bytes per element of the safetensors dtypes a model's floats come in
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
MLX_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
REPEATS = 15


@dataclass(frozen=True)
class Weights:
    """What a decode step reads: the bytes of every tensor, and the float dtype most of
    them are in (the matmul's dtype)."""

    bytes: int
    dtype: str
    hidden_size: int

    @property
    def elements(self) -> int:
        return self.bytes // FLOAT_BYTES[self.dtype]


def model_weights(model_dir: Path) -> Weights:
    """The weights of an mlx-lm model directory, from its safetensors headers (nothing
    is loaded)."""
    total = 0
    by_dtype: dict[str, int] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no .safetensors files")
    for path in files:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            start, end = tensor["data_offsets"]
            total += end - start
            by_dtype[tensor["dtype"]] = by_dtype.get(tensor["dtype"], 0) + end - start
    floats = {dtype: size for dtype, size in by_dtype.items() if dtype in FLOAT_BYTES}
    dtype = max(floats, key=floats.__getitem__) if floats else "F32"
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    hidden = int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size"))
    return Weights(total, dtype, hidden)


def _fastest(run: Callable[[], Any]) -> float:
    """The fastest of :data:`REPEATS` timings of ``run()`` evaluated (after two warm-ups).
    The fastest, not the median: a bound is what the machine can do, and on a shared
    machine the same matmul's times spread widely (42-65 ms at one row for the default
    model in one run of 29, 2026-11-28); a median read 57 ms in one bench run, 42 ms in
    another, and a decode step then ran faster than its bound."""
    import mlx.core as mx

    times = []
    for _ in range(REPEATS + 2):
        started = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - started)
    return min(times[2:])


def time_matmul(weights: Weights, rows: Sequence[int]) -> dict[str, dict[int, float]]:
    """Seconds of one ``rows x hidden`` by ``hidden x (elements / hidden)`` matmul per row
    count, by way: ``"blas"`` (mlx's matmul) and, where this machine runs it on float32
    weights, ``"packed"`` (the packed kernel over the same shape, its columns rounded down
    to whole panels and the time scaled back up). Run in this process: call it where the
    servers' BLAS is loaded."""
    import mlx.core as mx

    from omlx_core.models.packed_linear import PANELS, packed_bits

    dtype = getattr(mx, MLX_DTYPES[weights.dtype])
    columns = weights.elements // weights.hidden_size
    matrix = mx.random.normal((columns, weights.hidden_size)).astype(dtype)
    inputs = {count: mx.random.normal((count, weights.hidden_size)).astype(dtype) for count in rows}
    mx.eval(matrix, inputs)
    ways: dict[str, dict[int, float]] = {"blas": {}}
    for count in rows:
        ways["blas"][count] = _fastest(lambda: inputs[count] @ matrix.T)
    del matrix
    bits = packed_bits()
    if bits and dtype == mx.float32:
        from omlx_core.models.cpu_kernels import kernels

        width = PANELS[0]
        panels = mx.random.normal((columns // width, weights.hidden_size, width))
        mx.eval(panels)
        scale = columns / (columns // width * width)
        ways["packed"] = {count: _fastest(lambda: kernels().packed_matmul(inputs[count], panels, bits))
                          * scale for count in rows}
    return ways


#: what each way of timing the matmul is called in a report
WAY_NAMES = {"blas": "mlx's matmul (the BLAS)", "packed": "omlx-core's packed kernel"}


@dataclass(frozen=True)
class Bound:
    weights: Weights
    #: seconds of one matmul, by way (:func:`time_matmul`), by rows
    ways: dict[str, dict[int, float]]
    #: how many times it was timed (:meth:`faster` keeps the fastest of them)
    timed: int = 1

    @property
    def seconds(self) -> dict[int, float]:
        """Seconds of one matmul by rows: the fastest way's."""
        rows = set().union(*(times.keys() for times in self.ways.values()))
        return {r: min(times[r] for times in self.ways.values() if r in times) for r in rows}

    def faster(self, other: Bound) -> Bound:
        """Each way's faster timing of this bound and ``other`` (the same matmul timed
        again), by rows: a bench times it before every round and keeps the fastest, as
        the memory bandwidth this machine gives swings with its neighbours (one row read
        12.7-21.1 ms in four runs of 2026-11-29)."""
        ways: dict[str, dict[int, float]] = {}
        for way in {*self.ways, *other.ways}:
            mine, theirs = self.ways.get(way, {}), other.ways.get(way, {})
            ways[way] = {rows: min(t for t in (mine.get(rows), theirs.get(rows)) if t is not None)
                         for rows in {*mine, *theirs}}
        return Bound(self.weights, ways, self.timed + other.timed)

    def tokens_per_s(self, rows: int) -> float:
        return rows / self.seconds[rows]

    def describe(self) -> str:
        columns = self.weights.elements // self.weights.hidden_size
        shape = f"{self.weights.hidden_size} x {columns} {MLX_DTYPES[self.weights.dtype]}"
        seconds = self.seconds

        def timings(rows: int) -> str:
            return ", ".join(f"{WAY_NAMES.get(way, way)} {times[rows] * 1000:.1f} ms"
                             for way, times in self.ways.items() if rows in times)

        timed = f"the fastest of {self.timed} timings of {REPEATS}; " if self.timed > 1 else ""
        return timed + "; ".join(
            f"{rows} x {shape} ({self.weights.bytes / 2**20:.0f} MiB, the model's weights) in "
            f"{seconds[rows] * 1000:.1f} ms ({timings(rows)}; the faster counts): at most "
            f"{self.tokens_per_s(rows):.1f} tokens/s at {rows} stream(s)"
            for rows in sorted(seconds))


def measure_bound(model_dir: Path, rows: Sequence[int], env: dict[str, str]) -> Bound:
    """The bound for ``model_dir``, timed in a fresh interpreter with ``env`` (the
    servers' environment: their BLAS preloaded)."""
    done = subprocess.run([sys.executable, "-m", "omlx_core.bench.bound", str(model_dir),
                           "--rows", *map(str, rows)], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the weight-streaming matmul failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ways = {way: {int(k): v for k, v in times.items()} for way, times in result["ways"].items()}
    return Bound(model_weights(model_dir), ways)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omlx_core.bench.bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args(argv)
    ways = time_matmul(model_weights(args.model_dir), args.rows)
    print(json.dumps({"ways": ways}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
