"""One 256-token prefill chunk at long offsets on the CPU backend: mlx-lm's attention vs omlx-core's.

For each offset (cached tokens before the chunk) the default model (SmolLM2-135M float32)
runs one chunk through all its layers three ways, alternating within one process:

- ``mlx-lm``: mlx-lm's ``scaled_dot_product_attention`` (``mx.fast``'s CPU fallback);
- ``omlx-core``: :func:`omlx_core.models.attention.cpu_attention` (the mask and the
  softmax in NumPy, in place on mlx's scores), what omlx-core installs at model load;
- ``no attention``: attention replaced by returning the queries, so the rest of the
  chunk (projections, RoPE, MLP, norms, the KV cache append) is timed alone, and the
  attention share of the mlx-lm chunk is ``1 - no attention / mlx-lm``.

The cache before the chunk holds random keys and values (attention's cost does not
depend on their values); the chunk's logits are not computed, as in the engine's
prefill. Reported per offset: median wall time and process CPU time over the
repetitions, the CPU time of the process's busiest thread, the ratios, the attention
share, and the peak memory of one chunk above the resident model and cache
(``mx.get_peak_memory``). The machine's load average is printed: on a shared machine
wall times stretch and say little about work spread over cores; the busiest thread's
CPU time is what bounds a chunk's wall time on an idle machine (the other threads run
beside it), and does not stretch with the load.

With ``--ops`` it prints instead where one layer's attention spends its time: each op
of ``mx.fast.scaled_dot_product_attention``'s CPU fallback run alone on materialized
inputs at the default model's shapes (9 query heads over 3 KV heads, head_dim 64), wall
and process CPU time, times the model's layers. Run it with ``OPENBLAS_NUM_THREADS=1``
to read the CPU column as each op's work on one core (OpenBLAS's worker threads
otherwise spin after a matmul and bill the next op).

    python -m benchmarks.long_prefill [--offsets 0,1024,2048,3840] [--repeats 5] [--ops] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

CHUNK = 256
DEFAULT_OFFSETS = (0, 1024, 2048, 3840)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds so far of each thread of this process (Linux ``/proc``), by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[int(task)] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return seconds


def _busiest_thread(before: dict[int, float], after: dict[int, float]) -> float:
    return max(after[tid] - before.get(tid, 0.0) for tid in after)


def _no_attention(queries, keys, values, cache, scale, mask, sinks=None):
    return queries


@contextmanager
def attention_routed(modules: list[Any], function: Callable[..., Any]) -> Iterator[None]:
    """Every module in ``modules`` calls ``function`` as its attention while inside."""
    saved = [module.scaled_dot_product_attention for module in modules]
    for module in modules:
        module.scaled_dot_product_attention = function
    try:
        yield
    finally:
        for module, previous in zip(modules, saved):
            module.scaled_dot_product_attention = previous


def _filled_caches(model: Any, offset: int, kv_arrays: list[tuple[Any, Any]]) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    if offset:
        for cache, (keys, values) in zip(caches, kv_arrays):
            cache.state = (keys, values, offset)
    return caches


def _chunk_once(model: Any, tokens: Any, offset: int, kv_arrays) -> tuple[float, float, float, int]:
    import mlx.core as mx

    caches = _filled_caches(model, offset, kv_arrays)
    mx.eval([cache.state for cache in caches] if offset else [])
    mx.synchronize()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    threads, wall, cpu = _thread_cpu_seconds(), time.perf_counter(), _cpu_seconds()
    hidden = model.model(tokens, cache=caches)
    mx.eval(hidden, [cache.state for cache in caches])
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    busiest = _busiest_thread(threads, _thread_cpu_seconds())
    return wall, cpu, busiest, mx.get_peak_memory() - resident


def run(offsets: tuple[int, ...], repeats: int) -> tuple[list[str], str]:
    import mlx.core as mx
    from mlx_lm.models import base

    from omlx_core.models.attention import cpu_attention, install_cpu_attention
    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.loader import load_model
    from omlx_core.platform.blas import blas_in_use

    model, _tokenizer = load_model(ensure_default_model(progress=True))
    modules = [sys.modules[name] for name in install_cpu_attention(model)]
    args = model.args
    kv_heads = args.num_key_value_heads
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads

    def ours(queries, keys, values, cache, scale, mask, sinks=None):
        return cpu_attention(queries, keys, values, cache, scale, mask, sinks,
                             fallback=base.scaled_dot_product_attention)

    variants = {
        "mlx-lm": base.scaled_dot_product_attention,
        "omlx-core": ours,
        "no attention": _no_attention,
    }
    tokens = mx.random.randint(0, args.vocab_size, (1, CHUNK), key=mx.random.key(0))
    for name, function in variants.items():  # first calls pay one-time set-up: not counted
        with attention_routed(modules, function):
            _chunk_once(model, tokens, 0, [])
    rows = []
    for offset in offsets:
        key = mx.random.key(offset + 1)
        kv_arrays = [
            tuple(mx.random.normal((1, kv_heads, offset, head_dim), key=k)
                  for k in mx.random.split(layer_key, 2))
            for layer_key in mx.random.split(key, len(model.layers))
        ] if offset else []
        mx.eval(kv_arrays)
        walls = {name: [] for name in variants}
        cpus = {name: [] for name in variants}
        busiest = {name: [] for name in variants}
        peaks = {name: 0 for name in variants}
        for _ in range(repeats):
            for name, function in variants.items():
                with attention_routed(modules, function):
                    wall, cpu, thread_cpu, peak = _chunk_once(model, tokens, offset, kv_arrays)
                walls[name].append(wall)
                cpus[name].append(cpu)
                busiest[name].append(thread_cpu)
                peaks[name] = max(peaks[name], peak)
        del kv_arrays
        wall = {name: statistics.median(values) for name, values in walls.items()}
        cpu = {name: statistics.median(values) for name, values in cpus.items()}
        thread = {name: statistics.median(values) for name, values in busiest.items()}
        share = 1 - wall["no attention"] / wall["mlx-lm"]
        cpu_share = 1 - cpu["no attention"] / cpu["mlx-lm"]
        rows.append(
            f"| {offset:,} | {wall['mlx-lm']:.2f} | {wall['omlx-core']:.2f} "
            f"| {wall['mlx-lm'] / wall['omlx-core']:.2f}x | {cpu['mlx-lm']:.2f} "
            f"| {cpu['omlx-core']:.2f} | {thread['mlx-lm']:.2f} | {thread['omlx-core']:.2f} "
            f"| {thread['mlx-lm'] / thread['omlx-core']:.2f}x "
            f"| {wall['no attention']:.2f} | {share:.0%} / {cpu_share:.0%} "
            f"| {peaks['mlx-lm'] / 2**20:.0f} | {peaks['omlx-core'] / 2**20:.0f} |"
        )
        print(rows[-1], flush=True)
    load = os.getloadavg()
    machine = (f"{os.cpu_count()} cores, BLAS {blas_in_use()}, mlx {mx.__version__}, "
               f"load average after the run {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}, "
               f"{repeats} repetitions, medians")
    return rows, machine


def _op_times(function: Callable[[], Any], repeats: int) -> tuple[float, float]:
    import mlx.core as mx

    walls, cpus = [], []
    for _ in range(repeats):
        mx.synchronize()
        wall, cpu = time.perf_counter(), _cpu_seconds()
        mx.eval(function())
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu_seconds() - cpu)
    return statistics.median(walls), statistics.median(cpus)


OPS_HEADER = (
    "| offset | op | wall ms / layer | CPU ms / layer | CPU s / chunk (x layers) | share of attention CPU |\n"
    "|---:|---|---:|---:|---:|---:|"
)


def run_ops(offsets: tuple[int, ...], repeats: int, layers: int = 30) -> tuple[list[str], str]:
    import mlx.core as mx
    import numpy as np

    from omlx_core.models.attention import mask_in_place, softmax_in_place

    def numpy_softmax(scratch: Any) -> Any:
        mask_in_place(scratch, "causal")
        softmax_in_place(scratch)
        return mx.array(0)

    from omlx_core.platform.blas import blas_in_use

    heads, kv_heads, head_dim, rows = 9, 3, 64, CHUNK
    repeat = heads // kv_heads
    scale = head_dim**-0.5
    lowest = mx.finfo(mx.float32).min
    lines = []
    for offset in offsets:
        total = offset + rows
        q_key, k_key, v_key = mx.random.split(mx.random.key(offset), 3)
        queries = mx.random.normal((1, rows, heads, head_dim), key=q_key).transpose(0, 2, 1, 3)
        keys = mx.random.normal((1, kv_heads, total, head_dim), key=k_key)
        values = mx.random.normal((1, kv_heads, total, head_dim), key=v_key)
        # The fallback's intermediates, materialized so that each op is timed alone.
        scaled = (queries * scale).reshape(1, kv_heads, repeat, rows, head_dim)
        keys5, values5 = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        scores = scaled @ keys5.swapaxes(-1, -2)
        causal = mx.arange(offset, total)[:, None] >= mx.arange(total)[None]
        masked = mx.where(causal, scores, lowest)
        probabilities = mx.softmax(masked, axis=-1, precise=True)
        mx.eval(queries, keys, values, scaled, scores, causal, masked, probabilities)
        scratch = np.array(scores)  # the scores as the route sees them: (1, 3, 3, rows, keys)
        ops = {
            "scale queries": lambda: queries * scale,
            "score matmul": lambda: scaled @ keys5.swapaxes(-1, -2),
            "causal mask (index compare)": lambda: mx.arange(offset, total)[:, None] >= mx.arange(total)[None],
            "mask (where)": lambda: mx.where(causal, scores, lowest),
            "softmax": lambda: mx.softmax(masked, axis=-1, precise=True),
            "value matmul": lambda: probabilities @ values5,
        }
        extra = {
            "the whole mx.fast call": lambda: mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask="causal"),
            "(not done) repeat K/V to 9 heads": lambda: (mx.repeat(keys, repeat, axis=1),
                                                         mx.repeat(values, repeat, axis=1)),
            "(not done) exp alone": lambda: mx.exp(masked),
            "omlx-core: mask + softmax in NumPy, in place": lambda: numpy_softmax(scratch),
        }
        timed = {name: _op_times(function, repeats) for name, function in {**ops, **extra}.items()}
        attention_cpu = sum(timed[name][1] for name in ops)
        for name, (wall, cpu) in timed.items():
            share = f"{cpu / attention_cpu:.0%}" if name in ops else ""
            lines.append(f"| {offset:,} | {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} "
                         f"| {cpu * layers:.2f} | {share} |")
            print(lines[-1], flush=True)
    load = os.getloadavg()
    machine = (f"{os.cpu_count()} cores, BLAS {blas_in_use()} "
               f"(OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}), "
               f"mlx {mx.__version__}, load average after the run {load[0]:.1f} / {load[1]:.1f} / "
               f"{load[2]:.1f}, {repeats} repetitions, medians")
    return lines, machine


HEADER = (
    "| offset | mlx-lm s | omlx-core s | speed-up | mlx-lm CPU s | omlx-core CPU s "
    "| mlx-lm busiest thread s | omlx-core busiest thread s | busiest-thread ratio "
    "| no attention s | attention share (wall / CPU) | mlx-lm peak MiB | omlx-core peak MiB |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offsets", default=",".join(map(str, DEFAULT_OFFSETS)),
                        help="cached tokens before the chunk, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per offset")
    parser.add_argument("--ops", action="store_true",
                        help="time each op of one layer's attention instead of whole chunks")
    parser.add_argument("--out", help="also write the table as markdown to this file")
    options = parser.parse_args(argv)
    try:
        offsets = tuple(int(part) for part in options.offsets.split(","))
    except ValueError:
        parser.error(f"--offsets must be comma-separated integers, got {options.offsets!r}")
    if options.repeats < 1 or any(offset < 0 for offset in offsets):
        parser.error("--repeats must be at least 1 and every offset at least 0")

    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()  # on the reference BLAS the projections alone take seconds
    if options.ops:
        title = f"one layer's attention ops for a {CHUNK}-token chunk at the default model's shapes"
        header, measure = OPS_HEADER, run_ops
    else:
        title = f"one {CHUNK}-token prefill chunk of the default model, all layers, no logits"
        header, measure = HEADER, run
    print(title)
    print(header, flush=True)
    rows, machine = measure(offsets, options.repeats)
    print(machine)
    if options.out:
        with open(options.out, "w") as out:
            out.write(f"{title[0].upper()}{title[1:]} ({machine}).\n\n")
            out.write(header + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
