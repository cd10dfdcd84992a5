"""Where a batched decode step spends its time on this machine (issue 12, item 5).

    python -m benchmarks.decode_step [--rows 16] [--context 512] [--steps 40] [--ab]

Runs mlx-lm's ``BatchGenerator`` (what the batched engine and ``mlx_lm.server`` both
decode with) on the default model with ``--rows`` sequences of ``--context`` tokens
each, and times ``--steps`` decode steps. Then it times the step's parts alone, at the
same shapes, each evaluated on its own:

- the matrix products: every projection of every layer and the output head;
- attention over the cache (``scaled_dot_product_attention``, one query per row);
- the rest of a layer's arithmetic: norms, rotary embedding, the MLP's gating;
- the sampling and bookkeeping around the forward (what is left of the step).

Then (alone with ``--ab``) a paired A/B of mlx-lm's decode step (``BatchGenerator.next``)
against a step of this project's scheduler (its decode batch,
:mod:`omlx_core.scheduling.decode_batch`, with its token hand-out to every request's
queue): the same prompts decoding in both, stepped alternately, the median of per-pair
ratios.

The forward alone (one graph over the batch's own cache) against the whole step tells
what sampling and bookkeeping cost. The parts, each evaluated alone, pay their own
evaluation overhead, so they are upper bounds of their share: they say which
dominates, not exact shares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence


def _median_ms(run: Callable[[], Any], repeats: int) -> float:
    import mlx.core as mx

    mx.eval(run())  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(run())
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(rows: int, context: int, steps: int) -> list[tuple[str, float]]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from tqdm import tqdm

    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.loader import load_model

    model, _tokenizer = load_model(ensure_default_model(progress=True))
    args = model.args
    hidden, inter, layers = args.hidden_size, args.intermediate_size, args.num_hidden_layers
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or hidden // heads
    vocab = args.vocab_size
    dtype = model.model.embed_tokens.weight.dtype

    generator = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows,
                               prefill_step_size=512)
    prompts = [[(97 * r + 31 * i) % (vocab - 10) + 5 for i in range(context)] for r in range(rows)]
    generator.insert(prompts, max_tokens=[steps + 8] * rows)
    with tqdm(desc="prefill", unit="step") as progress:
        while True:  # until every row decodes
            _, generated = generator.next()
            progress.update(1)
            if len(generated) == rows:
                break
    step_ms = []
    for _ in tqdm(range(steps), desc="decode steps", unit="step"):
        begin = time.perf_counter()
        generator.next()
        step_ms.append((time.perf_counter() - begin) * 1000)
    # The forward alone, as one graph over the batch's own cache (trimmed back after).
    cache = generator._generation_batch.prompt_cache
    tokens = mx.array([[5]] * rows)
    forward_ms = []
    for index in range(steps + 1):
        begin = time.perf_counter()
        mx.eval(model(tokens, cache=cache)[:, -1, :])
        if index:  # the first is a warm-up
            forward_ms.append((time.perf_counter() - begin) * 1000)
        for layer_cache in cache:
            layer_cache.trim(1)
    generator.close()
    step = statistics.median(step_ms)
    forward_alone = statistics.median(forward_ms)

    repeats = max(5, steps // 2)
    x = mx.random.normal((rows, 1, hidden)).astype(dtype)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp

    def projections():
        outs = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x),
                attention.o_proj(mx.zeros((rows, 1, heads * head_dim), dtype=dtype)),
                mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj(mx.zeros((rows, 1, inter), dtype=dtype))]
        return outs

    matmuls = _median_ms(projections, repeats) * layers
    head = _median_ms(lambda: model.model.embed_tokens.as_linear(x)
                      if hasattr(model.model.embed_tokens, "as_linear") else model.lm_head(x), repeats)
    q = mx.random.normal((rows, heads, 1, head_dim)).astype(dtype)
    k = mx.random.normal((rows, kv_heads, context, head_dim)).astype(dtype)
    v = mx.random.normal((rows, kv_heads, context, head_dim)).astype(dtype)
    sdpa = _median_ms(lambda: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=head_dim ** -0.5), repeats) * layers

    import mlx.nn as nn

    gate = mx.random.normal((rows, 1, inter)).astype(dtype)
    up = mx.random.normal((rows, 1, inter)).astype(dtype)
    offsets = mx.full((rows,), context, dtype=mx.int32)
    mx.eval(gate, up)

    def elementwise():
        h = layer.input_layernorm(x)
        g = layer.post_attention_layernorm(h)
        r = attention.rope(q, offset=offsets)
        a = nn.silu(gate) * up
        return [h, g, r, a]

    rest = _median_ms(elementwise, repeats) * layers
    logits = mx.random.normal((rows, vocab)).astype(dtype)
    mx.eval(logits)
    log_softmax = _median_ms(lambda: logits - mx.logsumexp(logits, axis=-1, keepdims=True), repeats)
    return [
        ("decode step, whole (BatchGenerator.next)", step),
        ("the model's forward alone, one graph", forward_alone),
        ("left: sampling, logprobs, host syncs, Python bookkeeping", max(0.0, step - forward_alone)),
        (f"parts of the forward, each alone: projections, {layers} layers x 7", matmuls),
        ("... output head", head),
        (f"... attention over {context} cached tokens, {layers} layers", sdpa),
        (f"... norms, rotary, MLP gating, {layers} layers", rest),
        (f"log-softmax of the step's logits ({rows} x {vocab})", log_softmax),
    ]


def _decoding_generator(model: Any, prompts: list[list[int]], processors: list[tuple[Any, ...]],
                        steps: int) -> Any:
    """mlx-lm's ``BatchGenerator`` whose rows (greedy, no logprobs) have all started decoding."""
    from mlx_lm.generate import BatchGenerator

    rows = len(prompts)
    generator = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows,
                               prefill_step_size=512)
    generator.insert(prompts, max_tokens=[2 * steps + 8] * rows,
                     logits_processors=[list(p) for p in processors])
    while len(generator.next()[1]) < rows:
        pass
    return generator


