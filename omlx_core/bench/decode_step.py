"""Where a batched decode step spends its time on this machine (issue 12, item 5).

    python -m omlx_core.bench.decode_step [--rows 16] [--context 512] [--steps 40]

Runs mlx-lm's ``BatchGenerator`` (what the batched engine and ``mlx_lm.server`` both
decode with) on the default model with ``--rows`` sequences of ``--context`` tokens
each, and times ``--steps`` decode steps. Then it times the step's parts alone, at the
same shapes, each evaluated on its own:

- the matrix products: every projection of every layer and the output head;
- attention over the cache (``scaled_dot_product_attention``, one query per row);
- the rest of a layer's arithmetic: norms, rotary embedding, the MLP's gating;
- the sampling and bookkeeping around the forward (what is left of the step).

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

    def elementwise():
        h = layer.input_layernorm(x)
        g = layer.post_attention_layernorm(h)
        r = attention.rope(q)
        import mlx.nn as nn
        a = nn.silu(mx.random.normal((rows, 1, inter)).astype(dtype)) * mx.ones((rows, 1, inter), dtype)
        return [h, g, r, a]

    rest = _median_ms(elementwise, repeats) * layers
    return [
        ("decode step, whole (BatchGenerator.next)", step),
        ("the model's forward alone, one graph", forward_alone),
        ("left: sampling, logprobs, host syncs, Python bookkeeping", max(0.0, step - forward_alone)),
        (f"parts of the forward, each alone: projections, {layers} layers x 7", matmuls),
        ("... output head", head),
        (f"... attention over {context} cached tokens, {layers} layers", sdpa),
        (f"... norms, rotary, MLP gating, {layers} layers", rest),
    ]


def render(rows: int, context: int, steps: int, figures: Sequence[tuple[str, float]]) -> str:
    import os
    import platform

    step = figures[0][1]
    lines = [f"# Decode step profile: {rows} rows x {context} cached tokens", "",
             f"- {platform.machine()}, {os.cpu_count()} CPUs; default model; median of {steps} steps",
             "", "| part | ms per step | share of the step |", "|---|---:|---:|"]
    for name, ms in figures:
        lines.append(f"| {name} | {ms:.1f} | {100 * ms / step:.0f} % |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m omlx_core.bench.decode_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    print("\n" + render(args.rows, args.context, args.steps,
                        measure(args.rows, args.context, args.steps)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
