"""Decode throughput of the batched engine against plain ``mlx_lm.stream_generate``.

    python -m omlx_core.plugins.batched.benchmark [--model DIR] [--tokens 128]
        [--concurrency 8 16] [--repeats 3]

Without ``--model`` it uses the default model (SmolLM2-135M-Instruct). Every request is
greedy and ignores end-of-sequence, so each stream produces exactly ``--tokens`` tokens.
Single-stream runs alternate between the two so that background load hits both alike;
the median of ``--repeats`` runs is reported. Decode rate is measured from a stream's
first token to its last; aggregate rate from the first submit to the last token. CPU
milliseconds per decoded token (the whole process's user + system time) are shown too:
on a shared machine they move much less with other processes' load than wall time.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from omlx_core.engine import GenerationRequest, SamplingParams

PROMPT = "Write a long, detailed story about a dragon who learns to bake bread in a small village."


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reference_run(model: Any, tokenizer: Any, prompt: list[int], tokens: int) -> tuple[float, float, float]:
    from mlx_lm import stream_generate

    started = time.perf_counter()
    first = last = started
    cpu_first = 0.0
    count = 0
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        last = time.perf_counter()
        if count == 0:
            first, cpu_first = last, _cpu_seconds()
        count += 1
    cpu_ms = (_cpu_seconds() - cpu_first) / (count - 1) * 1000
    return (count - 1) / (last - first), count / (last - started), cpu_ms


def _engine_stream(engine: Any, prompt: list[int], tokens: int, times: list[float],
                   cpu: list[float]) -> int:
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens)
    handle = engine.submit(GenerationRequest(f"bench-{time.monotonic_ns()}-{id(times)}", prompt, sampling))
    count = 0
    for output in handle:
        count += len(output.token_ids)
        times.append(time.perf_counter())
        cpu.append(_cpu_seconds())
    return count


def _engine_run(engine: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float, float]:
    """``(decode tok/s, end-to-end tok/s, CPU ms per decoded token)`` of concurrent streams."""
    engine.prefix_cache.clear()
    times: list[list[float]] = [[] for _ in prompts]
    cpu: list[list[float]] = [[] for _ in prompts]
    counts = [0] * len(prompts)

    def stream(i: int) -> None:
        counts[i] = _engine_stream(engine, prompts[i], tokens, times[i], cpu[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = sum(counts)
    first = min(t[0] for t in times)
    last = max(t[-1] for t in times)
    decoded = total - len(prompts)
    cpu_ms = (max(c[-1] for c in cpu) - min(c[0] for c in cpu)) / decoded * 1000
    return decoded / (last - first), total / (last - started), cpu_ms


def main(argv: list[str] | None = None) -> None:
    from omlx_core.platform.blas import ensure_optimized_blas

    # Without OpenBLAS both sides run on mlx-cpu's reference BLAS and the figures mean little.
    ensure_optimized_blas()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="mlx-lm model directory (default: the default model)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from omlx_core.config import load_config
    from omlx_core.models.loader import load_model
    from omlx_core.models.registry import spec_for_path
    from omlx_core.plugins.batched.engine import BatchedEngine
    from omlx_core.mlx_thread import mlx_thread

    if args.model is None:
        from omlx_core.models.default import ensure_default_model

        args.model = ensure_default_model()
    config = load_config("base", overrides=[
        ("engine.max_batch_size", str(max(args.concurrency + [1])), "benchmark")], env={})
    # Exactly --tokens per stream: no end-of-sequence token ends a benchmark stream.
    engine = BatchedEngine(spec_for_path(args.model), config, ignore_eos=True)
    engine.start()
    messages = [{"role": "user", "content": PROMPT}]
    prompt = engine.tokenize_chat(messages)

    model, tokenizer = mlx_thread().run(load_model, args.model)
    tokenizer.eos_token_ids = set()
    reference, single = [], []
    for _ in range(args.repeats):
        reference.append(mlx_thread().run(_reference_run, model, tokenizer, prompt, args.tokens))
        single.append(_engine_run(engine, [prompt], args.tokens))
    ref_decode = statistics.median(r[0] for r in reference)
    eng_decode = statistics.median(r[0] for r in single)
    print(f"model {args.model.name}, {len(prompt)}-token prompt, {args.tokens} tokens per stream, "
          f"median of {args.repeats}")
    ref_cpu = statistics.median(r[2] for r in reference)
    eng_cpu = statistics.median(r[2] for r in single)
    print(f"  mlx_lm.stream_generate : {ref_decode:7.1f} tok/s decode, "
          f"{statistics.median(r[1] for r in reference):7.1f} tok/s end to end, {ref_cpu:6.1f} CPU ms/token")
    print(f"  batched engine, 1      : {eng_decode:7.1f} tok/s decode, "
          f"{statistics.median(r[1] for r in single):7.1f} tok/s end to end, {eng_cpu:6.1f} CPU ms/token "
          f"({eng_decode / ref_decode:.2f}x stream_generate's rate, {ref_cpu / eng_cpu:.2f}x its CPU efficiency)")
    for concurrency in args.concurrency:
        prompts = [engine.tokenize_chat([{"role": "user", "content": f"Story {i}: {PROMPT}"}])
                   for i in range(concurrency)]
        runs = [_engine_run(engine, prompts, args.tokens) for _ in range(args.repeats)]
        print(f"  batched engine, {concurrency:<6d}: {statistics.median(r[0] for r in runs):7.1f} tok/s "
              f"aggregate decode, {statistics.median(r[1] for r in runs):7.1f} tok/s end to end, "
              f"{statistics.median(r[2] for r in runs):6.1f} CPU ms/token")
    engine.shutdown()


if __name__ == "__main__":
    main()