class _OurSteps:
    """This project's scheduler over the same rows, every one decoding; ``next()`` is
    one scheduler step (decode, hand-out to each request's queue, which it drains)."""

    def __init__(self, model: Any, tokenizer: Any, prompts: list[list[int]],
                 banned: dict[int, float] | None, steps: int) -> None:
        from omlx_core.engine import GenerationRequest, SamplingParams
        from omlx_core.scheduling import PrefixCache, Scheduler, new_sequence

        rows = len(prompts)
        self.scheduler = Scheduler(
            model=model, tokenizer=tokenizer, model_id="default", model_config={},
            vocab_size=model.args.vocab_size, max_batch_size=rows, prefill_step_size=512,
            prefix_cache=PrefixCache(block_size=64, budget_bytes=0), wake=lambda: None)
        sampling = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, logit_bias=banned)
        self.sequences = [new_sequence(GenerationRequest(f"r{i}", prompt, sampling))
                          for i, prompt in enumerate(prompts)]
        for sequence in self.sequences:
            self.scheduler.enqueue(sequence)
        while len(self.scheduler.state.decoding) < rows or self.scheduler.state.prefilling:
            self.next()

    def next(self) -> None:
        self.scheduler.step()
        for sequence in self.sequences:
            while not sequence.outputs.empty():
                sequence.outputs.get()

    def close(self) -> None:
        self.scheduler.shutdown()


