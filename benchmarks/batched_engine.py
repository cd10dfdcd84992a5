"""Decode throughput of the batched engine against plain ``mlx_lm.stream_generate``.

    python -m benchmarks.batched_engine [--model DIR] [--tokens 128]
        [--concurrency 8 16] [--repeats 3]

Without ``--model`` it uses the default model (SmolLM2-135M-Instruct). Requests go
through the serving pipeline, as every caller's do (memory guard included). Every
request is greedy with the special tokens banned through ``logit_bias`` (so no
end-of-sequence ends it) and ``mlx_lm.stream_generate`` runs with no end-of-sequence
token, so each stream produces exactly ``--tokens`` tokens.
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

from omlx_core.engine import SamplingParams
from omlx_core.serving import Job, ServingPipeline

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


def _engine_stream(pipeline: ServingPipeline, model_id: str, prompt: list[int],
                   sampling: SamplingParams, times: list[float], cpu: list[float]) -> int:
    generation = pipeline.start(Job(model_id, sampling, token_ids=prompt, prompt_param="prompt"))
    times.append(time.perf_counter())
    cpu.append(_cpu_seconds())
    try:
        for _delta in generation.deltas():
            times.append(time.perf_counter())
            cpu.append(_cpu_seconds())
    finally:
        generation.close()
    return generation.completion_tokens


def _engine_run(pipeline: ServingPipeline, model_id: str, prompts: list[list[int]],
                sampling: SamplingParams) -> tuple[float, float, float]:
    """``(decode tok/s, end-to-end tok/s, CPU ms per decoded token)`` of concurrent streams."""
    pipeline.engine(model_id).prefix_cache.clear()  # type: ignore[attr-defined]
    times: list[list[float]] = [[] for _ in prompts]
    cpu: list[list[float]] = [[] for _ in prompts]
    counts = [0] * len(prompts)

    def stream(i: int) -> None:
        counts[i] = _engine_stream(pipeline, model_id, prompts[i], sampling, times[i], cpu[i])

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

    from omlx_core.bench.client import BANNED_BIAS, special_token_ids
    from omlx_core.bootstrap import load_setup, served_models, start_engines, stop_engines
    from omlx_core.models.loader import load_model
    from omlx_core.mlx_thread import mlx_thread

    if args.model is None:
        from omlx_core.models.default import ensure_default_model

        args.model = ensure_default_model()
    batch = max(args.concurrency + [1])
    print(f"override: plugin.batched.max_batch_size={batch} (every stream runs at once)")
    setup = load_setup("base", [], [("plugin.batched.max_batch_size", str(batch), "benchmark")])
    context = start_engines(setup, served_models(setup, [str(args.model)]), progress=True)
    pipeline = ServingPipeline(context)
    model_id, engine = next(iter(context.engines.items()))
    # Exactly --tokens per stream: no end-of-sequence token ends a benchmark stream.
    sampling = SamplingParams(temperature=0.0, max_tokens=args.tokens, logit_bias={
        token: BANNED_BIAS for token in special_token_ids(args.model)})
    messages = [{"role": "user", "content": PROMPT}]
    prompt = engine.tokenize_chat(messages)

    model, tokenizer = mlx_thread().run(load_model, args.model)
    tokenizer.eos_token_ids = set()
    reference, single = [], []
    for _ in range(args.repeats):
        reference.append(mlx_thread().run(_reference_run, model, tokenizer, prompt, args.tokens))
        single.append(_engine_run(pipeline, model_id, [prompt], sampling))
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
        runs = [_engine_run(pipeline, model_id, prompts, sampling) for _ in range(args.repeats)]
        print(f"  batched engine, {concurrency:<6d}: {statistics.median(r[0] for r in runs):7.1f} tok/s "
              f"aggregate decode, {statistics.median(r[1] for r in runs):7.1f} tok/s end to end, "
              f"{statistics.median(r[2] for r in runs):6.1f} CPU ms/token")
    pipeline.close()
    stop_engines(context)


if __name__ == "__main__":
    main()