def measure_pairs(rows: int, context: int, steps: int) -> list[tuple[str, float, float, float]]:
    """mlx-lm's decode step against this project's, alternating, same process.

    Rows are greedy without logprobs; "biased" rows each carry a ``logit_bias`` banning
    the special tokens. Returns, per case, (case, median ms of mlx-lm's step, median ms
    of ours, median pair ratio), in wall time and in the process's CPU time (all
    threads; it moves less with the load of a shared machine).
    """
    import time

    from tqdm import tqdm

    from omlx_core.bench.client import special_token_ids
    from omlx_core.models.default import ensure_default_model
    from omlx_core.scheduling import load_model
    from omlx_core.scheduling.sampling import LogitBias

    model_dir = ensure_default_model(progress=True)
    model, tokenizer = load_model(model_dir)
    vocab = model.args.vocab_size
    prompts = [[(97 * r + 31 * i) % (vocab - 10) + 5 for i in range(context)] for r in range(rows)]
    banned = {t: -100.0 for t in special_token_ids(model_dir)}
    results = []
    for case, bias in (("greedy, logit_bias on every row", banned), ("greedy, no processors", None)):
        processors = [(LogitBias(bias),) if bias else ()] * rows
        stock = _decoding_generator(model, prompts, processors, steps)
        ours = _OurSteps(model, tokenizer, prompts, bias, steps)
        times: dict[str, list[float]] = {"stock": [], "ours": []}
        cpu: dict[str, list[float]] = {"stock": [], "ours": []}
        for step in tqdm(range(steps + 2), desc=f"pairs: {case}", unit="pair"):
            order = (("stock", stock), ("ours", ours)) if step % 2 else (("ours", ours), ("stock", stock))
            for name, stepper in order:
                begin, begin_cpu = time.perf_counter(), time.process_time()
                stepper.next()
                if step >= 2:  # the first pairs warm up
                    times[name].append((time.perf_counter() - begin) * 1000)
                    cpu[name].append((time.process_time() - begin_cpu) * 1000)
        stock.close()
        ours.close()
        for what, figures in (("wall", times), ("CPU", cpu)):
            ratios = [a / b for a, b in zip(figures["stock"], figures["ours"])]
            results.append((f"{case}: {what} ms", statistics.median(figures["stock"]),
                            statistics.median(figures["ours"]), statistics.median(ratios)))
    return results


def render_pairs(rows: int, context: int, steps: int,
                 results: Sequence[tuple[str, float, float, float]]) -> str:
    lines = [f"## Decode step A/B: {rows} rows x {context} cached tokens, {steps} alternating pairs",
             "", f"- load average at the end: {_load_average()}", "",
             "| rows: time per step | mlx-lm's step | this project's step | mlx-lm / ours (median of pairs) |",
             "|---|---:|---:|---:|"]
    for case, stock, fused, ratio in results:
        lines.append(f"| {case} | {stock:.1f} | {fused:.1f} | {ratio:.3f}x |")
    return "\n".join(lines) + "\n"


def _load_average() -> str:
    import os

    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg()) + " (1 / 5 / 15 min)"
    except OSError:  # pragma: no cover - not every platform has one
        return "unknown"


def render(rows: int, context: int, steps: int, figures: Sequence[tuple[str, float]]) -> str:
    import os
    import platform

    step = figures[0][1]
    lines = [f"# Decode step profile: {rows} rows x {context} cached tokens", "",
             f"- {platform.machine()}, {os.cpu_count()} CPUs; default model; median of {steps} steps; "
             f"load average at the end: {_load_average()}",
             "", "| part | ms per step | share of the step |", "|---|---:|---:|"]
    for name, ms in figures:
        lines.append(f"| {name} | {ms:.1f} | {100 * ms / step:.0f} % |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ab", action="store_true",
                        help="only the A/B of mlx-lm's decode step against this project's")
    args = parser.parse_args(argv)
    if not args.ab:
        print("\n" + render(args.rows, args.context, args.steps,
                            measure(args.rows, args.context, args.steps)))
    print("\n" + render_pairs(args.rows, args.context, args.steps,
                              measure_pairs(args.rows, args.context, args.steps)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
